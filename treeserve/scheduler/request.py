"""The request state machine.

``WAITING -> RUNNING -> (PAUSED -> RUNNING)* -> FINISHED``; ``abort`` reaches FINISHED from any
state. A request owns, while RUNNING, one row of the request->slot table, the lock handle on its
matched prefix in the radix tree, and the pages it allocated past that prefix. The scheduler is
the only code that changes those fields; everyone else reads them. ``SpecStats``: speculative
decoding counters, kept per request (``RequestMetrics.speculation``) and for the whole scheduler.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from treeserve.sampling import SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding counters: draft nodes proposed / accepted, verify steps (drafts
    other than jump-forward tokens); jump-forward tokens proposed / accepted (``forced_*``:
    each accepted one is a forward pass saved)."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    forced_proposed: int = 0
    forced_accepted: int = 0

    def record(self, proposed: int, accepted: int, forced: int = 0) -> None:
        """One verified draft of ``proposed`` nodes, ``accepted`` of them accepted, whose first
        ``forced`` nodes were jump-forward tokens (a chain: accepted first)."""
        forced_ok = min(accepted, forced)
        self.forced_proposed += forced
        self.forced_accepted += forced_ok
        if proposed > forced:
            self.proposed += proposed - forced
            self.accepted += accepted - forced_ok
            self.steps += 1


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (``time.perf_counter``) of one request's life, and its counters."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0
    cached_prompt_tokens: int = 0
    speculation: SpecStats = field(default_factory=SpecStats)  # this request's drafts, as the engine counts them

    @property
    def ttft(self) -> float | None:
        """Time to first token (s)."""
        return None if self.first_token is None else self.first_token - self.arrival

    def tpot(self, num_output_tokens: int) -> float | None:
        """Mean time per output token after the first (s)."""
        if self.finished is None or self.first_token is None or num_output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (num_output_tokens - 1)


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    ``prompt_ids`` never changes; ``output_ids`` grows by committed tokens only. ``group`` links
    the ``n`` samples of one prompt. Token counts, each meaning one thing:

    - ``num_prompt_tokens``: ``len(prompt_ids)``.
    - ``seq_len``: prompt plus committed output tokens (``len(all_ids)``).
    - ``num_computed_tokens``: leading tokens of ``all_ids`` whose KV lives in the slots of
      ``row`` (the prefix matched in the radix tree included); ``seq_len - 1`` while decoding.
    - ``num_cached_tokens``: the leading part of those whose pages belong to the radix tree
      (page-aligned, locked by ``lock``).
    - ``num_owned_pages``: pages the request allocated itself, right after the cached part.
    """

    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    group: Any = None
    sample_index: int = 0
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # KV ownership (scheduler-managed)
    row: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    lock: Any = None
    num_owned_pages: int = 0
    # output text (a ``scheduler.stop.TextState``: fed by the stop checker, read by the engine)
    text_state: Any = None
    # structured output (a ``sampling.GrammarState``, set by the engine when ``params.structured``):
    # fed every committed token by the commit path; its bitmask masks the next token
    grammar: Any = None
    # speculative decoding: draft nodes accepted with their parent accepted / rejected there,
    # decayed counts (``scheduler.draft_plan``: the request's acceptance estimate)
    draft_hits: float = 0.0
    draft_misses: float = 0.0
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    _tokens: list[int] = field(default_factory=list, repr=False)

    @property
    def all_ids(self) -> list[int]:
        """Prompt then output: one token buffer per request, extended by the newly committed
        tokens on access (no list concatenation per access). Read it, never mutate it."""
        buf = self._tokens
        num_prompt = len(self.prompt_ids)
        if len(buf) < num_prompt:
            buf[:] = self.prompt_ids
        missing = num_prompt + len(self.output_ids) - len(buf)
        if missing:
            buf.extend(self.output_ids[len(self.output_ids) - missing :])
        return buf

    def tokens(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` (``0 <= start <= end <= seq_len``), read from the prompt or the
        output directly when the range lies in one of them."""
        num_prompt = len(self.prompt_ids)
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_ids[start:end]
        return self.all_ids[start:end]

    @property
    def text(self) -> str:
        """Output text decoded so far (trimmed at a matched stop string); "" without a text state."""
        return "" if self.text_state is None else self.text_state.text

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the prompt."""
        return len(self.prompt_ids)

    @property
    def seq_len(self) -> int:
        """Prompt plus committed output tokens."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True while more than one token of this request still lacks KV."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed_tokens > 1
