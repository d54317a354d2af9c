"""Grammar-constrained decoding on xgrammar: compiled grammars per tokenizer, one matcher per sample.

``GrammarCompiler`` is built once per (tokenizer, model vocabulary width): it turns a
``StructuredOutput`` into an ``xgrammar.CompiledGrammar`` (cached by the spec's ``key``, at most
``max_cached`` of them, least recently used evicted) and raises ``ValueError`` naming
``SamplingParams.structured.<kind>`` when the schema / regex / grammar is invalid.
``GrammarState`` is one sample's matcher plus the bitmask of the tokens it may take next
(``bitmask``, host int32 ``[bitmask_words(V)]``): the scheduler's commit path feeds it every
committed token (``accept``), which refills the mask; the runner stacks the masks of a step's
constrained rows into ``SamplingBatch.token_bitmask``. For speculation, ``check_draft`` walks a
draft tree through the matcher (``accept_token`` then ``rollback``: the state is unchanged
afterwards), cuts what the grammar refuses and fills one mask per tree position;
``jump_forward`` gives the tokens the grammar forces next (jump-forward decoding). Ids past the tokenizer's vocabulary
(padding of the logits) and special tokens other than the stop tokens are never allowed.

xgrammar is imported when the first compiler is built, so the rest of ``treeserve.sampling``
works without it.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from treeserve.sampling.bitmask import bitmask_words
from treeserve.sampling.structured import StructuredOutput

__all__ = ["DraftCheck", "GrammarCompiler", "GrammarState"]

_VOCAB_TYPES = ("byte_level", "byte_fallback", "raw")
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed:.*?: )?")


class DraftCheck(NamedTuple):
    """A draft tree checked against a grammar: ``keep`` the node indices kept (ascending: the
    kept nodes form a tree, every kept node's parent kept), ``masks [1 + len(keep), W]`` int32
    the bitmask of the state at the root (row 0, the current ``bitmask``) and after each kept
    node (row 1 + j for ``keep[j]``); a row no sample can reach (after a refused or stop token)
    is all ``-1``."""

    keep: list[int]
    masks: torch.Tensor


class GrammarState:
    """One sample's grammar matcher and its next-token ``bitmask``.

    ``accept(token)`` advances the matcher (False, state unchanged, if the grammar refuses the
    token) and refills ``bitmask``; ``ended`` is True once nothing but a stop token may follow
    (the grammar is complete and cannot go on, a stop token was accepted, or no token at all is
    allowed): the request is then finished without sampling that stop token. ``not_stop`` is
    the bitmask of every token but the stop tokens (shared, read-only). Owned by one ``Request``; not thread-safe.
    """

    __slots__ = ("_matcher", "_buf", "_not_stop", "_forced", "_ended", "vocab_size")

    def __init__(self, compiled: Any, vocab_size: int, not_stop: torch.Tensor) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._not_stop = not_stop.numpy()
        self.vocab_size = vocab_size
        self._buf = torch.empty(1, bitmask_words(vocab_size), dtype=torch.int32)
        self._matcher.fill_next_token_bitmask(self._buf, 0)
        self._forced: list[int] | None = None  # jump_forward's tokens, until the next accept
        self._ended = self._find_ended()

    @property
    def bitmask(self) -> torch.Tensor:
        """int32 ``[bitmask_words(vocab_size)]``: the tokens allowed next (see ``sampling.bitmask``)."""
        return self._buf[0]

    def accept(self, token: int) -> bool:
        """Advance by ``token``; True when the grammar allowed it."""
        if not self._matcher.accept_token(int(token)):
            return False
        self._forced = None
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(self._buf, 0)
        self._ended = self._find_ended()
        return True

    @property
    def ended(self) -> bool:
        """Nothing but a stop token may come next (or the grammar already accepted one); found
        once per ``accept`` (the commit path asks after every token)."""
        return self._ended

    def _find_ended(self) -> bool:
        # numpy on the host buffer: a few microseconds, ~10x torch's AND + any on 1,536 words
        return self._matcher.is_terminated() or not np.bitwise_and(self._buf.numpy()[0], self._not_stop).any()

    def jump_forward(self, max_tokens: int) -> list[int]:
        """At most ``max_tokens`` tokens the grammar forces next (xgrammar's
        ``find_jump_forward_tokens``: the forced string tokenized greedily, its last token
        dropped when a longer token could extend it, no stop or special token); [] when the
        grammar leaves a choice. Other tokenizations of the same text may also be allowed, so
        these are a draft to verify, not tokens to append unverified. Cached until ``accept``."""
        if self._forced is None:
            self._forced = [] if self._matcher.is_terminated() else self._matcher.find_jump_forward_tokens()
        return self._forced[: max(max_tokens, 0)]

    def check_draft(self, tokens: Sequence[int], parents: Sequence[int], sampled: bool) -> DraftCheck:
        """Walk a draft tree (node k: ``tokens[k]`` under ``parents[k] < k``, -1 = the current
        state) through the matcher and fill each kept node's mask; the state is unchanged after.

        A node the grammar refuses, and every node under it, is cut when the draft is
        deterministic (``sampled`` False): cutting is then just another deterministic proposal.
        A ``sampled`` node (drawn from a law verification is told about) is kept even when
        refused, with an all ``-1`` mask row: the masked target gives it probability 0, so it
        is rejected, and cutting it would change the law its siblings were drawn under; only
        the nodes under it are cut (they are never reached). Nodes under a stop token are cut.
        """
        m = self._matcher
        words = self._buf.shape[1]
        masks = torch.full((1 + len(tokens), words), -1, dtype=torch.int32)
        masks[0] = self._buf[0]
        keep: list[int] = []
        live: set[int] = set()  # kept nodes the grammar accepted (their states can go on)
        path: list[int] = []  # the nodes accepted into the matcher, root to deepest
        for k, (tok, par) in enumerate(zip(tokens, parents)):
            if par >= 0 and par not in live:
                continue  # under a cut, refused or stopping node
            chain = _chain(parents, par)  # root -> par: what the matcher must have accepted
            while path != chain[: len(path)]:
                m.rollback(1)
                path.pop()
            for node in chain[len(path) :]:  # re-advance into a sibling's branch
                m.accept_token(int(tokens[node]))
                path.append(node)
            if m.accept_token(int(tok)):
                path.append(k)
                keep.append(k)
                if not m.is_terminated():
                    live.add(k)
                    m.fill_next_token_bitmask(masks, len(keep))
            elif sampled:
                keep.append(k)
        if path:
            m.rollback(len(path))
        return DraftCheck(keep, masks[: 1 + len(keep)])


class GrammarCompiler:
    """Compiles ``StructuredOutput`` specs for one tokenizer and a ``vocab_size``-wide model.

    ``encoded_vocab[i]`` is token i's string as the tokenizer stores it (byte-level BPE:
    ``"Ġ"``-encoded); ``""`` marks an id the grammar must never produce (special tokens,
    padding). ``vocab_type``: ``"byte_level"`` (GPT-2 style), ``"byte_fallback"`` (``<0x0A>``
    tokens) or ``"raw"`` (tokens are their text); ``add_prefix_space`` as xgrammar's
    ``TokenizerInfo`` takes it.
    """

    def __init__(
        self,
        encoded_vocab: Sequence[str],
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        vocab_type: str = "byte_level",
        add_prefix_space: bool = False,
        max_cached: int = 256,
    ) -> None:
        import xgrammar as xgr

        if vocab_type not in _VOCAB_TYPES:
            raise ValueError(f"vocab_type must be one of {', '.join(_VOCAB_TYPES)}, got {vocab_type!r}")
        if not stop_token_ids:
            raise ValueError("stop_token_ids must list at least one id (structured output needs a way to stop)")
        bad = [t for t in stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids outside [0, {vocab_size}): {bad}")
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self._info = xgr.TokenizerInfo(
            list(encoded_vocab)[:vocab_size],
            getattr(xgr.VocabType, vocab_type.upper()),
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids),
            add_prefix_space=add_prefix_space,
        )
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1)
        self._not_stop = torch.full((bitmask_words(vocab_size),), -1, dtype=torch.int32)
        for t in stop_token_ids:
            self._not_stop[t // 32] &= ~_bit(t % 32)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, **kwargs: Any) -> GrammarCompiler:
        """From a ``treeserve.models.Tokenizer`` (anything with ``backend``, a
        ``tokenizers.Tokenizer``, and ``eos_token_ids``): its vocabulary with special tokens
        blanked, padded or cut to the model's ``vocab_size``, its EOS ids as stop tokens."""
        import xgrammar as xgr

        backend = tokenizer.backend
        encoded = [""] * vocab_size
        for text, idx in backend.get_vocab(with_added_tokens=True).items():
            if idx < vocab_size:
                encoded[idx] = text
        for idx, added in backend.get_added_tokens_decoder().items():
            if added.special and idx < vocab_size:
                encoded[idx] = ""
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        return cls(
            encoded, vocab_size, list(tokenizer.eos_token_ids),
            vocab_type=meta["vocab_type"].name.lower(), add_prefix_space=meta["add_prefix_space"], **kwargs,
        )  # fmt: skip

    @property
    def num_cached(self) -> int:
        """Compiled grammars held in the cache."""
        return len(self._cache)

    def compile(self, spec: StructuredOutput) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``spec`` (cached); ``ValueError`` naming
        ``SamplingParams.structured.<kind>`` and xgrammar's reason when it does not compile."""
        key = spec.key
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        try:
            compiled = self._compile(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
            raise ValueError(f"SamplingParams.structured.{spec.kind} is invalid: {reason}") from None
        self._cache[key] = compiled
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> Any:
        c = self._compiler
        kind = spec.kind
        if kind == "json_schema":
            return c.compile_json_schema(spec.json_schema, any_whitespace=False, strict_mode=True)
        if kind == "json_object":  # compact JSON: free whitespace lets a small model loop on it
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return c.compile_regex(spec.regex)
        if kind == "grammar":
            return c.compile_grammar(spec.grammar)
        return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec.choice))

    def new_state(self, spec: StructuredOutput) -> GrammarState:
        """A fresh matcher for one sample of a request constrained by ``spec``; ``ValueError``
        when ``spec`` does not compile or admits no output token at all (e.g. only the empty
        string, or text no token of this vocabulary can spell)."""
        state = GrammarState(self.compile(spec), self.vocab_size, self._not_stop)
        if state.ended:
            raise ValueError(
                f"SamplingParams.structured.{spec.kind} admits no output token with this tokenizer"
            )
        return state


def _chain(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (empty for the root, -1)."""
    out: list[int] = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def _bit(j: int) -> int:
    """int32 value with only bit ``j`` set (bit 31 is the sign bit)."""
    return -(2**31) if j == 31 else 1 << j
