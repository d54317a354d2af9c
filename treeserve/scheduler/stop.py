"""Stop conditions, checked after each committed token, and the incremental text they match on.

Order: ``max_new_tokens`` is a hard cap; below ``min_new_tokens`` nothing else stops a request
(the sampler also bans EOS / stop tokens there); then EOS (unless ``ignore_eos``), stop token
ids, and stop strings. Stop strings are matched on detokenized text and trimmed from it; the
token ids keep every generated token, as vLLM does.

Text is produced incrementally by a :class:`TextDecoder` (``push`` new ids, get the newly
completed text; ``finish`` flushes what is held): the engine gives every request a
:class:`TextState` over ``models.StreamDecoder``, so decoding costs O(new tokens) per step and
``stream()``, ``generate()``, stop strings and the step API all read the same text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from treeserve.scheduler.request import FinishReason, Request


class TextDecoder(Protocol):
    """Incremental detokenizer: ``push`` returns only complete text, appended in order."""

    def push(self, ids: Sequence[int]) -> str: ...

    def finish(self) -> str: ...


class WholeDecoder:
    """A :class:`TextDecoder` over a function that decodes a whole id list.

    Re-decodes the whole output at each push (O(length) per token): for the standalone scheduler
    with a simple ``detokenize``; the engine uses ``models.StreamDecoder`` instead. Text ending
    in U+FFFD (an incomplete UTF-8 character) is held back until it completes.
    """

    __slots__ = ("_decode", "_ids", "_emitted")

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._emitted = 0

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        text = self._decode(self._ids)
        if text.endswith("\ufffd") or len(text) <= self._emitted:
            return ""
        new, self._emitted = text[self._emitted :], len(text)
        return new

    def finish(self) -> str:
        text = self._decode(self._ids)
        new, self._emitted = text[self._emitted :], max(self._emitted, len(text))
        return new


class TextState:
    """One sample's output text: decoded incrementally, matched against stop strings.

    ``text`` only grows by appended complete text (until a stop string trims it, which ends the
    request). ``releasable(finished)`` is the part a consumer may see now: while the request
    runs, the longest suffix that is a proper prefix of a stop string is held back, so a stop
    string never leaks partially into a stream. ``emitted`` counts the characters handed out.
    """

    __slots__ = ("_decoder", "stops", "text", "emitted", "closed")

    def __init__(self, decoder: TextDecoder, stops: Sequence[str] = ()) -> None:
        self._decoder = decoder
        self.stops = tuple(stops)
        self.text = ""
        self.emitted = 0
        self.closed = False

    def push(self, ids: Sequence[int], match: bool = True) -> str | None:
        """Append ``ids``' text; with ``match``, return the earliest stop string that ends in the
        new text (``text`` is then trimmed before it), else ``None``."""
        if self.closed:
            return None
        before = len(self.text)
        self.text += self._decoder.push(ids)
        if not match or not self.stops or len(self.text) == before:
            return None
        best: tuple[int, str] | None = None
        for s in self.stops:
            idx = self.text.find(s, max(0, before - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self.closed = True
        return best[1]

    def close(self) -> None:
        """The request ended without a stop string: flush what the decoder still holds."""
        if not self.closed:
            self.text += self._decoder.finish()
            self.closed = True

    def releasable(self) -> str:
        """The text not yet emitted that no future token can turn into (part of) a stop string;
        marks it emitted."""
        end = len(self.text)
        if not self.closed:
            end -= self._held_back()
        if end <= self.emitted:
            return ""
        new, self.emitted = self.text[self.emitted : end], end
        return new

    def _held_back(self) -> int:
        text = self.text
        for k in range(min(max((len(s) for s in self.stops), default=1) - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


class StopChecker:
    """Decides whether a request is done; feeds each committed token to the request's text.

    A request's ``text_state`` (a :class:`TextState`, set by the engine) receives every committed
    token. A request with stop strings but no text state gets one over :class:`WholeDecoder`
    of ``detokenize`` (maps output ids to text, special tokens skipped); with ``detokenize``
    ``None`` such a request raises ``ValueError``.
    """

    def __init__(
        self, eos_token_ids: Sequence[int], detokenize: Callable[[list[int]], str] | None
    ) -> None:
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.detokenize = detokenize

    def check(self, req: Request) -> FinishReason | None:
        params = req.params
        output = req.output_ids
        n_out = len(output)
        token = output[-1]
        below_min = n_out < params.min_new_tokens
        hit = None
        if req.text_state is not None or params.stop:  # no text to follow otherwise
            hit = self._push_text(req, token, match=not below_min)
        if below_min:
            return FinishReason.LENGTH if n_out >= params.max_new_tokens else None
        if not params.ignore_eos and token in self.eos_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
        if params.stop_token_ids and token in params.stop_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
        if hit is not None:
            req.stop_reason = hit
            return FinishReason.STOP
        if n_out >= params.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _push_text(self, req: Request, token: int, match: bool) -> str | None:
        """Feed ``token`` to the request's text (created for stop strings on first use)."""
        state = req.text_state
        if state is None:
            if self.detokenize is None:
                raise ValueError("stop strings need a tokenizer to detokenize the output")
            state = req.text_state = TextState(WholeDecoder(self.detokenize), req.params.stop)
            if len(req.output_ids) > 1:  # output committed before the state existed
                state.push(req.output_ids[:-1], match=False)
        return state.push([token], match)
