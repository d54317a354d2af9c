"""Decode steps from static buffers: CUDA-graph capture and replay, or the same path eagerly.

A decode step (one new token per request, every request sampled) is padded to a batch-size
bucket (``1, 2, 4`` then multiples of 8) and run from buffers that never move: token ids,
positions, KV slots, the attention metadata (FlashInfer layout: ``kv_indptr`` /
``kv_page_indices`` (sized for every request at full context) / ``kv_last_page_len``; its host
fields are fixed per bucket, ``max_kv_len`` at the table's context capacity), the sampling
parameters and the RNG counters (seeds, absolute positions). Padding rows use the dummy table
row 0: their token sits at slot 0 of the dummy page 0 with a KV length of 1, so they write and
read nothing else.

On CUDA every bucket is captured, largest first, into one shared memory pool, and a step is a
few host->device copies plus one ``graph.replay()``. Warm-up and capture run inside
``graph_safe_backends()``, so attention uses the Triton kernel (which reads lengths from the
buffers on the device) rather than FlashInfer (whose planning reads them on the host). Elsewhere (or with ``use_cuda_graph=False``)
the very same buffers, padding and buckets run eagerly, which is how CPU tests cover everything
but the capture itself. Rows whose sampling needs per-step shapes (penalties, logit bias,
allowed-token lists, more stop ids than ``max_stop_token_ids``) make :meth:`run` return
``None``: the caller then takes its eager path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from treeserve.kvcache import AttentionMetadata, KVPool, ReqToTokenTable
from treeserve.kvcache._backend import graph_safe_backends
from treeserve.sampling import MAX_LOGPROBS, SampleOutput, SamplingBatch, SamplingParams, sample
from treeserve.scheduler import Request, SampledToken, ScheduledBatch

if TYPE_CHECKING:
    from treeserve.runner import CausalLM

__all__ = ["DecodeGraphRunner", "decode_buckets", "requests_sampling_batch", "to_sampled_tokens"]


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """Padded batch sizes for decode: ``1, 2, 4, 8, 16, ...``, ending at the first ``>= max_batch``.

    ``max_batch`` must be an int >= 1 (``ValueError`` otherwise).
    """
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    candidates = [1, 2, 4, *range(8, -(-max_batch // 8) * 8 + 1, 8)]
    below = [b for b in candidates if b < max_batch]
    return (*below, next(b for b in candidates if b >= max_batch))


def requests_sampling_batch(
    reqs: Sequence[Request], vocab_size: int, device: torch.device | str, eos_token_ids: Sequence[int]
) -> SamplingBatch:
    """The sampling rows of ``reqs`` for this step: their params, seeds, histories and counts."""
    return SamplingBatch.build(
        [r.params for r in reqs],
        [r.seed for r in reqs],
        [r.all_ids for r in reqs],
        vocab_size,
        device,
        eos_token_ids=eos_token_ids,
        num_generated=[len(r.output_ids) for r in reqs],
    )


def to_sampled_tokens(out: SampleOutput, num_logprobs: Sequence[int | None]) -> list[SampledToken]:
    """Host view of ``out``'s first ``len(num_logprobs)`` rows; row ``j`` keeps ``num_logprobs[j]`` top entries.

    This is the step's one device->host sync.
    """
    n = len(num_logprobs)
    tokens = out.tokens[:n].tolist()
    logprobs = out.logprobs[:n].tolist()
    want_top = any(num_logprobs)
    top_ids = out.top_ids[:n].tolist() if want_top else None
    top_lps = out.top_logprobs[:n].tolist() if want_top else None
    result = []
    for j in range(n):
        k = num_logprobs[j] or 0
        top = dict(zip(top_ids[j][:k], top_lps[j][:k])) if k and top_ids is not None else None
        result.append(SampledToken(tokens[j], logprobs[j], top))
    return result


@dataclass(slots=True)
class _Graph:
    """One captured bucket: the CUDA graph and the output tensors it refreshes on replay."""

    graph: torch.cuda.CUDAGraph
    output: SampleOutput


class DecodeGraphRunner:
    """Runs decode-only batches of at most ``max_batch`` requests from static, bucket-padded buffers.

    ``forward`` is the model call (the model itself, or ``treeserve.compile.compile_model(model)``).
    ``use_cuda_graph``: ``None`` = capture when ``device``
    is CUDA; ``True`` on a non-CUDA device raises ``ValueError``. Call :meth:`capture` once
    after the KV pool exists (a no-op in eager mode); :meth:`run` then serves steps. Sampling
    gives the same tokens as the eager runner for the same logits: the RNG is keyed by
    (seed, absolute position), both held in buffers. ``max_logprobs`` bounds the top logprobs a
    request may ask for here; ``max_stop_token_ids`` bounds its stop ids (beyond EOS).
    ``num_steps`` counts the steps served, ``capture_seconds`` the time :meth:`capture` took.
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
    ) -> None:
        self.buckets = decode_buckets(max_batch)
        self.device = kv.k_caches[0].device  # concrete ("cuda:0" where ``device`` may say "cuda")
        given = torch.device(device)
        same = given.type == self.device.type and given.index in (None, self.device.index)
        if not same or table.table.device != self.device:
            raise ValueError(f"device ({given}), kv ({self.device}) and table ({table.table.device}) must agree")
        if use_cuda_graph is None:
            use_cuda_graph = self.device.type == "cuda"
        if use_cuda_graph and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graph=True needs a CUDA device, got device={self.device}")
        for name, value in (("max_logprobs", max_logprobs), ("max_stop_token_ids", max_stop_token_ids)):
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
        self.kv_capacity = -(-table.max_context_len // self.page_size) * self.page_size
        self.graphs: dict[int, _Graph] = {}
        self.capture_seconds = 0.0
        self.num_steps = 0
        self._alloc_buffers()

    # ------------------------------------------------------------------ buffers
    def _alloc_buffers(self) -> None:
        bmax, dev = self.buckets[-1], self.device
        pages_per_req = self.kv_capacity // self.page_size

        def z(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=dev)

        i32, f64 = torch.int32, torch.float64
        self.input_ids, self.positions, self.out_slots = z(bmax), z(bmax), z(bmax)
        self.logits_indices = torch.arange(bmax, device=dev)
        self.qo_indptr = torch.arange(bmax + 1, dtype=i32, device=dev)
        self.kv_indptr = z(bmax + 1, dtype=i32)
        self.kv_page_indices = z(bmax * pages_per_req, dtype=i32)
        self.kv_last_page_len = z(bmax, dtype=i32)
        # Sampling parameters and RNG counters (pad rows: greedy, no filter, seed 0).
        self.temperature = z(bmax, dtype=f64)
        self.greedy = z(bmax, dtype=torch.bool)
        self.top_k, self.top_p, self.min_p = z(bmax), z(bmax, dtype=f64), z(bmax, dtype=f64)
        self.ban_ids = z(bmax, self.ban_width)
        self.min_tokens_left, self.seeds, self.gen_positions = z(bmax), z(bmax), z(bmax)
        self._ones, self._zeros = torch.ones(bmax, dtype=f64, device=dev), z(bmax, dtype=f64)

    def _meta(self, size: int) -> AttentionMetadata:
        """Fresh metadata over the buffers of bucket ``size`` (fresh: backends memoize in it)."""
        return AttentionMetadata(
            qo_indptr=self.qo_indptr[: size + 1],
            kv_indptr=self.kv_indptr[: size + 1],
            kv_page_indices=self.kv_page_indices[: size * (self.kv_capacity // self.page_size)],
            kv_last_page_len=self.kv_last_page_len[:size],
            page_size=self.page_size,
            max_qo_len=1,
            max_kv_len=self.kv_capacity,
            num_qo_tokens=size,
        )

    def _sampling_batch(self, size: int, flags: SamplingBatch) -> SamplingBatch:
        """The sampling view of bucket ``size``: per-row values from the buffers, host-side flags
        (which stages run, candidate widths) from ``flags``, widths fixed by the buffers."""
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return replace(
            flags,
            temperature=self.temperature[:size],
            greedy=self.greedy[:size],
            top_k=self.top_k[:size],
            top_p=self.top_p[:size],
            min_p=self.min_p[:size],
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
            ban_ids=self.ban_ids[:size],
            min_tokens_left=self.min_tokens_left[:size],
            seeds=self.seeds[:size],
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
        """Capture one CUDA graph per bucket, largest first, into one memory pool (no-op when eager).

        Each bucket is run once before its capture (Triton/compile warm-up) with every row a
        padding row. ``capture_seconds`` records the total time.
        """
        if not self.use_cuda_graph or self.graphs:
            return
        t0 = time.perf_counter()
        pool = None
        flags = self._capture_flags()
        with graph_safe_backends():
            for size in reversed(self.buckets):
                self._load_padding(size)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._compute(size, self._meta(size), self._sampling_batch(size, flags))
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._compute(size, self._meta(size), self._sampling_batch(size, flags))
                pool = graph.pool()
                self.graphs[size] = _Graph(graph, out)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[SampledToken] | None:
        """Run a decode-only ``batch`` and return one sampled token per item.

        Returns ``None`` (nothing computed, nothing written) when the batch is not a pure decode
        step of at most ``max_batch`` requests, or a row's sampling needs per-step shapes.
        """
        items = batch.items
        if not 1 <= len(items) <= self.max_batch or not all(it.num_tokens == 1 and it.sample for it in items):
            return None
        reqs = [it.req for it in items]
        sbatch = requests_sampling_batch(reqs, self.vocab_size, "cpu", self.eos_token_ids)
        if (
            sbatch.has_penalties
            or sbatch.allowed is not None
            or sbatch.bias_ids.shape[1]
            or sbatch.ban_ids.shape[1] > self.ban_width
            or sbatch.num_logprobs > self.num_logprobs
        ):
            return None
        size = self.bucket_for(len(items))
        self._load(
            [r.all_ids[it.start] for r, it in zip(reqs, items)],
            [it.start for it in items],
            [r.row for r in reqs],
            sbatch,
            size,
        )
        graph = self.graphs.get(size)
        if graph is not None:
            graph.graph.replay()
            out = graph.output
        else:
            out = self._compute(size, self._meta(size), self._sampling_batch(size, sbatch))
        self.num_steps += 1
        return to_sampled_tokens(out, [r.params.logprobs for r in reqs])

    # ------------------------------------------------------------------ internals
    def _compute(self, size: int, meta: AttentionMetadata, sbatch: SamplingBatch) -> SampleOutput:
        logits = self.forward(
            self.input_ids[:size],
            self.positions[:size],
            self.kv,
            self.out_slots[:size],
            meta,
            self.logits_indices[:size],
        )
        return sample(logits, sbatch, self.gen_positions[:size])

    def _load(
        self, ids: list[int], positions: list[int], rows: list[int], sbatch: SamplingBatch | None, size: int
    ) -> None:
        """Write one step into the buffers of bucket ``size``; rows past ``len(ids)`` become padding."""
        n, pad = len(ids), size - len(ids)
        ps = self.page_size
        long = torch.long
        rows_t = torch.tensor(rows + [0] * pad, dtype=long)
        pos_t = torch.tensor(positions + [0] * pad, dtype=long)
        kv_lens = pos_t + 1
        npages = torch.div(kv_lens + ps - 1, ps, rounding_mode="floor")
        starts = torch.cumsum(npages, 0) - npages
        page_no = torch.arange(int(npages.sum())) - starts.repeat_interleave(npages)
        width = self.table.max_context_len
        flat_slots = rows_t.repeat_interleave(npages) * width + page_no * ps  # first slot of each page
        dev = self.device
        table = self.table.table
        self.input_ids[:size].copy_(torch.tensor(ids + [0] * pad, dtype=long))
        self.positions[:size].copy_(pos_t)
        self.out_slots[:size].copy_(table[rows_t.to(dev), pos_t.to(dev)])
        self.kv_indptr[1 : size + 1].copy_(torch.cumsum(npages, 0))
        self.kv_page_indices[: page_no.numel()].copy_(table.view(-1)[flat_slots.to(dev)] // ps)
        self.kv_last_page_len[:size].copy_(kv_lens - (npages - 1) * ps)
        self.gen_positions[:size].copy_(pos_t + 1)
        self._load_sampling(sbatch, n, size)

    def _load_sampling(self, sbatch: SamplingBatch | None, n: int, size: int) -> None:
        pads = (
            (self.temperature, 1.0),
            (self.greedy, True),
            (self.top_k, 0),
            (self.top_p, 1.0),
            (self.min_p, 0.0),
            (self.ban_ids, -1),
            (self.min_tokens_left, 0),
            (self.seeds, 0),
        )
        for buf, pad_value in pads:
            buf[n:size].fill_(pad_value)
        if sbatch is None:
            return
        for name in ("temperature", "greedy", "top_k", "top_p", "min_p", "min_tokens_left", "seeds"):
            getattr(self, name)[:n].copy_(getattr(sbatch, name))
        self.ban_ids[:n, : sbatch.ban_ids.shape[1]].copy_(sbatch.ban_ids)
        self.ban_ids[:n, sbatch.ban_ids.shape[1] :].fill_(-1)

    def _load_padding(self, size: int) -> None:
        """Every row of bucket ``size`` a padding row (what capture runs on)."""
        self._load([], [], [], None, size)
