"""The eager runner's plain-greedy fast path returns what the full sampler returns."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.runner._helpers import commit, decode_batch, make_bench, tiny_model
from treeserve.sampling import SamplingParams, SamplingRows


class NanRow:
    """A forward whose logits row ``row`` (when present) is NaN at one token."""

    def __init__(self, forward, row: int) -> None:
        self.forward, self.row = forward, row

    def __call__(self, *args: object) -> torch.Tensor:
        logits = self.forward(*args).clone()
        if logits.shape[0] > self.row:
            logits[self.row, 3] = float("nan")
        return logits


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0.0, ignore_eos=True)] * 3,  # fast path
        [SamplingParams(temperature=0.0)] * 2 + [SamplingParams(temperature=0.0, logprobs=1)],  # falls back
        [SamplingParams(temperature=0.0)] * 2 + [SamplingParams(temperature=0.9)],  # mixed: falls back
        [SamplingParams(temperature=0.0, repetition_penalty=1.5)] * 3,
        [SamplingParams(temperature=0.0, min_new_tokens=2)] * 3,  # EOS banned for the first 2 steps
    ],
)
def test_fast_path_matches_full_sampler(params: list[SamplingParams], monkeypatch: pytest.MonkeyPatch) -> None:
    bench = make_bench(tiny_model(), page_size=4, max_batch=4)
    reqs = bench.add_requests(random.Random(0), 3, params)
    bench.eager.model = NanRow(bench.eager.model, row=1)
    fast_taken = []
    for _ in range(3):
        batch = decode_batch(reqs)
        got = bench.eager.run(batch)  # admits the rows on its first step
        rows = [r.row for r in reqs]
        fast_taken.append(bench.eager.sampling_rows.all_plain_greedy(rows, [len(r.output_ids) for r in reqs]))
        with monkeypatch.context() as m:
            m.setattr(SamplingRows, "all_plain_greedy", lambda *a, **k: False)
            ref = bench.eager.run(batch)
        assert [t.token for t in got] == [t.token for t in ref]
        assert got[1].token == -1  # the NaN row
        for g, r in zip(got, ref):
            assert (math.isnan(g.logprob) and math.isnan(r.logprob)) or g.logprob == r.logprob
            assert g.top == r.top
        commit(reqs, [t.token if t.token >= 0 else 4 for t in got])
    plain = all(p.temperature == 0.0 and p.logprobs is None and p.repetition_penalty == 1.0 for p in params)
    assert fast_taken == [plain and all(p.min_new_tokens <= g for p in params) for g in range(3)]
