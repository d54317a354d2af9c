"""Host views of a step's sampled and verified tokens: the step's one device->host sync."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from treeserve.sampling import SampleOutput, VerifyOutput
from treeserve.scheduler import SampledToken

__all__ = ["to_sampled_tokens", "verified_tokens"]


def to_sampled_tokens(out: SampleOutput, num_logprobs: Sequence[int | None]) -> list[SampledToken]:
    """Host view of ``out``'s first ``len(num_logprobs)`` rows; row ``j`` keeps ``num_logprobs[j]`` top entries.

    This is the step's one device->host sync.
    """
    n = len(num_logprobs)
    tokens = out.tokens[:n].tolist()
    logprobs = out.logprobs[:n].tolist()
    want_top = any(num_logprobs)
    if not want_top:
        return list(map(SampledToken, tokens, logprobs, repeat(None, n)))
    top_ids = out.top_ids[:n].tolist()
    top_lps = out.top_logprobs[:n].tolist()
    result = []
    for j in range(n):
        k = num_logprobs[j] or 0
        top = dict(zip(top_ids[j][:k], top_lps[j][:k])) if k else None
        result.append(SampledToken(tokens[j], logprobs[j], top))
    return result


def verified_tokens(out: VerifyOutput, n: int) -> list[SampledToken]:
    """Host view of ``out``'s first ``n`` requests: accepted draft tokens, then the bonus or
    correction token, each with its logprob (token -1 for an invalid request). One host sync."""
    tokens = out.tokens[:n].tolist()
    logprobs = out.logprobs[:n].tolist()
    accepted = out.accept_len[:n].tolist()
    valid = out.valid[:n].tolist()
    result = []
    for b, a in enumerate(accepted):
        if valid[b]:
            accepted_lps = tuple(logprobs[b][:a])
            result.append(SampledToken(tokens[b][a], logprobs[b][a], None, tuple(tokens[b][:a]), accepted_lps))
        else:
            result.append(SampledToken(-1, float("nan"), None))
    return result
