"""A step's inputs in one host buffer and one host->device copy (the static decode runner's loads).

:class:`StepStaging` owns one byte buffer on the device and one (CPU) or two (CUDA: pinned, used
in turn) byte buffers on the host. A :class:`StagedLayout` packs named, typed fields into the
buffers, each region 8-byte aligned, in the order given: its ``device`` views are what a
captured graph reads (their addresses never change), its :meth:`StagedLayout.fill` hands out
numpy views of a host buffer to write a step into, and :meth:`StagedLayout.send` issues the one
copy. Layouts over the same staging alias the same bytes: a runner uses one layout per step.

The copy covers every field but the last, and of the last only the first ``tail`` elements the
caller names: a field read up to a length held in the earlier fields (a page list read up to
``kv_indptr``) goes last, so a short step copies a short buffer.

On CUDA a host buffer is written again only once its previous copy has completed (an event per
buffer), so the host can fill step N+1 while step N's copy is in flight; the copy is
``non_blocking`` from pinned memory and runs in stream order before the next replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["StagedLayout", "StepStaging"]

_ALIGN = 8
Field = tuple[str, torch.dtype, int]


def _region_bytes(dtype: torch.dtype, count: int) -> int:
    size = count * torch.empty((), dtype=dtype).element_size()
    return -(-size // _ALIGN) * _ALIGN


def layout_bytes(fields: Sequence[Field]) -> int:
    """Bytes a layout of ``fields`` (name, dtype, element count) takes."""
    return sum(_region_bytes(dtype, count) for _, dtype, count in fields)


class StepStaging:
    """The byte buffers behind every :class:`StagedLayout` of a runner: ``nbytes`` on ``device``
    (zeroed) and their host twins (pinned on CUDA). ``num_copies`` counts the copies sent."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        self.device = device
        cuda = device.type == "cuda"
        self.device_bytes = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self._host = [torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2 if cuda else 1)]
        self._host_np = [h.numpy() for h in self._host]
        self._done: list[torch.cuda.Event | None] = [None] * len(self._host)
        self._turn = 0
        self.num_copies = 0

    def layout(self, fields: Sequence[Field]) -> StagedLayout:
        """Typed views of ``fields`` (name, dtype, count), packed from byte 0 in order
        (``ValueError`` when they do not fit or a name repeats)."""
        names = [name for name, _, _ in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"field names must be unique, got {names}")
        if layout_bytes(fields) > self.device_bytes.numel():
            raise ValueError(f"fields take {layout_bytes(fields)} bytes, the staging holds {self.device_bytes.numel()}")
        return StagedLayout(self, tuple(fields))

    def _host_buffer(self) -> int:
        """The host buffer to fill next, once its previous copy has completed."""
        turn = self._turn
        done = self._done[turn]
        if done is not None:
            done.synchronize()
        return turn

    def _send(self, nbytes: int) -> None:
        turn = self._turn
        self.device_bytes[:nbytes].copy_(self._host[turn][:nbytes], non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._done[turn] = event
        self._turn = (turn + 1) % len(self._host)
        self.num_copies += 1


@dataclass(slots=True)
class _Region:
    offset: int
    dtype: torch.dtype
    count: int


class StagedLayout:
    """One packing of named fields over a :class:`StepStaging` (build it with ``layout``)."""

    def __init__(self, staging: StepStaging, fields: tuple[Field, ...]) -> None:
        self.staging = staging
        self._regions: dict[str, _Region] = {}
        offset = 0
        for name, dtype, count in fields:
            self._regions[name] = _Region(offset, dtype, count)
            offset += _region_bytes(dtype, count)
        self.nbytes = offset
        self._last = fields[-1][0] if fields else None
        self.device = {name: self._view(staging.device_bytes, r) for name, r in self._regions.items()}
        self._host_views: dict[int, dict[str, np.ndarray]] = {}

    @staticmethod
    def _view(buf: torch.Tensor, r: _Region) -> torch.Tensor:
        size = r.count * torch.empty((), dtype=r.dtype).element_size()
        return buf[r.offset : r.offset + size].view(r.dtype)

    def fill(self) -> dict[str, np.ndarray]:
        """Numpy views of the host buffer to write this step into (waits, on CUDA, until its
        previous copy is done). Write every field; then call :meth:`send`."""
        turn = self.staging._host_buffer()
        views = self._host_views.get(turn)
        if views is None:
            host = self.staging._host[turn]
            views = {name: self._view(host, r).numpy() for name, r in self._regions.items()}
            self._host_views[turn] = views
        return views

    def send(self, tail: int | None = None) -> None:
        """One host->device copy of what :meth:`fill` wrote: every field, the last one only up to
        ``tail`` elements (``None``: all of it)."""
        nbytes = self.nbytes
        if tail is not None and self._last is not None:
            r = self._regions[self._last]
            if not 0 <= tail <= r.count:
                raise ValueError(f"tail must be in [0, {r.count}], got {tail}")
            nbytes = r.offset + _region_bytes(r.dtype, tail)
        self.staging._send(nbytes)
