"""A tiny model over a real KV pool and table, with requests prefilled by the eager runner.

Each request gets its own pages and table row; the eager ``ModelRunner`` computes all prompt
tokens but the last, so the next step of every request is a one-token decode.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from treeserve.runner import DecodeGraphRunner
from treeserve.kvcache import KVPool, ReqToTokenTable, pages_to_slots
from treeserve.models import LlamaForCausalLM, random_model, tiny_config
from treeserve.runner import ModelRunner
from treeserve.sampling import SamplingParams
from treeserve.scheduler import Request, ScheduledBatch, ScheduledItem

VOCAB = 256
MAX_LEN = 96
MAX_PROMPT = 40


def tiny_model(init_std: float = 0.3, device: str = "cpu", num_layers: int = 2) -> LlamaForCausalLM:
    """Peaked logits by default (init_std 0.3) so rounding never flips a greedy token."""
    cfg = tiny_config("llama", eos_token_ids=(2,), num_layers=num_layers)
    return random_model(cfg, seed=0, init_std=init_std, device=device)


class LogitsRecorder:
    """Wraps a forward and keeps the logits of its last call (``last``)."""

    def __init__(self, forward) -> None:
        self.forward = forward
        self.last: torch.Tensor | None = None

    def __call__(self, *args: object) -> torch.Tensor:
        self.last = self.forward(*args).clone()
        return self.last


@dataclass
class Bench:
    """Pool, table, eager runner and (recorded) graph runner sharing one tiny model."""

    model: LlamaForCausalLM
    kv: KVPool
    table: ReqToTokenTable
    eager: ModelRunner
    eager_rec: LogitsRecorder
    graph: DecodeGraphRunner
    graph_rec: LogitsRecorder
    next_rid: int = 0

    def add_requests(self, rng: random.Random, n: int, params: list[SamplingParams] | None = None) -> list[Request]:
        """``n`` requests with random prompts, prefilled up to their last prompt token."""
        ps = self.kv.page_size
        reqs = []
        for i in range(n):
            length = rng.randint(1, MAX_PROMPT)
            sp = params[i] if params else SamplingParams(temperature=0.0, logprobs=0)
            req = Request(self.next_rid, [rng.randrange(3, VOCAB) for _ in range(length)], sp, seed=rng.randrange(2**32))
            self.next_rid += 1
            req.row = self.table.alloc()
            pages = self.kv.allocator.alloc(-(-MAX_LEN // ps))
            self.table.write(req.row, 0, pages_to_slots(pages, ps)[:MAX_LEN].to(self.table.device))
            if length > 1:
                self.eager.run(ScheduledBatch([ScheduledItem(req, 0, length - 1, False)]))
            reqs.append(req)
        return reqs


def make_bench(
    model: LlamaForCausalLM,
    page_size: int,
    max_batch: int,
    max_requests: int = 40,
    forward=None,
    max_draft_nodes: int = 0,
) -> Bench:
    """Everything on the model's device; the graph runner captures when that is CUDA."""
    cfg, dev = model.config, model.device
    num_pages = max_requests * -(-MAX_LEN // page_size) + 1
    kv = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, dev)
    table = ReqToTokenTable(max_requests, MAX_LEN, dev)
    eager_rec = LogitsRecorder(model)
    graph_rec = LogitsRecorder(forward if forward is not None else model)
    eos = list(cfg.eos_token_ids)
    eager = ModelRunner(eager_rec, kv, table, cfg.vocab_size, eos, dev)
    graph = DecodeGraphRunner(
        graph_rec, kv, table, cfg.vocab_size, eos, dev, max_batch=max_batch, max_draft_nodes=max_draft_nodes
    )
    return Bench(model, kv, table, eager, eager_rec, graph, graph_rec)


def decode_batch(reqs: list[Request]) -> ScheduledBatch:
    """One decode step: the last (uncomputed) token of every request, sampled."""
    return ScheduledBatch([ScheduledItem(r, r.seq_len - 1, 1, True) for r in reqs])


def commit(reqs: list[Request], tokens: list[int]) -> None:
    """Append each sampled token, as the scheduler would."""
    for r, t in zip(reqs, tokens):
        r.output_ids.append(t)


# The graph path pads a batch to its bucket, so every float32 GEMM runs with another row count M
# and the CPU BLAS may pick another blocking for it: rows then differ in the last bits (up to
# 2.1e-5 seen on an AVX2-only AMD EPYC, where M=1 is a GEMV and M>=2 a GEMM; 0 on AVX-512 Xeons).
PADDED_GEMM_ATOL = 5e-5


def step_and_compare(bench: Bench, reqs: list[Request], atol: float = PADDED_GEMM_ATOL) -> list[int]:
    """One decode step through both runners; tokens, logprobs and top logprobs must agree, and so
    must the logits when the graph runner runs eagerly (a replay does not re-run the recorder)."""
    batch = decode_batch(reqs)
    ref = bench.eager.run(batch)
    ref_logits = bench.eager_rec.last
    got = bench.graph.run(batch)
    assert got is not None, "a pure decode batch of eligible requests must be served"
    n = len(reqs)
    if not bench.graph.graphs:
        padded = bench.graph_rec.last
        assert padded.shape[0] == bench.graph.bucket_for(n)
        torch.testing.assert_close(padded[:n], ref_logits, atol=atol, rtol=1e-5)
    assert [t.token for t in got] == [t.token for t in ref]
    asked = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]  # others: not computed
    lp_got, lp_ref = (torch.tensor([out[i].logprob for i in asked]) for out in (got, ref))
    assert not lp_ref.isnan().any()
    torch.testing.assert_close(lp_got, lp_ref, atol=5 * atol + 1e-4, rtol=1e-4)
    for g, r in zip(got, ref):
        assert (g.top is None) == (r.top is None)
        if g.top is not None:
            assert list(g.top) == list(r.top)
            assert list(g.top.values()) == pytest.approx(list(r.top.values()), abs=5 * atol + 1e-4)
    return [t.token for t in got]
