"""Triton paged attention: one program per (request, KV head, block of query rows, KV split).

The rows of a program are (query, group head) pairs, ``row = i * G + g``, so the ``G`` query
heads that share a KV head read each K/V page once (decode and tree verify alike). The kernel
walks the request's KV in blocks of ``BLOCK_N`` tokens, translating token ``j`` to
``page_indices[j // page_size]`` and offset ``j % page_size``, and keeps an online (flash)
softmax in float32. Masks: key ``j < kv_len``; causal ``j <= prefix + i``; tree: for new tokens
(``j >= prefix``) the request's ``qo_len x qo_len`` tree mask row ``i``. Masked K/V are never
loaded, so garbage in unused slots cannot leak into the result.

Split-KV (flash-decoding): with ``num_splits > 1`` (a runtime argument: one compiled variant
serves every count) the KV of each request is cut into ``num_splits`` equal ``BLOCK_N``-aligned
chunks of its actual length; each chunk's program writes its normalized partial output and
log-sum-exp (``-inf`` for a chunk with nothing visible, e.g. past a short request's end) into
float32 workspaces, and ``_merge_splits_kernel`` combines them.
How many splits: :func:`treeserve.kvcache.split_kv.kv_splits`.

Half-precision inputs feed ``tl.dot`` directly on GPU (float32 accumulation); float32 inputs,
and every dtype under the interpreter (``TRITON_INTERPRET=1``, whose bf16 ``tl.dot`` is wrong),
use float32 IEEE dots.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from treeserve._utils import interpreting
from treeserve.kvcache.metadata import AttentionMetadata
from treeserve.kvcache.split_kv import MAX_SPLITS, kv_splits

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _paged_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    part_ptr,
    lse_ptr,
    qo_indptr,
    kv_indptr,
    page_indices,
    last_page_len,
    tree_mask,
    tree_indptr,
    scale,
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    page_size,
    num_splits,
    part_plane,
    lse_plane,
    G: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_TREE: tl.constexpr,
    DOT_F32: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mblk = tl.program_id(2)
    split = 0
    if SPLIT:  # the grid's third axis is (query block, split)
        mblk = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
    qo_start = tl.load(qo_indptr + b)
    qo_len = tl.load(qo_indptr + b + 1) - qo_start
    if mblk * BLOCK_M >= qo_len * G:
        return
    page_start = tl.load(kv_indptr + b)
    num_pages = tl.load(kv_indptr + b + 1) - page_start
    kv_len = (num_pages - 1) * page_size + tl.load(last_page_len + b)
    prefix = kv_len - qo_len

    rows = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G  # query index within the request
    head = kvh * G + rows % G
    row_ok = qi < qo_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_off = (qo_start + qi).to(tl.int64)[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo = 0
    hi = kv_len
    if CAUSAL:  # keys past the block's last query are masked for every row
        hi = prefix + tl.minimum(qo_len, ((mblk + 1) * BLOCK_M - 1) // G + 1)
    if SPLIT:  # this program's chunk of the request's KV (empty past its end)
        chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(hi, lo + chunk)
    if HAS_TREE:
        tree_start = tl.load(tree_indptr + b)
    slot_stride = NUM_KV_HEADS * HEAD_DIM
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_len
        page = tl.load(page_indices + page_start + offs_n // page_size, mask=n_ok, other=0)
        slot = page.to(tl.int64) * page_size + offs_n % page_size
        kv_off = slot[:, None] * slot_stride + kvh * HEAD_DIM + offs_d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_F32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        # torch.compile passes ``scale`` typed fp64 (a plain launch types it fp32): the product is
        # cast back so the loop-carried softmax state keeps one type under both.
        s = (s * scale).to(tl.float32)
        ok = n_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= prefix + qi[:, None])
        if HAS_TREE:
            col = offs_n - prefix
            is_new = col >= 0
            t_off = tree_start + qi[:, None] * qo_len + col[None, :]
            t_ok = tl.load(tree_mask + t_off, mask=row_ok[:, None] & is_new[None, :] & n_ok[None, :], other=0)
            ok = ok & ((~is_new)[None, :] | (t_ok != 0))
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    io_mask = row_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        o_off = (qo_start + qi).to(tl.int64)[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=io_mask)
    else:  # split s's partial in plane s, laid out like a contiguous ``out``: normalized output and
        # log-sum-exp (-inf: nothing seen). 32-bit offsets within a plane (the launcher checks the
        # size) keep the tile's registers below the spill line.
        row = (qo_start + qi) * (NUM_KV_HEADS * G) + head
        p_off = row[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(part_ptr + split.to(tl.int64) * part_plane + p_off, out, mask=io_mask)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + split * lse_plane + row, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr,
    lse_ptr,
    o_ptr,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (token, query head): ``o = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)``
    over the planes ``part[s]`` / ``lse[s]`` (``o``'s contiguous layout, one plane per split)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    num_tokens = tl.num_programs(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    row = n.to(tl.int64) * NUM_HEADS + h
    lse_off = offs_s.to(tl.int64) * num_tokens * NUM_HEADS + row
    lse = tl.load(lse_ptr + lse_off, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))  # empty splits weigh 0
    den = tl.sum(w, 0)
    parts = tl.load(part_ptr + lse_off[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(o_ptr + row * HEAD_DIM + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


_NOMINAL_SMS = 132
"""SM count assumed for CPU tensors (the interpreter): an H100/H200's, so CPU tests take the split
decisions a GPU of that class takes."""

_SMS: dict[int | None, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _NOMINAL_SMS
    sms = _SMS.get(device.index)  # a plain dict lookup after the first call (traceable)
    if sms is None:
        sms = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return sms


class Tiles(NamedTuple):
    """Launch shape of one attention call: query rows, keys and head-dim lanes per program, warps."""

    block_m: int
    block_n: int
    block_d: int
    num_warps: int


def tiles(dtype: torch.dtype, rows: int, head_dim: int, has_tree: bool) -> Tiles:
    """Tiles for ``rows = max_qo_len x G`` query rows per (request, KV head). Sized so that no
    compiled variant spills (tests/test_triton_aot.py, ptxas for sm_80 and sm_90): float32 inputs
    keep at most 32 query rows per program; every tile but the plain decode one (16 rows, no tree
    mask; 4 warps, as measured on the H200) gets 8 warps; 64 rows of head dim 128 walk the KV 16
    keys at a time, the others 32 (64 keys made the head-dim-128 decode tile spill)."""
    block_m = min(32 if dtype == torch.float32 else 64, max(16, triton.next_power_of_2(rows)))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 16 if block_m * block_d >= 64 * 128 else 32
    return Tiles(block_m, block_n, block_d, 4 if block_m == 16 and not has_tree else 8)


def _valid_tile(t: object, head_dim: int) -> bool:
    """Whether ``t`` compiles on a GPU: ``tl.arange`` needs powers of two and ``tl.dot`` at least
    16 along every dimension (Triton 3.6 refuses K = 8 there, which the interpreter and Triton
    3.9 accept)."""
    if not isinstance(t, Tiles) or t.block_d < head_dim:
        return False
    return all(isinstance(v, int) and v >= 16 and v & (v - 1) == 0 for v in t[:3]) and t.num_warps in (1, 2, 4, 8, 16)


def auto_splits(meta: AttentionMetadata, dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int,
                device: torch.device) -> int:
    """The split count the launcher takes for ``meta`` when not told one: :func:`kv_splits` of
    ``batch x KV heads x query blocks`` programs, ``meta.max_kv_len`` and ``device``'s SM count
    (host sizes only: fixed for a CUDA-graph key's static metadata)."""
    t = tiles(dtype, meta.max_qo_len * group, head_dim, meta.tree_mask is not None)
    programs = meta.batch_size * num_kv_heads * triton.cdiv(meta.max_qo_len * group, t.block_m)
    return kv_splits(programs, max(1, meta.max_kv_len), _num_sms(device))


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    causal: bool,
    num_splits: int | None = None,
    tile: Tiles | None = None,
) -> torch.Tensor:
    """Triton backend of :func:`treeserve.kvcache.paged_attention` (inputs already validated).

    ``num_splits`` (an int >= 1) overrides the split rule :func:`~treeserve.kvcache.split_kv.kv_splits`
    (benchmarks and tests compare split with unsplit); ``None`` applies it to the metadata's host
    sizes (batch, ``max_qo_len``, ``max_kv_len``) and the device's SM count. Steps of ``2^31`` or
    more output elements are never split. ``tile`` overrides :func:`tiles` (benchmarks sweep it;
    a tile the AOT check has not compiled may spill).
    """
    if q.dtype not in _DTYPES:
        raise TypeError(f"the triton attention backend supports {_DTYPES}, got {q.dtype}")
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    tree = meta.tree_mask
    has_tree = tree is not None
    t = tiles(q.dtype, meta.max_qo_len * g, d, has_tree) if tile is None else tile
    if not _valid_tile(t, d):
        raise ValueError(f"tile must be a Tiles of powers of two, block_m, block_n, block_d >= 16 (tl.dot's least), "
                         f"block_d >= head_dim {d}, num_warps in 1..16, got {t!r}")
    q_blocks = triton.cdiv(meta.max_qo_len * g, t.block_m)
    if num_splits is None:
        num_splits = auto_splits(meta, q.dtype, hkv, g, d, q.device)
    elif isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    if n * hq * d >= 2**31:  # a split plane's offsets are 32-bit; a batch this large fills the GPU anyway
        num_splits = 1
    if num_splits > 1:  # one plane per split, each laid out like ``out`` (contiguous)
        part = torch.empty(num_splits, n, hq, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(num_splits, n, hq, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # never written: the kernel stores straight into ``out``
    tree_u8 = tree.view(torch.uint8) if has_tree else meta.qo_indptr
    grid = (meta.batch_size, hkv, q_blocks * num_splits)
    _paged_attn_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part,
        lse,
        meta.qo_indptr,
        meta.kv_indptr,
        meta.kv_page_indices,
        meta.kv_last_page_len,
        tree_u8,
        meta.tree_mask_indptr if has_tree else meta.qo_indptr,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        meta.page_size,
        num_splits,
        n * hq * d,
        n * hq,
        G=g,
        NUM_KV_HEADS=hkv,
        HEAD_DIM=d,
        CAUSAL=causal,
        HAS_TREE=has_tree,
        DOT_F32=q.dtype == torch.float32 or interpreting(),
        SPLIT=num_splits > 1,
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_D=t.block_d,
        num_warps=t.num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(n, hq)](
            part, lse, out, num_splits, NUM_HEADS=hq, HEAD_DIM=d,
            BLOCK_S=max(MAX_SPLITS, triton.next_power_of_2(num_splits)), BLOCK_D=t.block_d,  # one variant
        )
    return out
