"""One engine step: batch -> tensors -> model forward -> sampling -> host.

The runner owns no queue and no page: it reads the scheduler's :class:`ScheduledBatch`, the
request->slot table and the KV pool, and returns one :class:`SampledToken` (or ``None``) per
batch item. It synchronizes with the host once per step, when the sampled tokens are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from treeserve.kvcache import AttentionMetadata, KVPool, ReqToTokenTable
from treeserve.sampling import SamplingBatch, sample
from treeserve.scheduler import SampledToken, ScheduledBatch


class CausalLM(Protocol):
    """What the runner needs of a model (``treeserve.models.LlamaForCausalLM`` is one)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVPool,
        out_slots: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor: ...


class ModelRunner:
    """Runs scheduled batches through ``model`` over the paged KV ``kv``.

    ``attention_backend`` is passed to every attention call ("auto" picks flashinfer > triton on
    CUDA, torch on CPU). ``eos_token_ids`` feed ``min_new_tokens`` suppression in sampling.
    """

    def __init__(
        self,
        model: CausalLM,
        kv: KVPool,
        table: ReqToTokenTable,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.kv = kv
        self.table = table
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.page_size = kv.page_size

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[SampledToken | None]:
        """Compute every item of ``batch`` and sample the rows that end their pending tokens."""
        if not batch.items:
            return []
        items = batch.items
        ps = self.page_size
        ids: list[int] = []
        pos_starts: list[int] = []
        qo_lens: list[int] = []
        kv_lens: list[int] = []
        rows: list[int] = []
        for it in items:
            ids.extend(it.req.all_ids[it.start : it.start + it.num_tokens])
            pos_starts.append(it.start)
            qo_lens.append(it.num_tokens)
            kv_lens.append(it.start + it.num_tokens)
            rows.append(it.req.row)
        dev = self.device
        qo = torch.tensor(qo_lens, dtype=torch.long)
        row_t = torch.tensor(rows, dtype=torch.long).repeat_interleave(qo)
        offsets = torch.arange(int(qo.sum())) - torch.repeat_interleave(torch.cumsum(qo, 0) - qo, qo)
        positions = torch.tensor(pos_starts, dtype=torch.long).repeat_interleave(qo) + offsets
        out_slots = self.table.table[row_t.to(self.table.table.device), positions.to(self.table.table.device)]
        width = -(-max(kv_lens) // ps) * ps
        slot_rows = self.table.table[torch.tensor(rows, dtype=torch.long), :width]
        meta = AttentionMetadata.build(qo_lens, kv_lens, slot_rows, ps, device=dev)
        sample_rows = [i for i, it in enumerate(items) if it.sample]
        ends = torch.cumsum(qo, 0) - 1
        logits_indices = ends[sample_rows] if sample_rows else ends[:0]
        logits = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            positions.to(dev),
            self.kv,
            out_slots.to(dev),
            meta,
            logits_indices.to(dev),
        )
        results: list[SampledToken | None] = [None] * len(items)
        if not sample_rows:
            return results
        reqs = [items[i].req for i in sample_rows]
        sbatch = SamplingBatch.build(
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [r.all_ids for r in reqs],
            self.vocab_size,
            dev,
            eos_token_ids=self.eos_token_ids,
            num_generated=[len(r.output_ids) for r in reqs],
        )
        gen_positions = torch.tensor([r.num_tokens for r in reqs], dtype=torch.long, device=dev)
        out = sample(logits, sbatch, gen_positions)
        tokens = out.tokens.tolist()  # the one host sync of the step
        logprobs = out.logprobs.tolist()
        want_top = [r.params.logprobs for r in reqs]
        top_ids = out.top_ids.tolist() if any(want_top) else None
        top_lps = out.top_logprobs.tolist() if any(want_top) else None
        for j, i in enumerate(sample_rows):
            k = want_top[j] or 0
            top = dict(zip(top_ids[j][:k], top_lps[j][:k])) if k and top_ids is not None else None
            results[i] = SampledToken(tokens[j], logprobs[j], top)
        return results
