"""One process group per tensor-parallel engine, with a timeout on every collective.

The group is built directly on a ``TCPStore`` (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL``
on CUDA), never through ``torch.distributed.init_process_group``: the caller's process keeps
its default group (if any) and may hold several engines. Every collective waits at most
``timeout_s`` seconds (``recv_step`` excepted: a worker waits for the next step as long as its
parent lives) and raises :class:`CollectiveError` naming the operation and the rank on failure.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["STARTUP_TIMEOUT_S", "CollectiveError", "Communicator"]

# Bound on a launch: spawning the workers, the rendezvous and loading every shard.
STARTUP_TIMEOUT_S = 600.0

_IDLE_WAIT = timedelta(days=365)  # a worker's wait for the next step: bounded by its parent's life


class CollectiveError(RuntimeError):
    """A collective failed (a peer died or closed the group) or timed out."""


class Communicator:
    """Rank ``rank`` of a ``world``-rank group over ``store``; tensors live on ``device``.

    Implements :class:`treeserve.models.parallel.Collectives` (``all_reduce``, ``gather_cols``)
    plus the step broadcast and a barrier. ``timeout_s`` bounds every collective;
    ``connect_timeout_s`` the group's rendezvous (workers start and import torch first).
    """

    def __init__(
        self, store: dist.Store, rank: int, world: int, device: torch.device, timeout_s: float, connect_timeout_s: float
    ) -> None:
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.timeout = timedelta(seconds=timeout_s)
        connect = timedelta(seconds=max(timeout_s, connect_timeout_s))
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = connect
            self.pg: dist.ProcessGroup = dist.ProcessGroupNCCL(store, rank, world, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = connect
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            self.pg = dist.ProcessGroupGloo(store, rank, world, opts)
        self.collective_seconds = 0.0  # time spent inside all_reduce / gather (benchmarks)
        self.broadcast_seconds = 0.0  # time spent broadcasting steps

    def _wait(self, what: str, work: dist.Work, timeout: timedelta | None = None) -> None:
        try:
            work.wait(timeout or self.timeout) if self.device.type == "cuda" else work.wait()
        except Exception as exc:
            raise CollectiveError(f"{what} failed on tensor-parallel rank {self.rank}: {exc}") from exc

    def all_reduce(self, t: torch.Tensor, timeout: timedelta | None = None) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t`` (``timeout``: default the group's)."""
        t0 = time.perf_counter()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        opts.timeout = timeout or self.timeout
        self._wait("all_reduce", self.pg.allreduce([t], opts), timeout)
        self.collective_seconds += time.perf_counter() - t0
        return t

    def gather_cols(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Rank 0: ``[M, sum(sizes)]``, the ranks' ``[M, sizes[r]]`` blocks side by side; other
        ranks: ``t`` itself. Blocks are padded to ``max(sizes)`` columns for the transfer."""
        t0 = time.perf_counter()
        width = max(sizes)
        send = t if t.shape[1] == width else torch.nn.functional.pad(t, (0, width - t.shape[1]))
        send = send.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        outs = [[torch.empty_like(send) for _ in range(self.world)]] if self.rank == 0 else []
        self._wait("gather", self.pg.gather(outs, [send], opts))
        self.collective_seconds += time.perf_counter() - t0
        if self.rank != 0:
            return t
        return torch.cat([o[:, :n] for o, n in zip(outs[0], sizes, strict=True)], dim=1)

    def broadcast(self, t: torch.Tensor, *, idle: bool = False) -> torch.Tensor:
        """Broadcast ``t`` from rank 0 in place. ``idle``: a worker waiting for the next step
        (no timeout: the engine may be idle for long; a dead parent closes the group)."""
        t0 = time.perf_counter()
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = _IDLE_WAIT if idle else self.timeout
        self._wait("broadcast", self.pg.broadcast([t], opts), _IDLE_WAIT if idle else None)
        self.broadcast_seconds += time.perf_counter() - t0
        return t

    def barrier(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` until every rank got here (used once: every shard is loaded)."""
        self.all_reduce(torch.zeros(1, device=self.device), timedelta(seconds=timeout_s))
