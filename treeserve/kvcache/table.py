"""Request -> token-slot table (one row per running request, like LightLLM's req_to_token_indexs)."""

from __future__ import annotations

import numpy as np
import torch

from .pool import InvariantError

__all__ = ["OutOfRowsError", "ReqToTokenTable"]


class OutOfRowsError(RuntimeError):
    """Every request row is in use; the table is unchanged."""


class ReqToTokenTable:
    """``table[row, i]`` is the KV slot of token ``i`` of the request holding ``row``.

    ``table`` is ``int64 [max_requests + 1, max_context_len]``. Row 0 is the dummy row: all zeros
    (slot 0 is in the dummy page), used to pad batches; it is never handed out. A row is owned by
    one request from ``alloc()`` to ``free(row)``; ``free`` zeroes it so no stale slot outlives it.

    ``host`` is the table flattened, as a numpy array on the host: the table's own memory on
    CPU, a mirror on an accelerator that every write here keeps equal to the device copy, so a
    step's slots and pages are gathered on the host with no device read. Write through
    :meth:`write`, :meth:`scatter` and :meth:`free` only.
    """

    __slots__ = ("max_requests", "max_context_len", "device", "table", "host", "_free_rows", "_in_use")

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        if not isinstance(max_requests, int) or max_requests < 1:
            raise ValueError(f"max_requests must be an int >= 1, got {max_requests!r}")
        if not isinstance(max_context_len, int) or max_context_len < 1:
            raise ValueError(f"max_context_len must be an int >= 1, got {max_context_len!r}")
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.table = torch.zeros(max_requests + 1, max_context_len, dtype=torch.int64, device=self.device)
        on_host = self.device.type == "cpu"
        self.host = self.table.numpy().reshape(-1) if on_host else np.zeros(self.table.numel(), dtype=np.int64)
        self._free_rows = list(range(max_requests, 0, -1))  # pop() hands out 1, 2, ...
        self._in_use = [False] * (max_requests + 1)

    @property
    def num_free(self) -> int:
        """Number of rows that ``alloc`` can still hand out."""
        return len(self._free_rows)

    def alloc(self) -> int:
        """Hand out a free row id in ``[1, max_requests]``; ``OutOfRowsError`` when none is free."""
        if not self._free_rows:
            raise OutOfRowsError(f"all {self.max_requests} request rows are in use")
        row = self._free_rows.pop()
        self._in_use[row] = True
        return row

    def free(self, row: int) -> None:
        """Give ``row`` back and zero it. ``ValueError`` for row 0, out of range, or not in use."""
        self._check_row(row)
        self.table[row].zero_()
        if self.device.type != "cpu":
            width = self.max_context_len
            self.host[row * width : (row + 1) * width] = 0
        self._in_use[row] = False
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Set ``table[row, start : start + len(slots)] = slots`` after checking row and bounds."""
        self._check_row(row)
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
            raise TypeError("slots must be a 1-D torch.int64 tensor")
        end = start + slots.numel()
        if not isinstance(start, int) or start < 0 or end > self.max_context_len:
            raise ValueError(
                f"start must satisfy 0 <= start and start + len(slots) <= max_context_len="
                f"{self.max_context_len}, got start={start!r}, len(slots)={slots.numel()}"
            )
        self.table[row, start:end] = slots
        if self.device.type != "cpu":
            base = row * self.max_context_len
            self.host[base + start : base + end] = slots.cpu().numpy()

    def scatter(self, index: np.ndarray, slots: torch.Tensor) -> None:
        """``table.view(-1)[index] = slots`` (and the host mirror), unchecked: for a caller that
        owns the rows and derives ``index`` (flat ``row * max_context_len + column``, int64) from
        its own accounting, on the hot path where a checked call per row would cost too much."""
        if self.device.type == "cpu":
            self.host[index] = slots.numpy()
            return
        self.table.view(-1)[torch.from_numpy(index).to(self.device)] = slots.to(self.device)
        self.host[index] = slots.cpu().numpy()

    def _check_row(self, row: int) -> None:
        if not isinstance(row, int) or isinstance(row, bool):
            raise TypeError(f"row must be an int, got {type(row).__name__}")
        if not 1 <= row <= self.max_requests:
            raise ValueError(f"row must be in [1, max_requests={self.max_requests}] (row 0 is the dummy row), got {row}")
        if not self._in_use[row]:
            raise ValueError(f"row {row} is not in use (never allocated or already freed)")

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless row 0 and every free row are zero and the free list is exact."""
        if bool(self.table[0].any()):
            raise InvariantError("req_to_token: dummy row 0 holds a non-zero slot")
        free = sorted(self._free_rows)
        expected = [r for r in range(1, self.max_requests + 1) if not self._in_use[r]]
        if free != expected:
            raise InvariantError(f"req_to_token: free list {free} disagrees with in-use flags (free {expected})")
        if free and bool(self.table[free].any()):
            raise InvariantError("req_to_token: a free row holds a non-zero slot")
        if self.device.type != "cpu" and not np.array_equal(self.host, self.table.view(-1).cpu().numpy()):
            raise InvariantError("req_to_token: the host mirror differs from the device table")
