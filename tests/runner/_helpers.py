"""A tiny model over a real KV pool and table, with requests prefilled by the eager runner.

Each request gets its own pages and table row; the eager ``ModelRunner`` computes all prompt
tokens but the last, so the next step of every request is a one-token decode.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from treeserve.graph_runner import DecodeGraphRunner
from treeserve.kvcache import KVPool, ReqToTokenTable, pages_to_slots
from treeserve.models import LlamaForCausalLM, random_model, tiny_config
from treeserve.runner import ModelRunner
from treeserve.sampling import SamplingParams
from treeserve.scheduler import Request, ScheduledBatch, ScheduledItem

VOCAB = 256
MAX_LEN = 96
MAX_PROMPT = 40


def tiny_model() -> LlamaForCausalLM:
    """Peaked logits (init_std 0.3) so rounding never flips a greedy token."""
    return random_model(tiny_config("llama", eos_token_ids=(2,)), seed=0, init_std=0.3)


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
            sp = params[i] if params else SamplingParams(temperature=0.0)
            req = Request(self.next_rid, [rng.randrange(3, VOCAB) for _ in range(length)], sp, seed=rng.randrange(2**32))
            self.next_rid += 1
            req.row = self.table.alloc()
            pages = self.kv.allocator.alloc(-(-MAX_LEN // ps))
            self.table.write(req.row, 0, pages_to_slots(pages, ps)[:MAX_LEN])
            if length > 1:
                self.eager.run(ScheduledBatch([ScheduledItem(req, 0, length - 1, False)]))
            reqs.append(req)
        return reqs


def make_bench(model: LlamaForCausalLM, page_size: int, max_batch: int, max_requests: int = 40, forward=None) -> Bench:
    cfg = model.config
    num_pages = max_requests * -(-MAX_LEN // page_size) + 1
    kv = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    table = ReqToTokenTable(max_requests, MAX_LEN)
    eager_rec = LogitsRecorder(model)
    graph_rec = LogitsRecorder(forward if forward is not None else model)
    eos = list(cfg.eos_token_ids)
    eager = ModelRunner(eager_rec, kv, table, cfg.vocab_size, eos)
    graph = DecodeGraphRunner(model, kv, table, cfg.vocab_size, eos, max_batch=max_batch, forward=graph_rec)
    return Bench(model, kv, table, eager, eager_rec, graph, graph_rec)


def decode_batch(reqs: list[Request]) -> ScheduledBatch:
    """One decode step: the last (uncomputed) token of every request, sampled."""
    return ScheduledBatch([ScheduledItem(r, r.num_tokens - 1, 1, True) for r in reqs])


def commit(reqs: list[Request], tokens: list[int]) -> None:
    """Append each sampled token, as the scheduler would."""
    for r, t in zip(reqs, tokens):
        r.output_ids.append(t)
