"""Decode and verify steps from static buffers: CUDA-graph capture and replay, or the same path eagerly.

A step whose items each compute one pending token (plus, with speculation, a draft tree of at
most ``max_draft_nodes`` nodes), every item sampled, is padded to a *graph key*
``(batch bucket, draft-node bucket)``: batch buckets are ``1, 2, 4`` then multiples of 8, node
buckets ``0`` (plain decode) and, when ``max_draft_nodes > 0``, ``1, 2, 4, 8, 16, ...`` up to
the first ``>= max_draft_nodes``. Every request of a step then has ``1 + K`` query tokens (the
pending one, then ``K`` draft nodes, the real ones first), run from buffers that never move: token
ids, positions, KV slots, the attention metadata (FlashInfer layout: ``kv_indptr`` /
``kv_page_indices`` sized for every request at full context / ``kv_last_page_len``, and for
verify keys the ``(1 + K)^2`` tree masks), the draft arrays, the sampling parameters and the RNG
counters (seeds, absolute positions).

Padding never touches a real page: padding requests use the dummy table row 0 (all their tokens
at slot 0 of the dummy page 0), padding draft nodes write their K/V to slot 0 and attend only to
the request's prefix and pending token (the tree mask hides them from every real node and their
own slots from themselves), and the KV pages past a request's real tokens point at page 0.
A verify key runs the forward, :func:`treeserve.sampling.verify` (a request without a draft gets
exactly ``sample``'s token) and the fixed-shape compaction of the accepted paths
(:func:`treeserve.kvcache.padded_path_moves`), all on the device.

A step's inputs (ids, positions, KV slots, attention metadata, drafts, sampling rows) are
computed on the host (the slot table's and the sampling rows' host mirrors: no device read) into
one staging buffer, pinned on CUDA, and sent in **one** host->device copy
(:mod:`treeserve.runner.staging`); the buffers a graph reads are views of its device twin.
On CUDA every key is captured, largest first, into one shared memory pool, and a step is that
copy plus one ``graph.replay()``. The runner's attention kernel is chosen
once with ``select_backend(..., graph_safe=True)``: the Triton kernel on CUDA (which reads
lengths from the buffers on the device) rather than FlashInfer (whose planning reads them on
the host), for captured and eager steps alike. Elsewhere
(or with ``use_cuda_graph=False``) the very same buffers, padding and keys run eagerly, which is
how CPU tests cover everything but the capture itself. Steps the buffers cannot express
(penalties, logit bias, allowed-token lists, grammar token masks, more stop ids than ``max_stop_token_ids``, more top
logprobs than ``max_logprobs``, top logprobs in a verify step, draft probabilities) make
:meth:`DecodeGraphRunner.run` return ``None``: the caller then takes its eager path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from treeserve.kvcache import (
    AttentionMetadata,
    KVPool,
    ReqToTokenTable,
    compact_tree_path,
    select_backend,
    padded_path_moves,
)
from treeserve.models.quant import plain_rows
from treeserve.runner.inputs import CausalLM, admit_requests, draft_arrays, step_index
from treeserve.runner.staging import StepStaging, layout_bytes
from treeserve.runner.outputs import to_sampled_tokens, verified_tokens
from treeserve.sampling import (
    MAX_LOGPROBS,
    SampleOutput,
    SamplingBatch,
    SamplingParams,
    SamplingRows,
    VerifyOutput,
    sample,
    verify,
)
from treeserve.scheduler import Request, SampledToken, ScheduledBatch, ScheduledItem

__all__ = ["DecodeGraphRunner", "DecodeLaunch", "decode_buckets"]


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """Padded sizes: ``1, 2, 4, 8, 16, 24, ...``, ending at the first ``>= max_batch``.

    ``max_batch`` must be an int >= 1 (``ValueError`` otherwise).
    """
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    candidates = [1, 2, 4, *range(8, -(-max_batch // 8) * 8 + 1, 8)]
    below = [b for b in candidates if b < max_batch]
    return (*below, next(b for b in candidates if b >= max_batch))


@dataclass(slots=True)
class _Graph:
    """One captured key: the CUDA graph and the output tensors it refreshes on replay."""

    graph: torch.cuda.CUDAGraph
    output: SampleOutput | VerifyOutput


@dataclass(slots=True)
class DecodeLaunch:
    """A decode step launched by :meth:`DecodeGraphRunner.launch`: its ``batch`` and its
    outputs' host copies, complete once ``event`` has (None: already complete)."""

    batch: ScheduledBatch
    host: SampleOutput
    event: torch.cuda.Event | None
    num_logprobs: list[int | None]

    def tokens(self) -> list[SampledToken]:
        """One sampled token per item of ``batch`` (waits for the step on CUDA)."""
        if self.event is not None:
            self.event.synchronize()
        return to_sampled_tokens(self.host, self.num_logprobs)


class DecodeGraphRunner:
    """Runs decode and verify steps of at most ``max_batch`` requests from static, padded buffers.

    ``forward`` is the model call (the model itself, or ``treeserve.runner.compile_model(model)``).
    ``use_cuda_graph``: ``None`` = capture when ``device`` is CUDA; ``True`` on a non-CUDA device
    raises ``ValueError``. ``max_draft_nodes`` (0 = decode only) is the largest draft tree a
    verify step may carry per request (the scheduler's ``num_speculative_tokens``). Call
    :meth:`capture` once after the KV pool exists (a no-op in eager mode); :meth:`run` then
    serves steps. Sampling and verification give the same tokens as the eager runner for the
    same logits: the RNG is keyed by (seed, absolute position), both held in buffers.
    ``max_logprobs`` bounds the top logprobs a decode request may ask for here;
    ``max_stop_token_ids`` bounds its stop ids (beyond EOS). ``keys`` lists the graph keys
    ``(batch bucket, node bucket)``; ``num_steps`` counts the steps served (``num_verify_steps``
    of them with drafts, ``num_follow_ups`` launched before the step they follow was read),
    ``capture_seconds`` the time :meth:`capture` took.
    """

    def __init__(
        self,
        forward: CausalLM,
        kv: KVPool,
        table: ReqToTokenTable,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        device: torch.device | str = "cpu",
        max_batch: int = 256,
        use_cuda_graph: bool | None = None,
        max_logprobs: int = MAX_LOGPROBS,
        max_stop_token_ids: int = 4,
        max_draft_nodes: int = 0,
    ) -> None:
        self.buckets = decode_buckets(max_batch)
        self.device = kv.k_caches[0].device  # concrete ("cuda:0" where ``device`` may say "cuda")
        self.attention = select_backend("paged_attention", "auto", self.device, kv.dtype, graph_safe=True)
        self.compact = select_backend("compact_tree_path", "auto", self.device, kv.dtype)
        given = torch.device(device)
        same = given.type == self.device.type and given.index in (None, self.device.index)
        if not same or table.table.device != self.device:
            raise ValueError(f"device ({given}), kv ({self.device}) and table ({table.table.device}) must agree")
        if use_cuda_graph is None:
            use_cuda_graph = self.device.type == "cuda"
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph=True needs a CUDA device, got device={self.device}")
        for name, value in (
            ("max_logprobs", max_logprobs),
            ("max_stop_token_ids", max_stop_token_ids),
            ("max_draft_nodes", max_draft_nodes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if max_logprobs > MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {max_logprobs}")
        self.forward = forward
        self.kv = kv
        self.table = table
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_batch = max_batch
        self.use_cuda_graph = use_cuda_graph
        self.num_logprobs = max_logprobs
        self.ban_width = len(set(self.eos_token_ids)) + max_stop_token_ids
        self.page_size = kv.page_size
        self.node_buckets = (0, *decode_buckets(max_draft_nodes)) if max_draft_nodes else (0,)
        self.keys = tuple((b, k) for b in self.buckets for k in self.node_buckets)
        self.pages_per_req = -(-(table.max_context_len + self.node_buckets[-1]) // self.page_size)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.sampling_rows = SamplingRows(table.max_requests + 1, vocab_size, self.device, self.eos_token_ids)
        self.capture_seconds = 0.0
        self.num_steps = 0
        self.num_verify_steps = 0
        self.num_follow_ups = 0
        self._alloc_buffers()
        self._flags = self._capture_flags()

    # ------------------------------------------------------------------ buffers
    def _fields(self, size: int, k: int) -> list[tuple[str, torch.dtype, int]]:
        """The staged inputs of key ``(size, k)``, the page list last (copied up to its use)."""
        t, i64, f64, i32, b8 = size * (1 + k), torch.int64, torch.float64, torch.int32, torch.bool
        drafts = [("draft_tokens", i64, size * k), ("draft_parents", i64, size * k), ("num_draft", i64, size)]
        return [
            ("input_ids", i64, t), ("positions", i64, t), ("out_slots", i64, t),
            ("gen_positions", i64, size), ("prev_row", i64, size), ("seeds", i64, size), ("top_k", i64, size),
            ("min_tokens_left", i64, size), ("ban_ids", i64, size * self.ban_width),
            ("temperature", f64, size), ("top_p", f64, size), ("min_p", f64, size),
            *(drafts if k else []),
            ("kv_indptr", i32, size + 1), ("kv_last_page_len", i32, size), ("greedy", b8, size),
            *([("tree_mask", b8, t * (1 + k))] if k else []),
            ("kv_page_indices", i32, size * self.pages_per_req),
        ]  # fmt: skip

    def _alloc_buffers(self) -> None:
        """One staging buffer holding any key's inputs, a layout per key over it, and the
        constants (logits rows, query and mask offsets, penalty defaults)."""
        bmax, kmax, dev = self.buckets[-1], self.node_buckets[-1], self.device
        self.staging = StepStaging(max(layout_bytes(self._fields(*key)) for key in self.keys), dev)
        self._layouts = {key: self.staging.layout(self._fields(*key)) for key in self.keys}
        self.logits_indices = torch.arange(bmax * (1 + kmax), device=dev)
        steps = torch.arange(bmax + 1, dtype=torch.int32, device=dev)
        self._qo_indptr = {k: steps * (1 + k) for k in self.node_buckets}
        self._mask_indptr = {k: steps * (1 + k) ** 2 for k in self.node_buckets}
        self._ones = torch.ones(bmax, dtype=torch.float64, device=dev)
        self._zeros = torch.zeros(bmax, dtype=torch.float64, device=dev)
        # The tokens the last decode step sampled, on the device: a step launched before they are
        # read takes its pending tokens from here (``prev_row``).
        self.last_tokens = torch.zeros(bmax, dtype=torch.int64, device=dev)
        # Host copies of two launched steps' outputs (pinned on CUDA), used in turn.
        pin, nl = dev.type == "cuda", self.num_logprobs

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self._host_out = [
            SampleOutput(host(bmax, dtype=torch.int64), host(bmax, dtype=torch.float32),
                         host(bmax, nl, dtype=torch.int64), host(bmax, nl, dtype=torch.float32))
            for _ in range(2)
        ]  # fmt: skip
        self._host_turn = 0

    def _meta(self, size: int, k: int) -> AttentionMetadata:
        """Fresh metadata over the buffers of key ``(size, k)`` (fresh: backends memoize in it)."""
        q, buf = 1 + k, self._layouts[size, k].device
        return AttentionMetadata(
            qo_indptr=self._qo_indptr[k][: size + 1],
            kv_indptr=buf["kv_indptr"],
            kv_page_indices=buf["kv_page_indices"],
            kv_last_page_len=buf["kv_last_page_len"],
            page_size=self.page_size,
            max_qo_len=q,
            max_kv_len=self.pages_per_req * self.page_size,
            num_qo_tokens=size * q,
            tree_mask=buf["tree_mask"] if k else None,
            tree_mask_indptr=self._mask_indptr[k][: size + 1] if k else None,
            attention_backend=self.attention,
        )

    def _sampling_batch(self, size: int, k: int) -> SamplingBatch:
        """The sampling view of key ``(size, k)``: per-row values from its buffers, the stage
        switches of :meth:`_capture_flags` (every stage on: each is a no-op on rows not using
        it, so the tokens are those of the rows' own flags)."""
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        buf = self._layouts[size, k].device
        return replace(
            self._flags,
            temperature=buf["temperature"],
            greedy=buf["greedy"],
            top_k=buf["top_k"],
            top_p=buf["top_p"],
            min_p=buf["min_p"],
            repetition_penalty=self._ones[:size],
            frequency_penalty=self._zeros[:size],
            presence_penalty=self._zeros[:size],
            hist_rows=empty,
            hist_tokens=empty,
            hist_weight=empty.float(),
            hist_output=empty.float(),
            bias_ids=empty.view(size, 0),
            bias_values=empty.double().view(size, 0),
            allowed=None,
            ban_ids=buf["ban_ids"].view(size, self.ban_width),
            min_tokens_left=buf["min_tokens_left"],
            seeds=buf["seeds"],
            num_logprobs=self.num_logprobs,
        )

    def _capture_flags(self) -> SamplingBatch:
        """Flags that switch every stage a graph serves on (greedy rows, top-k/p, min-p, logprobs),
        so one captured graph is right for any step; the stages are no-ops on rows not using them."""
        params = [
            SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1, logprobs=self.num_logprobs),
            SamplingParams(temperature=0.0),
        ]
        return SamplingBatch.build(params, [0, 0], [[0], [0]], self.vocab_size, self.device)

    # ------------------------------------------------------------------ public API
    def bucket_for(self, batch_size: int) -> int:
        """The smallest bucket holding ``batch_size`` rows (``ValueError`` outside ``[1, max_batch]``)."""
        if not 1 <= batch_size <= self.max_batch:
            raise ValueError(f"batch_size must be in [1, max_batch={self.max_batch}], got {batch_size}")
        return next(b for b in self.buckets if b >= batch_size)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one CUDA graph per key, largest first, into one memory pool (no-op when eager).

        Each key is run once before its capture (Triton/compile warm-up) with every row a
        padding row. ``capture_seconds`` records the total time.
        """
        if not self.use_cuda_graph or self.graphs:
            return
        t0 = time.perf_counter()
        pool = None
        for size, k in sorted(self.keys, key=lambda key: (key[0] * (1 + key[1]), key), reverse=True):
            self._load([], size, k)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._compute(size, k)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._compute(size, k)
            pool = graph.pool()
            self.graphs[size, k] = _Graph(graph, out)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[SampledToken] | None:
        """Run a decode or verify ``batch`` and return one sampled token (with the accepted
        draft tokens) per item.

        Returns ``None`` (nothing computed, nothing written) when the batch is not such a step
        of at most ``max_batch`` requests (each item: its pending token plus its draft, sampled;
        drafts of at most ``max_draft_nodes`` nodes and without probabilities), or a row's
        sampling needs per-step shapes.
        """
        key = self._key(batch)
        if key is None:
            return None
        if key[1]:
            out = self._launch(batch, key, None)
            self.num_verify_steps += 1
            return verified_tokens(out, len(batch.items))
        return self.launch(batch).tokens()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, follows: DecodeLaunch | None = None) -> DecodeLaunch | None:
        """Launch a decode ``batch`` (no drafts) and return before its tokens are read.

        An item whose pending token is not committed yet (``start == req.seq_len``) takes it
        on the device from ``follows``, the decode step launched just before this one, which
        sampled it (``ValueError`` when ``follows`` does not hold the request). Its sampling
        counts that token as generated. ``None`` as for :meth:`run`, or for a verify step.
        On CUDA the outputs are copied to pinned host memory behind an event, so the host can
        prepare and launch the next step while this one runs; on CPU the step has run when
        this returns.
        """
        key = self._key(batch, follows)
        if key is None or key[1]:
            return None
        out = self._launch(batch, key, follows)
        self.num_follow_ups += follows is not None
        n = len(batch.items)
        host = self._host_out[self._host_turn]
        self._host_turn ^= 1
        for dst, src in zip(host, out):
            dst[:n].copy_(src[:n], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        logprobs = [it.req.params.logprobs for it in batch.items]
        return DecodeLaunch(batch, SampleOutput(*(t[:n] for t in host)), event, logprobs)

    def _key(self, batch: ScheduledBatch, follows: DecodeLaunch | None = None) -> tuple[int, int] | None:
        """The graph key of ``batch`` (admitting its requests' sampling rows), or None when the
        static path cannot serve it."""
        items = batch.items
        if not 1 <= len(items) <= self.max_batch:
            return None
        need = 0
        for it in items:
            nodes = 0 if it.draft is None else len(it.draft)
            if not it.sample or it.num_scheduled_tokens != 1 + nodes or (nodes and it.draft.probs is not None):
                return None
            need = max(need, nodes)
        if need > self.node_buckets[-1] or (need and follows is not None):
            return None
        reqs = [it.req for it in items]
        admit_requests(self.sampling_rows, reqs)
        rows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=len(reqs))
        max_logprobs = 0 if need else self.num_logprobs  # verify reports no top logprobs
        if any(r.grammar is not None for r in reqs) or not self.sampling_rows.per_row_only(
            rows, self.ban_width, max_logprobs
        ):
            return None
        return self.bucket_for(len(items)), next(b for b in self.node_buckets if b >= need)

    def _launch(
        self, batch: ScheduledBatch, key: tuple[int, int], follows: DecodeLaunch | None
    ) -> SampleOutput | VerifyOutput:
        size, k = key
        self._load(batch.items, size, k, follows)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.graph.replay()
            out = graph.output
        else:
            out = self._compute(size, k)
        self.num_steps += 1
        return out

    # ------------------------------------------------------------------ internals
    def _compute(self, size: int, k: int) -> SampleOutput | VerifyOutput:
        """Forward, then sampling (``k == 0``) or verification and KV compaction, on the buffers."""
        t, buf, sbatch = size * (1 + k), self._layouts[size, k].device, self._sampling_batch(size, k)
        ids = buf["input_ids"]
        if not k:  # pending tokens still on the device: the previous decode step's
            prev = buf["prev_row"]
            ids = torch.where(prev >= 0, self.last_tokens[prev.clamp(min=0)], ids)
        with plain_rows(size):  # a verify key's draft nodes take its pending tokens' path (``quant.plain_rows``)
            logits = self.forward(ids, buf["positions"], self.kv, buf["out_slots"], self._meta(size, k),
                                  self.logits_indices[:t])
        if not k:
            out = sample(logits, sbatch, buf["gen_positions"])
            self.last_tokens[:size].copy_(out.tokens)
            return out
        out = verify(
            logits,
            sbatch,
            buf["draft_tokens"].view(size, k),
            buf["draft_parents"].view(size, k),
            buf["num_draft"],
            buf["gen_positions"],
        )
        src, dst = padded_path_moves(buf["out_slots"].view(size, 1 + k)[:, 1:], out.path)
        compact_tree_path(self.kv.k_caches, self.kv.v_caches, src, dst, backend=self.compact)
        return out

    def _load(self, items: Sequence[ScheduledItem], size: int, k: int, follows: DecodeLaunch | None = None) -> None:
        """Write one step into the host staging of key ``(size, k)`` and send it in one copy;
        rows past ``len(items)`` (all of them when ``items`` is empty) become padding requests,
        nodes past a draft padding nodes (indices as :func:`step_index` gives every step's).
        A pending token not committed yet is read on the device from row ``prev_row`` of the
        step ``follows`` launched (see :meth:`launch`)."""
        n, q = len(items), 1 + k
        drafts = draft_arrays(items, self.table.max_context_len, k)
        reqs = [it.req for it in items]
        prev_row = np.full(size, -1, dtype=np.int64)
        pending = np.zeros(size, dtype=np.int64)
        in_flight = None if follows is None else {id(it.req): j for j, it in enumerate(follows.batch.items)}
        for i, it in enumerate(items):
            ids = it.req.all_ids
            if it.start < len(ids):
                pending[i] = ids[it.start]
            elif in_flight is not None and id(it.req) in in_flight:
                prev_row[i] = in_flight[id(it.req)]
            else:
                raise ValueError(f"request {it.req.rid}: its pending token {it.start} is neither committed nor in flight")

        def padded(values: np.ndarray, pad_value: int) -> np.ndarray:
            return np.concatenate([values, np.full((size - n, *values.shape[1:]), pad_value, dtype=values.dtype)])

        rows = padded(np.fromiter((r.row for r in reqs), np.int64, n), 0)
        starts = padded(np.fromiter((it.start for it in items), np.int64, n), 0)
        num_draft = padded(drafts.num_draft.numpy(), 0)
        tokens, parents = padded(drafts.tokens.numpy(), 0), padded(drafts.parents.numpy(), -1)
        qo = np.full(size, q, dtype=np.int64)
        # Pending token at the root, nodes below it (padding nodes: children of the pending token).
        local_parents = np.concatenate([np.full((size, 1), -1), parents + 1], 1) if k else None
        idx = step_index(self.table.max_context_len, rows, starts, qo, self.page_size, qo,
                         parents=local_parents, num_real=1 + num_draft)  # fmt: skip
        host_table = self.table.host
        layout = self._layouts[size, k]
        h = layout.fill()
        h["input_ids"][:] = np.concatenate([pending[:, None], tokens], 1).reshape(-1)
        h["positions"][:] = idx.positions
        h["out_slots"][:] = host_table[idx.slot_index]
        num_pages = idx.page_index.shape[0]
        pages = host_table[idx.page_index]
        h["kv_page_indices"][:num_pages] = pages if self.page_size == 1 else pages // self.page_size
        h["kv_indptr"][:] = idx.kv_indptr
        h["kv_last_page_len"][:] = idx.last_page_len
        h["gen_positions"][:] = starts + 1
        h["prev_row"][:] = prev_row
        if k:
            h["tree_mask"][:] = idx.tree_mask
            h["draft_tokens"][:] = tokens.reshape(-1)
            h["draft_parents"][:] = parents.reshape(-1)
            h["num_draft"][:] = num_draft
        self._stage_sampling(h, reqs, rows[:n], size, prev_row[:n] >= 0)
        layout.send(tail=num_pages)

    def _stage_sampling(
        self, h: dict[str, np.ndarray], reqs: Sequence[Request], rows: np.ndarray, size: int, in_flight: np.ndarray
    ) -> None:
        """The sampling rows of ``reqs`` (gathered on the host; a token ``in_flight`` counts as
        generated), then padding rows (greedy, no filter, no ban, seed 0)."""
        n = len(reqs)
        generated = np.fromiter((len(r.output_ids) for r in reqs), np.int64, n) + in_flight
        values = self.sampling_rows.host_rows(rows, generated, self.ban_width)
        for name, pad_value in (
            ("temperature", 1.0),
            ("greedy", True),
            ("top_k", 0),
            ("top_p", 1.0),
            ("min_p", 0.0),
            ("min_tokens_left", 0),
            ("seeds", 0),
        ):
            h[name][:n] = getattr(values, name)
            h[name][n:] = pad_value
        ban = h["ban_ids"].reshape(size, self.ban_width)
        ban[:n] = values.ban_ids
        ban[n:] = -1
