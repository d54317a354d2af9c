"""The output processor: turns the scheduler's committed tokens into per-consumer deltas.

Every sample's text comes from its ``TextState`` (``scheduler.stop``), fed token by token by the
stop checker through ``models.StreamDecoder``: O(new tokens) per step. A :class:`TrackedRequest`
keeps, per sample, how much its consumer has already seen, so a delta is computed when the
consumer asks, whoever stepped the engine meanwhile: nothing is lost, several steps merge into
one delta.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treeserve.scheduler import Request, TextState

__all__ = ["SampleDelta", "TrackedRequest"]


@dataclass(slots=True)
class SampleDelta:
    """What one sample of a request produced since its previous delta.

    ``text``: new complete UTF-8 text (never a suffix that could still become a stop string);
    ``token_ids``: new tokens; ``logprobs`` / ``top_logprobs``: for those tokens, empty unless
    the request asked for logprobs. ``finish_reason`` is ``None`` while the sample runs, then
    ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` (with ``error`` set) in its last delta.
    """

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str | None = None


@dataclass(slots=True, eq=False)
class _Cursor:
    tokens: int = 0
    top: int = 0
    done: bool = False


@dataclass(slots=True, eq=False)
class TrackedRequest:
    """The ``n`` samples of one request and what their consumer has seen of each."""

    request_id: str
    samples: list[Request]
    cursors: list[_Cursor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cursors = [_Cursor() for _ in self.samples]

    @property
    def finished(self) -> bool:
        """Every sample finished and its last delta handed out."""
        return all(c.done for c in self.cursors)

    def collect(self) -> list[SampleDelta]:
        """Deltas of the samples with new output or a new finish since the last call."""
        deltas = []
        for req, cur in zip(self.samples, self.cursors):
            if cur.done:
                continue
            delta = self._delta(req, cur)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _delta(self, req: Request, cur: _Cursor) -> SampleDelta | None:
        finished = req.is_finished
        state: TextState | None = req.text_state
        if state is not None and finished:
            state.close()
        text = "" if state is None else state.releasable()
        n = len(req.output_ids)
        if n == cur.tokens and not text and not finished:
            return None
        asked = req.params.logprobs is not None
        tops = req.output_top_logprobs
        delta = SampleDelta(
            request_id=self.request_id,
            index=req.sample_index,
            text=text,
            token_ids=req.output_ids[cur.tokens : n],
            logprobs=req.output_logprobs[cur.tokens : n] if asked else [],
            top_logprobs=tops[cur.top :] if asked else [],
            finish_reason=req.finish_reason.value if finished and req.finish_reason else None,
            stop_reason=req.stop_reason if finished else None,
            num_prompt_tokens=len(req.prompt_ids),
            num_cached_tokens=req.metrics.cached_prompt_tokens,
            error=req.error if finished else None,
        )
        cur.tokens, cur.top, cur.done = n, len(tops), finished
        return delta
