"""Rank 0 of a tensor-parallel model: launch the workers, then drive them step by step.

:func:`launch_tensor_parallel` spawns ranks ``1..N-1`` (``torch.multiprocessing``, spawn
context, daemon processes), builds one process group with them (gloo on CPU, NCCL on CUDA:
rank ``r`` on ``cuda:(index + r)``), loads rank 0's shard in the calling process and returns a
:class:`TensorParallelModel`. That object is the engine's model: each call broadcasts the step's
tensors to the workers (:mod:`treeserve.distributed.protocol`), then runs rank 0's shard; the
logits of the asked rows come back to rank 0 only. The scheduler, page allocator, radix tree
and sampling stay in the calling process, unchanged.

Failures: every collective is bounded by ``timeout_s``; a worker that dies closes its sockets,
so rank 0's next collective fails at once; one that hangs makes it fail after ``timeout_s``.
Either way the call raises :class:`TensorParallelError` (which rank, its exit code and its
traceback when it left one), every worker is killed and joined, and every later call raises
the same error at once. ``close()`` stops and joins the workers; it also runs at interpreter
exit, and each worker exits by itself when its parent process is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from treeserve.distributed.comm import STARTUP_TIMEOUT_S, Communicator
from treeserve.distributed.protocol import pack_compact, pack_forward, pack_stop
from treeserve.distributed.worker import ModelSource, build_shard, worker_main, worker_up_key
from treeserve.kvcache import AttentionMetadata, KVPool, compact_tree_path
from treeserve.models import LlamaForCausalLM, ModelConfig
from treeserve.models.llama import check_forward_inputs
from treeserve.models.parallel import TPShard, check_tensor_parallel

__all__ = ["TensorParallelError", "TensorParallelModel", "launch_tensor_parallel"]

_LIVE: weakref.WeakSet[TensorParallelModel] = weakref.WeakSet()


class TensorParallelError(RuntimeError):
    """The tensor-parallel group failed (a worker died, hung or raised); the model is closed."""


def _close_all() -> None:
    for model in list(_LIVE):
        model.close()


atexit.register(_close_all)


class TensorParallelModel:
    """Rank 0's shard plus the handle on ranks ``1..N-1``; called like ``LlamaForCausalLM``.

    ``config`` is the full model's; ``kv_heads_per_rank`` the KV heads each rank's pools hold
    (the engine sizes its pool with it). ``compact_kv(kv, src, dst)`` moves KV slots on every
    rank (speculative verification). ``comm`` exposes the time spent in collectives.
    """

    def __init__(self, local: LlamaForCausalLM, comm: Communicator, procs: list[Any], errors: Any) -> None:
        self.local = local
        self.comm = comm
        self.config: ModelConfig = local.config
        self.kv_heads_per_rank: int = local.kv_heads_per_rank
        self.world_size = comm.world
        self._procs = procs
        self._errors = errors
        self._pool_ids: dict[int, tuple[int, KVPool]] = {}  # id(pool) -> (pool id, pool kept alive)
        self._failure: str | None = None
        self._closed = False
        _LIVE.add(self)

    # --- what the engine reads of a model
    def parameters(self) -> Iterator[nn.Parameter]:
        return self.local.parameters()

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def is_alive(self) -> bool:
        return not self._closed and self._failure is None

    # --- steps
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVPool,
        out_slots: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """``LlamaForCausalLM.forward`` over all ranks; returns rank 0's gathered logits ``[M, vocab]``."""
        check_forward_inputs(input_ids, positions, out_slots, logits_indices)  # before a worker sees them
        if kv.num_kv_heads != self.kv_heads_per_rank or len(kv.k_caches) != self.config.num_layers:
            raise ValueError(
                f"kv must hold {self.config.num_layers} layers of {self.kv_heads_per_rank} KV heads (this rank's share), "
                f"got {len(kv.k_caches)} layers of {kv.num_kv_heads}"
            )
        header, payload = pack_forward(self._pool_id(kv), kv.num_pages, input_ids, positions, out_slots, meta, logits_indices)
        with self._guard("forward"):
            self._send(header, payload)
            return self.local(input_ids, positions, kv, out_slots, meta, logits_indices)

    def compact_kv(self, kv: KVPool, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``compact_tree_path`` on every rank's share of ``kv``."""
        header, payload = pack_compact(self._pool_id(kv), kv.num_pages, kv.page_size, src, dst)
        with self._guard("KV compaction"):
            self._send(header, payload.to(self.comm.device))
            compact_tree_path(kv.k_caches, kv.v_caches, src, dst)

    def _pool_id(self, kv: KVPool) -> int:
        entry = self._pool_ids.get(id(kv))
        if entry is None:
            entry = self._pool_ids[id(kv)] = (len(self._pool_ids), kv)
        return entry[0]

    def _send(self, header: torch.Tensor, payload: torch.Tensor) -> None:
        self.comm.broadcast(header.to(self.comm.device))
        if payload.numel():
            self.comm.broadcast(payload)

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        if not self.is_alive:
            raise TensorParallelError(self._failure or "the tensor-parallel model is closed")
        try:
            yield
        except BaseException as exc:
            self._failure = self._diagnose(what, exc)
            self._kill()
            raise TensorParallelError(self._failure) from exc

    def _diagnose(self, what: str, exc: BaseException) -> str:
        for p in self._procs:
            p.join(timeout=1.0)  # a worker that just died needs a moment to be reaped
        dead = [(r, p) for r, p in enumerate(self._procs, start=1) if p.exitcode is not None]
        tracebacks = {}
        with contextlib.suppress(queue.Empty, OSError, ValueError):
            while True:
                rank, tb = self._errors.get_nowait()
                tracebacks[rank] = tb
        if dead:
            parts = [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}" for r, p in dead]
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(tracebacks.items()))
            return f"tensor-parallel worker died during {what}: {'; '.join(parts)}{detail}"
        return (
            f"tensor-parallel {what} failed or timed out (distributed_timeout_s="
            f"{self.comm.timeout.total_seconds():g}) with every worker still running: {type(exc).__name__}: {exc}"
        )

    # --- shutdown
    def close(self) -> None:
        """Stop every worker and join it (idempotent; later calls raise ``TensorParallelError``)."""
        if self._closed:
            return
        if self._failure is None:
            with contextlib.suppress(Exception):
                self._send(*pack_stop())
        for p in self._procs:
            p.join(timeout=5.0)
        self._kill()
        self._closed = True

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10.0)
        with contextlib.suppress(Exception):
            self.comm.pg.abort()
        _LIVE.discard(self)


def _await_workers(store: dist.Store, procs: list[Any], timeout_s: float) -> None:
    """Wait until every worker reached the store (``worker_up_key``), failing as soon as one exits
    (e.g. it could not import treeserve), instead of letting the rendezvous wait out its timeout."""
    keys = [worker_up_key(r) for r in range(1, len(procs) + 1)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(procs, start=1) if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"worker {', '.join(dead)} exited before joining the group")
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers did not reach the rendezvous within {timeout_s:g} s")
        time.sleep(0.05)


def launch_tensor_parallel(
    model: str | tuple[LlamaForCausalLM, Any],
    world: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    timeout_s: float = 60.0,
    threads: int | None = None,
) -> tuple[TensorParallelModel, Any]:
    """Start a ``world``-rank tensor-parallel copy of ``model``; return ``(model, tokenizer)``.

    ``model``: a name or path for :func:`treeserve.models.load` (every rank reads only its
    slices), or a ``(LlamaForCausalLM, tokenizer)`` pair (its weights are shared with the
    workers once, at launch; the shards take its dtype). ``threads``: torch threads per worker
    (default: this process's threads divided by ``world``). Raises ``ValueError`` for a
    ``world`` the model cannot be split over (before any process starts) and
    ``TensorParallelError`` when a worker fails to start or load (within ``STARTUP_TIMEOUT_S``).
    """
    from treeserve.models.loader import load, load_config

    if isinstance(model, str):
        config, source, tokenizer = load_config(model), ("path", model), None
    else:
        full, tokenizer = model
        if not isinstance(full, LlamaForCausalLM):
            raise TypeError(f"tensor parallelism needs a LlamaForCausalLM, got {type(full).__name__}")
        from treeserve.models.weights import hf_state_dict

        config, dtype = full.config, full.dtype
        source = ("state", (config, {k: v.share_memory_() for k, v in hf_state_dict(full).items()}))
    check_tensor_parallel(config, world)
    dev = torch.device(device)
    if dev.type == "cuda":
        base = dev.index or 0
        if base + world > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size ({world}) from {device} needs CUDA devices {base}..{base + world - 1}, "
                f"only {torch.cuda.device_count()} exist"
            )
        devices = [f"cuda:{base + r}" for r in range(world)]
    else:
        devices = ["cpu"] * world
    threads = threads or max(1, torch.get_num_threads() // world)
    startup = max(timeout_s, STARTUP_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=startup), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [
        ctx.Process(
            target=worker_main,
            args=(r, world, store.port, source, dtype, devices[r], timeout_s, threads, os.getpid(), errors),
            daemon=True,
            name=f"treeserve-tp-rank{r}",
        )
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    try:
        _await_workers(store, procs, startup)
        comm = Communicator(store, 0, world, torch.device(devices[0]), timeout_s, startup)
        shard = TPShard(0, world, comm)
        if isinstance(model, str):
            local, tokenizer = load(model, dtype=dtype, device=devices[0], shard=shard)
        else:
            local = build_shard(source, shard, dtype, torch.device(devices[0]))
        comm.barrier(startup)
    except BaseException as exc:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(timeout=10.0)
        codes = ", ".join(f"rank {r}: {p.exitcode}" for r, p in enumerate(procs, start=1))
        tbs = []
        with contextlib.suppress(queue.Empty, OSError, ValueError):
            while True:
                tbs.append("--- rank {} ---\n{}".format(*errors.get(timeout=0.5)))
        raise TensorParallelError(
            f"tensor-parallel launch of {world} ranks failed ({type(exc).__name__}: {exc}); worker exit codes {codes}\n"
            + "\n".join(tbs)
        ) from exc
    tp = TensorParallelModel(local, comm, procs, errors)
    tp._store = store  # the rendezvous store lives as long as the group
    return tp, tokenizer
