"""Commit: apply one step's sampled tokens to its requests and decide who stops.

Per item: the tokens the step computed become ``num_computed_tokens`` (for a drafted item, the
pending token plus the accepted draft nodes); a sampled row's accepted draft tokens then its
token are appended one at a time, each checked by the :class:`StopChecker` and against
``max_model_len``; the first stop condition finishes the request (later tokens are dropped, and
``num_computed_tokens`` falls back to the tokens kept, so the KV of accepted nodes after a stop
never reaches the radix tree).
A grammar-constrained request's matcher (``Request.grammar``) takes each committed token that
did not stop the request (refilling its next-token mask); the request finishes with "stop" once
nothing but a stop token may follow (that stop token is not sampled), and with "error" if the
grammar refuses the token.
The first committed token publishes the prompt's KV to the radix tree (so ``n``-sample siblings and
later prompts share it); an item that asked for a draft and goes on frees the pages of its unused
and rejected draft slots when the pool is short (``KVLedger.trim``); a verified draft's counts feed
the request's acceptance estimate (``Request.draft_hits`` / ``draft_misses``, read by
``draft_plan``) and its metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from treeserve.scheduler.batch import DraftTree, SampledToken, ScheduledBatch
from treeserve.scheduler.draft_plan import verified_counts
from treeserve.scheduler.ledger import KVLedger
from treeserve.scheduler.queues import RequestQueues
from treeserve.scheduler.request import FinishReason, Request, RequestState, SpecStats
from treeserve.scheduler.stop import StopChecker

__all__ = ["commit_step"]

_RUNNING = RequestState.RUNNING
_INVALID_LOGITS = "the model produced invalid logits (NaN or inf) for this request"


def commit_step(
    queues: RequestQueues,
    stop_checker: StopChecker,
    spec: SpecStats,
    max_model_len: int,
    batch: ScheduledBatch,
    sampled: Sequence[SampledToken | None],
) -> list[Request]:
    """Commit ``batch``'s results (``sampled[i]`` for ``batch.items[i]``); return the requests
    that finished. See :meth:`Scheduler.update` for the contract."""
    finished: list[Request] = []
    ledger = queues.ledger
    check = stop_checker.check
    for (req, start, num_scheduled, sample, draft, draft_budget), out in zip(batch.items, sampled):
        if req.state is not _RUNNING:
            continue  # aborted while the step ran
        if draft is None:
            req.num_computed_tokens = start + num_scheduled
        else:  # the pending token and the accepted draft nodes now have KV
            req.num_computed_tokens = start + 1 + (len(out.accepted) if out is not None else 0)
        if out is None or not sample:
            continue
        token, logprob, top, accepted, _ = out
        if token < 0:  # the sampler flags rows whose logits were NaN/inf
            queues.finish(req, FinishReason.ERROR)
            req.error = _INVALID_LOGITS
            finished.append(req)
            continue
        if draft is None:
            reason = _commit_one(ledger, check, max_model_len, req, token, logprob, top)
        else:
            _record_draft(spec, req, draft, len(accepted))
            reason = _commit_drafted(ledger, check, max_model_len, req, out)
            if reason is not None and req.num_computed_tokens > req.seq_len:
                # stopped on a draft node: the nodes accepted after it have KV but are not the
                # request's tokens; their slots are freed with its other unused ones
                req.num_computed_tokens = req.seq_len
        if reason is not None:
            queues.finish(req, reason)
            finished.append(req)
        elif draft_budget:
            ledger.trim(req)
    return finished


def _commit_one(
    ledger: KVLedger,
    check: Callable[[Request], FinishReason | None],
    max_model_len: int,
    req: Request,
    token: int,
    logprob: float,
    top: dict[int, float] | None,
) -> FinishReason | None:
    """Append one token; the stop condition it meets, if any. The first one publishes the
    prompt's KV (and releases ``n``-sample siblings waiting for it)."""
    output = req.output_ids
    output.append(token)
    req.output_logprobs.append(logprob)
    if top is not None:
        req.output_top_logprobs.append(top)
    if len(output) == 1:
        ledger.publish(req)
        if req.group is not None and req.sample_index == 0:
            req.group.prompt_cached = True
    reason = check(req)
    if req.grammar is not None and reason in (None, FinishReason.LENGTH):
        # A grammar that completes on the last token max_new_tokens allows reports "stop": the
        # output is whole (and one it refuses reports "error" either way).
        reason = _advance_grammar(req, token) or reason
    if reason is None and len(req.prompt_ids) + len(output) >= max_model_len:
        return FinishReason.LENGTH
    return reason


def _record_draft(spec: SpecStats, req: Request, draft: DraftTree, accepted: int) -> None:
    """A verified draft's counts: the scheduler's and the request's ``SpecStats`` (one
    accounting), and the request's acceptance estimate from the drafter's nodes
    (``Request.draft_hits`` / ``draft_misses``, aged per draft: ``draft_plan.verified_counts``;
    jump-forward tokens, accepted with probability 1 but at a tokenization boundary, say nothing
    about the drafter)."""
    for stats in (spec, req.metrics.speculation):
        stats.record(len(draft), accepted, draft.num_forced)
    if len(draft) > draft.num_forced:
        req.draft_hits, req.draft_misses = verified_counts(
            req.draft_hits, req.draft_misses, max(0, accepted - draft.num_forced),
            accepted < max(draft.depths()),  # the walk stopped short of a leaf
        )  # fmt: skip


def _advance_grammar(req: Request, token: int) -> FinishReason | None:
    """Feed ``token`` to the request's grammar; STOP once only a stop token could follow."""
    grammar = req.grammar
    if not grammar.accept(token):
        req.error = f"token {token} is not allowed by the request's grammar"
        return FinishReason.ERROR
    return FinishReason.STOP if grammar.ended else None


def _commit_drafted(
    ledger: KVLedger, check: Callable[[Request], FinishReason | None], max_model_len: int, req: Request, out: SampledToken
) -> FinishReason | None:
    """Append the accepted draft tokens then the verified token, stopping at the first stop."""
    missing = len(out.accepted) - len(out.accepted_logprobs)
    logprobs = (*out.accepted_logprobs, *[float("nan")] * missing)
    for token, logprob in zip(out.accepted, logprobs):
        reason = _commit_one(ledger, check, max_model_len, req, token, logprob, None)
        if reason is not None:
            return reason
    return _commit_one(ledger, check, max_model_len, req, out.token, out.logprob, out.top)
