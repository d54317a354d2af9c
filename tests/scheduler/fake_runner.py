"""A null model for scheduler tests: it checks the KV bookkeeping instead of doing math.

For every computed token it writes ``(token id, position)`` into layer 0's K at the token's
slot; before sampling it reads back the K of every earlier position of the request through the
request->slot table and asserts it equals the request's own tokens. The "next token" is a hash
of that read-back history, so any slot mix-up (shared prefix remapped wrong, page freed while
still used, stale KV after preemption) changes the output or trips the assertion.
"""

from __future__ import annotations

import torch

from treeserve.kvcache import KVPool, ReqToTokenTable
from treeserve.scheduler import SampledToken, ScheduledBatch


def next_token(history: list[int], vocab: int) -> int:
    h = 1469598103934665603
    for t in history[-8:]:
        h = ((h ^ t) * 1099511628211) % (1 << 61)
    return (h + len(history)) % vocab


def make_pool(num_pages: int, page_size: int) -> KVPool:
    return KVPool(1, num_pages, page_size, 1, 2, torch.float32, "cpu")


class FakeRunner:
    def __init__(self, kv: KVPool, table: ReqToTokenTable, vocab: int) -> None:
        self.kv = kv
        self.table = table
        self.vocab = vocab
        self.steps = 0

    def run(self, batch: ScheduledBatch) -> list[SampledToken | None]:
        self.steps += 1
        flat = self.kv.k_caches[0].view(-1, 2)
        out: list[SampledToken | None] = []
        for it in batch.items:
            req = it.req
            end = it.start + it.num_scheduled_tokens
            slots = self.table.table[req.row, it.start : end]
            assert bool((slots > 0).all()), f"request {req.rid} computes into the dummy page"
            toks = torch.tensor(req.all_ids[it.start : end], dtype=torch.float32)
            pos = torch.arange(it.start, end, dtype=torch.float32)
            flat[slots] = torch.stack([toks, pos], dim=1)
            stored = flat[self.table.table[req.row, :end]]
            expect = torch.tensor(req.all_ids[:end], dtype=torch.float32)
            assert torch.equal(stored[:, 0], expect), f"request {req.rid}: KV history differs from its tokens"
            assert torch.equal(stored[:, 1], torch.arange(end, dtype=torch.float32))
            if it.sample:
                history = [int(t) for t in stored[:, 0].tolist()]
                out.append(SampledToken(next_token(history, self.vocab), 0.0, None))
            else:
                out.append(None)
        return out
