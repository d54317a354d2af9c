"""One engine step: batch -> tensors -> model forward -> sampling -> host.

The runner owns no queue and no page: it reads the scheduler's :class:`ScheduledBatch`, the
request->slot table and the KV pool, and returns one :class:`SampledToken` (or ``None``) per
batch item. It synchronizes with the host once per step, when the sampled tokens are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from treeserve.graph_runner import (
    DecodeGraphRunner,
    draft_arrays,
    requests_sampling_batch,
    to_sampled_tokens,
    verified_tokens,
)
from treeserve.kvcache import AttentionMetadata, KVPool, ReqToTokenTable, compact_tree_path, rollback_slots
from treeserve.sampling import SamplingBatch, sample, verify
from treeserve.scheduler import Request, SampledToken, ScheduledBatch, ScheduledItem


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
    ``decode_graph``, when given, serves the decode-only batches it accepts (static buffers,
    CUDA graphs); every other batch takes the eager path below.
    """

    def __init__(
        self,
        model: CausalLM,
        kv: KVPool,
        table: ReqToTokenTable,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        device: torch.device | str = "cpu",
        decode_graph: DecodeGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.decode_graph = decode_graph
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
        if self.decode_graph is not None:
            done = self.decode_graph.run(batch)
            if done is not None:
                return list(done)
        items = batch.items
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        qo_lens: list[int] = []
        kv_lens: list[int] = []
        rows: list[int] = []
        parents: list[list[int] | None] = []
        logit_rows: list[int] = []
        logit_end: list[int] = []  # per item: end of its rows in the logits
        for it in items:
            req, start, n = it.req, it.start, it.num_tokens
            offset = len(ids)
            if it.draft is None:
                ids.extend(req.all_ids[start : start + n])
                positions.extend(range(start, start + n))
                parents.append(None)
                if it.sample:
                    logit_rows.append(offset + n - 1)
            else:  # pending token, then the draft nodes at their tree depths
                ids.append(req.all_ids[start])
                ids.extend(it.draft.tokens)
                positions.append(start)
                positions.extend(start + d for d in it.draft.depths())
                parents.append([-1] + [p + 1 for p in it.draft.parents])
                logit_rows.extend(range(offset, offset + n))
            qo_lens.append(n)
            kv_lens.append(start + n)
            rows.append(req.row)
            logit_end.append(len(logit_rows))
        dev = self.device
        table = self.table.table
        qo = torch.tensor(qo_lens, dtype=torch.long)
        row_t = torch.tensor(rows, dtype=torch.long)
        starts = torch.tensor([it.start for it in items], dtype=torch.long)
        offsets = torch.arange(int(qo.sum())) - torch.repeat_interleave(torch.cumsum(qo, 0) - qo, qo)
        # KV goes to consecutive slots after the pending token's (draft nodes in node order).
        out_slots = table[row_t.repeat_interleave(qo), starts.repeat_interleave(qo) + offsets]
        width = -(-max(kv_lens) // ps) * ps
        tree = parents if any(p is not None for p in parents) else None
        meta = AttentionMetadata.build(qo_lens, kv_lens, table[row_t, :width], ps, tree_parents=tree, device=dev)
        logits = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv,
            out_slots.to(dev),
            meta,
            torch.tensor(logit_rows, dtype=torch.long, device=dev),
        )
        results: list[SampledToken | None] = [None] * len(items)
        plain = [i for i, it in enumerate(items) if it.sample and it.draft is None]
        drafted = [i for i, it in enumerate(items) if it.draft is not None]
        if plain:
            idx = torch.tensor([logit_end[i] - 1 for i in plain], dtype=torch.long, device=dev)
            for i, token in zip(plain, self._sample(logits.index_select(0, idx), [items[i] for i in plain])):
                results[i] = token
        if drafted:
            rows_of = [range(logit_end[i] - items[i].num_tokens, logit_end[i]) for i in drafted]
            idx = torch.tensor([r for rs in rows_of for r in rs], dtype=torch.long, device=dev)
            verified = self._verify(logits.index_select(0, idx), [items[i] for i in drafted])
            for i, token in zip(drafted, verified):
                results[i] = token
        return results

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        return requests_sampling_batch(reqs, self.vocab_size, self.device, self.eos_token_ids)

    def _sample(self, logits: torch.Tensor, items: list[ScheduledItem]) -> list[SampledToken]:
        reqs = [it.req for it in items]
        gen_positions = torch.tensor([r.num_tokens for r in reqs], dtype=torch.long, device=self.device)
        out = sample(logits, self._sampling_batch(reqs), gen_positions)
        return to_sampled_tokens(out, [r.params.logprobs for r in reqs])  # host sync

    def _verify(self, logits: torch.Tensor, items: list[ScheduledItem]) -> list[SampledToken]:
        """Verify the drafted items (``logits``: each item's root row, then one per draft node),
        compact their accepted KV, return their tokens."""
        dev = self.device
        reqs = [it.req for it in items]
        drafts = draft_arrays(items, self.table.max_context_len, max(it.num_tokens for it in items) - 1)
        draft_slots = self.table.table.view(-1)[drafts.slot_index.to(dev)]
        num_draft = drafts.num_draft.to(dev)
        positions = torch.tensor([r.num_tokens for r in reqs], dtype=torch.long, device=dev)
        out = verify(
            logits,
            self._sampling_batch(reqs),
            drafts.tokens.to(dev),
            drafts.parents.to(dev),
            num_draft,
            positions,
        )
        plan = rollback_slots(draft_slots, num_draft, out.path)
        if plan.src_slots.numel():
            compact_tree_path(self.kv.k_caches, self.kv.v_caches, plan.src_slots, plan.dst_slots)
        return verified_tokens(out, len(items))  # host sync
