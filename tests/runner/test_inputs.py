"""The step-input builder against the validated reference path (``AttentionMetadata.build``)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeserve.kvcache import AttentionMetadata, build_tree_mask
from treeserve.runner import build_step_inputs
from treeserve.runner.inputs import step_token_ids
from treeserve.sampling import SamplingParams
from treeserve.scheduler import Request


@st.composite
def steps(draw):
    ps = draw(st.sampled_from([1, 2, 4]))
    width = 32
    b = draw(st.integers(1, 5))
    nrows = b + 1
    # Each row owns random distinct pages, page-aligned slots (a real table's layout).
    perm = torch.randperm(nrows * width // ps, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    pages = perm.view(nrows, width // ps) + 1
    table = (pages[:, :, None] * ps + torch.arange(ps)).reshape(nrows, width)
    rows = torch.tensor(draw(st.permutations(range(nrows)))[:b])
    starts, qo, parents, logit_rows = [], [], [], []
    for _ in range(b):
        start = draw(st.integers(0, 20))
        n = draw(st.integers(1, 8))
        tree = draw(st.booleans())
        par = [draw(st.integers(-1, i - 1)) for i in range(n)] if tree else list(range(-1, n - 1))
        starts.append(start)
        qo.append(n)
        parents.append(par)
        logit_rows.append(draw(st.sampled_from([0, 1, n])))
    return ps, table, rows, starts, qo, parents, logit_rows, draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(steps())
def test_builder_matches_reference(case) -> None:
    ps, table, rows, starts, qo, parents, logit_rows, with_tree = case
    b = len(qo)
    q = max(qo)
    par = torch.tensor([p + list(range(len(p) - 1, q - 1)) for p in parents]) if with_tree else None
    ids = torch.randint(0, 100, (sum(qo),))
    got = build_step_inputs(
        table, rows, torch.tensor(starts), torch.tensor(qo), ids, ps, torch.tensor(logit_rows), parents=par
    )
    kv = [s + n for s, n in zip(starts, qo)]
    ref = AttentionMetadata.build(qo, kv, table[rows], ps, tree_parents=parents if with_tree else None)
    for name in ("qo_indptr", "kv_indptr", "kv_page_indices", "kv_last_page_len", "tree_mask", "tree_mask_indptr"):
        a, r = getattr(got.meta, name), getattr(ref, name)
        assert (a is None) == (r is None), name
        if a is not None:
            assert torch.equal(a, r), name
    assert (got.meta.max_qo_len, got.meta.max_kv_len, got.meta.num_qo_tokens) == (max(qo), max(kv), sum(qo))
    assert torch.equal(got.input_ids, ids)
    slots, positions, logit_idx, off = [], [], [], 0
    for i in range(b):
        slots += table[rows[i], starts[i] : starts[i] + qo[i]].tolist()
        depth = build_tree_mask(parents[i]).sum(1) - 1 if with_tree else torch.arange(qo[i])
        positions += (starts[i] + depth).tolist()
        logit_idx += range(off + qo[i] - logit_rows[i], off + qo[i])
        off += qo[i]
    assert got.out_slots.tolist() == slots
    assert got.positions.tolist() == positions
    assert got.logits_indices.tolist() == logit_idx


@settings(max_examples=40, deadline=None)
@given(steps(), st.data())
def test_padding_slots_and_pages_match_reference(case, data) -> None:
    """With ``num_real``: the first ``num_real[b]`` new tokens write to their own slots, the
    rest to flat slot 0; KV pages holding no real token read as the page of flat slot 0."""
    ps, table, rows, starts, qo, _, logit_rows, _ = case
    num_real = [data.draw(st.integers(1, n)) for n in qo]
    ids = torch.randint(0, 100, (sum(qo),))
    got = build_step_inputs(table, rows, starts, qo, ids, ps, logit_rows, num_real=torch.tensor(num_real))
    flat = table.view(-1)
    slots, pages = [], []
    for i in range(len(qo)):
        row, start, real = int(rows[i]), starts[i], starts[i] + num_real[i]
        slots += [int(table[row, p]) if p < real else int(flat[0]) for p in range(start, start + qo[i])]
        pages += [int(table[row, j]) // ps if j < real else int(flat[0]) // ps for j in range(0, start + qo[i], ps)]
    assert got.out_slots.tolist() == slots
    assert got.meta.kv_page_indices.tolist() == pages
    assert got.positions.tolist() == [s + k for s, n in zip(starts, qo) for k in range(n)]


def test_padding_tokens_write_slot_zero_and_are_hidden() -> None:
    """Padding nodes (past ``num_real``): slot 0, see only the first new token, seen by nobody;
    KV pages past the real tokens read as page 0."""
    table = torch.arange(2 * 8).view(2, 8) + 100
    table[0] = 0  # the dummy row, as in a ReqToTokenTable
    par = torch.tensor([[-1, 0, 0, 0]])
    one = torch.ones(1, dtype=torch.long)
    got = build_step_inputs(table, one, one * 2, one * 4, torch.arange(4), 2, one * 4, parents=par, num_real=one * 2)
    assert got.out_slots.tolist() == [110, 111, 0, 0]
    # Request 1 at start 2 with 4 tokens: KV length 6 = pages 0..2; real tokens end at 4 -> pages 0, 1 real.
    assert got.meta.kv_page_indices.tolist() == [54, 55, 0]
    mask = got.meta.tree_mask.view(4, 4)
    assert mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, False, False],
        [True, False, False, False],
    ]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_step_token_ids_are_the_requests_token_ranges(data) -> None:
    """Decodes (one token each, read from the prompt or the output) and chunks alike."""
    reqs, starts, qo = [], [], []
    one_each = data.draw(st.booleans())
    for rid in range(data.draw(st.integers(1, 4))):
        prompt = data.draw(st.lists(st.integers(0, 99), min_size=1, max_size=6))
        req = Request(rid=rid, prompt_ids=prompt, params=SamplingParams(), seed=0)
        req.output_ids = data.draw(st.lists(st.integers(0, 99), max_size=4))
        start = data.draw(st.integers(0, req.seq_len - 1))
        reqs.append(req)
        starts.append(start)
        qo.append(1 if one_each else data.draw(st.integers(1, req.seq_len - start)))
    expected = [t for r, s, n in zip(reqs, starts, qo) for t in (r.prompt_ids + r.output_ids)[s : s + n]]
    assert step_token_ids(reqs, starts, qo) == expected
