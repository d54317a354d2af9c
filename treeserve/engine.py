"""The ``LLM`` API: ``generate``, ``stream`` and ``chat`` over the continuous-batching engine.

``LLM`` wires a model, the KV pool, the radix prefix cache, the scheduler and the runner
together and drives the step loop. A request with bad input (empty prompt, prompt longer than
the context, token ids outside the vocabulary, invalid sampling parameters, more samples than
the pool can ever hold) comes back with ``error`` set and no outputs; every other request in the
same call completes normally.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from treeserve._utils import log_once
from treeserve.compile import compile_model
from treeserve.graph_runner import DecodeGraphRunner
from treeserve.kvcache import KVPool, RadixCache, ReqToTokenTable
from treeserve.runner import CausalLM, ModelRunner
from treeserve.sampling import SamplingParams
from treeserve.scheduler import (
    DraftModelDrafter,
    Drafter,
    FinishReason,
    NgramDrafter,
    Request,
    Scheduler,
    SchedulerConfig,
    StopChecker,
)

Prompt = str | Sequence[int]


@dataclass(slots=True)
class EngineConfig:
    """Engine-wide settings (validated; every field named in errors).

    ``kv_cache_tokens``: KV pool capacity in tokens (rounded up to whole pages).
    ``max_model_len``: prompt + output cap per request; ``None`` = the model's, at most 4096.
    ``seed``: seeds the per-request seeds of unseeded requests (``None`` = fresh each run).
    ``cuda_graph``: serve decode steps from static, bucket-padded buffers captured as CUDA graphs
    (``None`` = on when ``device`` is CUDA; ``True`` on CPU runs the same static path eagerly).
    ``cuda_graph_max_batch``: the largest decode batch served that way.
    ``compile``: ``torch.compile`` the model forward of those decode steps.
    ``speculative``: ``"ngram"`` (prompt lookup over the request's own tokens),
    ``"draft:<model>"`` (a smaller model sharing the tokenizer, loaded like ``model``; or
    ``"draft:self:<N>"``, the target's first N layers: self-speculation) or ``None``;
    ``num_speculative_tokens`` draft nodes per step at most; ``speculative_tree_width``: 1 for
    chain drafts, more for token trees (that many alternative continuations); ``ngram_min`` /
    ``ngram_max``: the n-gram sizes the prompt lookup tries (longest first).
    """

    dtype: str = "float32"
    device: str = "cpu"
    page_size: int = 1
    kv_cache_tokens: int = 32768
    max_batched_tokens: int = 512
    max_running: int = 64
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    num_threads: int | None = None
    seed: int | None = None
    cuda_graph: bool | None = None
    cuda_graph_max_batch: int = 256
    compile: bool = False
    speculative: str | None = None
    num_speculative_tokens: int = 4
    speculative_tree_width: int = 1
    ngram_min: int = 2
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        for name in ("page_size", "kv_cache_tokens", "max_batched_tokens", "max_running", "cuda_graph_max_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        spec = self.speculative
        if not (spec is None or spec == "ngram" or (isinstance(spec, str) and spec.startswith("draft:") and spec[6:])):
            raise ValueError(f"speculative must be None, 'ngram' or 'draft:<model>', got {spec!r}")
        for name in ("num_speculative_tokens", "speculative_tree_width", "ngram_min", "ngram_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 or None, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {self.num_threads}")
        if self.cuda_graph not in (None, True, False) or not isinstance(self.compile, bool):
            raise TypeError(f"cuda_graph must be a bool or None and compile a bool, got {self.cuda_graph!r}, {self.compile!r}")


@dataclass(slots=True)
class CompletionOutput:
    """One generated sample of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str
    stop_reason: int | str | None


@dataclass(slots=True)
class RequestOutput:
    """Result of one prompt: its ``n`` samples.

    ``error`` is set when the request was rejected (bad input: ``outputs`` is empty) or failed
    while running (invalid logits: ``outputs`` hold what was generated, finish reason "error").
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None
    metrics: dict[str, float | int | None] = field(default_factory=dict)


@dataclass(slots=True)
class EngineMetrics:
    """Counters since the engine was created (``LLM.metrics``)."""

    num_requests: int = 0
    num_errors: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    busy_seconds: float = 0.0
    preemptions: int = 0
    ttft_sum: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: int = 0
    kv_usage: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0

    @property
    def throughput(self) -> float:
        """Generated tokens per second of engine busy time."""
        return self.generated_tokens / self.busy_seconds if self.busy_seconds else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of prompt tokens whose KV came from the radix cache."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_ttft(self) -> float:
        done = self.num_requests - self.num_errors
        return self.ttft_sum / done if done else 0.0

    @property
    def mean_tpot(self) -> float:
        return self.tpot_sum / self.tpot_count if self.tpot_count else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the bonus token)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("throughput", "prefix_cache_hit_rate", "mean_ttft", "mean_tpot", "acceptance_rate",
                     "mean_accepted_length"):
            d[name] = getattr(self, name)
        return d


class LLM:
    """An offline inference engine: ``LLM(model="smollm2-135m-instruct", **config)``.

    ``model`` is a name or path understood by :func:`treeserve.models.load`, or a
    ``(model, tokenizer)`` pair (tokenizer may be ``None``: then prompts must be token ids and
    stop strings are unavailable; the KV pool takes the given model's dtype, ``dtype`` is then
    ignored). Keyword arguments are :class:`EngineConfig` fields.
    """

    def __init__(self, model: str | tuple[CausalLM, Any] = "smollm2-135m-instruct", **config: Any) -> None:
        self.config = EngineConfig(**config)
        cfg = self.config
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        dtype = getattr(torch, cfg.dtype)
        if isinstance(model, str):
            from treeserve.models import load

            self.model, self.tokenizer = load(model, dtype=dtype, device=cfg.device)
        else:
            self.model, self.tokenizer = model
            dtype = next(self.model.parameters()).dtype  # the KV pool follows the given model
        mc = self.model.config
        self.vocab_size = mc.vocab_size
        max_len = cfg.max_model_len or min(mc.max_position_embeddings, 4096)
        ps = cfg.page_size
        num_pages = -(-cfg.kv_cache_tokens // ps) + 1  # + the dummy page
        self.kv = KVPool(mc.num_layers, num_pages, ps, mc.num_kv_heads, mc.head_dim, dtype, cfg.device)
        self.radix = RadixCache(self.kv.allocator, ps, disable=not cfg.enable_prefix_cache)
        self.table = ReqToTokenTable(cfg.max_running, -(-max_len // ps) * ps, device=cfg.device)
        eos = list(getattr(self.tokenizer, "eos_token_ids", None) or mc.eos_token_ids or [])
        detok = None if self.tokenizer is None else self._detokenize
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_batched_tokens=cfg.max_batched_tokens,
                max_running=cfg.max_running,
                max_model_len=max_len,
                num_speculative_tokens=cfg.num_speculative_tokens if cfg.speculative else 0,
            ),
            self.kv.allocator,
            self.radix,
            self.table,
            StopChecker(eos, detok),
            drafter=self._make_drafter(max_len),
        )
        decode_graph = None
        use_graph = cfg.cuda_graph if cfg.cuda_graph is not None else torch.device(cfg.device).type == "cuda"
        if use_graph or cfg.compile:
            forward = compile_model(self.model) if cfg.compile else self.model
            decode_graph = DecodeGraphRunner(
                forward, self.kv, self.table, self.vocab_size, eos, cfg.device,
                max_batch=min(cfg.cuda_graph_max_batch, cfg.max_running),
                use_cuda_graph=use_graph and torch.device(cfg.device).type == "cuda",
                max_draft_nodes=cfg.num_speculative_tokens if cfg.speculative else 0,
            )  # fmt: skip
            decode_graph.capture()
        self.runner = ModelRunner(self.model, self.kv, self.table, self.vocab_size, eos, cfg.device, decode_graph)
        self.metrics = EngineMetrics()
        self._seed_gen = torch.Generator()
        self._seed_gen.manual_seed(cfg.seed if cfg.seed is not None else torch.seed())
        log_once(f"treeserve engine: dtype={cfg.dtype} page_size={ps} kv_tokens={cfg.kv_cache_tokens}")

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | dict[str, Any] | Sequence[SamplingParams | dict[str, Any]] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); results in prompt order.

        ``sampling_params`` is one for all prompts or one per prompt (a dict is validated per
        request, so a bad one fails only its own request).
        """
        plist = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(plist))
        entries = [self._submit(p, sp) for p, sp in zip(plist, params)]
        total = sum(len(reqs) for _, reqs in entries)
        bar = None
        if use_tqdm and total:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
        while self.scheduler.has_work():
            finished = self._step()
            if bar is not None and finished:
                bar.update(len(finished))
        if bar is not None:
            bar.close()
        return [self._output(out, reqs) for out, reqs in entries]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | dict[str, Any] | None = None
    ) -> Iterator[str]:
        """Yield the text of one request as it is generated (complete UTF-8 pieces only).

        Raises ``ValueError`` up front for bad input. Requests already queued keep running.
        """
        params = self._as_params_list(sampling_params, 1)[0]
        out, reqs = self._submit(prompt, params)
        if out.error is not None:
            raise ValueError(out.error)
        if len(reqs) != 1:
            raise ValueError(f"stream supports n=1, got n={len(reqs)}")
        req = reqs[0]
        emitted = ""
        while not req.is_finished:
            self._step()
            text = self._current_text(req)
            if req.is_finished or not text.endswith("\ufffd"):
                if len(text) > len(emitted) and text.startswith(emitted):
                    yield text[len(emitted) :]
                    emitted = text
        self._output(out, reqs)

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this engine was built without one")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------ internals
    def _make_drafter(self, max_len: int) -> Drafter | None:
        cfg = self.config
        if cfg.speculative is None:
            return None
        if cfg.speculative == "ngram":
            return NgramDrafter(cfg.ngram_max, cfg.ngram_min, cfg.speculative_tree_width)
        from treeserve.models import load, truncated_copy

        name = cfg.speculative[len("draft:") :]
        if name.startswith("self:"):
            draft = truncated_copy(self.model, int(name[len("self:") :]))
        else:
            draft, _ = load(name, dtype=self.kv.dtype, device=cfg.device)
        dc = draft.config
        if dc.vocab_size != self.vocab_size:
            raise ValueError(f"draft model vocab {dc.vocab_size} differs from the target's {self.vocab_size}")
        dtype = next(draft.parameters()).dtype
        pool = KVPool(dc.num_layers, cfg.kv_cache_tokens + 1, 1, dc.num_kv_heads, dc.head_dim, dtype, cfg.device)
        return DraftModelDrafter(draft, pool, cfg.max_running, max_len, cfg.speculative_tree_width)

    def _step(self) -> list[Request]:
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.items:
            raise RuntimeError("scheduler has work but scheduled nothing (KV pool too small?)")
        sampled = self.runner.run(batch)
        finished = self.scheduler.update(batch, sampled)
        now = time.perf_counter()
        m = self.metrics
        m.steps += 1
        m.busy_seconds += now - t0
        for item, s in zip(batch.items, sampled):
            if s is not None:
                m.generated_tokens += 1 + len(s.accepted)
                if item.req.metrics.first_token is None:
                    item.req.metrics.first_token = now
        for req in finished:
            self._account_finished(req)
        m.preemptions = self.scheduler.num_preemptions
        spec = self.scheduler.spec
        m.draft_tokens, m.accepted_tokens, m.verify_steps = spec.proposed, spec.accepted, spec.steps
        alloc = self.kv.allocator
        m.kv_usage = 1.0 - alloc.num_free / alloc.capacity
        return finished

    def _account_finished(self, req: Request) -> None:
        m = self.metrics
        rm = req.metrics
        if rm.ttft is not None:
            m.ttft_sum += rm.ttft
        tpot = rm.tpot(len(req.output_ids))
        if tpot is not None:
            m.tpot_sum += tpot
            m.tpot_count += 1

    def _submit(self, prompt: Prompt, params: SamplingParams | Exception) -> tuple[RequestOutput, list[Request]]:
        text = prompt if isinstance(prompt, str) else None
        out = RequestOutput(request_id=self.metrics.num_requests, prompt=text, prompt_token_ids=[])
        self.metrics.num_requests += 1
        try:
            if isinstance(params, Exception):
                raise params
            ids = self._encode(prompt)
            out.prompt_token_ids = ids
            if params.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this engine was built without one")
            seed = params.seed if params.seed is not None else self._fresh_seed()
            reqs = self.scheduler.new_request(ids, params, seed, self.vocab_size)
        except (ValueError, TypeError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
            self.metrics.num_errors += 1
            return out, []
        self.metrics.prompt_tokens += len(ids)
        return out, reqs

    def _output(self, out: RequestOutput, reqs: list[Request]) -> RequestOutput:
        if out.error is not None or out.outputs:
            return out
        for req in reqs:
            out.outputs.append(
                CompletionOutput(
                    index=req.sample_index,
                    text=self._current_text(req),
                    token_ids=list(req.output_ids),
                    logprobs=list(req.output_logprobs),
                    top_logprobs=list(req.output_top_logprobs),
                    finish_reason=req.finish_reason.value if req.finish_reason else "",
                    stop_reason=req.stop_reason,
                )
            )
        errors = [r.error for r in reqs if r.error]
        if errors:
            out.error = errors[0]
        lead = reqs[0].metrics
        out.metrics = {
            "ttft": lead.ttft,
            "tpot": lead.tpot(len(reqs[0].output_ids)),
            "cached_prompt_tokens": lead.cached_prompt_tokens,
            "num_preemptions": sum(r.metrics.num_preemptions for r in reqs),
        }
        self.metrics.cached_prompt_tokens += lead.cached_prompt_tokens
        return out

    def _current_text(self, req: Request) -> str:
        if self.tokenizer is None:
            return ""
        if req.finish_reason is FinishReason.STOP and isinstance(req.stop_reason, str):
            return req.text  # already trimmed at the stop string
        return self._detokenize(req.output_ids)

    def _detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) or (isinstance(t, torch.Tensor) and t.ndim == 0) for t in prompt):
            raise TypeError("a token-id prompt must be a sequence of ints")
        return [int(t) for t in prompt]

    def _fresh_seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))

    @staticmethod
    def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if len(prompts) and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one token-id prompt
        return list(prompts)

    @staticmethod
    def _as_params_list(
        sp: SamplingParams | dict[str, Any] | Sequence[SamplingParams | dict[str, Any]] | None, n: int
    ) -> list[SamplingParams | Exception]:
        if sp is None or isinstance(sp, (SamplingParams, dict)):
            sp = [sp] * n
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        out: list[SamplingParams | Exception] = []
        for p in sp:
            if p is None:
                out.append(SamplingParams())
            elif isinstance(p, SamplingParams):
                out.append(p)
            else:
                try:
                    out.append(SamplingParams(**p))
                except (ValueError, TypeError) as exc:
                    out.append(exc)
        return out
