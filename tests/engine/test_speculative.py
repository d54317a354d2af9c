"""Speculative decoding end to end (n-gram drafts, chain and tree) on a tiny random model."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from treeserve import LLM, SamplingParams
from treeserve.kvcache import AttentionMetadata, KVPool
from treeserve.models import random_model, tiny_config
from treeserve.runner import DraftRequest
from treeserve.scheduler import DraftTree

from .test_engine import assert_drained, make_llm


@pytest.fixture(scope="module")
def loopy() -> torch.nn.Module:
    # Few distinct tokens and peaked logits: generations fall into loops, so n-gram drafts hit.
    return random_model(tiny_config("llama", vocab_size=32, eos_token_ids=(2,)), seed=3, init_std=0.5)


def repetitive_prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 32) for _ in range(rng.randint(2, 5))]
        out.append((motif * 6)[: rng.randint(6, 24)] + [rng.randrange(3, 32)])
    return out


def test_plain_greedy_verify_walks_on_the_host(loopy, monkeypatch) -> None:
    """Plain greedy requests with n-gram drafts are verified by the host walk (``greedy_paths``), with
    ``verify``'s outputs (the plain run's tokens); a penalty (processing needed) takes ``verify``."""
    import treeserve.runner.eager as eager

    calls = {"host": 0, "verify": 0}

    def counted(name: str, fn):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(eager, "greedy_paths", counted("host", eager.greedy_paths))
    monkeypatch.setattr(eager, "verify", counted("verify", eager.verify))
    prompts = repetitive_prompts(2, 8)
    for penalty, path in ((1.0, "host"), (1.2, "verify")):
        params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True, repetition_penalty=penalty)
        plain = make_llm(loopy).generate(prompts, params, use_tqdm=False)
        calls.update(host=0, verify=0)
        spec = make_llm(loopy, speculative="ngram").generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
        other = "verify" if path == "host" else "host"
        assert calls[path] > 0 and calls[other] == 0, (penalty, calls)


@pytest.mark.parametrize(
    "kw",
    [
        dict(speculative="ngram", speculative_tree_width=1),
        dict(speculative="ngram", speculative_tree_width=3, num_speculative_tokens=6),
        dict(speculative="ngram", speculative_tree_width=2, page_size=4, kv_cache_tokens=200, max_running=8),
        dict(speculative="draft:self:1", speculative_tree_width=1),
        dict(speculative="draft:self:1", speculative_tree_width=3, num_speculative_tokens=5),
        dict(speculative="draft:self:1", page_size=4, kv_cache_tokens=96, max_running=8),
    ],
    ids=["ngram-chain", "ngram-tree", "ngram-preempt", "draft-chain", "draft-tree", "draft-preempt"],
)
def test_greedy_identical_with_and_without_speculation(loopy, kw) -> None:
    draft_model = kw["speculative"].startswith("draft")  # drafts one request at a time: keep it small
    prompts = repetitive_prompts(1, 6 if draft_model else 16)
    params = SamplingParams(temperature=0.0, max_new_tokens=16 if draft_model else 24, ignore_eos=True)
    base_kw = {k: v for k, v in kw.items() if k in ("page_size", "kv_cache_tokens", "max_running")}
    plain = make_llm(loopy, **base_kw).generate(prompts, params, use_tqdm=False)
    llm = make_llm(loopy, **kw)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    m = llm.metrics
    assert m.draft_tokens > 0 and m.accepted_tokens > 0, "n-gram drafts should be proposed and accepted"
    assert m.mean_accepted_length > 1.0
    per_request = [(o.metrics["draft_tokens"], o.metrics["accepted_draft_tokens"], o.metrics["verify_steps"]) for o in spec]
    assert [sum(c) for c in zip(*per_request)] == [m.draft_tokens, m.accepted_tokens, m.verify_steps]
    assert_drained(llm)
    if "kv_cache_tokens" in kw:
        assert m.preemptions > 0


def committed_paths(llm: LLM) -> list[list[int]]:
    """Token sequences of every root-to-leaf path of the radix tree."""
    paths, stack = [], [(llm.radix._root, [])]
    while stack:
        node, prefix = stack.pop()
        seq = prefix + list(node.key)
        if not node.children:
            paths.append(seq)
        stack.extend((c, seq) for c in node.children.values())
    return paths


def fresh_prefill_kv(model, tokens: list[int]) -> list[torch.Tensor]:
    """Per-layer K of ``tokens`` computed by one causal prefill into a scratch pool."""
    c = model.config
    n = len(tokens)
    kv = KVPool(c.num_layers, n + 1, 1, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    slots = torch.arange(1, n + 1)
    meta = AttentionMetadata.build([n], [n], slots[None, :], 1)
    with torch.inference_mode():
        model(torch.tensor(tokens), torch.arange(n), kv, slots, meta, torch.tensor([n - 1]))
    return [k[1 : n + 1, 0] for k in kv.k_caches]


@pytest.mark.parametrize("spec", ["ngram", "draft:self:1"])
@pytest.mark.parametrize("width", [1, 3])
def test_kv_matches_fresh_prefill_after_every_verify(loopy, spec: str, width: int) -> None:
    llm = make_llm(loopy, speculative=spec, speculative_tree_width=width, num_speculative_tokens=6)
    prompts = repetitive_prompts(5, 6)
    sp = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    outs = [llm._submit(p, sp) for p in prompts]
    seqs_seen: list[list[int]] = []
    while llm.scheduler.has_work():
        llm._step()
        llm.scheduler.check_invariants()
        for req in llm.scheduler.running:
            seqs_seen.append(req.all_ids)
            n = req.num_computed_tokens
            slots = llm.table.table[req.row, :n]
            ref = fresh_prefill_kv(loopy, req.all_ids[:n])
            for layer, k_ref in enumerate(ref):
                got = llm.kv.k_caches[layer].view(-1, *k_ref.shape[1:])[slots]
                torch.testing.assert_close(got, k_ref, rtol=1e-4, atol=1e-4)
        for path in committed_paths(llm):
            assert any(s[: len(path)] == path for s in seqs_seen + [r.all_ids for _, rs in outs for r in rs])
    assert llm.metrics.accepted_tokens > 0
    assert_drained(llm)
    drafter = llm.drafter
    if hasattr(drafter, "kv"):  # the draft model's own pool is empty again
        assert drafter.kv.allocator.num_free == drafter.kv.allocator.capacity


def two_token_counts(llm: LLM, prompt: list[int], n: int, seed0: int) -> list[tuple[int, int]]:
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=seed0 + i, max_new_tokens=3, ignore_eos=True) for i in range(n)
    ]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    # With 3 new tokens the step after the first one may draft (and verify) the second.
    return [tuple(o.outputs[0].token_ids[:2]) for o in outs]


def test_sampling_law_unchanged_by_speculation() -> None:
    """Two-sample chi-square on the joint law of the first two tokens (different seeds per arm).

    A 12-token vocabulary makes any drafted token likely enough to be accepted often; with
    ``ngram_min=1`` every first token seen in the prompt gets a draft for the second.
    """
    model = random_model(tiny_config("llama", vocab_size=12, eos_token_ids=(2,)), seed=4, init_std=0.3)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 5, 7, 9, 11, 4, 6, 8, 10]
    n = 1200
    plain = two_token_counts(make_llm(model, max_running=64), prompt, n, seed0=0)
    llm = make_llm(model, speculative="ngram", ngram_min=1, max_running=64)
    spec = two_token_counts(llm, prompt, n, seed0=10**6)
    assert llm.metrics.accepted_tokens > 0, "drafts must be accepted for the test to mean anything"
    p = same_law_p_value(plain, spec)
    assert p > 1e-3, f"speculation changed the law of the first two tokens (p={p:.2e})"
    print(f"accepted {llm.metrics.accepted_tokens} of {llm.metrics.draft_tokens} drafts, p={p:.3f}")


def same_law_p_value(plain: list[tuple[int, int]], spec: list[tuple[int, int]]) -> float:
    """Two-sample chi-square p-value of the two arms' token-pair counts (sparse cells merged so
    the chi-square approximation holds)."""
    keys = sorted(set(plain) | set(spec))
    table = np.array([[plain.count(k) for k in keys], [spec.count(k) for k in keys]])
    big = table.sum(0) >= 10
    merged = np.concatenate([table[:, big], table[:, ~big].sum(1, keepdims=True)], axis=1)
    merged = merged[:, merged.sum(0) > 0]
    return float(stats.chi2_contingency(merged)[1])


def test_sampling_law_unchanged_by_sampled_drafts() -> None:
    """The same two-sample chi-square with self-speculation whose drafts are sampled from the
    draft model's processed law and verified with it: a tree of two root siblings (drawn
    without replacement) and the first one's child."""
    model = random_model(tiny_config("llama", vocab_size=12, eos_token_ids=(2,)), seed=4, init_std=0.3)
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 5, 7, 9, 11, 4, 6, 8, 10]
    n = 800
    plain = two_token_counts(make_llm(model, max_running=64), prompt, n, seed0=0)
    llm = make_llm(model, speculative="draft:self:1", speculative_tree_width=2, num_speculative_tokens=3,
                   max_running=64)
    spec = two_token_counts(llm, prompt, n, seed0=10**6)
    assert llm.metrics.accepted_tokens > 0, "drafts must be accepted for the test to mean anything"
    assert any(d.probs is not None for d in llm.drafter.propose_batch(
        [DraftRequest(0, prompt, 3, SamplingParams(temperature=1.0, top_p=0.9), 1)])), "drafts must be sampled"
    p = same_law_p_value(plain, spec)
    assert p > 1e-3, f"sampled drafts changed the law of the first two tokens (p={p:.2e})"


def test_seeded_requests_with_sampled_drafts_are_reproducible(loopy) -> None:
    """A seeded request at temperature 0.8 with sampled self-speculative drafts emits the same
    tokens alone, twice, and in a batch with other requests (draft randomness is keyed by
    (seed, position, DRAFT, sibling)); the drafts carry their laws and some are accepted."""
    kw = dict(speculative="draft:self:1", speculative_tree_width=3, num_speculative_tokens=4)
    params = SamplingParams(temperature=0.8, top_k=8, seed=11, max_new_tokens=20, ignore_eos=True)
    prompt = repetitive_prompts(2, 1)[0]
    alone = [make_llm(loopy, **kw).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
             for _ in range(2)]
    llm = make_llm(loopy, **kw)
    others = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=12, ignore_eos=True) for s in range(5)]
    batch = llm.generate(repetitive_prompts(3, 5) + [prompt], others + [params], use_tqdm=False)
    assert alone[0] == alone[1] == batch[-1].outputs[0].token_ids
    assert llm.metrics.accepted_tokens > 0
    assert_drained(llm)


def test_draft_pool_is_sized_for_the_drafts(loopy) -> None:
    """The draft model's KV pool holds the running requests' contexts plus their draft nodes,
    not a copy of the target's whole pool; the drafts still come and are accepted."""
    llm = make_llm(loopy, speculative="draft:self:1", num_speculative_tokens=4, max_running=4, kv_cache_tokens=4096)
    assert llm.drafter.kv.allocator.capacity == 4 * (256 + 4) < llm.kv.allocator.capacity
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    outs = llm.generate(repetitive_prompts(5, 6), params, use_tqdm=False)
    plain = make_llm(loopy).generate(repetitive_prompts(5, 6), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.metrics.accepted_tokens > 0
    assert llm.drafter.kv.allocator.num_free == llm.drafter.kv.allocator.capacity


class OracleDrafter:
    """Drafts the next tokens of known continuations (every node is accepted), so a stop can land
    on any draft node, not only on the bonus token n-gram drafts usually end with."""

    stateless = True

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def propose_batch(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        out = []
        for r in requests:
            n = len(r.tokens)
            seq = next((s for s in self.sequences if s[:n] == list(r.tokens)), [])
            nodes = seq[n : n + r.max_tokens]
            out.append(DraftTree(nodes, list(range(-1, len(nodes) - 1))) if nodes else None)
        return out

    def release(self, key: int) -> None:
        pass


@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 50), at=st.integers(0, 15), page_size=st.sampled_from([1, 4]),
       by_eos=st.booleans(), n=st.sampled_from([1, 2]), small_pool=st.booleans())
def test_a_stop_on_a_draft_node_drops_the_nodes_after_it(loopy, seed: int, at: int, page_size: int, by_eos: bool,
                                                        n: int, small_pool: bool) -> None:
    """A stop token (a stop id, or EOS) accepted inside a draft finishes the request there: the
    output is the plain run's, the accepted nodes after the stop (whose KV was computed) are not
    committed to the radix tree (their tokens are not the request's) nor leaked, and
    ``generated_tokens`` counts the tokens kept; with ``n`` samples sharing the prompt and with a
    pool small enough to pause requests."""
    prompts = repetitive_prompts(seed, 4)
    free = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    full = [p + o.outputs[0].token_ids for p, o in zip(prompts, make_llm(loopy).generate(prompts, free, use_tqdm=False))]
    stop = full[0][len(prompts[0]) + at]
    model = loopy
    if by_eos:  # the same weights, the stop token as the model's EOS
        model = random_model(tiny_config("llama", vocab_size=32, eos_token_ids=(stop,)), seed=3, init_std=0.5)
        params = SamplingParams(temperature=0.0, max_new_tokens=16, n=n)
    else:
        params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, stop_token_ids=[stop], n=n)
    kw = dict(page_size=page_size, **(dict(kv_cache_tokens=64, max_running=4) if small_pool else {}))
    plain = make_llm(model, **kw).generate(prompts, params, use_tqdm=False)
    llm = make_llm(model, speculative="ngram", num_speculative_tokens=6, **kw)
    llm.drafter = OracleDrafter(full)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in plain]
    assert llm.metrics.accepted_tokens > 0
    assert llm.metrics.generated_tokens == sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert_drained(llm)
    kept = [p + c.token_ids for p, o in zip(prompts, outs) for c in o.outputs]
    for path in committed_paths(llm):
        assert any(s[: len(path)] == path for s in kept), "a committed path is some request's tokens"


@pytest.mark.parametrize("kw", [dict(), dict(speculative_row_cost=0.05), dict(speculative_tree_width=3, num_speculative_tokens=6)],
                         ids=["whole-room", "goodput", "tree"])  # fmt: skip
def test_point_mass_drafts_never_change_a_seeded_sampled_request(loopy, kw) -> None:
    """n-gram drafts are point masses, verified by the token ``sample`` draws at each position: a
    seeded sampled request emits the tokens it emits alone without speculation, in a batch and
    however the goodput rule sizes its drafts there (batch-invariant logits, so only the drafts
    differ between the runs)."""
    prompts = repetitive_prompts(7, 8)
    params = [SamplingParams(temperature=0.8, top_k=8, top_p=0.95, repetition_penalty=1.1, seed=s,
                             max_new_tokens=8 + 3 * s, ignore_eos=True) for s in range(8)]  # fmt: skip
    alone = [make_llm(loopy, batch_invariant=True).generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
             for p, sp in zip(prompts, params)]  # fmt: skip
    llm = make_llm(loopy, batch_invariant=True, speculative="ngram", **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert llm.metrics.accepted_tokens > 0
    assert_drained(llm)
