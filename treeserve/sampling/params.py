"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from treeserve.sampling.structured import StructuredOutput

MAX_LOGPROBS = 20
"""Largest number of top logprobs a request may ask for."""

MIN_TEMPERATURE = 1e-5
"""Smallest positive temperature: below it logits / temperature overflow (use 0 for greedy)."""

MAX_LOGIT_BIAS = 100.0
"""Largest magnitude of a ``logit_bias`` entry (OpenAI's range; enough to force or ban a token)."""

_PENALTY_RANGE = 2.0
_MAX_SEED = 2**63 - 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_real(name: str, x: Any) -> float:
    if not _is_real(x):
        raise TypeError(f"SamplingParams.{name} must be a real number, got {type(x).__name__}")
    if not math.isfinite(x):
        raise ValueError(f"SamplingParams.{name} must be finite, got {x!r}")
    return float(x)


def _check_int(name: str, x: Any) -> int:
    if not _is_int(x):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(x).__name__}")
    return x


def _check_token_ids(name: str, ids: Any) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"SamplingParams.{name} must be a sequence of token ids")
    out = tuple(ids)
    for t in out:
        if not _is_int(t):
            raise TypeError(f"SamplingParams.{name} entries must be ints, got {type(t).__name__}")
        if t < 0:
            raise ValueError(f"SamplingParams.{name} entries must be >= 0, got {t}")
    return out


@dataclass(slots=True)
class SamplingParams:
    """How one request's tokens are chosen; every field is validated in ``__post_init__``.

    Filtering/sampling fields (applied by ``process_logits``, in this order: penalties ->
    min-token ban -> logit_bias -> allowed_token_ids -> temperature -> top_k -> top_p -> min_p):

    - ``temperature``: 0 (greedy: argmax of the processed logits) or >= 1e-5.
    - ``top_k``: -1 (off) or >= 1. ``top_p`` in (0, 1] (1 = off). ``min_p`` in [0, 1) (0 = off).
    - ``repetition_penalty > 0`` (1 = off; HF semantics, over prompt + output);
      ``frequency_penalty`` and ``presence_penalty`` in [-2, 2] (0 = off; OpenAI semantics, over
      the generated tokens only).
    - ``logit_bias``: token id -> additive bias in [-100, 100]. Token ids are checked against the
      vocabulary by ``validate_for_vocab`` (called by ``SamplingBatch.build``).
    - ``allowed_token_ids``: if given (non-empty), every other token is masked out.
    - ``seed``: None (the engine picks one) or an int in [0, 2**63 - 1].
    - ``logprobs``: None or 0..20, the number of top logprobs to return besides the chosen one.
    - ``structured``: None, or a ``StructuredOutput`` (a dict of its fields is converted): the
      output must match one JSON schema / any JSON object / regex / EBNF grammar / choice. Its
      shape is checked here; the engine compiles it when the request is submitted (an invalid
      schema, regex or grammar is a ``ValueError`` there). Every step masks the tokens the
      grammar does not allow next (after ``allowed_token_ids``, before temperature), so
      reported logprobs are those of the masked distribution; the request finishes ("stop")
      when the grammar ends.

    Fields the engine acts on (sampling only provides the min-token ban): ``max_new_tokens >= 1``,
    ``0 <= min_new_tokens <= max_new_tokens`` (EOS and ``stop_token_ids`` are banned while fewer
    tokens were generated), ``stop`` (strings), ``stop_token_ids``, ``ignore_eos``, ``n >= 1``.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    structured: StructuredOutput | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.temperature = _check_real("temperature", self.temperature)
        if self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"SamplingParams.temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {self.temperature}"
            )
        self._check_filters()
        self._check_penalties()
        self._check_token_sets()
        self._check_lengths()
        if self.structured is not None:
            self.structured = StructuredOutput.of(self.structured)

    def _check_filters(self) -> None:
        top_k = _check_int("top_k", self.top_k)
        if top_k != -1 and top_k < 1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {top_k}")
        self.top_p = _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        self.min_p = _check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1), got {self.min_p}")

    def _check_penalties(self) -> None:
        self.repetition_penalty = _check_real("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"SamplingParams.repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = _check_real(name, getattr(self, name))
            if not -_PENALTY_RANGE <= value <= _PENALTY_RANGE:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)

    def _check_token_sets(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise TypeError("SamplingParams.logit_bias must be a dict {token_id: bias}")
        bias: dict[int, float] = {}
        for tok, b in self.logit_bias.items():
            if not _is_int(tok) or tok < 0:
                raise ValueError(f"SamplingParams.logit_bias keys must be token ids >= 0, got {tok!r}")
            bias[tok] = _check_real(f"logit_bias[{tok}]", b)
            if abs(bias[tok]) > MAX_LOGIT_BIAS:
                raise ValueError(
                    f"SamplingParams.logit_bias[{tok}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {b!r}"
                )
        self.logit_bias = bias
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("SamplingParams.allowed_token_ids must be None or non-empty")
        self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids)
        if isinstance(self.stop, (bytes, bytearray)):
            raise TypeError("SamplingParams.stop must be a str or a sequence of str, got bytes")
        if isinstance(self.stop, str):
            self.stop = (self.stop,) if self.stop else ()
        else:
            self.stop = tuple(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop entries must be non-empty strings, got {s!r}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError("SamplingParams.ignore_eos must be a bool")
        if self.seed is not None:
            seed = _check_int("seed", self.seed)
            if not 0 <= seed <= _MAX_SEED:
                raise ValueError(f"SamplingParams.seed must be None or in [0, 2**63 - 1], got {seed}")

    def _check_lengths(self) -> None:
        if _check_int("max_new_tokens", self.max_new_tokens) < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        min_new = _check_int("min_new_tokens", self.min_new_tokens)
        if not 0 <= min_new <= self.max_new_tokens:
            raise ValueError(
                f"SamplingParams.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {min_new}"
            )
        self.check_producible(())
        if _check_int("n", self.n) < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.logprobs is not None:
            lp = _check_int("logprobs", self.logprobs)
            if not 0 <= lp <= MAX_LOGPROBS:
                raise ValueError(f"SamplingParams.logprobs must be None or in [0, {MAX_LOGPROBS}], got {lp}")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature 0)."""
        return self.temperature == 0.0

    def check_producible(self, eos_token_ids: Sequence[int]) -> None:
        """Raise ``ValueError`` when no token could ever be produced: every allowed token is a stop
        token (``stop_token_ids``, plus ``eos_token_ids`` unless ``ignore_eos``), all banned
        while fewer than ``min_new_tokens > 0`` tokens were generated."""
        if self.min_new_tokens == 0 or not self.allowed_token_ids:
            return
        banned = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
        if set(self.allowed_token_ids) <= banned:
            raise ValueError(
                "SamplingParams.allowed_token_ids are all stop/EOS ids, which min_new_tokens="
                f"{self.min_new_tokens} bans: no token can be produced"
            )

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` if a token id in this request is outside ``[0, vocab_size)``."""
        for name, ids in (
            ("logit_bias", tuple(self.logit_bias)),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"SamplingParams.{name} has token ids outside [0, {vocab_size}): {bad[:5]}"
                )
