"""Hand-fused Triton kernels of a decoder layer on CUDA, and the first pass of the bf16 LM head.

Each kernel replaces several torch kernels of the layer's torch path (``LlamaForCausalLM`` on CPU)
and rounds where that path rounds, so results agree with it to the last bit of the output dtype
(float32 differs only where a sum is taken in another order):

- ``add_rms_norm_triton``: ``s = x + residual`` (rounded to the dtype) and ``rms_norm(s) * w``
  (statistics in float32, one rounding), one pass per row: 2 kernels -> 1;
- ``rope_store_triton``: RoPE ("rotate half", cos/sin rounded to the model dtype as the torch path
  gathers them) of the q and k heads of the fused QKV output, q written contiguous in the KV
  dtype, k and v stored at their slots of the paged caches: ~9 kernels (gather, two multiplies,
  two multiply-adds, concat, two contiguous copies, the store) -> 1;
- ``silu_mul_triton``: ``silu(gate) * up`` of the fused gate|up output: 2 kernels -> 1;
- ``head_bf16_triton`` + ``head_rescore_triton``: the LM head's bf16 pass with float32
  accumulation and output (``x`` and ``W`` rounded to bf16), then every vocabulary entry the
  error bound cannot rule out of the row's argmax recomputed in float32 (see ``TritonHead``).

Scalars that are per model (``eps``, the bound factor) are constexprs: never typed fp32 by one
launcher and fp64 by another (the failure mode of issue 27). The launchers validate shapes,
dtypes and devices (``ValueError`` / ``TypeError`` naming the argument); value ranges (positions,
slots) are checked by the caller under ``TREESERVE_DEBUG_CHECKS``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeserve._utils import interpreting

__all__ = [
    "add_rms_norm_triton",
    "head_bf16_triton",
    "head_bound_factor",
    "head_rescore_triton",
    "rope_store_triton",
    "silu_mul_triton",
]

_FLOATS = (torch.float32, torch.bfloat16)
MAX_HIDDEN = 16384  # one row of the norm is one tile
HEAD_BLOCK_M = 64  # rows of x per program of the head's first pass (its weight is read cdiv(M, 64) times)
HEAD_BLOCK_V = 64  # vocabulary entries per program of the first pass (and per partial maximum)
HEAD_BLOCK_K = 64
RESCORE_BLOCK_V = 32  # vocabulary entries per program of the re-scoring
RESCORE_BLOCK_K = 128


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _check_float(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS or (dtype is not None and t.dtype != dtype):
        want = dtype if dtype is not None else "float32 or bfloat16"
        raise TypeError(f"{name} must be {want}, got {t.dtype}")


def _check_rows(name: str, t: torch.Tensor, cols: int) -> None:
    if t.dim() != 2 or t.shape[1] != cols or t.stride(1) != 1:
        raise ValueError(f"{name} must be [N, {cols}] with contiguous rows, got shape {tuple(t.shape)}")


# ---------------------------------------------------------------- residual add + RMSNorm


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, sum_ptr, out_ptr, rows_ptr, x_stride, res_stride, n_cols,
                         EPS: tl.constexpr, HAS_RES: tl.constexpr, GATHER: tl.constexpr, BLOCK: tl.constexpr):
    out_row = tl.program_id(0).to(tl.int64)
    if GATHER:
        row = tl.load(rows_ptr + out_row).to(tl.int64)
    else:
        row = out_row
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    s = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + out_row * n_cols + cols, s, mask=mask)
    sf = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / n_cols + EPS)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_row * n_cols + cols, (sf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, y)``: ``s = x + residual`` (``x`` itself when ``residual`` is None and ``rows`` too)
    and ``y = rms_norm(s) * weight``, both ``[N, H]`` in ``x``'s dtype; one kernel, one pass per row.

    ``x``, ``residual``: ``[N, H]`` float32/bfloat16 of one dtype with contiguous rows; ``weight``
    ``[H]`` of that dtype, ``H <= 16384``; ``eps`` a float > 0. ``rows``: int ``[M]`` (each in
    ``[0, N)``, not checked): only those rows, gathered, ``s`` and ``y`` then ``[M, H]`` (the
    final norm of the logits rows, without a gather kernel before it).
    """
    _check_float("x", x)
    n, h = x.shape if x.dim() == 2 else (0, -1)
    _check_rows("x", x, h)
    if not 1 <= h <= MAX_HIDDEN:
        raise ValueError(f"x's hidden size must be in [1, {MAX_HIDDEN}], got {h}")
    _check_float("weight", weight, x.dtype)
    if weight.shape != (h,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{h}], got {tuple(weight.shape)}")
    if residual is not None:
        _check_float("residual", residual, x.dtype)
        _check_rows("residual", residual, h)
        if residual.shape[0] != n:
            raise ValueError(f"residual must have x's {n} rows, got {residual.shape[0]}")
    if not isinstance(eps, float) or not eps > 0:
        raise ValueError(f"eps must be a float > 0, got {eps!r}")
    if rows is not None:
        if not isinstance(rows, torch.Tensor) or rows.dtype not in (torch.int32, torch.int64) or rows.dim() != 1:
            raise TypeError("rows must be a 1-D int32/int64 tensor")
        if rows.device != x.device:
            raise ValueError(f"rows is on {rows.device} but x is on {x.device}")
    m = n if rows is None else rows.shape[0]
    out = torch.empty((m, h), dtype=x.dtype, device=x.device)
    if residual is None:
        s = x if rows is None else x[rows]
    else:
        s = torch.empty_like(out)
    if m:
        block = triton.next_power_of_2(h)
        res = x if residual is None else residual
        _add_rms_norm_kernel[(m,)](x, res, weight, s, out, x if rows is None else rows, x.stride(0), res.stride(0), h,
                                   EPS=eps, HAS_RES=residual is not None, GATHER=rows is not None, BLOCK=block,
                                   num_warps=_warps(block))
    return s, out


# ---------------------------------------------------------------- RoPE on q and k + the paged KV store


@triton.jit
def _rope_store_kernel(qkv_ptr, rope_ptr, pos_ptr, slot_ptr, q_ptr, k_cache, v_cache, qn_ptr, kn_ptr, qkv_stride,
                       HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr,
                       BLOCK_H: tl.constexpr, QK_NORM: tl.constexpr, EPS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_P2)
    dm = d < HALF
    dt = qkv_ptr.dtype.element_ty
    # The torch path gathers the float32 table and rounds it to the model dtype.
    cos = tl.load(rope_ptr + pos * (2 * HALF) + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(rope_ptr + pos * (2 * HALF) + HALF + d, mask=dm, other=0.0).to(dt).to(tl.float32)
    row = qkv_ptr + t * qkv_stride
    for h0 in tl.static_range(0, HQ + 2 * HKV, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        off = h[:, None] * (2 * HALF) + d[None, :]
        ok = (h < HQ + 2 * HKV)[:, None] & dm[None, :]
        x1 = tl.load(row + off, mask=ok, other=0.0)
        x2 = tl.load(row + off + HALF, mask=ok, other=0.0)
        rotate = (h < HQ + HKV)[:, None]
        if QK_NORM:  # each q / k head RMS-normalized over head_dim first, as _add_rms_norm_kernel rounds it
            n1, n2 = x1.to(tl.float32), x2.to(tl.float32)
            rstd = tl.rsqrt((tl.sum(n1 * n1, axis=1) + tl.sum(n2 * n2, axis=1)) / (2 * HALF) + EPS)[:, None]
            q_head = (h < HQ)[:, None]
            w1 = tl.where(q_head, tl.load(qn_ptr + d, mask=dm, other=0.0)[None, :],
                          tl.load(kn_ptr + d, mask=dm, other=0.0)[None, :]).to(tl.float32)
            w2 = tl.where(q_head, tl.load(qn_ptr + HALF + d, mask=dm, other=0.0)[None, :],
                          tl.load(kn_ptr + HALF + d, mask=dm, other=0.0)[None, :]).to(tl.float32)
            x1 = tl.where(rotate, (n1 * rstd * w1).to(dt), x1)
            x2 = tl.where(rotate, (n2 * rstd * w2).to(dt), x2)
        # x1 cos - x2 sin and x2 cos + x1 sin, rounded where torch's mul and addcmul round.
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        o1 = tl.where(rotate, ((x1f * cos[None, :]).to(dt).to(tl.float32) - x2f * sin[None, :]).to(dt), x1)
        o2 = tl.where(rotate, ((x2f * cos[None, :]).to(dt).to(tl.float32) + x1f * sin[None, :]).to(dt), x2)
        is_q = (h < HQ)[:, None]
        q_off = t * (HQ * 2 * HALF) + off
        qt = q_ptr.dtype.element_ty
        tl.store(q_ptr + q_off, o1.to(qt), mask=ok & is_q)
        tl.store(q_ptr + q_off + HALF, o2.to(qt), mask=ok & is_q)
        is_k = rotate & ~is_q
        kt = k_cache.dtype.element_ty
        k_off = slot * (HKV * 2 * HALF) + (h - HQ)[:, None] * (2 * HALF) + d[None, :]
        tl.store(k_cache + k_off, o1.to(kt), mask=ok & is_k)
        tl.store(k_cache + k_off + HALF, o2.to(kt), mask=ok & is_k)
        is_v = ~rotate
        v_off = k_off - HKV * (2 * HALF)
        tl.store(v_cache + v_off, o1.to(kt), mask=ok & is_v)
        tl.store(v_cache + v_off + HALF, o2.to(kt), mask=ok & is_v)


def rope_store_triton(
    qkv: torch.Tensor,
    rope_table: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """RoPE on the q and k heads of ``qkv`` and the paged KV store, in one kernel; returns q.

    ``q_norm``, ``k_norm`` (both or neither; Qwen3): ``[head_dim]`` weights of ``qkv``'s dtype; each q /
    k head is first RMS-normalized over ``head_dim`` (``eps`` a float > 0) and scaled by them, as the
    torch layers' ``RMSNorm`` does, then rotated.

    ``qkv``: ``[N, (num_heads + 2 num_kv_heads) head_dim]`` float32/bfloat16, contiguous rows
    (q heads, k heads, v heads); ``rope_table``: float32 ``[P, 2, head_dim // 2]`` (cos, sin:
    ``rope.rope_table``); ``positions`` (each ``< P``) and ``slots`` (each a row of the caches):
    int ``[N]``; ``k_cache, v_cache``: contiguous ``[num_pages, page_size, num_kv_heads, head_dim]``
    of one float dtype. Token ``i``'s rotated k and its v are written at slot ``slots[i]``; the
    rotated q comes back as a new contiguous ``[N, num_heads, head_dim]`` in the caches' dtype.
    """
    _check_float("qkv", qkv)
    _check_float("k_cache", k_cache)
    _check_float("v_cache", v_cache, k_cache.dtype)
    _check_float("rope_table", rope_table, torch.float32)
    if rope_table.dim() != 3 or rope_table.shape[1] != 2 or not rope_table.is_contiguous():
        raise ValueError(f"rope_table must be a contiguous [P, 2, head_dim // 2], got {tuple(rope_table.shape)}")
    half = rope_table.shape[2]
    want = (num_kv_heads, 2 * half)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or tuple(c.shape[2:]) != want or not c.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous [pages, page_size, {want[0]}, {want[1]}], got {tuple(c.shape)}"
            )
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    n = qkv.shape[0]
    _check_rows("qkv", qkv, (num_heads + 2 * num_kv_heads) * 2 * half)
    for name, idx in (("positions", positions), ("slots", slots)):
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32/int64 tensor")
        if idx.shape != (n,):
            raise ValueError(f"{name} must be [N={n}], got {tuple(idx.shape)}")
    if len({t.device for t in (qkv, rope_table, positions, slots, k_cache, v_cache)}) != 1:
        raise ValueError("qkv, rope_table, positions, slots and the caches must be on one device")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm must be given together")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None:
            _check_float(name, w, qkv.dtype)
            if w.shape != (2 * half,) or not w.is_contiguous() or w.device != qkv.device:
                raise ValueError(f"{name} must be a contiguous [{2 * half}] on {qkv.device}, got {tuple(w.shape)}")
    if q_norm is not None and (not isinstance(eps, float) or not eps > 0):
        raise ValueError(f"eps must be a float > 0, got {eps!r}")
    q = torch.empty((n, num_heads, 2 * half), dtype=k_cache.dtype, device=qkv.device)
    if n:
        half_p2 = triton.next_power_of_2(half)
        block_h = max(1, min(triton.next_power_of_2(num_heads + 2 * num_kv_heads), 4096 // half_p2))
        norm = q_norm is not None
        _rope_store_kernel[(n,)](qkv, rope_table, positions, slots, q, k_cache, v_cache,
                                 q_norm if norm else qkv, k_norm if norm else qkv, qkv.stride(0),
                                 HQ=num_heads, HKV=num_kv_heads, HALF=half, HALF_P2=half_p2, BLOCK_H=block_h,
                                 QK_NORM=norm, EPS=eps if norm else 0.0)
    return q


# ---------------------------------------------------------------- SiLU(gate) * up


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, gu_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # torch's silu rounds before the multiply
    tl.store(out_ptr + row * n_cols + cols, (a * u).to(dt), mask=mask)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]``, ``[N, 2I]`` float32/bfloat16 with
    contiguous rows (``I >= 1``); returns ``[N, I]`` in its dtype, in one kernel."""
    _check_float("gate_up", gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.shape[1] == 0 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [N, 2I] (I >= 1) with contiguous rows, got {tuple(gate_up.shape)}")
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), inter, BLOCK=block)
    return out


# ---------------------------------------------------------------- the LM head: bf16 pass, exact re-scoring


def head_bound_factor(hidden: int) -> float:
    """``F`` with ``|approx_j - x . W_j| <= F |x| |W_j|`` for the first pass (see ``TritonHead``):
    ``x`` and ``W`` rounded to bf16 (``u = 2^-8`` each: ``2u + u^2``), float32 accumulation of
    ``hidden`` exact products (each addition within ``2^-23``, however the tensor cores order and
    round it), plus the float32 rounding of ``|x|``, of the bound and of the comparisons."""
    return 2.0**-7 + 2.0**-14 + (4 * hidden + 64) * 2.0**-24


@triton.jit
def _head_bf16_kernel(x_ptr, w_ptr, rn_ptr, out_ptr, part_ptr, xnorm_ptr, M, V, K, x_stride, n_blocks,
                      F: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                      BF16_DOT: tl.constexpr):
    pm, pv = tl.program_id(0), tl.program_id(1)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    vs = pv * BLOCK_V + tl.arange(0, BLOCK_V)
    rm, vm = rows < M, vs < V
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        km = k0 + ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + (k0 + ks)[None, :],
                    mask=rm[:, None] & km[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + vs[:, None].to(tl.int64) * K + (k0 + ks)[None, :], mask=vm[:, None] & km[None, :],
                    other=0.0)
        sq += tl.sum(x * x, axis=1)
        if BF16_DOT:
            acc = tl.dot(x.to(tl.bfloat16), tl.trans(w), acc)
        else:  # the same exact products of bf16 values, as float32 operands (see head_bf16_triton)
            acc = tl.dot(x.to(tl.bfloat16).to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    xn = tl.sqrt(sq)
    rn = tl.load(rn_ptr + vs, mask=vm, other=0.0)
    out_off = rows[:, None].to(tl.int64) * V + vs[None, :]
    tl.store(out_ptr + out_off, acc, mask=rm[:, None] & vm[None, :])
    lower = tl.where(vm[None, :], acc - F * xn[:, None] * rn[None, :], float("-inf"))
    tl.store(part_ptr + rows.to(tl.int64) * n_blocks + pv, tl.max(lower, axis=1), mask=rm)
    if pv == 0:
        tl.store(xnorm_ptr + rows, xn, mask=rm)


def head_bf16_triton(
    x: torch.Tensor, weight_bf16: torch.Tensor, row_norms: torch.Tensor, factor: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head's first pass: ``(approx, partial, xnorm)``.

    ``x``: ``[M, K]`` float32/bfloat16 (contiguous rows); ``weight_bf16``: contiguous ``[V, K]``
    bfloat16; ``row_norms``: float32 ``[V]`` (``|W_j|``); ``factor``: ``head_bound_factor(K)``.
    ``approx [M, V]`` float32 = ``bf16(x) . bf16(W_j)`` accumulated in float32;
    (The interpreter multiplies bfloat16 dot operands as their raw bits, so there the same bf16
    values enter the dot as float32: the products are exact either way.)
    ``partial [M, cdiv(V, 64)]``: per block of 64 entries, the largest lower bound
    ``approx - factor |x| |W_j|``; ``xnorm [M]``: ``|x|`` in float32.
    """
    _check_float("x", x)
    _check_float("weight_bf16", weight_bf16, torch.bfloat16)
    if weight_bf16.dim() != 2 or not weight_bf16.is_contiguous():
        raise ValueError(f"weight_bf16 must be a contiguous [V, K], got {tuple(weight_bf16.shape)}")
    v, k = weight_bf16.shape
    _check_rows("x", x, k)
    _check_float("row_norms", row_norms, torch.float32)
    if row_norms.shape != (v,):
        raise ValueError(f"row_norms must be [V={v}], got {tuple(row_norms.shape)}")
    m = x.shape[0]
    n_blocks = triton.cdiv(v, HEAD_BLOCK_V)
    approx = torch.empty((m, v), dtype=torch.float32, device=x.device)
    partial = torch.empty((m, n_blocks), dtype=torch.float32, device=x.device)
    xnorm = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        block_m = min(HEAD_BLOCK_M, max(16, triton.next_power_of_2(m)))
        grid = (triton.cdiv(m, block_m), n_blocks)
        _head_bf16_kernel[grid](x, weight_bf16, row_norms, approx, partial, xnorm, m, v, k, x.stride(0), n_blocks,
                                F=factor, BLOCK_M=block_m, BLOCK_V=HEAD_BLOCK_V, BLOCK_K=HEAD_BLOCK_K,
                                BF16_DOT=not interpreting(), num_warps=8, num_stages=2)
    return approx, partial, xnorm


@triton.jit
def _head_threshold_kernel(part_ptr, thr_ptr, n_blocks, BLOCK_P: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    best = tl.full((BLOCK_P,), float("-inf"), tl.float32)
    for p0 in range(0, n_blocks, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        best = tl.maximum(best, tl.load(part_ptr + m * n_blocks + p, mask=p < n_blocks, other=float("-inf")))
    tl.store(thr_ptr + m, tl.max(best, axis=0))


@triton.jit
def _head_rescore_kernel(x_ptr, w_ptr, rn_ptr, out_ptr, thr_ptr, xnorm_ptr, V, K, x_stride,
                         F: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = vs < V
    approx = tl.load(out_ptr + m * V + vs, mask=vm, other=0.0)
    upper = approx + F * tl.load(xnorm_ptr + m) * tl.load(rn_ptr + vs, mask=vm, other=0.0)
    cand = vm & (upper >= tl.load(thr_ptr + m))
    if tl.max(cand.to(tl.int32), axis=0) > 0:
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            km = k0 + ks < K
            x = tl.load(x_ptr + m * x_stride + k0 + ks, mask=km, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + vs[:, None].to(tl.int64) * K + (k0 + ks)[None, :], mask=cand[:, None] & km[None, :],
                        other=0.0)
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(out_ptr + m * V + vs, acc, mask=cand)


def head_rescore_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    row_norms: torch.Tensor,
    approx: torch.Tensor,
    partial: torch.Tensor,
    xnorm: torch.Tensor,
    factor: float,
) -> torch.Tensor:
    """Re-score, in float32 from the float32 ``weight [V, K]``, every entry of ``approx`` (in
    place) whose upper bound ``approx + factor |x| |W_j|`` reaches the row's largest lower bound
    (the maximum of ``partial``): the outputs of :func:`head_bf16_triton` for ``x``. Two kernels
    (that maximum per row, then the re-scoring: a block of entries without a candidate reads
    nothing of ``weight``). Returns ``approx``."""
    _check_float("weight", weight, torch.float32)
    if weight.dim() != 2 or not weight.is_contiguous() or weight.shape[0] != approx.shape[1]:
        raise ValueError(f"weight must be a contiguous [V={approx.shape[1]}, K], got {tuple(weight.shape)}")
    m, v = approx.shape
    _check_rows("x", x, weight.shape[1])
    if m:
        n_blocks = partial.shape[1]
        threshold = torch.empty((m,), dtype=torch.float32, device=x.device)
        _head_threshold_kernel[(m,)](partial, threshold, n_blocks, BLOCK_P=min(1024, triton.next_power_of_2(n_blocks)))
        grid = (m, triton.cdiv(v, RESCORE_BLOCK_V))
        _head_rescore_kernel[grid](x, weight, row_norms, approx, threshold, xnorm, v, weight.shape[1], x.stride(0),
                                   F=factor, BLOCK_V=RESCORE_BLOCK_V, BLOCK_K=RESCORE_BLOCK_K)
    return approx
