"""``Tokenizer``: text <-> token ids, chat template, special tokens; built from HF files or GGUF.

Backed by the ``tokenizers`` library. From a GGUF file:

- ``tokenizer.ggml.model == "gpt2"``: the byte-level BPE is rebuilt from
  ``tokenizer.ggml.tokens``/``merges``/``token_type`` the way transformers rebuilds it;
- ``"llama"`` (SentencePiece BPE: Llama 1/2, Mistral, TinyLlama and their fine-tunes): the pieces and
  ``tokenizer.ggml.scores`` become a BPE whose merges are every split of a piece into two pieces,
  ranked by the joined piece's score (``_spm_merges``), so that merging the highest-ranked adjacent
  pair first joins the pair whose piece scores highest, as SentencePiece and llama.cpp do; spaces are
  ``▁``, one is put before the text and after each special token (``tokenizer.ggml.add_space_prefix``,
  default on), characters outside the pieces fall back to their ``<0xXX>`` byte tokens, and decoding
  drops the one leading space, as transformers' Llama tokenizer does.

Either way control tokens become special added tokens and user-defined ones plain added tokens, so
transformers, llama.cpp and this class encode alike.
``StreamDecoder`` turns a growing id list into text chunks that never split a UTF-8 character.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from treeserve.models.chat_template import render_chat_template

__all__ = ["StreamDecoder", "Tokenizer"]

_log = logging.getLogger("treeserve.models")

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space

# Pre-tokenizer split patterns for GGUF ``tokenizer.ggml.pre`` values whose merges were learned
# on a split other than GPT-2's default.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Mistral's Tekken (Mistral-Nemo, Mistral-Small 3, Pixtral 12B): words split at case changes, digits alone.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The names llama.cpp gives each (its llama-vocab.cpp groups them by pre-tokenizer type), so that the
# files of those models (DeepSeek-R1's Qwen distills, Falcon 3, Pixtral, ...) load; None: GPT-2's split.
_GGUF_SPLITS: dict[str, str | None] = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "phi-2", "smollm", "exaone4", "mellum", "a.x-4.0"), None),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2",
                     "midm-2.0"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez"), _QWEN2_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}
# Splits whose vocabularies take a piece that is a whole token as that token, whatever the merges say
# (transformers' ``ignore_merges``, llama.cpp's for its llama3 and tekken types).
_WHOLE_WORDS = (_LLAMA3_SPLIT, _TEKKEN_SPLIT)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


class Tokenizer:
    """Encode/decode text, render the chat template, expose special token ids.

    Immutable after construction. ``eos_token_ids`` lists every id that ends generation (the
    tokenizer's EOS plus any the model config adds).
    """

    __slots__ = ("_backend", "chat_template", "bos_token", "eos_token", "eos_token_ids", "bos_token_id")

    def __init__(
        self,
        backend: _Backend,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        extra_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._id_of("bos_token", bos_token)
        eos_id = self._id_of("eos_token", eos_token)
        ids = ([] if eos_id is None else [eos_id]) + [int(i) for i in extra_eos_token_ids]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))

    def _id_of(self, field: str, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self._backend.token_to_id(token)
        if tid is None:
            raise ValueError(f"{field} {token!r} is not in the vocabulary")
        return tid

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer`` (shared, do not mutate)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text map to their ids.

        ``add_special_tokens`` applies the tokenizer's post-processor (e.g. a leading BOS), except that
        a text that already starts with the BOS token (a rendered chat template writes it) gets no
        second one, as llama.cpp strips it from a rendered chat.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and bos is not None and ids[:2] == [bos, bos] and text.startswith(self.bos_token or ""):
            del ids[0]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 byte sequences become U+FFFD)."""
        ids = list(ids)
        vocab = self.vocab_size
        for i in ids:
            if not 0 <= i < vocab:
                raise ValueError(f"token id must lie in [0, {vocab}), got {i}")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's chat template (``ValueError`` if it has none)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        return render_chat_template(self.chat_template, messages, add_generation_prompt, specials, **kwargs)

    @classmethod
    def from_gguf_metadata(cls, md: Mapping[str, Any], extra_eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Build from GGUF ``tokenizer.*`` metadata: ``tokenizer.ggml.model`` ``"gpt2"`` (byte-level BPE)
        or ``"llama"`` (SentencePiece BPE; module docstring).

        Raises ``ValueError`` for another tokenizer model, an unknown ``tokenizer.ggml.pre`` (a file
        without one splits as GPT-2 does, with a warning, as llama.cpp loads it), or missing or
        inconsistent keys.
        """
        kind = md.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ValueError("GGUF tokenizer.ggml.model must be 'gpt2' (byte-level BPE) or 'llama' "
                             f"(SentencePiece BPE), got {kind!r}")
        if "tokenizer.ggml.tokens" not in md:
            raise ValueError("GGUF metadata is missing 'tokenizer.ggml.tokens'")
        tokens: list[str] = md["tokenizer.ggml.tokens"]
        types: list[int] = md.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
        if len(types) < len(tokens):  # entries past the tokens are never read (llama.cpp reads them by index)
            raise ValueError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        for key in ("bos", "eos", "unknown", "padding"):
            tid = md.get(f"tokenizer.ggml.{key}_token_id")
            if tid is not None and not 0 <= int(tid) < len(tokens):
                raise ValueError(f"GGUF tokenizer.ggml.{key}_token_id must lie in [0, {len(tokens)}), got {tid}")
        backend, spelled = (_bpe_backend if kind == "gpt2" else _spm_backend)(md, tokens, types)

        def token(key: str) -> str | None:
            tid = md.get(f"tokenizer.ggml.{key}_token_id")
            return None if tid is None else tokens[int(tid)]

        bos, eos = token("bos"), token("eos")
        named = {t for t in (bos, eos, token("unknown"), token("padding")) if t is not None}
        special = [t for t, ty in zip(tokens, types) if ty == _CONTROL and t in spelled]
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys([*special, *named])]
        )
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
             if ty == _USER_DEFINED and t in spelled]
        )
        # llama.cpp puts BOS first where the file says so, and by default for SentencePiece vocabularies.
        if md.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, spelled[bos])]
            )
        return cls(backend, md.get("tokenizer.chat_template"), bos, eos, extra_eos_token_ids)

    @classmethod
    def from_hf_dir(cls, path: str | Path, extra_eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Build from ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json")
        try:
            backend = _Backend.from_file(str(path / "tokenizer.json"))
        except Exception as exc:
            raise ValueError(f"cannot parse {path / 'tokenizer.json'}: {exc}") from exc
        cfg_file = path / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()

        def token(key: str) -> str | None:
            value = cfg.get(key)
            return value.get("content") if isinstance(value, dict) else value

        return cls(backend, template, token("bos_token"), token("eos_token"), extra_eos_token_ids)


def _bpe_backend(md: Mapping[str, Any], tokens: list[str], types: list[int]) -> tuple[_Backend, dict[str, int]]:
    """The byte-level BPE of a ``gpt2`` GGUF vocabulary and its ``{token: id}`` (as spelled in the model)."""
    pre = md.get("tokenizer.ggml.pre")
    if pre is None:  # as llama.cpp loads such a file: the default split, and a warning
        _log.warning("GGUF tokenizer.ggml.pre is missing: splitting text as GPT-2 does; the ids may differ "
                     "from this model's own tokenizer's")
        pre = "default"
    if pre not in _GGUF_SPLITS:
        raise ValueError(f"GGUF tokenizer.ggml.pre must be one of {sorted(_GGUF_SPLITS)}, got {pre!r}")
    if "tokenizer.ggml.merges" not in md:
        raise ValueError("GGUF metadata is missing 'tokenizer.ggml.merges'")
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    # Tokens not spelled in the byte alphabet (e.g. raw special tokens) are re-spelled so the
    # BPE model can hold them; transformers does the same.
    vocab = {
        t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    split = _GGUF_SPLITS[pre]
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                         ignore_merges=split in _WHOLE_WORDS)
    except Exception as exc:  # tokenizers raises a bare Exception for inconsistent merges
        raise ValueError(f"GGUF tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {exc}") from exc
    backend = _Backend(bpe)
    backend.pre_tokenizer = (
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if split is None
        else pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    )
    backend.decoder = decoders.ByteLevel()
    return backend, {t: i for t, i in vocab.items() if set(t) <= letters and tokens[i] == t}


def _spm_merges(tokens: list[str], types: list[int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, the joined piece's score highest first
    (ties: the lower id, then the shorter left part): a BPE that applies them in this order merges, of
    the adjacent pairs that form a piece, the one whose piece scores highest, as SentencePiece's BPE
    and llama.cpp do (both break ties between equal scores by position, which ranks here cannot: real
    vocabularies give every normal piece its own score)."""
    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _NORMAL}
    ranked = []
    for piece, i in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-float(scores[i]), i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_backend(md: Mapping[str, Any], tokens: list[str], types: list[int]) -> tuple[_Backend, dict[str, int]]:
    """The BPE of a ``llama`` (SentencePiece) GGUF vocabulary and its ``{token: id}`` (module docstring)."""
    scores = md.get("tokenizer.ggml.scores")
    if scores is None or len(scores) < len(tokens):
        got = "none" if scores is None else f"{len(scores)}"
        raise ValueError(f"GGUF tokenizer.ggml.scores must hold one score per token ({len(tokens)}), got {got}")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated piece (llama.cpp refuses such a file): its first id
    unk_id = md.get("tokenizer.ggml.unknown_token_id")  # in range: checked by the caller
    unk = None if unk_id is None else tokens[int(unk_id)]
    bpe = models.BPE(vocab=vocab, merges=_spm_merges(tokens, types, scores), unk_token=unk, fuse_unk=True,
                     byte_fallback=True)
    backend = _Backend(bpe)
    prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(_SPACE)] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    backend.decoder = decoders.Sequence([
        decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if prefix else []),
    ])
    return backend, vocab


class StreamDecoder:
    """Incremental detokenization of a growing id list.

    ``push(ids)`` appends ids and returns the newly completed text: text is held back while it
    ends in an incomplete UTF-8 sequence (U+FFFD), and decoding is re-anchored a few tokens back
    so that merges across token boundaries (leading spaces, multi-byte characters) come out as a
    full decode would. ``finish()`` returns whatever is still held. The concatenation of all
    returned chunks equals ``tokenizer.decode(all_ids)``.

    ``context``: ids that come before the pushed ones (a prompt's last tokens), decoded with them but
    never returned: the chunks then add up to the text the pushed ids add after the context, e.g.
    the space a SentencePiece output token starts with, which a decode of the output alone drops (as
    vLLM's incremental detokenizer seeds itself with the prompt). A context whose text ends in an
    incomplete character is not used.
    """

    __slots__ = ("_tok", "_skip", "_ids", "_prefix", "_read")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False, context: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in context]
        if self._ids and tokenizer.decode(self._ids, skip_special_tokens).endswith("\ufffd"):
            self._ids = []
        self._prefix = 0  # start of the decoding window
        self._read = len(self._ids)  # ids before this have been emitted (or are the context)

    def push(self, ids: Sequence[int]) -> str:
        """Append ``ids``; return the text they complete (possibly empty)."""
        self._ids.extend(int(i) for i in ids)
        emitted = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        window = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(window) <= len(emitted) or window.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(emitted) :]

    def finish(self) -> str:
        """The text still held back (e.g. a trailing incomplete character, as U+FFFD)."""
        emitted = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        window = self._tok.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return window[len(emitted) :]
