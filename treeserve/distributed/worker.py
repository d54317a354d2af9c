"""The worker process of a tensor-parallel group (ranks 1..N-1): load a shard, then run steps.

A worker joins the group, loads its shard, reports ready (a barrier), then loops: receive a
step message from rank 0 (:mod:`treeserve.distributed.protocol`), run the same forward or KV
compaction on its shard and its share of the KV pools, until ``STOP``. It never samples and
never sees a request. A failure (including at load time) puts its traceback on ``errors`` and
exits non-zero, which closes its sockets so rank 0's next collective fails at once. A watchdog
thread ends the process when its parent is gone, so no worker outlives the engine.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Any

import torch

from treeserve.distributed.comm import STARTUP_TIMEOUT_S, Communicator
from treeserve.distributed.protocol import HEADER_LEN, Op, payload_len, unpack
from treeserve.kvcache import KVPool, compact_tree_path
from treeserve.models import LlamaForCausalLM
from treeserve.models.parallel import TPShard

__all__ = ["ModelSource", "build_shard", "worker_main", "worker_up_key"]

# How a rank gets its weights: ("path", name_or_path) or ("state", {hf_name: tensor}) (the
# caller's in-memory model, shared with the workers once, at launch).
ModelSource = tuple[str, Any]


def worker_up_key(rank: int) -> str:
    """The store key a worker sets once it reached rank 0's store (rank 0 polls it, watching
    for workers that exit first)."""
    return f"treeserve/tp/up/{rank}"


def build_shard(source: ModelSource, shard: TPShard, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Rank ``shard.rank``'s shard of the model ``source`` describes (only its slices are read)."""
    kind, what = source
    if kind == "path":
        from treeserve.models import load

        return load(what, dtype=dtype, device=device, shard=shard).model
    from treeserve.models.weights import build_model

    config, state = what
    return build_model(config, state.__getitem__, state, dtype=dtype, device=device, shard=shard)


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.2)


def recv_step(comm: Communicator) -> tuple[list[int], torch.Tensor]:
    """Receive one step message from rank 0 (waits without timeout for the header)."""
    header = comm.broadcast(torch.zeros(HEADER_LEN, dtype=torch.int64, device=comm.device), idle=True).tolist()
    payload = torch.empty(payload_len(header), dtype=torch.int64, device=comm.device)
    if payload.numel():
        comm.broadcast(payload)
    return header, payload


def worker_main(
    rank: int,
    world: int,
    port: int,
    source: ModelSource,
    dtype: torch.dtype,
    device: str,
    timeout_s: float,
    threads: int,
    parent_pid: int,
    errors: Any,
) -> None:
    """Process entry point of rank ``rank`` (see the module docstring)."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="tp-parent-watch").start()
    torch.set_num_threads(threads)
    try:
        _serve(rank, world, port, source, dtype, torch.device(device), timeout_s)
    except BaseException:
        errors.put((rank, traceback.format_exc(limit=8)))
        os._exit(1)


def _serve(
    rank: int, world: int, port: int, source: ModelSource, dtype: torch.dtype, device: torch.device, timeout_s: float
) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    startup = max(timeout_s, STARTUP_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=startup))
    store.set(worker_up_key(rank), "1")
    comm = Communicator(store, rank, world, device, timeout_s, startup)
    shard = TPShard(rank, world, comm)
    model = build_shard(source, shard, dtype, device)
    comm.barrier(startup)
    pools: dict[int, KVPool] = {}
    cfg = model.config
    with torch.inference_mode():
        while True:
            header, payload = recv_step(comm)
            step = unpack(header, payload, model.dtype)
            if step.op == Op.STOP:
                return
            pool = pools.get(step.pool_id)
            if pool is None:
                pool = pools[step.pool_id] = KVPool(
                    cfg.num_layers, step.num_pages, step.page_size, model.kv_heads_per_rank, cfg.head_dim,
                    model.dtype, device,
                )  # fmt: skip
            if (pool.num_pages, pool.page_size) != (step.num_pages, step.page_size):
                raise RuntimeError(f"KV pool {step.pool_id} changed shape on rank 0")
            if step.op == Op.FORWARD:
                ids, positions, slots, meta, logits_rows = step.forward
                model(ids, positions, pool, slots, meta, logits_rows)
            else:
                src, dst = step.moves
                compact_tree_path(pool.k_caches, pool.v_caches, src, dst)
