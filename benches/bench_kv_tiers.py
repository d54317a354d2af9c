"""KV tiers (issue 29): a long shared system prompt evicted from the device pool, then asked again.

Same run, same model (the default ``LLM()`` configuration's SmolLM2), one process:

1. TTFT of a request whose ~4k-token system prompt left the device pool: recomputed (no tiers),
   promoted from the host tier, promoted from the disk tier, and from the disk tier after a
   restart (a new engine over the same directory), and after a restart with the entries dropped from
   the OS page cache (``posix_fadvise(DONTNEED)``: a cold read from the disk). Eviction is
   ``llm.radix.evict`` of everything evictable, so each case starts from the same empty device tree.
2. A working set of prefixes 4x the device pool, asked in shuffled rounds: throughput and prefix
   hit rate with a host tier vs without.
3. ``--bandwidth [--shape smollm2|llama3-8b]``: promotion bandwidth from the host tier into the pool
   (the model's KV shapes, 4k tokens, no model) against a plain copy of the same bytes in the same run: on CUDA the
   pinned host -> device copy (the issue's target: >= 70%), on CPU a host memcpy.

Run: ``flock /work/bench.lock python benches/bench_kv_tiers.py [--prefix 4000] [--quick] [--bandwidth]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from treeserve import LLM, SamplingParams
from treeserve._cpu import cpu_features
from treeserve.kvcache import KVPool, KVTiers, RadixCache, TierLayout, default_chunk_tokens, pages_to_slots

ONE = SamplingParams(temperature=0, max_new_tokens=1)


def system_prompt(llm: LLM, n: int) -> list[int]:
    text = " ".join(f"Rule {i}: answer politely, cite the handbook section {i % 37}, and never guess." for i in range(n))
    return llm.tokenizer.encode(text)[:n]


def ttft(llm: LLM, ids: list[int]) -> float:
    t0 = time.perf_counter()
    out = llm.generate([ids], ONE, use_tqdm=False)[0]
    assert out.error is None
    return time.perf_counter() - t0


def evicted_ttft(llm: LLM, system: list[int], q: int) -> float:
    """Serve system + question 0 (the KV is computed), evict the device tree, time system + q."""
    ttft(llm, system + [q])
    if llm.tiers is not None:
        llm.tiers.flush()
    llm.radix.evict(llm.radix.evictable_tokens)
    assert llm.radix.total_tokens == 0
    return ttft(llm, system + [q + 1])


def drop_page_cache(directory: str) -> int:
    """Drop the OS page cache of every file under ``directory`` (``posix_fadvise(DONTNEED)`` after an
    ``fsync``: the next read comes from the disk, as after a reboot); return the bytes covered."""
    total = 0
    for path in Path(directory).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def single_prefix(pair: tuple, system: list[int], pool: int) -> None:
    base = evicted_ttft(LLM(pair, kv_cache_tokens=pool), system, 100)
    host = LLM(pair, kv_cache_tokens=pool, kv_host_tokens=2 * len(system))
    t_host = evicted_ttft(host, system, 200)
    with tempfile.TemporaryDirectory(prefix="kvtier-") as d:
        disk = LLM(pair, kv_cache_tokens=pool, kv_host_tokens=0, kv_disk_dir=d)
        t_disk = evicted_ttft(disk, system, 300)
        disk.close()
        restarted = LLM(pair, kv_cache_tokens=pool, kv_host_tokens=0, kv_disk_dir=d)
        t_restart = ttft(restarted, system + [400])
        hits = restarted.metrics.kv_tiers.disk_hit_tokens
        restarted.close()
        cached = drop_page_cache(d)
        cold = LLM(pair, kv_cache_tokens=pool, kv_host_tokens=0, kv_disk_dir=d)
        t_cold = ttft(cold, system + [500])
        cold.close()
    print(f"\n{len(system)}-token system prompt evicted from the device pool, then asked again (TTFT):")
    print(f"  recomputed                 {base:8.3f} s")
    for name, t in (("promoted from host", t_host), ("promoted from disk", t_disk), ("disk after a restart", t_restart),
                    ("restart, cold page cache", t_cold)):
        print(f"  {name:<26} {t:8.3f} s   {base / t:6.1f}x")
    print(f"  (restart: {hits} prompt tokens promoted from disk; cold: {cached / 2**20:.0f} MiB of entries "
          f"dropped from the page cache first)")


def working_set(pair: tuple, pool: int, prefix_len: int, rounds: int, seed: int = 0) -> None:
    num_prefixes = 4 * pool // prefix_len
    rng = random.Random(seed)
    tok = pair[1]
    prefixes = [tok.encode(" ".join(f"Doc {p} line {i}: the value of item {i} is {rng.randrange(999)}." for i in range(prefix_len)))[:prefix_len]
                for p in range(num_prefixes)]  # fmt: skip
    order = [p for _ in range(rounds) for p in rng.sample(range(num_prefixes), num_prefixes)]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    print(f"\nworking set: {num_prefixes} prefixes x {prefix_len} tokens = 4x the {pool}-token device pool, "
          f"{len(order)} requests one at a time, 8 new tokens each:")  # fmt: skip
    rows = {}
    for name, kw in (("no tiers", {}), ("host tier", {"kv_host_tokens": 2 * num_prefixes * prefix_len})):
        llm = LLM(pair, kv_cache_tokens=pool, max_batched_tokens=prefix_len + 16, **kw)
        t0 = time.perf_counter()
        for i, p in enumerate(order):
            out = llm.generate([prefixes[p] + [500 + i]], params, use_tqdm=False)[0]
            assert out.error is None
        seconds = time.perf_counter() - t0
        m = llm.metrics
        rows[name] = seconds
        print(f"  {name:<10} {len(order) / seconds:6.2f} req/s  {m.generated_tokens / seconds:7.1f} gen tok/s  "
              f"prefix hit rate {m.prefix_cache_hit_rate:5.1%} (host {m.kv_host_hit_rate:5.1%})  {seconds:6.1f} s")  # fmt: skip
    print(f"  throughput with tiers / without: {rows['no tiers'] / rows['host tier']:.2f}x")


# (layers, KV heads, head dim) of the models whose KV the bandwidth run moves.
KV_SHAPES = {"smollm2": (30, 3, 64), "llama3-8b": (32, 8, 128)}


def promotion_bandwidth(device: str, shape: str = "smollm2", tokens: int = 4096, reps: int = 5) -> tuple[float, float]:
    """GB/s of promoting ``tokens`` from the host tier (best of ``reps``, after one warm-up) and of
    one plain copy of the same bytes (pinned host -> device on CUDA, a host copy on CPU)."""
    layers, heads, dim = KV_SHAPES[shape]
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    pool = KVPool(layers, tokens + 2, 1, heads, dim, dtype, device)
    tiers = KVTiers(pool, TierLayout("bench", dtype, layers, heads, dim, 1, default_chunk_tokens(1)), 2 * tokens)
    cache = RadixCache(pool.allocator, 1, tiers=tiers)
    ids = list(range(1, tokens + 2))
    slots = pages_to_slots(pool.allocator.alloc(len(ids)), 1)
    cache.release_request(ids, slots, None)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    nbytes = tokens * tiers.layout.chunk_bytes // tiers.chunk_tokens
    best = float("inf")
    for rep in range(reps + 1):
        cache.evict(cache.evictable_tokens)
        sync()
        t0 = time.perf_counter()
        m = cache.match_prefix(ids)
        sync()
        if rep:
            best = min(best, time.perf_counter() - t0)
        assert m.length == tokens
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.startswith("cuda"))
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    copy = float("inf")
    for rep in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        if rep:
            copy = min(copy, time.perf_counter() - t0)
    return nbytes / best / 1e9, nbytes / copy / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prefix", type=int, default=4000, help="system prompt tokens")
    ap.add_argument("--quick", action="store_true", help="a 1k-token prompt and a smaller working set")
    ap.add_argument("--bandwidth", action="store_true", help="only the promotion bandwidth")
    ap.add_argument("--shape", choices=sorted(KV_SHAPES), default="smollm2", help="KV shape of --bandwidth")
    ap.add_argument("--working-set-only", action="store_true", help="skip the single-prefix TTFT part")
    args = ap.parse_args()
    f = cpu_features()
    print(f"CPU: {f.model_name} ({platform.machine()}, torch ISA {f.torch_capability})")
    if args.bandwidth:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        promote, copy = promotion_bandwidth(device, args.shape)
        print(f"{device}, {args.shape} KV: promotion from the host tier {promote:.2f} GB/s, plain copy {copy:.2f} GB/s, "
              f"{promote / copy:.0%} of it")  # fmt: skip
        return
    prefix = 1000 if args.quick else args.prefix
    base = LLM(kv_cache_tokens=512)  # the default configuration's model and tokenizer, loaded once
    pair = (base.model, base.tokenizer)
    if not args.working_set_only:
        single_prefix(pair, system_prompt(base, prefix), pool=prefix + 512)
    working_set(pair, pool=512 if args.quick else 1024, prefix_len=128 if args.quick else 256, rounds=2 if args.quick else 3)


if __name__ == "__main__":
    main()
