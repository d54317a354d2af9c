"""The ``LLM`` API: a step API (``add_request`` / ``step`` / ``abort_request``) and the
``generate``, ``stream`` and ``chat`` front ends, all over one continuous-batching engine.

``LLM`` wires a model, the KV pool, the radix prefix cache, the scheduler and the runner
together and drives the step loop. A request with bad input (empty prompt, prompt longer than
the context, token ids outside the vocabulary, invalid sampling parameters, more samples than
the pool can ever hold) is refused before anything is queued: ``add_request`` and ``stream``
raise, ``generate`` returns it with ``error`` set and no outputs while every other request of
the same call completes normally.

Threads: one lock serializes engine steps, submissions and aborts; every front end collects only
its own requests' outputs, so several threads may share one ``LLM`` (each call still waits for
the steps others run). For concurrent serving use the server's async engine, which drives the
step API from one thread.
"""

from __future__ import annotations

import numbers
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from treeserve._cpp import load_all_cpp_ops
from treeserve._cpu import auto_dtype, cpu_features, release_free_memory
from treeserve._utils import log_once
from treeserve.kvcache import (
    DiskStore,
    KVPool,
    KVTiers,
    RadixCache,
    ReqToTokenTable,
    TierLayout,
    TierStats,
    default_chunk_tokens,
    module_fingerprint,
)
from treeserve.models.invariant import make_batch_invariant
from treeserve.models.quant import check_quantization, prepare_large_weights
from treeserve.output import SampleDelta, TrackedRequest
from treeserve.runner import (
    CALIBRATION_TEXT,
    MAX_ROW_COST,
    MAX_TABLE_ROWS,
    ROW_COST_CONTEXT,
    CausalLM,
    DecodeGraphRunner,
    DecodeLaunch,
    DraftModelDrafter,
    Drafter,
    ModelRunner,
    NgramDrafter,
    compile_model,
    draft_pool_tokens,
    fill_drafts,
    measure_draft_cost,
    measure_step_costs,
    row_cost_of,
    self_draft_layers,
)
from treeserve.sampling import GrammarCompiler, SamplingParams
from treeserve.scheduler import (
    FinishReason,
    Request,
    RequestState,
    SampledToken,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    StopChecker,
    TextState,
)

Prompt = str | Sequence[int]

_TEXT_CONTEXT = 4
"""Prompt tokens an output's text is decoded after (``StreamDecoder(context=...)``): the output's first
token keeps the space a SentencePiece piece starts with, as vLLM and llama.cpp return it."""

CPU_SPECULATIVE_MAX_BATCH = 8
"""On CPU, steps with more decoding requests than this draft nothing: a batch is compute-bound
there, and scoring rejected draft nodes costs about what the steps accepted ones save (issue 6
measured 1.03x at batch 16 on the 2-core EPYC; ``benches/bench_speculative.py`` measures the
crossover, not yet re-measured with verify steps on the fused path: ``benches/RESULTS.md``)."""


def row_cost_rows(num_speculative_tokens: int) -> int:
    """The rows up to which ``LLM`` measures the step-cost table: the most a lone request's verify
    step reaches, ``1 + num_speculative_tokens`` (its draft rows on the plain row's path, as the
    runner computes them: ``quant.plain_rows``), at least 2 and at most ``MAX_TABLE_ROWS``."""
    return max(2, min(1 + num_speculative_tokens, MAX_TABLE_ROWS))


@dataclass(slots=True)
class EngineConfig:
    """Engine-wide settings (validated; every field named in errors).

    ``dtype``: ``"auto"`` (``treeserve._cpu.auto_dtype``: bfloat16 on CUDA and on CPUs with
    AMX, float32 activations over quantized weights otherwise), ``"float32"`` or ``"bfloat16"``. ``quantization``:
    ``"auto"`` keeps a GGUF's Q4_0/Q4_1/Q8_0 codes packed for decode steps plus the exact bf16
    head (CPU; not with an explicit ``dtype="float32"``, the parity configuration), ``"int4"`` /
    ``"int8"`` also quantize float checkpoints, None keeps dense weights
    (``treeserve.models.quant``).
    ``kv_cache_dtype``: ``"auto"`` (the model's dtype, except a 16-bit cache under the default
    float32 CPU configuration: bfloat16 on CPUs with AVX-512 BF16, float16 on other AVX2 CPUs,
    :meth:`kv_dtype`), ``"float32"``, ``"bfloat16"`` or ``"float16"`` (K/V stored rounded to
    that type and attended with q rounded to it: half the KV memory; float16 keeps 3 more
    mantissa bits than bfloat16 and overflows past 65504).

    ``kv_cache_tokens``: KV pool capacity in tokens (rounded up to whole pages).
    ``max_model_len``: prompt + output cap per request; ``None`` = the model's, at most 4096.
    ``seed``: seeds the per-request seeds of unseeded requests (``None`` = fresh each run).
    ``cuda_graph``: serve decode steps from static, bucket-padded buffers captured as CUDA graphs
    (``None`` = on when ``device`` is CUDA; ``True`` on CPU runs the same static path eagerly).
    ``cuda_graph_max_batch``: the largest decode batch served that way.
    ``overlap``: with those static decode steps, launch the next decode step before reading
    the tokens of the one running, so the host's scheduling and input staging overlap the
    device's step (tokens are committed one step late; ``None`` = on with CUDA graphs,
    ``True`` on CPU with ``cuda_graph=True`` runs the same loop synchronously, which is how CI
    tests it; :meth:`LLM._step`).
    ``compile``: ``torch.compile`` the model forward of those decode steps.
    ``speculative``: ``"ngram"`` (prompt lookup over the request's own tokens),
    ``"draft:<model>"`` (a smaller model sharing the tokenizer, loaded like ``model``; or
    ``"draft:self:<N>"``: self-speculation, N of the target's layers, those that change its hidden
    state most over a calibration text, ``runner.self_draft``) or ``None``;
    ``num_speculative_tokens`` draft nodes per step at most; ``speculative_tree_width``: 1 for
    chain drafts, more for token trees (that many alternative continuations); ``ngram_min`` /
    ``ngram_max``: the n-gram sizes the prompt lookup tries (longest first); ``ngram_edits``: where
    none matches, align the tail with an earlier occurrence up to one inserted, replaced or dropped
    token (a rewrite's edits; :class:`~treeserve.runner.NgramDrafter`);
    ``speculative_max_batch``: steps with more decoding requests than this draft nothing (0 = no
    limit; None = the measured rule: :data:`CPU_SPECULATIVE_MAX_BATCH` for a model loaded by name
    on CPU, which is what it was measured on; no limit on CUDA or for a given module).
    ``speculative_row_cost`` / ``speculative_draft_cost``: what one more query row / one draft
    node's drafter forward costs relative to a step's fixed part, the goodput rule's inputs
    (``scheduler.draft_plan``); None = measured once per machine and model for a model loaded by
    name on CPU (the draft cost only for a drafter that runs a model; the row cost as a table of a
    verify step's cost per row count, ``runner.measure_step_costs``, and a given row cost as the
    line it stands for), else 0 (both 0: every asking request drafts its whole room).
    ``jump_forward_tokens``: a structured-output request whose grammar forces its next tokens
    (``{"name": "`` in a schema) proposes up to this many of them as a draft each step, verified
    like any draft (a forced token is accepted with probability 1, so the output law is
    unchanged) whether or not ``speculative`` is set: one forward pass for the whole run
    instead of one per token (0 = off; ``GrammarState.jump_forward``).
    ``batch_invariant``: every request's tokens and logprobs are bitwise the same whatever else
    runs in its batch, in any dtype: projections on fixed row tiles, attention one request at a
    time, the plain float32 LM head (``treeserve.models.invariant``); costs speed (see
    benches/RESULTS.md), not available with ``cuda_graph`` or ``compile``.
    ``tensor_parallel_size``: ranks the model is split over (``treeserve.distributed``: worker
    processes, one CUDA device each from ``device`` on; dense weights, eager path only);
    ``distributed_timeout_s`` bounds every collective, so a dead or hung worker fails the step
    with a ``RuntimeError`` instead of hanging it.
    ``kv_host_tokens``: capacity in tokens of the host-memory KV tier under the pool (evicted
    prefixes are demoted there and promoted back on a hit; ``None`` = off on CPU, where the pool
    already is host memory, and the pool's size on CUDA, pinned); ``kv_disk_dir``: a directory for
    the disk tier (content-addressed chunk files that outlive the process; ``None`` = off), at
    most ``kv_disk_bytes`` bytes of them (``treeserve.kvcache.tiers``).
    """

    dtype: str = "auto"
    quantization: str | None = "auto"
    kv_cache_dtype: str = "auto"
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
    overlap: bool | None = None
    compile: bool = False
    speculative: str | None = "auto"
    num_speculative_tokens: int = 4
    speculative_tree_width: int = 1
    ngram_min: int = 2
    ngram_max: int = 4
    ngram_edits: bool = True
    speculative_max_batch: int | None = None
    speculative_row_cost: float | None = None
    speculative_draft_cost: float | None = None
    jump_forward_tokens: int = 16
    batch_invariant: bool = False
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 60.0
    kv_host_tokens: int | None = None
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 16 << 30

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError("kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or 'float16', "
                             f"got {self.kv_cache_dtype!r}")
        check_quantization(self.quantization)
        self._check_device()
        for name in ("page_size", "kv_cache_tokens", "max_batched_tokens", "max_running", "cuda_graph_max_batch"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("enable_prefix_cache", "ngram_edits"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("max_model_len", "num_threads", "seed"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise TypeError(f"{name} must be an int or None, got {value!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be None or in [0, 2**63 - 1], got {self.seed}")
        spec = self.speculative
        if not (spec in (None, "auto", "ngram") or (isinstance(spec, str) and spec.startswith("draft:") and spec[6:])):
            raise ValueError(f"speculative must be None, 'auto', 'ngram' or 'draft:<model>', got {spec!r}")
        for name in ("num_speculative_tokens", "speculative_tree_width", "ngram_min", "ngram_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        jft = self.jump_forward_tokens
        if isinstance(jft, bool) or not isinstance(jft, int) or jft < 0:
            raise ValueError(f"jump_forward_tokens must be an int >= 0 (0 = off), got {jft!r}")
        smb = self.speculative_max_batch
        if smb is not None and (isinstance(smb, bool) or not isinstance(smb, int) or smb < 0):
            raise ValueError(f"speculative_max_batch must be None or an int >= 0, got {smb!r}")
        for name in ("speculative_row_cost", "speculative_draft_cost"):
            cost = getattr(self, name)
            if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float))
                                     or not 0 <= cost < float("inf")):
                raise ValueError(f"{name} must be None or a finite number >= 0, got {cost!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 or None, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {self.num_threads}")
        if self.cuda_graph not in (None, True, False) or not isinstance(self.compile, bool):
            raise TypeError(f"cuda_graph must be a bool or None and compile a bool, got {self.cuda_graph!r}, {self.compile!r}")
        if self.overlap not in (None, True, False):
            raise TypeError(f"overlap must be a bool or None, got {self.overlap!r}")
        if not isinstance(self.batch_invariant, bool):
            raise TypeError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        if self.batch_invariant and (self.cuda_graph or self.compile):
            raise ValueError("batch_invariant=True runs the eager path: it needs cuda_graph=False/None and compile=False")
        self._check_parallel()
        self._check_tiers()

    def host_tokens(self) -> int:
        """The host tier's capacity: ``kv_host_tokens``, or its default for ``device``."""
        if self.kv_host_tokens is not None:
            return self.kv_host_tokens
        return self.kv_cache_tokens if torch.device(self.device).type == "cuda" else 0

    def _check_tiers(self) -> None:
        if self.kv_host_tokens is not None and (not _is_int(self.kv_host_tokens) or self.kv_host_tokens < 0):
            raise ValueError(f"kv_host_tokens must be None or an int >= 0, got {self.kv_host_tokens!r}")
        if not _is_int(self.kv_disk_bytes) or self.kv_disk_bytes < 0:
            raise ValueError(f"kv_disk_bytes must be an int >= 0, got {self.kv_disk_bytes!r}")
        if self.kv_disk_dir is not None:
            DiskStore.check_directory(self.kv_disk_dir)
        if self.kv_host_tokens or self.kv_disk_dir is not None:
            if not self.enable_prefix_cache:
                raise ValueError("kv_host_tokens / kv_disk_dir need enable_prefix_cache=True (they hold its evictions)")
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_host_tokens / kv_disk_dir are not supported with tensor_parallel_size > 1")

    def resolved_speculative(self, loaded: bool) -> str | None:
        """``speculative`` with ``"auto"`` resolved (``loaded``: the model was loaded by name, not
        given as a module): n-gram drafting, its lengths set per step by the goodput rule over
        the measured row cost (``treeserve.scheduler.draft_plan``), for a loaded model on CPU in
        one process, where it was measured (benches/RESULTS.md); None elsewhere (on CUDA the
        overlapped decode loop, which speculation turns off, is kept; a given module decodes
        plainly)."""
        if self.speculative != "auto":
            return self.speculative
        return "ngram" if self.measured_setting(loaded) and not self.batch_invariant else None

    def measured_setting(self, loaded: bool) -> bool:
        """A model loaded by name on CPU in one process: where speculation's row cost is measured
        (``LLM`` measures it there, ``"auto"`` drafts there)."""
        return loaded and torch.device(self.device).type == "cpu" and self.tensor_parallel_size == 1

    def draft_batch_limit(self, loaded: bool) -> int:
        """``speculative_max_batch`` resolved (``loaded``: the model was loaded by name, not given
        as a module): the given value, else the measured rule (:data:`CPU_SPECULATIVE_MAX_BATCH`
        for a loaded model on CPU, 0 = no limit otherwise)."""
        if self.speculative_max_batch is not None:
            return self.speculative_max_batch
        return CPU_SPECULATIVE_MAX_BATCH if loaded and torch.device(self.device).type == "cpu" else 0

    def kv_dtype(self, model_dtype: torch.dtype, loaded: bool) -> torch.dtype:
        """The KV pool's dtype for a model of ``model_dtype`` (``loaded``: loaded by name, not
        given as a module): ``kv_cache_dtype`` when given; for ``"auto"``, under the default
        float32 CPU configuration (``dtype`` and ``quantization`` "auto", one process), a 16-bit
        cache the decode attention operator reads at half the bytes (measured: benches/RESULTS.md):
        bfloat16 on CPUs with AVX-512 BF16, which score its rows with ``vdpbf16ps`` (float16
        measured up to 1.26x slower there at Llama-3-8B's shapes), float16 on other AVX2 CPUs,
        which widen both kinds alike (F16C) and where float16 measured as fast as bfloat16 with 8x
        less rounding; else the model's dtype (explicit ``dtype="float32"`` is the parity
        configuration: float32 KV)."""
        if self.kv_cache_dtype != "auto":
            return getattr(torch, self.kv_cache_dtype)
        default_cpu = (self.dtype == "auto" and self.quantization == "auto" and torch.device(self.device).type == "cpu"
                       and self.tensor_parallel_size == 1 and not self.batch_invariant)  # fmt: skip
        if not (loaded and default_cpu and model_dtype == torch.float32):
            return model_dtype
        features = cpu_features()
        if features.avx512_bf16:
            return torch.bfloat16
        return torch.float16 if features.avx2 else model_dtype

    def _check_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if not _is_int(tp) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        t = self.distributed_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e6:
            raise ValueError(f"distributed_timeout_s must be a number in (0, 1e6) seconds, got {t!r}")
        if tp == 1:
            return
        if self.compile or self.cuda_graph or self.batch_invariant:
            raise ValueError("tensor_parallel_size > 1 runs the eager path: compile, cuda_graph and batch_invariant must be off")
        if self.quantization not in (None, "auto"):
            raise ValueError(f"quantization must be None or 'auto' (dense shards) with tensor_parallel_size > 1, got {self.quantization!r}")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype must be 'auto' (the model's dtype on every rank) with tensor_parallel_size > 1, "
                             f"got {self.kv_cache_dtype!r}")
        if isinstance(self.speculative, str) and self.speculative.startswith("draft:self:"):
            raise ValueError("speculative='draft:self:N' is not supported with tensor_parallel_size > 1; use 'draft:<model>'")

    def _check_device(self) -> None:
        if not isinstance(self.device, str):
            raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0', got {self.device!r}")
        try:
            dev = torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"device {self.device!r} is not a device name: {exc}") from exc
        if dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if (dev.index or 0) >= count:
                raise ValueError(f"device {self.device!r} does not exist here ({count} CUDA devices)")
        elif dev.type != "cpu":
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
    jump_forward_proposed: int = 0
    jump_forward_tokens: int = 0
    kv_tiers: TierStats = field(default_factory=TierStats)  # the KV tiers' hits and bytes moved

    @property
    def throughput(self) -> float:
        """Generated tokens per second of engine busy time."""
        return self.generated_tokens / self.busy_seconds if self.busy_seconds else 0.0

    def _of_prompts(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of prompt tokens whose KV came from the radix cache."""
        return self._of_prompts(self.cached_prompt_tokens)

    @property
    def kv_host_hit_rate(self) -> float:
        """Fraction of prompt tokens whose KV was promoted from the host tier."""
        return self._of_prompts(self.kv_tiers.host_hit_tokens)

    @property
    def kv_disk_hit_rate(self) -> float:
        """Fraction of prompt tokens whose KV was promoted from the disk tier."""
        return self._of_prompts(self.kv_tiers.disk_hit_tokens)

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
                     "mean_accepted_length", "kv_host_hit_rate", "kv_disk_hit_rate"):
            d[name] = getattr(self, name)
        return d


class LLM:
    """An inference engine: ``LLM(model="smollm2-135m-instruct", **config)``.

    ``model`` is a name or path understood by :func:`treeserve.models.load`, or a
    ``(model, tokenizer)`` pair (tokenizer may be ``None``: then prompts must be token ids and
    stop strings are unavailable; the KV pool takes the given model's dtype, ``dtype`` is then
    ignored). Keyword arguments are :class:`EngineConfig` fields.

    Step API (what a server drives): ``add_request`` validates and queues, ``step`` runs one
    engine step and returns a :class:`SampleDelta` per sample of those requests with new output,
    ``abort_request`` frees a request. ``generate``, ``stream`` and ``chat`` run on the same
    machinery and never see each other's (or the step API's) outputs.

    Failures inside a step: a request that alone makes the model step raise is failed alone
    (``finish_reason`` "error", ``error`` set) and the others continue; a fault that cannot be
    pinned on one request fails the step's requests the same way and is re-raised (``generate``
    and ``stream`` then abort the rest of their own requests). Pages always return to the pool.
    """

    def __init__(self, model: str | tuple[CausalLM, Any] = "smollm2-135m-instruct", **config: Any) -> None:
        cfg = EngineConfig(**config)
        if cfg.speculative == "auto":
            cfg = replace(cfg, speculative=cfg.resolved_speculative(loaded=isinstance(model, str)))
        self.config = cfg
        if cfg.num_threads is not None:
            torch.set_num_threads(cfg.num_threads)
        dtype = getattr(torch, auto_dtype(cfg.device) if cfg.dtype == "auto" else cfg.dtype)
        tp_name = model if isinstance(model, str) else None
        if cfg.tensor_parallel_size > 1:  # this process is rank 0; the workers hold the other shards
            from treeserve.distributed import launch_tensor_parallel

            model = launch_tensor_parallel(
                model, cfg.tensor_parallel_size, dtype, cfg.device, cfg.distributed_timeout_s, cfg.num_threads
            )
        if isinstance(model, str):
            from treeserve.models import load

            # An explicit float32 is the parity configuration: dense weights, float32 head.
            quant = None if cfg.dtype == "float32" and cfg.quantization == "auto" else cfg.quantization
            self.model, self.tokenizer = load(model, dtype=dtype, device=cfg.device, quantization=quant)
            self.model_name = model
        else:
            self.model, self.tokenizer = model
            dtype = next(self.model.parameters()).dtype  # the KV pool follows the given model
            self.model_name = tp_name or type(self.model).__name__
        if cfg.batch_invariant:
            make_batch_invariant(self.model)
        if torch.device(cfg.device).type == "cpu":
            load_all_cpp_ops()  # now, not in the first request's step
            release_free_memory()  # the loader's temporary copies
        mc = self.model.config
        self.vocab_size = mc.vocab_size
        positions = mc.max_position_embeddings
        if cfg.max_model_len is not None and cfg.max_model_len > positions:
            raise ValueError(
                f"max_model_len must be <= the model's max_position_embeddings ({positions}), "
                f"got {cfg.max_model_len}"
            )
        self.max_model_len: int = cfg.max_model_len or min(positions, 4096)
        max_len = self.max_model_len
        fit = getattr(self.model, "fit_context", None)  # wrappers (tensor parallel, test doubles) have none
        if fit is not None:
            fit(max_len)  # longrope's short or long factors, as llama.cpp picks them
        ps = cfg.page_size
        num_pages = -(-cfg.kv_cache_tokens // ps) + 1  # + the dummy page
        kv_heads = getattr(self.model, "kv_heads_per_rank", mc.num_kv_heads)  # rank 0's share under TP
        self.model_dtype = dtype
        kv_dtype = cfg.kv_dtype(dtype, loaded=isinstance(model, str))
        self.kv = KVPool(mc.num_layers, num_pages, ps, kv_heads, mc.head_dim, kv_dtype, cfg.device)
        self.tiers = self._make_tiers(quant if isinstance(model, str) else None)
        self.radix = RadixCache(self.kv.allocator, ps, disable=not cfg.enable_prefix_cache, tiers=self.tiers)
        self.table = ReqToTokenTable(cfg.max_running, -(-max_len // ps) * ps, device=cfg.device)
        eos = list(getattr(self.tokenizer, "eos_token_ids", None) or mc.eos_token_ids or [])
        self.drafter = self._make_drafter(max_len, eos)  # run by the engine; the scheduler only asks
        drafter = self.drafter
        row_cost, step_costs = self._step_costs(loaded=isinstance(model, str))
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_batched_tokens=cfg.max_batched_tokens,
                max_running=cfg.max_running,
                max_model_len=max_len,
                num_speculative_tokens=cfg.num_speculative_tokens if cfg.speculative else 0,
                speculative_max_batch=cfg.draft_batch_limit(loaded=isinstance(model, str)),
                jump_forward_tokens=cfg.jump_forward_tokens,
                speculative_row_cost=row_cost,
                speculative_draft_cost=self._draft_cost(loaded=isinstance(model, str), row_cost=row_cost),
                speculative_step_costs=step_costs,
            ),
            self.kv.allocator,
            self.radix,
            self.table,
            StopChecker(eos, None),  # every request gets an incremental TextState instead
            on_release=None if drafter is None else (lambda req: drafter.release(req.rid)),
        )
        decode_graph = None
        use_graph = cfg.cuda_graph if cfg.cuda_graph is not None else torch.device(cfg.device).type == "cuda"
        use_graph = use_graph and cfg.tensor_parallel_size == 1
        use_graph = use_graph and not cfg.batch_invariant
        if use_graph or cfg.compile:
            forward = compile_model(self.model) if cfg.compile else self.model
            decode_graph = DecodeGraphRunner(
                forward, self.kv, self.table, self.vocab_size, eos, cfg.device,
                max_batch=min(cfg.cuda_graph_max_batch, cfg.max_running),
                use_cuda_graph=use_graph and torch.device(cfg.device).type == "cuda",
                max_draft_nodes=cfg.num_speculative_tokens if cfg.speculative else 0,
            )  # fmt: skip
            decode_graph.capture()
        overlap = cfg.overlap if cfg.overlap is not None else decode_graph is not None and decode_graph.use_cuda_graph
        if overlap and decode_graph is None:
            raise ValueError("overlap=True needs the static decode path: cuda_graph=True (or CUDA) or compile=True")
        self._overlap = overlap and not cfg.speculative
        self._in_flight: DecodeLaunch | None = None  # a launched decode step whose tokens are not committed
        self.runner = ModelRunner(
            self.model, self.kv, self.table, self.vocab_size, eos, cfg.device, decode_graph,
            attention_backend="torch_per_request" if cfg.batch_invariant else "auto",
        )  # fmt: skip
        self.metrics = EngineMetrics()
        if self.tiers is not None:
            self.metrics.kv_tiers = self.tiers.stats  # live counters
        self._seed_gen = torch.Generator()
        self._seed_gen.manual_seed(cfg.seed if cfg.seed is not None else torch.seed())
        self._lock = threading.RLock()
        self._tracked: dict[str, TrackedRequest] = {}  # step-API requests not fully delivered
        self._grammars: GrammarCompiler | None = None  # built on the first structured request
        log_once(f"treeserve engine: dtype={cfg.dtype} page_size={ps} kv_tokens={cfg.kv_cache_tokens}")

    def _make_tiers(self, quantization: str | None) -> KVTiers | None:
        """The host / disk KV tiers of the config (None when both are off). Their keys name the
        model (name, dtype, quantization, a fingerprint of the weights) and the KV layout."""
        cfg, kv = self.config, self.kv
        if not cfg.host_tokens() and cfg.kv_disk_dir is None:
            return None
        model_id = f"{self.model_name}|{self.model_dtype}|{quantization}|{module_fingerprint(self.model)}"
        layout = TierLayout(model_id, kv.dtype, kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.page_size,
                            default_chunk_tokens(kv.page_size))  # fmt: skip
        return KVTiers(kv, layout, cfg.host_tokens(), cfg.kv_disk_dir, cfg.kv_disk_bytes)

    def close(self) -> None:
        """Release what outlives the engine object: with tensor parallelism, stop and join every
        worker (also done at interpreter exit and when the model is collected); with a disk KV
        tier, finish its queued writes. Idempotent; the engine cannot step afterwards."""
        if self.tiers is not None:
            self.tiers.close()
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ step API
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | dict[str, Any] | None = None,
        *,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue one prompt (its ``n`` samples share the id); return its id.

        Raises ``ValueError`` / ``TypeError`` naming the field before anything is queued: bad
        prompt (type, empty, too long for ``max_model_len``, ids outside the vocabulary), bad
        params, ``n`` samples that can never fit the KV pool, or a ``request_id`` that is live.
        """
        if request_id is None:
            request_id = uuid.uuid4().hex
        elif not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str or None, got {request_id!r}")
        ids, sp = self._prepare(prompt, self._as_params(params))
        with self._lock:
            if request_id in self._tracked:
                raise ValueError(f"request_id {request_id!r} is already live")
            self._tracked[request_id] = TrackedRequest(request_id, self._enqueue(ids, sp))
        return request_id

    def step(self) -> list[SampleDelta]:
        """Run one engine step (if any request has work); return one delta per step-API sample
        with new output or a finish since the previous delta.

        A fault re-raised from the step (see the class docstring) leaves the failed requests'
        final deltas (``finish_reason`` "error") for the next call.
        """
        with self._lock:
            if self.scheduler.has_work():
                self._step()
            deltas: list[SampleDelta] = []
            for rid, tracked in list(self._tracked.items()):
                deltas.extend(tracked.collect())
                if tracked.finished:
                    del self._tracked[rid]
            return deltas

    def abort_request(self, request_id: str) -> bool:
        """Abort a step-API request, freeing its pages and rows; True when it was live. No
        further delta is produced for it."""
        with self._lock:
            tracked = self._tracked.pop(request_id, None)
            if tracked is None:
                return False
            self._abort(tracked.samples)
            return True

    def prepare_large(self) -> int:
        """Build the large-batch weights that loading deferred (the int8 copies or dense weights of
        packed projections, built otherwise by the first batch above the packed crossover: +0.6 s on
        SmolLM2, +2.9 s on Llama-3.2-1B on a 2-core EPYC) now; returns how many projections had them
        pending. ``LLM()`` defers them to load fast; a server calls this before it listens, so that its
        first large request does not wait for them."""
        with self._lock:
            return prepare_large_weights(self.model)

    def has_unfinished_requests(self) -> bool:
        """True while any request (of any front end) runs or waits, or a step-API request has
        output not yet returned by ``step``."""
        with self._lock:
            return self.scheduler.has_work() or bool(self._tracked)

    # ------------------------------------------------------------------ front ends
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
        return self._generate(self._as_prompt_list(prompts), sampling_params, use_tqdm)

    def _generate(
        self,
        plist: list[Prompt | Exception],
        sampling_params: SamplingParams | dict[str, Any] | Sequence[SamplingParams | dict[str, Any]] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """``generate`` over prompts already listed; an ``Exception`` in place of a prompt fails
        only its own request."""
        params = self._as_params_list(sampling_params, len(plist))
        entries = [self._submit(p, sp) for p, sp in zip(plist, params)]
        mine = [r for _, reqs in entries for r in reqs]
        bar = None
        if use_tqdm and mine:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(mine), desc="generate", unit="req", dynamic_ncols=True)
        try:
            self._drive(mine, bar)
        finally:
            if bar is not None:
                bar.close()
        return [self._output(out, reqs) for out, reqs in entries]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | dict[str, Any] | None = None
    ) -> Iterator[str]:
        """Yield the text of one request as it is generated: complete UTF-8 pieces only, never
        the start of a stop string; the pieces join to ``generate``'s text.

        Raises ``ValueError`` / ``TypeError`` for bad input before queuing (``n`` must be 1), and
        ``RuntimeError`` when the request fails at run time. Closing the generator early aborts
        the request. Other requests keep running; whoever steps the engine, this stream's output
        stays this stream's.
        """
        sp = self._as_params(sampling_params)
        if sp.n != 1:
            raise ValueError(f"stream supports SamplingParams.n=1, got n={sp.n}")
        ids, sp = self._prepare(prompt, sp)
        with self._lock:
            reqs = self._enqueue(ids, sp)
        tracked = TrackedRequest("stream", reqs)
        try:
            while not tracked.finished:
                with self._lock:
                    self._drive(reqs, None, max_steps=1)
                    deltas = tracked.collect()
                for d in deltas:
                    if d.text:
                        yield d.text
                    if d.finish_reason == FinishReason.ERROR.value:
                        raise RuntimeError(f"request failed: {d.error}")
        finally:
            self._abort(reqs)

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        A malformed conversation (not a list of ``{"role": str, "content": str}`` dicts, or one
        the template rejects) fails only its own request, with ``error`` set.
        """
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this engine was built without one")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise TypeError("messages must be a non-empty list of message dicts or of conversations")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        return self._generate([self._render_chat(c) for c in convs], sampling_params, use_tqdm)

    def _render_chat(self, conv: Any) -> str | Exception:
        if isinstance(conv, (str, bytes)) or not isinstance(conv, Sequence) or not conv:
            return TypeError(f"a conversation must be a non-empty list of message dicts, got {conv!r:.80}")
        for i, msg in enumerate(conv):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                return ValueError(f"message {i} must be a dict with a str 'role', got {msg!r:.80}")
            if not isinstance(msg.get("content"), str):
                return ValueError(f"message {i} ({msg['role']}) must have a str 'content', got {msg.get('content')!r:.80}")
        try:
            return self.tokenizer.apply_chat_template(list(conv), add_generation_prompt=True)
        except Exception as exc:  # the template's own errors (raise_exception, undefined names)
            return ValueError(f"chat template failed on this conversation: {exc}")

    # ------------------------------------------------------------------ stepping
    def _drive(self, reqs: list[Request], bar: Any, max_steps: int | None = None) -> None:
        """Step the engine until every one of ``reqs`` finished (or ``max_steps`` steps ran);
        on a fault, abort the unfinished ones, then re-raise."""
        steps = 0
        try:
            while any(not r.is_finished for r in reqs) and (max_steps is None or steps < max_steps):
                with self._lock:
                    if any(not r.is_finished for r in reqs):
                        self._step()
                steps += 1
                if bar is not None:
                    bar.n = sum(r.is_finished for r in reqs)
                    bar.refresh()
        except BaseException:
            self._abort(reqs)
            raise

    def _step(self) -> None:
        """One ``schedule -> run -> update`` step, with faults contained (class docstring).

        With ``overlap``, a decode step the static runner serves is launched and left running:
        the next call schedules the step after it (``Scheduler.schedule_follow_up``: the same
        requests, each decoding the token in flight), launches it with those tokens taken on the
        device, and only then reads and commits the first step's tokens. Stops, aborts and
        finishes are applied at that commit; a request finished there has its in-flight token
        discarded by the next commit. Anything else (admissions, preemption, prefill chunks,
        speculation, grammars, rows the static path cannot serve) first commits the step in
        flight and runs synchronously.
        """
        t0 = time.perf_counter()
        sched = self.scheduler
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            follow = None
            try:
                nxt = sched.schedule_follow_up(in_flight.batch)
                if nxt is not None:
                    follow = self.runner.decode_graph.launch(nxt, follows=in_flight)
            except Exception as exc:
                self._fail([it.req for it in in_flight.batch.items], exc)
                raise
            self._commit(in_flight.batch, in_flight.tokens(), t0)
            self._in_flight = follow
            return
        try:
            batch = sched.schedule()
            jump = self.config.jump_forward_tokens if self._grammars is not None else 0  # none before a grammar
            if self.drafter is not None or jump:
                batch = fill_drafts(batch, self.drafter, jump)
        except Exception as exc:
            self._fail(list(sched.running), exc)
            raise
        if not batch.items:
            raise RuntimeError("scheduler has work but scheduled nothing (KV pool too small?)")
        if self._overlap:
            try:
                self._in_flight = self.runner.decode_graph.launch(batch)
            except Exception:
                self._in_flight = None  # the synchronous path below isolates the fault
            if self._in_flight is not None:
                return
        try:
            sampled = self.runner.run(batch)
        except Exception as exc:
            sampled = self._isolate(batch, exc)
        self._commit(batch, sampled, t0)

    def _commit(self, batch: ScheduledBatch, sampled: list[SampledToken | None], t0: float) -> None:
        """Commit a step's tokens (``Scheduler.update``) and account them in the metrics; the
        tokens of requests finished meanwhile (aborted, or stopped by the previous commit) are
        dropped."""
        sched = self.scheduler
        live = [it.req.state is RequestState.RUNNING for it in batch.items]
        before = [len(it.req.output_ids) for it in batch.items]
        try:
            finished = sched.update(batch, sampled)
        except Exception as exc:
            self._fail([it.req for it in batch.items], exc)
            raise
        now = time.perf_counter()
        m = self.metrics
        m.steps += 1
        m.busy_seconds += now - t0
        for item, s, was_live, n0 in zip(batch.items, sampled, live, before):
            if s is not None and was_live:
                m.generated_tokens += len(item.req.output_ids) - n0  # a stop drops what follows it
                if item.req.metrics.first_token is None:
                    item.req.metrics.first_token = now
        for req in finished:
            self._account_finished(req)
        m.preemptions = sched.num_preemptions
        spec = sched.spec
        m.draft_tokens, m.accepted_tokens, m.verify_steps = spec.proposed, spec.accepted, spec.steps
        m.jump_forward_proposed, m.jump_forward_tokens = spec.forced_proposed, spec.forced_accepted
        alloc = self.kv.allocator
        m.kv_usage = 1.0 - alloc.num_free / alloc.capacity

    def _isolate(self, batch: ScheduledBatch, exc: Exception) -> list[SampledToken | None]:
        """The model step of ``batch`` raised ``exc``: rerun each item alone; items that still
        raise are failed alone. Re-raises ``exc`` when every item fails (not one request's fault)."""
        sampled: list[SampledToken | None] = []
        culprits: list[tuple[Request, Exception]] = []
        for item in batch.items:
            try:
                (out,) = self.runner.run(ScheduledBatch([item]))
            except Exception as alone:
                culprits.append((item.req, alone))
                out = None
            sampled.append(out)
        for req, err in culprits:
            self.scheduler.abort(req, FinishReason.ERROR, error=f"{type(err).__name__}: {err}")
        if len(culprits) == len(batch.items):
            raise exc
        return sampled

    def _fail(self, reqs: list[Request], exc: Exception) -> None:
        for req in reqs:
            self.scheduler.abort(req, FinishReason.ERROR, error=f"{type(exc).__name__}: {exc}")

    def _abort(self, reqs: list[Request]) -> None:
        with self._lock:
            for req in reqs:
                self.scheduler.abort(req)

    # ------------------------------------------------------------------ internals
    def _step_costs(self, loaded: bool) -> tuple[float, tuple[float, ...]]:
        """The scheduler's ``speculative_row_cost`` and ``speculative_step_costs``: the config's row
        cost and no table, else measured for a model loaded by name on CPU in one process
        (``runner.measure_step_costs`` up to ``row_cost_rows`` rows and the line through its last
        entry, ``row_cost_of``; after the usual 128 cached tokens, or as many as a smaller KV pool
        can lend: its requests are no longer; a pool that cannot lend one gives ``MAX_ROW_COST``,
        drafting only near-certain nodes), else 0 and no table (every asking request drafts its
        whole room, as measured on no machine: a given module, CUDA)."""
        cfg = self.config
        if not cfg.speculative:
            return 0.0, ()
        if cfg.speculative_row_cost is not None:
            return float(cfg.speculative_row_cost), ()
        if not cfg.measured_setting(loaded):
            return 0.0, ()
        rows = row_cost_rows(cfg.num_speculative_tokens)
        context = min(ROW_COST_CONTEXT, self.kv.allocator.num_free * self.kv.page_size - rows)
        if context < 1:
            return MAX_ROW_COST, ()
        costs = measure_step_costs(self.model, self.kv, rows, context)
        return row_cost_of(costs), costs

    def _draft_cost(self, loaded: bool, row_cost: float) -> float:
        """The scheduler's ``speculative_draft_cost``: the config's, else measured for a drafter that
        runs a model when the row cost is measured (``runner.measure_draft_cost``, after as many
        cached tokens as ``_step_costs``'; pools that cannot lend one give ``MAX_ROW_COST``), else 0."""
        cfg, drafter = self.config, self.drafter
        if cfg.speculative_draft_cost is not None:
            return float(cfg.speculative_draft_cost)
        if not isinstance(drafter, DraftModelDrafter) or not cfg.measured_setting(loaded):
            return 0.0
        free = min(self.kv.allocator.num_free * self.kv.page_size, drafter.kv.allocator.num_free)
        context = min(ROW_COST_CONTEXT, free - 1)
        if context < 1:
            return MAX_ROW_COST
        return measure_draft_cost(self.model, self.kv, drafter.model, drafter.kv, row_cost, context)

    def _make_drafter(self, max_len: int, eos: list[int]) -> Drafter | None:
        cfg = self.config
        if cfg.speculative is None:
            return None
        if cfg.speculative == "ngram":
            return NgramDrafter(cfg.ngram_max, cfg.ngram_min, cfg.speculative_tree_width, cfg.ngram_edits)
        from treeserve.models import layer_subset, load

        name = cfg.speculative[len("draft:") :]
        if name.startswith("self:"):
            calibration = None if self.tokenizer is None else self.tokenizer.encode(CALIBRATION_TEXT)
            draft = layer_subset(self.model, self_draft_layers(self.model, int(name[len("self:") :]), calibration))
        else:
            draft, _ = load(name, dtype=self.model_dtype, device=cfg.device)
            draft.fit_context(min(max_len, draft.config.max_position_embeddings))
        dc = draft.config
        if dc.vocab_size != self.vocab_size:
            raise ValueError(f"draft model vocab {dc.vocab_size} differs from the target's {self.vocab_size}")
        dtype = next(draft.parameters()).dtype
        tokens = draft_pool_tokens(cfg.max_running, max_len, cfg.num_speculative_tokens, cfg.kv_cache_tokens)
        pool = KVPool(dc.num_layers, tokens + 1, 1, dc.num_kv_heads, dc.head_dim, dtype, cfg.device)
        return DraftModelDrafter(draft, pool, cfg.max_running, max_len, cfg.speculative_tree_width, eos)

    def _account_finished(self, req: Request) -> None:
        m = self.metrics
        rm = req.metrics
        if req.sample_index == 0:
            m.cached_prompt_tokens += rm.cached_prompt_tokens
        if rm.ttft is not None:
            m.ttft_sum += rm.ttft
        tpot = rm.tpot(len(req.output_ids))
        if tpot is not None:
            m.tpot_sum += tpot
            m.tpot_count += 1

    def _prepare(self, prompt: Prompt, params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """Token ids of ``prompt`` checked against this engine, and ``params``; raises
        ``ValueError`` / ``TypeError`` naming the problem (nothing is queued here)."""
        ids = self._encode(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine was built without one")
        params.check_producible(self.scheduler.stop_checker.eos_token_ids)
        self.scheduler.validate_request(ids, params, self.vocab_size)
        if params.structured is not None:
            with self._lock:  # the compiler's cache is shared by every thread
                self.grammar_compiler().new_state(params.structured)  # compiled (and cached) now, or ValueError
        return ids, params

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's ``GrammarCompiler`` for its tokenizer and vocabulary (built on first use;
        ``ValueError`` for an engine without a tokenizer)."""
        with self._lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("SamplingParams.structured needs a tokenizer; this engine was built without one")
                self._grammars = GrammarCompiler.from_tokenizer(self.tokenizer, self.vocab_size)
            return self._grammars

    def _enqueue(self, ids: list[int], params: SamplingParams) -> list[Request]:
        """Queue a prepared prompt (caller holds the lock); every sample gets its text state."""
        seed = params.seed if params.seed is not None else self._fresh_seed()
        reqs = self.scheduler.new_request(ids, params, seed, self.vocab_size)
        self.metrics.num_requests += 1
        self.metrics.prompt_tokens += len(ids)
        if self.tokenizer is not None:
            from treeserve.models import StreamDecoder

            for req in reqs:
                decoder = StreamDecoder(self.tokenizer, skip_special_tokens=True, context=ids[-_TEXT_CONTEXT:])
                req.text_state = TextState(decoder, params.stop)
        if params.structured is not None:
            for req in reqs:  # one matcher per sample, fed by the commit path
                req.grammar = self.grammar_compiler().new_state(params.structured)
        return reqs

    def _submit(self, prompt: Prompt | Exception, params: SamplingParams | Exception) -> tuple[RequestOutput, list[Request]]:
        text = prompt if isinstance(prompt, str) else None
        out = RequestOutput(request_id=self.metrics.num_requests, prompt=text, prompt_token_ids=[])
        try:
            for bad in (prompt, params):
                if isinstance(bad, Exception):
                    raise bad
            ids, params = self._prepare(prompt, params)
            out.prompt_token_ids = ids
            with self._lock:
                reqs = self._enqueue(ids, params)
        except (ValueError, TypeError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
            self.metrics.num_requests += 1
            self.metrics.num_errors += 1
            return out, []
        return out, reqs

    def _output(self, out: RequestOutput, reqs: list[Request]) -> RequestOutput:
        if out.error is not None or out.outputs:
            return out
        for req in reqs:
            out.outputs.append(
                CompletionOutput(
                    index=req.sample_index,
                    text=self._final_text(req),
                    token_ids=list(req.output_ids),
                    logprobs=list(req.output_logprobs) if req.params.logprobs is not None else [],
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
            "draft_tokens": sum(r.metrics.speculation.proposed for r in reqs),
            "accepted_draft_tokens": sum(r.metrics.speculation.accepted for r in reqs),
            "verify_steps": sum(r.metrics.speculation.steps for r in reqs),
        }
        return out

    @staticmethod
    def _final_text(req: Request) -> str:
        state: TextState | None = req.text_state
        if state is None:
            return ""
        state.close()
        return state.text

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return self.tokenizer.encode(prompt)
        ids = _token_ids(prompt)
        if ids is None:
            raise TypeError(
                f"prompt must be a str or a sequence of int token ids, got {type(prompt).__name__}"
            )
        return ids

    def _fresh_seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self._seed_gen))

    @staticmethod
    def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        if prompts is None or isinstance(prompts, (bytes, bytearray)) or not hasattr(prompts, "__len__"):
            raise TypeError(
                f"prompts must be a str, a token-id sequence or a list of them, got {type(prompts).__name__}"
            )
        if len(prompts) and _token_ids(prompts) is not None:
            return [prompts]  # one token-id prompt
        return list(prompts)

    @staticmethod
    def _as_params(sp: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        if sp is None:
            return SamplingParams()
        if isinstance(sp, SamplingParams):
            return sp
        if isinstance(sp, dict):
            return SamplingParams(**sp)
        raise TypeError(f"sampling params must be a SamplingParams, a dict or None, got {type(sp).__name__}")

    @classmethod
    def _as_params_list(
        cls, sp: SamplingParams | dict[str, Any] | Sequence[SamplingParams | dict[str, Any]] | None, n: int
    ) -> list[SamplingParams | Exception]:
        if sp is None or isinstance(sp, (SamplingParams, dict)):
            sp = [sp] * n
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        out: list[SamplingParams | Exception] = []
        for p in sp:
            try:
                out.append(cls._as_params(p))
            except (ValueError, TypeError) as exc:
                out.append(exc)
        return out


def _token_ids(prompt: Any) -> list[int] | None:
    """``prompt`` as a list of int token ids (a sequence, 1-D numpy array or tensor of integers;
    bools refused), or ``None`` when it is not one."""
    if isinstance(prompt, (str, bytes, bytearray)):
        return None
    if hasattr(prompt, "ndim") and hasattr(prompt, "tolist"):  # numpy array / torch tensor
        dtype = str(getattr(prompt, "dtype", ""))
        if prompt.ndim != 1 or "int" not in dtype:
            return None
        return [int(t) for t in prompt.tolist()]
    try:
        items = list(prompt)
    except TypeError:
        return None
    ok = all(
        (isinstance(t, numbers.Integral) and not isinstance(t, bool) and type(t).__name__ != "bool_")
        or (isinstance(t, torch.Tensor) and t.ndim == 0 and not t.is_floating_point() and t.dtype != torch.bool)
        for t in items
    )
    return [int(t) for t in items] if ok else None
