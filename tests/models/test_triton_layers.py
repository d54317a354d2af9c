"""The fused Triton kernels of a layer and the bf16 exact head against the torch path.

Under the interpreter (CPU) with the GPU's float32 -> bfloat16 rounding (``_triton_rounding``),
or on CUDA tensors where CUDA is present. Under the interpreter bfloat16 results equal the torch
path's bit for bit (on CUDA within one bf16 ulp: torch's CUDA reductions and ``exp`` round
differently from NumPy's); float32 ones agree to a few ulps (sums and multiply-adds in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._devices import backend_device
from tests.models._triton_rounding import gpu_rounding
from treeserve.kvcache import AttentionMetadata, KVPool
from treeserve.models import random_model, tiny_config
from treeserve.models._norm_op import add_rms_norm_torch
from treeserve.models._triton_layers import (
    add_rms_norm_triton,
    head_bf16_triton,
    head_bound_factor,
    rope_store_triton,
    silu_mul_triton,
)
from treeserve.models.rope import apply_rope
from treeserve.models.triton_forward import HEAD_MEASURED_ROWS, TritonHead, bf16_min_rows, uses_triton_layers

DEV = backend_device("triton")
BITWISE = DEV.type == "cpu"  # the interpreter, compared with torch's CPU kernels
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
FEW = settings(max_examples=8)


@pytest.fixture(autouse=True)
def _gpu_rounding():
    with gpu_rounding():
        yield


def assert_matches(ours: torch.Tensor, ref: torch.Tensor, scale: float = 1.0) -> None:
    """bf16: bit for bit (one ulp on CUDA); float32: within 8 ulps of ``scale`` (the inputs' magnitude)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ref.dtype == torch.bfloat16 and not BITWISE:
        torch.testing.assert_close(ours, ref, rtol=2**-7, atol=2**-7 * scale)
    elif ref.dtype == torch.bfloat16:
        assert torch.equal(ours, ref), (ours.float() - ref.float()).abs().max()
    else:
        torch.testing.assert_close(ours, ref, rtol=2**-20, atol=8 * 2**-23 * scale)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEV)


@FEW
@given(n=st.integers(0, 4), h=st.integers(1, 300), dtype=DTYPES, residual=st.booleans(), seed=st.integers(0, 99),
       gather=st.booleans())
def test_add_rms_norm_matches_torch(n: int, h: int, dtype: torch.dtype, residual: bool, seed: int, gather: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, w = _randn(gen, n, h, dtype=dtype), _randn(gen, h, dtype=dtype)
    r = _randn(gen, n, h, dtype=dtype) if residual else None
    rows = torch.randint(0, max(n, 1), (3 if n else 0,), generator=gen).to(DEV) if gather else None
    s, y = add_rms_norm_triton(x, r, w, 1e-6, rows=rows)
    if rows is not None:  # the torch path gathers first
        x, r = x[rows], (None if r is None else r[rows])
    s0, y0 = add_rms_norm_torch(x, r, w, 1e-6)
    assert torch.equal(s, s0)
    assert_matches(y, y0, scale=float(y0.abs().max()) if y0.numel() else 1.0)


@FEW
@given(
    heads=st.sampled_from([(4, 2), (3, 1), (2, 2), (9, 3)]),
    head_dim=st.sampled_from([8, 12, 16]),
    n=st.integers(1, 5),
    dtype=DTYPES,
    kv_bf16=st.booleans(),
    qk_norm=st.booleans(),
    data=st.data(),
)
def test_rope_store_matches_torch(heads, head_dim, n, dtype, kv_bf16, qk_norm, data) -> None:
    """With ``qk_norm`` (Qwen3) each q / k head RMS-normalized first, as the torch layers' ``RMSNorm``."""
    hq, hkv = heads
    kv_dtype = torch.bfloat16 if kv_bf16 else dtype
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    table = torch.rand(64, 2, head_dim // 2, generator=gen).to(DEV) * 2 - 1
    qkv = _randn(gen, n, (hq + 2 * hkv) * head_dim, dtype=dtype)
    pages, page_size = 5, 4
    positions = torch.tensor(data.draw(st.lists(st.integers(0, 63), min_size=n, max_size=n)), device=DEV)
    slots = torch.tensor(data.draw(st.lists(st.integers(0, pages * page_size - 1), min_size=n, max_size=n,
                                            unique=True)), device=DEV)
    k_cache = _randn(gen, pages, page_size, hkv, head_dim, dtype=kv_dtype)
    v_cache = _randn(gen, pages, page_size, hkv, head_dim, dtype=kv_dtype)
    k_ref, v_ref = k_cache.clone().view(-1, hkv, head_dim), v_cache.clone().view(-1, hkv, head_dim)

    norms = [(_randn(gen, head_dim, dtype=dtype) + 1) for _ in range(2)] if qk_norm else [None, None]
    q = rope_store_triton(qkv, table, positions, slots, k_cache, v_cache, hq, hkv, *norms, eps=1e-6)

    cos_sin = table[positions].to(dtype)  # the torch path of ``Attention.forward``
    qk, v = qkv.split(((hq + hkv) * head_dim, hkv * head_dim), dim=-1)
    qk = qk.reshape(n, hq + hkv, head_dim)
    if qk_norm:
        qh, kh = qk.split((hq, hkv), dim=1)
        qk = torch.cat([add_rms_norm_torch(t, None, w, 1e-6)[1] for t, w in ((qh, norms[0]), (kh, norms[1]))], dim=1)
    qk = apply_rope(qk, cos_sin[:, None, 0], cos_sin[:, None, 1])
    q0, k0 = qk.split((hq, hkv), dim=1)
    k_ref[slots], v_ref[slots] = k0.to(kv_dtype), v.reshape(n, hkv, head_dim).to(kv_dtype)
    scale = float(qkv.abs().max())
    assert_matches(q, q0.to(kv_dtype).contiguous(), scale)
    assert_matches(k_cache.view(-1, hkv, head_dim), k_ref, scale)
    assert torch.equal(v_cache.view(-1, hkv, head_dim), v_ref)  # untouched slots included


@FEW
@given(n=st.integers(0, 4), inter=st.integers(1, 1500), dtype=DTYPES, seed=st.integers(0, 99))
def test_silu_mul_matches_torch(n: int, inter: int, dtype: torch.dtype, seed: int) -> None:
    gate_up = _randn(torch.Generator().manual_seed(seed), n, 2 * inter, dtype=dtype) * 3
    gate, up = gate_up.split(inter, dim=-1)
    assert_matches(silu_mul_triton(gate_up), F.silu(gate) * up, scale=float(gate_up.abs().max()) ** 2 if n else 1.0)


def _near_ties(gen: torch.Generator, m: int, vocab: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose top logits are a few near-copies of one weight row: bf16 cannot order them,
    float32 can (gaps ~1e-3 relative, far above float32 rounding)."""
    w = torch.randn(vocab, hidden, generator=gen)
    x = torch.randn(m, hidden, generator=gen)
    for i in range(m):
        top = int((x[i] @ w.T).argmax())
        rivals = torch.randint(0, vocab, (6,), generator=gen)
        w[rivals] = w[top] + 3e-3 * torch.randn(6, hidden, generator=gen)
    return x, w


def test_bf16_head_argmax_equals_float64() -> None:
    """The GPU head's argmax is float64's wherever float64's top two differ by more than float32
    rounding; the plain bf16 head gets some of those rows wrong (the test can fail)."""
    gen = torch.Generator().manual_seed(0)
    m, vocab, hidden = 24, 700, 96
    x, w = _near_ties(gen, m, vocab, hidden)
    head = TritonHead.of(w.to(DEV), bf16_min_rows=1)  # the bf16 pass whatever a GPU would measure
    logits = head(x.to(DEV)).cpu()
    exact = x.double() @ w.double().T
    top2 = exact.topk(2, dim=1).values
    decided = (top2[:, 0] - top2[:, 1]) > 1e-4 * x.norm(dim=1).double() * w.norm(dim=1).max().double()
    assert int(decided.sum()) >= m // 2
    assert torch.equal(logits.argmax(1)[decided], exact.argmax(1)[decided])
    plain_bf16 = (x.bfloat16().float() @ w.bfloat16().float().T).argmax(1)
    assert not torch.equal(plain_bf16[decided], exact.argmax(1)[decided])
    # Every logit stays within the bound of the float32 head's.
    bound = head_bound_factor(hidden) * x.norm(dim=1, keepdim=True) * w.norm(dim=1)
    assert bool(((logits - x @ w.T).abs() <= bound + 1e-5).all())


def test_head_bound_holds_on_worst_case_rounding() -> None:
    """Every x_i and W_i just above 1 + 2^-8 rounds up by almost 2^-8 (bf16's unit roundoff, not
    2^-9): the first pass's error reaches ~2^-7 |x| |W|, and the bound still covers it."""
    hidden = 64
    v = 1 + 2**-8 + 2**-20
    x = torch.full((1, hidden), v)
    w = torch.full((3, hidden), v)
    w[1:] *= -1
    approx, _, xnorm = head_bf16_triton(x.to(DEV), w.bfloat16().to(DEV), w.norm(dim=1).to(DEV),
                                        head_bound_factor(hidden))
    err = (approx.cpu().double() - x.double() @ w.double().T).abs()
    scale = float(x.norm()) * w.norm(dim=1).double()
    assert bool((err <= head_bound_factor(hidden) * scale).all())
    assert bool((err > 2**-7 * 0.99 * scale).all())  # the bound is nearly tight here
    assert float(xnorm) == pytest.approx(float(x.norm()), rel=2**-20)


def test_bf16_head_bad_input() -> None:
    with pytest.raises(TypeError, match="weight must be float32"):
        TritonHead.of(torch.zeros(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        TritonHead.of(torch.zeros(8, 4).T)
    head = TritonHead.of(torch.zeros(4, 8).to(DEV), bf16_min_rows=1)
    with pytest.raises(ValueError, match=r"x must be \[N, 8\]"):
        head(torch.zeros(2, 7).to(DEV))


def test_kernels_refuse_bad_input() -> None:
    x = torch.zeros(2, 8, device=DEV)
    with pytest.raises(TypeError, match="x must be float32 or bfloat16"):
        add_rms_norm_triton(x.half(), None, torch.zeros(8, device=DEV), 1e-6)
    with pytest.raises(TypeError, match="weight must be torch.float32"):
        add_rms_norm_triton(x, None, torch.zeros(8, device=DEV, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="residual must have x's 2 rows"):
        add_rms_norm_triton(x, torch.zeros(3, 8, device=DEV), torch.zeros(8, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="eps must be a float > 0"):
        add_rms_norm_triton(x, None, torch.zeros(8, device=DEV), 0.0)
    with pytest.raises(TypeError, match="rows must be a 1-D int32/int64 tensor"):
        add_rms_norm_triton(x, None, torch.zeros(8, device=DEV), 1e-6, rows=torch.zeros(2, device=DEV))
    with pytest.raises(ValueError, match=r"gate_up must be \[N, 2I\]"):
        silu_mul_triton(torch.zeros(2, 7, device=DEV))
    cache = torch.zeros(2, 4, 1, 8, device=DEV)
    table = torch.zeros(16, 2, 4, device=DEV)
    idx = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match=r"qkv must be \[N, 32\]"):
        rope_store_triton(torch.zeros(2, 24, device=DEV), table, idx, idx, cache, cache.clone(), 2, 1)
    with pytest.raises(TypeError, match="slots must be an int32/int64"):
        rope_store_triton(torch.zeros(2, 32, device=DEV), table, idx, idx.float(), cache, cache.clone(), 2, 1)
    with pytest.raises(ValueError, match=r"k_cache must be a contiguous \[pages, page_size, 2, 8\]"):
        rope_store_triton(torch.zeros(2, 48, device=DEV), table, idx, idx, cache, cache.clone(), 2, 2)
    with pytest.raises(TypeError, match="rope_table must be torch.float32"):
        rope_store_triton(torch.zeros(2, 32, device=DEV), table.bfloat16(), idx, idx, cache, cache.clone(), 2, 1)


def _steps(model, kv_dtype: torch.dtype) -> tuple[list[torch.Tensor], KVPool]:
    """A 7-token prefill of one request and a decode step of it plus another request."""
    page = 4
    kv = KVPool(model.config.num_layers, 10, page, 2, 16, kv_dtype, DEV)
    meta = AttentionMetadata.build([7], [7], [[1, 2]], page, device=DEV)
    out = [model(torch.arange(5, 12, device=DEV), torch.arange(7, device=DEV), kv, torch.arange(4, 11, device=DEV),
                 meta, torch.tensor([3, 6], device=DEV))]
    meta = AttentionMetadata.build([1, 1], [8, 1], [[1, 2], [3]], page, device=DEV)
    ids, pos, slots = (torch.tensor(v, device=DEV) for v in ([3, 9], [7, 0], [11, 12]))
    out.append(model(ids, pos, kv, slots, meta, torch.arange(2, device=DEV)))
    return out, kv


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                             (torch.float32, torch.float32)])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_triton_forward_matches_the_torch_path(dtype: torch.dtype, kv_dtype: torch.dtype, arch: str) -> None:
    """Prefill and decode through the fused path (Qwen2: QKV bias; Qwen3: per-head q / k norms): the same
    KV (bit for bit where the model is bf16), logits within the head's bound of the float32 head's and the
    same argmax."""
    model = random_model(tiny_config(arch), seed=1, init_std=0.3, dtype=dtype).to(DEV)
    model.layer_kernels = "torch"
    ref, ref_kv = _steps(model, kv_dtype)
    model.layer_kernels = "triton"
    assert uses_triton_layers(model)
    fused, fused_kv = _steps(model, kv_dtype)
    for layer in range(model.config.num_layers):
        for ours, theirs in ((fused_kv.k_caches[layer], ref_kv.k_caches[layer]),
                             (fused_kv.v_caches[layer], ref_kv.v_caches[layer])):
            if dtype == torch.bfloat16 and BITWISE:
                assert torch.equal(ours, theirs)
            else:
                torch.testing.assert_close(ours, theirs, rtol=2**-6, atol=1e-5)
    for ours, theirs in zip(fused, ref, strict=True):
        assert ours.dtype == torch.float32
        assert torch.equal(ours.argmax(1), theirs.argmax(1))
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0.02 * float(theirs.abs().max()))


def test_layer_kernels_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    model = random_model(tiny_config("llama"), seed=0)
    assert model.layer_kernels == "auto" and not uses_triton_layers(model)  # a CPU model: the torch path
    monkeypatch.setenv("TREESERVE_LAYER_KERNELS", "triton")
    if DEV.type == "cpu":  # the interpreter runs it on CPU tensors
        assert uses_triton_layers(model)
    else:
        with pytest.raises(ValueError, match="needs a CUDA model or TRITON_INTERPRET=1"):
            uses_triton_layers(model)
    monkeypatch.setenv("TREESERVE_LAYER_KERNELS", "fast")
    with pytest.raises(ValueError, match="TREESERVE_LAYER_KERNELS"):
        uses_triton_layers(model)
    monkeypatch.delenv("TREESERVE_LAYER_KERNELS")
    model.layer_kernels = "fused"
    with pytest.raises(ValueError, match=r"layer_kernels \(or TREESERVE_LAYER_KERNELS\) must be one of"):
        uses_triton_layers(model)
    model.layer_kernels = "torch"
    assert not uses_triton_layers(model)


def test_qwen3_takes_the_triton_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's per-head query / key norms run inside the fused layers: ``"auto"`` on a CUDA model takes them."""
    import treeserve.models.triton_forward as tf
    from treeserve.models import LlamaForCausalLM

    monkeypatch.setattr(tf, "triton_usable", lambda device: True)
    monkeypatch.setattr(LlamaForCausalLM, "device", property(lambda self: torch.device("cuda")))
    assert all(uses_triton_layers(random_model(tiny_config(arch), seed=0)) for arch in ("llama", "qwen3", "phi3"))


def test_rope_store_refuses_bad_norms() -> None:
    table, idx = torch.zeros(8, 2, 8, device=DEV), torch.zeros(2, dtype=torch.int64, device=DEV)
    cache, qkv, w = torch.zeros(4, 2, 1, 16, device=DEV), torch.zeros(2, 64, device=DEV), torch.ones(16, device=DEV)
    with pytest.raises(ValueError, match="q_norm and k_norm must be given together"):
        rope_store_triton(qkv, table, idx, idx, cache, cache.clone(), 2, 1, w, None)
    with pytest.raises(ValueError, match=r"k_norm must be a contiguous \[16\]"):
        rope_store_triton(qkv, table, idx, idx, cache, cache.clone(), 2, 1, w, w[:8])
    with pytest.raises(TypeError, match="q_norm must be torch.float32"):
        rope_store_triton(qkv, table, idx, idx, cache, cache.clone(), 2, 1, w.bfloat16(), w)
    with pytest.raises(ValueError, match="eps must be a float > 0"):
        rope_store_triton(qkv, table, idx, idx, cache, cache.clone(), 2, 1, w, w, eps=0.0)


@given(f32=st.lists(st.floats(1e-6, 1.0), min_size=1, max_size=9), data=st.data())
def test_bf16_min_rows_is_where_the_bf16_pass_stops_losing(f32: list[float], data: st.DataObject) -> None:
    """The chosen count: from it on the bf16 pass was never slower; at the count before it, it was
    (so no smaller count would do); None exactly when it lost at the largest count."""
    rows = HEAD_MEASURED_ROWS[: len(f32)]
    b16 = data.draw(st.lists(st.floats(1e-6, 1.0), min_size=len(f32), max_size=len(f32)))
    got = bf16_min_rows(rows, f32, b16)
    assert (got is None) == (b16[-1] > f32[-1])
    if got is not None:
        i = rows.index(got)
        assert all(b <= f for b, f in zip(b16[i:], f32[i:]))
        assert i == 0 or b16[i - 1] > f32[i - 1]


@pytest.mark.parametrize(("rows", "f32", "b16"), [((1, 2), (1.0,), (1.0, 1.0)), ((2, 1), (1.0, 1.0), (1.0, 1.0)),
                                                  ((1, 1), (1.0, 1.0), (1.0, 1.0))])
def test_bf16_min_rows_bad_input(rows, f32, b16) -> None:
    with pytest.raises(ValueError, match="rows must increase and match the timings"):
        bf16_min_rows(rows, f32, b16)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "fast"])
def test_triton_head_refuses_a_bad_bf16_min_rows(bad: object) -> None:
    with pytest.raises(ValueError, match="bf16_min_rows must be"):
        TritonHead.of(torch.zeros(4, 8).to(DEV), bf16_min_rows=bad)  # type: ignore[arg-type]


def test_triton_head_serves_few_rows_with_the_float32_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``bf16_min_rows`` a call is the float32 head itself (bit for bit, no bf16 pass);
    from it on, the bf16 pass and the re-scoring; None keeps no bf16 copy and never takes it."""
    import treeserve.models._triton_layers as ops

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 32, generator=gen).to(DEV)
    x = torch.randn(6, 32, generator=gen).to(DEV)
    calls = []
    real = ops.head_bf16_triton
    monkeypatch.setattr(ops, "head_bf16_triton", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    head = TritonHead.of(w, bf16_min_rows=4)
    assert torch.equal(head(x[:3]), F.linear(x[:3], w)) and calls == []
    assert torch.equal(head(x[:5]), TritonHead.of(w, bf16_min_rows=1)(x[:5])) and calls == [5, 5]
    never = TritonHead.of(w, bf16_min_rows=None)
    assert never.weight_bf16 is None and torch.equal(never(x), F.linear(x, w))
    assert calls == [5, 5]


@pytest.mark.gpu
def test_triton_head_measures_where_the_bf16_pass_pays() -> None:
    """On CUDA the default head times both passes: a measured count (or None), and its logits'
    argmax is the float32 head's on rows whose top two are apart."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(4096, 256, generator=gen).cuda()
    head = TritonHead.of(w)
    assert head.bf16_min_rows is None or head.bf16_min_rows in HEAD_MEASURED_ROWS
    x = torch.randn(64, 256, generator=gen).cuda()
    exact = x.double() @ w.double().T
    top2 = exact.topk(2, dim=1).values
    decided = (top2[:, 0] - top2[:, 1]) > 1e-3
    assert torch.equal(head(x).argmax(1)[decided].cpu(), exact.argmax(1)[decided].cpu())
