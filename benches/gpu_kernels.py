"""Kernel table of the GPU check: each kernel's achieved bytes/s over the copy bandwidth measured in
the same run, ours (triton) beside torch, torch SDPA and FlashInfer (when installed).

    python benches/gpu_kernels.py [--device cuda]
    (add --quick --device cpu for a smoke run of the script itself: tiny shapes, the interpreter)

Bytes moved = what a kernel must read and write at least once (the paged K/V of every request,
queries and outputs; logits; target logits and draft probabilities), so "of copy" says how close
it is to memory-bound-optimal. Attention rows (Llama-3-8B heads: 32 query / 8 KV, head dim 128,
bf16, pages of 16): decode at batch 64 x 2048 (the issue's case), batch 8 x 4096 and batch
1 x 16384 (where split-KV matters), tree verify at batch 16 x 1024 with 16 nodes. Each Triton
case runs unsplit (``s=1``), with the split rule's choice (``auto``) and a sweep of split counts,
so one run calibrates :mod:`treeserve.kvcache.split_kv`; the first decode case also runs three
other tiles (16 or 64 keys per block, 8 warps: ``triton nN wW``) to see whether the tile (and its
registers, hence occupancy) is what holds decode back. ``sdpa`` is
``torch.nn.functional.scaled_dot_product_attention`` over the same K/V laid out contiguously
(``[B, KV heads, kv, d]``, no page table): the dense baseline.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--device", default="cuda")
ARGS.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run of the script")
OPTS = ARGS.parse_args()
if OPTS.device == "cpu":  # Triton on CPU tensors only runs under its interpreter (set before import)
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from treeserve._utils import flashinfer_available  # noqa: E402
from treeserve.kvcache import AttentionMetadata, build_tree_mask, paged_attention  # noqa: E402
from treeserve.kvcache._attention_triton import auto_splits, paged_attention_triton, tiles  # noqa: E402
from treeserve.sampling import SamplingBatch, SamplingParams, sample, verify  # noqa: E402
from treeserve.sampling.triton_kernels import thresholds_triton, walk_tree_triton  # noqa: E402

DEV = torch.device(OPTS.device)
QUICK = OPTS.quick
CUDA = DEV.type == "cuda"
GEN = torch.Generator(device=DEV).manual_seed(0)
ROWS: list[tuple[str, str, str, str, str, str]] = []


def seconds(fn: Callable[[], object], iters: int = 20) -> float:
    """Median seconds per call (CUDA events on GPU)."""
    for _ in range(1 if QUICK else 3):
        fn()
    times = []
    for _ in range(2 if QUICK else iters):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    n = (1 << 20) if QUICK else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * n / seconds(lambda: dst.copy_(src))


def record(kernel: str, backend: str, fn: Callable[[], object], nbytes: int, bw: float, note: str = "") -> None:
    try:
        s = seconds(fn)
    except Exception as exc:  # noqa: BLE001 - a backend that cannot run this case is reported, not fatal
        ROWS.append((kernel, backend, "error", "", "", f"{type(exc).__name__}: {str(exc)[:60]}"))
        return
    ROWS.append((kernel, backend, f"{s * 1e6:9.1f}", f"{nbytes / s / 1e9:7.1f}", f"{100 * nbytes / s / bw:5.1f}%", note))


def attention_case(bsz: int, kv_len: int, qo_len: int, tree: bool, bw: float) -> None:
    hq, hkv, d, ps = (4, 2, 16, 4) if QUICK else (32, 8, 128, 16)
    name = f"{'tree' if tree else 'decode'} attn B={bsz} kv={kv_len}" + (f" nodes={qo_len}" if tree else "")
    dtype = torch.bfloat16 if CUDA else torch.float32
    per = -(-kv_len // ps)
    k = torch.randn(bsz * per + 1, ps, hkv, d, device=DEV, generator=GEN).to(dtype)
    v = torch.randn_like(k)
    perm = torch.randperm(bsz * per, device=DEV, generator=GEN) + 1  # page 0 is the dummy page
    pages = [perm[i * per : (i + 1) * per] for i in range(bsz)]
    parents = None
    if tree:
        par = [-1] + [int(torch.randint(0, i, (1,), generator=GEN, device=DEV)) for i in range(1, qo_len)]
        parents = [par] * bsz
    q = torch.randn(bsz * qo_len, hq, d, device=DEV, generator=GEN).to(dtype)
    nbytes = 2 * bsz * kv_len * hkv * d * k.element_size() + 2 * q.numel() * q.element_size()
    meta = AttentionMetadata.build([qo_len] * bsz, [kv_len] * bsz, pages, ps, tree_parents=parents, device=DEV)
    scale = d**-0.5
    record(name, "torch", lambda: paged_attention(q, k, v, meta, backend="torch"), nbytes, bw)
    # the dense baseline: the same K/V contiguous per request, no page table
    kd = torch.stack([k[p].reshape(-1, hkv, d)[:kv_len] for p in pages]).transpose(1, 2).contiguous()
    vd = torch.stack([v[p].reshape(-1, hkv, d)[:kv_len] for p in pages]).transpose(1, 2).contiguous()
    qd = q.view(bsz, qo_len, hq, d).transpose(1, 2)
    mask = None
    if tree:
        mask = torch.ones(qo_len, kv_len, dtype=torch.bool, device=DEV)
        mask[:, kv_len - qo_len :] = build_tree_mask(parents[0], device=DEV)
    sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True)  # noqa: E731
    record(name, "sdpa", sdpa, nbytes, bw)
    chosen = auto_splits(meta, dtype, hkv, hq // hkv, d, DEV)
    sweep = (2,) if QUICK else (2, 4, 8, 16, 32, 64)  # past MAX_SPLITS too: where the cap should be
    counts = [None, 1, *(s for s in sweep if s * qo_len <= kv_len)]
    for s in counts:
        fn = lambda s=s: paged_attention_triton(q, k, v, meta, scale, True, s)  # noqa: E731
        record(name, "triton" + (" auto" if s is None else f" s={s}"), fn, nbytes, bw,
               f"rule: s={chosen}" if s is None else "")
    # other tiles, unsplit (the AOT check compiles only the chosen one)
    base = tiles(dtype, qo_len * hq // hkv, d, tree)
    variants = (base._replace(block_n=16), base._replace(block_n=64), base._replace(num_warps=8))
    if tree:
        variants = (base._replace(block_n=32), base._replace(block_n=32, num_warps=4),
                    base._replace(block_m=32, block_n=32), base._replace(block_m=16, block_n=32, num_warps=4))
    for t in variants:
        fn = lambda t=t: paged_attention_triton(q, k, v, meta, scale, True, 1, t)  # noqa: E731
        record(name, f"triton m{t.block_m} n{t.block_n} w{t.num_warps}", fn, nbytes, bw)
    if CUDA and flashinfer_available():
        record(name, "flashinfer", lambda: paged_attention(q, k, v, meta, backend="flashinfer"), nbytes, bw)


def sampling_case(bw: float) -> None:
    bsz, vocab = (4, 512) if QUICK else (64, 128256)
    logits = torch.randn(bsz, vocab, device=DEV, generator=GEN) * 3
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9)] * bsz
    batch = SamplingBatch.build(params, list(range(bsz)), [[0]] * bsz, vocab, DEV)
    pos = torch.arange(bsz, device=DEV)
    nbytes = logits.numel() * 4
    name = f"sampling top-k/p {bsz}x{vocab}"
    for b in ("torch", "triton"):
        record(name, b, lambda b=b: sample(logits, batch, pos, backend=b), nbytes, bw)
    # the kernel alone, without the processing around it (temperature, softmax, token draw)
    top_k = torch.full((bsz,), 50, device=DEV, dtype=torch.int64)
    top_p = torch.full((bsz,), 0.9, device=DEV, dtype=torch.float64)
    min_p = torch.zeros(bsz, device=DEV, dtype=torch.float64)
    record(f"thresholds kernel {bsz}x{vocab}", "triton", lambda: thresholds_triton(logits, top_k, top_p, min_p),
           nbytes, bw)
    if CUDA and flashinfer_available():
        import flashinfer

        k_t = torch.full((bsz,), 50, device=DEV, dtype=torch.int32)
        p_t = torch.full((bsz,), 0.9, device=DEV)
        fi = lambda: flashinfer.sampling.top_k_top_p_sampling_from_logits(logits / 0.8, k_t, p_t)  # noqa: E731
        record(name, "flashinfer", fi, nbytes, bw)


def verify_case(bw: float) -> None:
    bsz, m, vocab = (4, 3, 512) if QUICK else (64, 4, 128256)
    target = torch.randn(bsz * (m + 1), vocab, device=DEV, generator=GEN) * 3
    draft_probs = torch.softmax(torch.randn(bsz * m, vocab, device=DEV, generator=GEN) * 3, -1)
    tokens = torch.multinomial(draft_probs, 1, generator=GEN).view(bsz, m)
    parents = torch.arange(-1, m - 1, device=DEV).expand(bsz, m).contiguous()
    num = torch.full((bsz,), m, device=DEV)
    batch = SamplingBatch.build([SamplingParams(temperature=1.0)] * bsz, list(range(bsz)), [[0]] * bsz, vocab, DEV)
    pos = torch.arange(bsz, device=DEV)
    nbytes = (target.numel() + draft_probs.numel()) * 4
    name = f"verify chain x{m} {bsz}x{vocab}"
    for b in ("torch", "triton"):
        fn = lambda b=b: verify(target, batch, tokens, parents, num, pos, draft_probs=draft_probs, backend=b)  # noqa: E731
        record(name, b, fn, nbytes, bw)
    # the walk kernel alone, on probabilities already processed
    target_p = torch.softmax(target, -1).view(bsz, m + 1, vocab)
    u = torch.rand(bsz, m, device=DEV, generator=GEN)
    walk = lambda: walk_tree_triton(target_p, draft_probs.view(bsz, m, vocab), tokens, parents, num, u)  # noqa: E731
    record(f"walk kernel x{m} {bsz}x{vocab}", "triton", walk, nbytes, bw)
    if CUDA and flashinfer_available():
        import flashinfer

        fi = lambda: flashinfer.sampling.chain_speculative_sampling(  # noqa: E731
            draft_probs.view(bsz, m, vocab), tokens.int(), target_p
        )
        record(name, "flashinfer", fi, nbytes, bw)


def main() -> None:
    bw = copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e9:.0f} GB/s ({DEV}{', ' + torch.cuda.get_device_name() if CUDA else ''})")
    cases = ((2, 64, 1, False), (2, 40, 4, True)) if QUICK else (
        (64, 2048, 1, False), (8, 4096, 1, False), (1, 16384, 1, False), (16, 1024, 16, True))
    for bsz, kv, qo, tree in cases:
        attention_case(bsz, kv, qo, tree, bw)
    sampling_case(bw)
    verify_case(bw)
    print(f"{'kernel':36} {'backend':18} {'us':>9} {'GB/s':>7} {'of copy':>7}")
    for kernel, backend, us, gbs, frac, note in ROWS:
        print(f"{kernel:36} {backend:18} {us:>9} {gbs:>7} {frac:>7} {note}".rstrip())
    errors = [r for r in ROWS if r[2] == "error" and r[1] != "flashinfer"]
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
