"""Triton kernels (interpreter on CPU, compiled on CUDA) against the torch reference, given the same
inputs/uniforms."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.sampling._verify_law import random_parents
from treeserve.sampling import SamplingBatch, SamplingParams, process_logits, sample, verify
from treeserve.sampling.processing import thresholds
from treeserve.sampling.tree_walk import one_hot, walk_tree
from treeserve.sampling.triton_kernels import thresholds_triton, walk_tree_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU runs under TRITON_INTERPRET=1


@st.composite
def filter_rows(draw: st.DrawFn):
    vocab = draw(st.sampled_from([5, 37, 300]))
    rows = draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * draw(st.sampled_from([0.5, 4.0]))
    if draw(st.booleans()):
        x = torch.round(x * 2) / 2  # ties
    if draw(st.booleans()):
        x[0, : vocab // 2] = float("-inf")
    params = [
        SamplingParams(
            top_k=draw(st.sampled_from([-1, 1, 3, vocab - 1])),
            top_p=draw(st.sampled_from([1.0, 0.9, 0.3])),
            min_p=draw(st.sampled_from([0.0, 0.2])),
            logprobs=0,
        )
        for _ in range(rows)
    ]
    batch = SamplingBatch.build(params, list(range(rows)), [[]] * rows, vocab, device=DEVICE)
    return x.to(DEVICE), batch, draw(st.sampled_from([None, 16]))


@settings(max_examples=12)
@given(case=filter_rows())
def test_threshold_kernel_matches_sorted_reference(case) -> None:
    x, batch, block = case
    want = thresholds(torch.sort(x, dim=1, descending=True).values, x.shape[1], batch, None)[0]
    got = thresholds_triton(x, batch.top_k, batch.top_p, batch.min_p, block=block)
    assert torch.equal(got, want)


@settings(max_examples=8)
@given(case=filter_rows(), pos=st.integers(0, 1000))
def test_triton_backend_process_and_sample_match_torch(case, pos: int) -> None:
    x, batch, _ = case
    assert torch.equal(process_logits(x, batch, backend="triton"), process_logits(x, batch, backend="torch"))
    positions = torch.full((batch.num_rows,), pos, device=DEVICE)
    a = sample(x, batch, positions, backend="triton")
    b = sample(x, batch, positions, backend="torch")
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.logprobs, b.logprobs)


@st.composite
def walk_case(draw: st.DrawFn):
    vocab = draw(st.sampled_from([4, 9]))
    b = draw(st.integers(1, 4))
    m = draw(st.integers(0, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    parents = torch.tensor([random_parents(draw(st.lists(st.integers(0, 6), min_size=m, max_size=m))) for _ in range(b)],
                           dtype=torch.int64).reshape(b, m)
    tokens = torch.randint(0, vocab, (b, m), generator=gen)
    num_draft = torch.randint(0, m + 1, (b,), generator=gen)
    target = torch.softmax(torch.randn(b, m + 1, vocab, generator=gen, dtype=torch.float64) * 2, -1)
    if draw(st.booleans()):
        draft = torch.softmax(torch.randn(b, m, vocab, generator=gen, dtype=torch.float64), -1)
        draft[..., 0] = 0.0  # a drafted token 0 has draft probability 0
        draft = draft / draft.sum(-1, keepdim=True)
    else:  # one-hot rows: a greedy request's, or a deterministic node among sampled ones
        draft = one_hot(tokens, vocab, torch.float64)
    u = torch.rand(b, m, generator=gen, dtype=torch.float64)
    return target, draft, tokens, parents, num_draft, u


def on_device(case):
    return tuple(t.to(DEVICE) for t in case)


@settings(max_examples=15)
@given(case=walk_case())
def test_walk_kernel_matches_reference(case) -> None:
    want = walk_tree(*case)
    got = type(want)(*(t.cpu() for t in walk_tree_triton(*on_device(case))))
    for name in ("accepted", "path", "accept_len", "last_node", "pristine"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.residual, want.residual, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got.accept_probs, want.accept_probs, rtol=1e-12, atol=0, equal_nan=True)


def test_verify_triton_backend_matches_torch() -> None:
    vocab, b = 11, 3
    params = [SamplingParams(top_p=0.9), SamplingParams(temperature=0), SamplingParams(top_k=4, presence_penalty=0.5)]
    batch = SamplingBatch.build(params, [1, 2, 3], [[1, 2]] * b, vocab, device=DEVICE)
    tokens = torch.tensor([[1, 2, 3], [4, 4, 0], [5, 0, 0]], device=DEVICE)
    parents = torch.tensor([[-1, 0, 0], [-1, -1, 0], [-1, 0, 0]], device=DEVICE)
    nd = torch.tensor([3, 2, 1], device=DEVICE)
    target = torch.randn(9, vocab, dtype=torch.float64, device=DEVICE)
    probs = torch.softmax(torch.randn(6, vocab, dtype=torch.float64, device=DEVICE), -1)
    pos = torch.tensor([3, 4, 5], device=DEVICE)
    for draft in (None, probs):
        a = verify(target, batch, tokens, parents, nd, pos, draft_probs=draft, backend="triton")
        t = verify(target, batch, tokens, parents, nd, pos, draft_probs=draft, backend="torch")
        for x, y in zip(a, t):  # logprobs: NaN past the emitted tokens
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


def test_unknown_backend_rejected() -> None:
    batch = SamplingBatch.build([SamplingParams()], [0], [[]], 4)
    with pytest.raises(ValueError, match="backend must be one of"):
        sample(torch.zeros(1, 4), batch, torch.zeros(1, dtype=torch.int64), backend="cuda")
