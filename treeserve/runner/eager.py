"""One engine step: batch -> tensors -> model forward -> sampling -> host.

The runner owns no queue and no page: it reads the scheduler's :class:`ScheduledBatch`, the
request->slot table and the KV pool, and returns one :class:`SampledToken` (or ``None``) per
batch item. It synchronizes with the host once per step, when the sampled tokens are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from treeserve.kvcache import KVPool, ReqToTokenTable, compact_tree_path, rollback_slots, select_backend
from treeserve.runner.graph import DecodeGraphRunner
from treeserve.runner.inputs import CausalLM, StepInputs, build_step_inputs, draft_arrays, requests_sampling_batch
from treeserve.runner.outputs import to_sampled_tokens, verified_tokens
from treeserve.sampling import SamplingBatch, SamplingRows, sample, verify
from treeserve.scheduler import Request, SampledToken, ScheduledBatch, ScheduledItem

__all__ = ["CausalLM", "ModelRunner"]


class ModelRunner:
    """Runs scheduled batches through ``model`` over the paged KV ``kv``.

    ``attention_backend`` names the attention kernel chosen once for every step ("auto" picks
    flashinfer > triton on CUDA, torch on CPU; "torch_per_request" is the batch-invariant one). ``eos_token_ids`` feed ``min_new_tokens`` suppression in sampling.
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
        attention_backend: str = "auto",
    ) -> None:
        self.model = model
        self.decode_graph = decode_graph
        self.kv = kv
        self.table = table
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self.page_size = kv.page_size
        self.attention = select_backend("paged_attention", attention_backend, kv.device, kv.dtype)
        self.compact = select_backend("compact_tree_path", "auto", kv.device, kv.dtype)
        # A sharded model moves every rank's share of the KV itself (treeserve.distributed).
        self.compact_kv = getattr(model, "compact_kv", None)
        self.sampling_rows = SamplingRows(table.max_requests + 1, vocab_size, self.device, self.eos_token_ids)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[SampledToken | None]:
        """Compute every item of ``batch`` and sample the rows that end their pending tokens."""
        if not batch.items:
            return []
        if self.decode_graph is not None:
            done = self.decode_graph.run(batch)
            if done is not None:
                return list(done)
        items, dev = batch.items, self.device
        step, logit_end = self._inputs(items)
        logits = self.model(step.input_ids, step.positions, self.kv, step.out_slots, step.meta, step.logits_indices)
        results: list[SampledToken | None] = [None] * len(items)
        plain = [i for i, it in enumerate(items) if it.sample and it.draft is None]
        drafted = [i for i, it in enumerate(items) if it.draft is not None]
        if plain:
            idx = torch.tensor([logit_end[i] - 1 for i in plain], dtype=torch.long, device=dev)
            for i, token in zip(plain, self._sample(logits.index_select(0, idx), [items[i] for i in plain])):
                results[i] = token
        if drafted:
            rows_of = [range(logit_end[i] - items[i].num_scheduled_tokens, logit_end[i]) for i in drafted]
            idx = torch.tensor([r for rs in rows_of for r in rs], dtype=torch.long, device=dev)
            verified = self._verify(logits.index_select(0, idx), [items[i] for i in drafted])
            for i, token in zip(drafted, verified):
                results[i] = token
        return results

    def _inputs(self, items: list[ScheduledItem]) -> tuple[StepInputs, list[int]]:
        """The step inputs of ``items`` and, per item, the end of its rows in the logits.

        A plain item computes tokens ``[start, start + n)`` (logits of the last one when it
        samples); a drafted item its pending token then the draft nodes at their tree depths,
        KV in node order after the pending token's slot, logits of every node.
        """
        ids: list[int] = []
        logit_rows: list[int] = []
        drafted: list[int] = []
        for i, it in enumerate(items):
            if it.draft is None:
                ids.extend(it.req.all_ids[it.start : it.start + it.num_scheduled_tokens])
                logit_rows.append(1 if it.sample else 0)
            else:
                ids.append(it.req.all_ids[it.start])
                ids.extend(it.draft.tokens)
                logit_rows.append(it.num_scheduled_tokens)
                drafted.append(i)
        qo = [it.num_scheduled_tokens for it in items]
        parents = None
        if drafted:  # causal items are chains, drafted ones their trees under the pending token
            width = max(qo)
            parents = (torch.arange(width) - 1).repeat(len(items), 1)
            for i in drafted:
                tree = items[i].draft
                parents[i, 1 : 1 + len(tree)] = torch.tensor(tree.parents, dtype=torch.long) + 1
        step = build_step_inputs(
            self.table.table,
            [it.req.row for it in items],
            [it.start for it in items],
            qo,
            ids,
            self.page_size,
            logit_rows,
            parents=parents,
            attention_backend=self.attention,
        )
        return step, list(accumulate(logit_rows))

    def _sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        return requests_sampling_batch(self.sampling_rows, reqs)

    def _sample(self, logits: torch.Tensor, items: list[ScheduledItem]) -> list[SampledToken]:
        reqs = [it.req for it in items]
        gen_positions = torch.tensor([r.seq_len for r in reqs], dtype=torch.long, device=self.device)
        out = sample(logits, self._sampling_batch(reqs), gen_positions)
        return to_sampled_tokens(out, [r.params.logprobs for r in reqs])  # host sync

    def _verify(self, logits: torch.Tensor, items: list[ScheduledItem]) -> list[SampledToken]:
        """Verify the drafted items (``logits``: each item's root row, then one per draft node),
        compact their accepted KV, return their tokens."""
        dev = self.device
        reqs = [it.req for it in items]
        drafts = draft_arrays(items, self.table.max_context_len, max(it.num_scheduled_tokens for it in items) - 1)
        draft_slots = self.table.table.view(-1)[drafts.slot_index.to(dev)]
        num_draft = drafts.num_draft.to(dev)
        positions = torch.tensor([r.seq_len for r in reqs], dtype=torch.long, device=dev)
        out = verify(
            logits,
            self._sampling_batch(reqs),
            drafts.tokens.to(dev),
            drafts.parents.to(dev),
            num_draft,
            positions,
        )
        plan = rollback_slots(draft_slots, num_draft, out.path)
        if plan.src_slots.numel() and self.compact_kv is not None:
            self.compact_kv(self.kv, plan.src_slots, plan.dst_slots)
        elif plan.src_slots.numel():
            compact_tree_path(self.kv.k_caches, self.kv.v_caches, plan.src_slots, plan.dst_slots, backend=self.compact)
        return verified_tokens(out, len(items))  # host sync
