"""Stop conditions, checked after each committed token.

Order: ``max_new_tokens`` is a hard cap; below ``min_new_tokens`` nothing else stops a request
(the sampler also bans EOS / stop tokens there); then EOS (unless ``ignore_eos``), stop token
ids, and stop strings. Stop strings are matched on detokenized text and trimmed from it; the
token ids keep every generated token, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from treeserve.scheduler.request import FinishReason, Request


class StopChecker:
    """Decides whether a request is done; keeps ``req.text`` current when stop strings need it.

    ``detokenize`` maps output ids to text (special tokens skipped); it is required only for
    requests with stop strings (``None`` makes such requests a ``ValueError`` at submit time).
    """

    def __init__(
        self, eos_token_ids: Sequence[int], detokenize: Callable[[list[int]], str] | None
    ) -> None:
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.detokenize = detokenize

    def check(self, req: Request) -> FinishReason | None:
        params = req.params
        n_out = len(req.output_ids)
        token = req.output_ids[-1]
        if n_out < params.min_new_tokens:
            return FinishReason.LENGTH if n_out >= params.max_new_tokens else None
        if not params.ignore_eos and token in self.eos_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
        if params.stop_token_ids and token in params.stop_token_ids:
            req.stop_reason = token
            return FinishReason.STOP
        if params.stop and self._hit_stop_string(req):
            return FinishReason.STOP
        if n_out >= params.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def _hit_stop_string(self, req: Request) -> bool:
        if self.detokenize is None:
            raise ValueError("stop strings need a tokenizer to detokenize the output")
        stops = req.params.stop  # SamplingParams normalizes it to a tuple of strings
        previous = len(req.text)
        req.text = self.detokenize(req.output_ids)
        # Only a match that ends in the new text counts; earlier text was already checked.
        search_from = max(0, previous - max(len(s) for s in stops) + 1)
        best: tuple[int, str] | None = None
        for s in stops:
            idx = req.text.find(s, search_from)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return False
        req.text = req.text[: best[0]]
        req.stop_reason = best[1]
        return True
