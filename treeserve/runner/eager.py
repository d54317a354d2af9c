"""One engine step: batch -> tensors -> model forward -> sampling -> host.

The runner owns no queue and no page: it reads the scheduler's :class:`ScheduledBatch`, the
request->slot table and the KV pool, and returns one :class:`SampledToken` (or ``None``) per
batch item. It synchronizes with the host once per step, when the sampled tokens are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from itertools import accumulate

import numpy as np
import torch

from treeserve.kvcache import KVPool, ReqToTokenTable, compact_tree_path, rollback_slots, select_backend
from treeserve.models.quant import plain_rows
from treeserve.runner.graph import DecodeGraphRunner
from treeserve.runner.inputs import (
    CausalLM,
    DraftArrays,
    StepInputs,
    admit_requests,
    build_step_inputs,
    draft_arrays,
    draft_bitmasks,
    draft_laws,
    grammar_masks,
    step_token_ids,
    with_grammar_masks,
)
from treeserve.runner.outputs import to_sampled_tokens, verified_tokens
from treeserve.sampling import SamplingRows, greedy_masked_tokens, greedy_tokens, sample, verify
from treeserve.sampling.verify import greedy_paths
from treeserve.scheduler import Request, SampledToken, ScheduledBatch, ScheduledItem

__all__ = ["CausalLM", "ModelRunner"]

_NAN = float("nan")


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
        n = len(items)
        reqs, starts, qo, samples, drafts, _ = zip(*items)
        rows = np.fromiter([r.row for r in reqs], np.int64, n)  # converted once for the builder and sampling
        drafted = [] if drafts.count(None) == n else [i for i, d in enumerate(drafts) if d is not None]
        step, logit_rows = self._inputs(items, reqs, rows, starts, qo, samples, drafted)
        # draft nodes ride the path of the step's plain rows (``quant.plain_rows``: plain decoding's arithmetic)
        route = plain_rows(sum(qo) - sum(len(drafts[i]) for i in drafted)) if drafted else nullcontext()
        with route:
            logits = self.model(step.input_ids, step.positions, self.kv, step.out_slots, step.meta, step.logits_indices)
        if not drafted and samples.count(True) == n:  # every item samples its last row: the common decode step
            return self._sample(logits, reqs, rows, starts, qo)  # one logits row per item, in order
        results: list[SampledToken | None] = [None] * n
        logit_end = list(accumulate(logit_rows))
        plain = [i for i, (s, d) in enumerate(zip(samples, drafts)) if s and d is None]
        if plain:
            idx = torch.tensor([logit_end[i] - 1 for i in plain], dtype=torch.long, device=dev)
            sampled = self._sample(
                logits.index_select(0, idx),
                [reqs[i] for i in plain],
                rows[plain],
                [starts[i] for i in plain],
                [qo[i] for i in plain],
            )
            for i, token in zip(plain, sampled):
                results[i] = token
        if drafted:
            flat = [r for i in drafted for r in range(logit_end[i] - qo[i], logit_end[i])]
            if flat != list(range(logits.shape[0])):  # else every logits row is a drafted one's, in order
                logits = logits.index_select(0, torch.tensor(flat, dtype=torch.long, device=dev))
            verified = self._verify(logits, [items[i] for i in drafted])
            for i, token in zip(drafted, verified):
                results[i] = token
        return results

    def _inputs(
        self,
        items: Sequence[ScheduledItem],
        reqs: Sequence[Request],
        rows: np.ndarray,
        starts: Sequence[int],
        qo: Sequence[int],
        samples: Sequence[bool],
        drafted: list[int],
    ) -> tuple[StepInputs, Sequence[int]]:
        """The step inputs of ``items`` (given also as columns, ``rows`` their table rows) and,
        per item, its number of rows in the logits.

        A plain item computes tokens ``[start, start + n)`` (logits of the last one when it
        samples); a drafted item (indices ``drafted``) its pending token then the draft nodes at
        their tree depths, KV in node order after the pending token's slot, logits of every node.
        A step whose drafts are all chains is causal (no tree mask: chains see what a causal chunk
        sees, and the attention paths skip the mask's bookkeeping).
        """
        parents = None
        if not drafted:
            logit_rows: Sequence[int] = samples  # bools: 1 or 0 rows
            ids = step_token_ids(reqs, starts, qo)
        else:  # causal items are chains, drafted ones their trees under the pending token
            logit_rows = [1 if s else 0 for s in samples]
            ids = []
            for it in items:
                if it.draft is None:
                    ids.extend(it.req.tokens(it.start, it.start + it.num_scheduled_tokens))
                else:
                    ids.extend(it.req.tokens(it.start, it.start + 1))
                    ids.extend(it.draft.tokens)
            for i in drafted:
                logit_rows[i] = qo[i]
            trees = [i for i in drafted if not items[i].draft.is_chain]
            if trees:
                parents = np.tile(np.arange(-1, max(qo) - 1), (len(items), 1))
                for i in trees:
                    tree = items[i].draft
                    parents[i, 1 : 1 + len(tree)] = np.asarray(tree.parents) + 1
        step = build_step_inputs(
            self.table.table,
            rows,
            starts,
            qo,
            ids,
            self.page_size,
            logit_rows,
            parents=parents,
            attention_backend=self.attention,
        )
        return step, logit_rows

    def _sample(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Request],
        rows: np.ndarray,
        starts: Sequence[int],
        qo: Sequence[int],
    ) -> list[SampledToken]:
        """Sample one token per row of ``logits`` for ``reqs`` (in table ``rows``), each having
        computed tokens ``[start, start + qo)`` (its next token sits at ``start + qo``).

        A step whose rows are all plain greedy (``SamplingRows.all_plain_greedy``), grammar masks
        aside, takes their first argmax directly (the same tokens, logprob NaN, no
        ``SamplingBatch``), the masks applied in place to ``logits`` (which this consumes)."""
        admit_requests(self.sampling_rows, reqs)
        counts = lambda: [len(r.output_ids) for r in reqs]  # noqa: E731
        if self.sampling_rows.all_plain_greedy(rows, counts, grammar=True):
            mask = grammar_masks(reqs, self.sampling_rows.vocab_size, self.device)
            new = tuple.__new__  # SampledToken(...) without its Python-level __new__
            return [new(SampledToken, (t, _NAN, None, (), ())) for t in greedy_masked_tokens(logits, mask).tolist()]  # host sync
        positions = [s + n for s, n in zip(starts, qo)]
        gen_positions = torch.tensor(positions, dtype=torch.long, device=self.device)
        batch = with_grammar_masks(self.sampling_rows.batch(rows, [r.output_ids for r in reqs]), reqs)  # admitted above
        out = sample(logits, batch, gen_positions)
        return to_sampled_tokens(out, [r.params.logprobs for r in reqs])  # host sync

    def _verify(self, logits: torch.Tensor, items: list[ScheduledItem]) -> list[SampledToken]:
        """Verify the drafted items (``logits``: each item's root row, then one per draft node),
        compact their accepted KV, return their tokens."""
        dev = self.device
        reqs = [it.req for it in items]
        admit_requests(self.sampling_rows, reqs)  # grammar masks go per tree position instead
        if self._plain_greedy_drafts(items):
            return self._verify_greedy(logits, items)
        drafts = self._draft_arrays(items)
        positions = torch.tensor([r.seq_len for r in reqs], dtype=torch.long, device=dev)
        out = verify(
            logits,
            self.sampling_rows.batch([r.row for r in reqs], [r.output_ids for r in reqs]),
            drafts.tokens.to(dev),
            drafts.parents.to(dev),
            drafts.num_draft.to(dev),
            positions,
            draft_laws([it.draft for it in items], self.vocab_size, dev),
            draft_bitmask=draft_bitmasks(items, drafts.tokens.shape[1], self.vocab_size, dev),
        )
        self._keep_path(drafts, out.path)
        return verified_tokens(out, len(items))  # host sync

    def _draft_arrays(self, items: Sequence[ScheduledItem]) -> DraftArrays:
        """``draft_arrays`` of ``items``, as wide as their longest draft."""
        return draft_arrays(items, self.table.max_context_len, max(it.num_scheduled_tokens for it in items) - 1)

    def _keep_path(self, drafts: DraftArrays, path: torch.Tensor) -> None:
        """Move the KV of each request's accepted nodes (``path [B, M]``, -1 padded; ``drafts``
        their draft arrays) into the slots that follow its committed tokens
        (``kvcache.rollback_slots``' plan), through the sharded model's ``compact_kv`` where it
        has one."""
        draft_slots = self.table.table.view(-1)[drafts.slot_index.to(self.device)]
        plan = rollback_slots(draft_slots, drafts.num_draft.to(self.device), path)
        if plan.src_slots.numel() and self.compact_kv is not None:
            self.compact_kv(self.kv, plan.src_slots, plan.dst_slots)
        elif plan.src_slots.numel():
            compact_tree_path(self.kv.k_caches, self.kv.v_caches, plan.src_slots, plan.dst_slots, backend=self.compact)

    def _plain_greedy_drafts(self, items: Sequence[ScheduledItem]) -> bool:
        """Every item plain greedy (``SamplingRows.all_plain_greedy``; admitted) with a point-mass
        draft or none, and no grammar mask: ``greedy_paths``' case."""
        if any(it.draft is not None and (it.draft.probs is not None or it.draft.bitmask is not None) for it in items):
            return False
        reqs = [it.req for it in items]
        return self.sampling_rows.all_plain_greedy([r.row for r in reqs], lambda: [len(r.output_ids) for r in reqs])

    def _verify_greedy(self, logits: torch.Tensor, items: Sequence[ScheduledItem]) -> list[SampledToken]:
        """``_verify`` of a ``_plain_greedy_drafts`` step: the rows' first argmaxes (``greedy_tokens``,
        one host sync) walked on the host (``greedy_paths``: ``verify``'s tokens and path), then the
        accepted nodes' KV compacted as ``_verify`` does, unless every path is already in place
        (nodes ``0 .. n-1``, a chain's accepted prefix: their KV sits where it is kept)."""
        drafts = [((), ()) if it.draft is None else (it.draft.tokens, it.draft.parents) for it in items]
        paths = greedy_paths(greedy_tokens(logits).tolist(), [d[0] for d in drafts], [d[1] for d in drafts])
        if any(p.nodes != tuple(range(len(p.nodes))) for p in paths):
            arrays = self._draft_arrays(items)
            accepted = torch.full(arrays.slot_index.shape, -1, dtype=torch.long)
            for i, path in enumerate(paths):
                accepted[i, : len(path.nodes)] = torch.tensor(path.nodes, dtype=torch.long)
            self._keep_path(arrays, accepted.to(self.device))
        return [SampledToken(p.tokens[-1], _NAN, None, p.tokens[:-1], (_NAN,) * (len(p.tokens) - 1)) if p.tokens
                else SampledToken(-1, _NAN, None) for p in paths]
