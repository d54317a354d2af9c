"""Synthetic GGUF files of real architectures: real shapes, random codes from a seed, no download.

``write_synthetic_gguf(path, "llama-3-8b", "Q4_0", seed=0)`` writes what llama.cpp's converter
would write for that architecture (the metadata ``gguf_config`` reads, a byte-level BPE vocabulary
of the real size, every tensor under its GGUF name), with every 2-D weight in ``qtype`` (token
embedding and output head included) and norms in F32 (ones). Codes are uniform random bytes and
each block's f16 scale is drawn so weights have a standard deviation of about 0.02; the file is
written tensor by tensor (peak memory about one tensor's bytes), so an 8B file (~4.3 GiB in
Q4_0) needs no more memory than its largest tensor. Same ``(spec, qtype, seed)``: same bytes.

The models are for loading, memory and speed measurements: their text is noise. Context length is
8192 for every spec (the RoPE table is built for it); Llama 3's RoPE scaling and Qwen's sliding
window are not written (the loader supports neither).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from treeserve.models.tokenizer import _byte_alphabet

__all__ = ["QTYPES", "SPECS", "SyntheticSpec", "add_metadata", "synthetic_tensor_shapes", "tensor_type",
           "write_synthetic_gguf"]

_WEIGHT_STD = 0.02
# Spread of each block's weight over its scale ``d`` (uniform random codes): Q4_0 ``q - 8``, Q4_1 ``q`` (centred
# by its minimum), Q8_0 ``q`` (int8), Q4_K ``sc q - 7.5 m`` (6-bit sc, m; its dmin 7.5 d centres it), Q5_K
# ``sc q - 15.5 m`` (5-bit q, dmin 15.5 d), Q6_K ``sc (q - 32)`` (int8 sc, 6-bit q).
_CODE_STD = {"Q4_0": 4.61, "Q4_1": 4.61, "Q8_0": 73.9, "Q4_K": 258.0, "Q5_K": 527.0, "Q6_K": 1365.0}
_SCALE_AT = {"Q6_K": 208}  # byte offset of a block's f16 d (0 for the others)
_MIN_OVER_D = {"Q4_1": -7.5, "Q4_K": 7.5, "Q5_K": 15.5}  # the minimum (Q4_1's m, the k-quants' dmin) over d
_MIXTURES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}  # llama.cpp's mixtures: their base type
QTYPES = (*_CODE_STD, *_MIXTURES)
"""The ``qtype`` values :func:`write_synthetic_gguf` takes: one type for every 2-D weight, or
``"Q4_K_M"`` / ``"Q5_K_M"``, llama.cpp's mixtures of those names (:func:`tensor_type`)."""


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """The shapes of one architecture, as its GGUF metadata states them."""

    architecture: str  # "llama", "qwen2", "qwen3" or "phi3"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_theta: float
    context_length: int = 8192
    key_length: int | None = None  # head_dim where it is not hidden_size // num_heads (Qwen3)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden_size // self.num_heads


SPECS: dict[str, SyntheticSpec] = {
    "llama-3-8b": SyntheticSpec("llama", 32, 4096, 32, 8, 14336, 128256, False, False, 500000.0),
    "llama-3.2-1b": SyntheticSpec("llama", 16, 2048, 32, 8, 8192, 128256, True, False, 500000.0),
    "qwen2.5-1.5b": SyntheticSpec("qwen2", 28, 1536, 12, 2, 8960, 151936, True, True, 1000000.0),
    "qwen3-0.6b": SyntheticSpec("qwen3", 28, 1024, 16, 8, 3072, 151936, True, False, 1000000.0, key_length=128),
    "phi-3-mini": SyntheticSpec("phi3", 32, 3072, 32, 32, 8192, 32064, False, False, 10000.0, 4096),
}
"""Llama-3-8B, Llama-3.2-1B, Qwen2.5-1.5B, Qwen3-0.6B and Phi-3-mini-4k shapes (from their published
configs; Phi-3's QKV and gate|up fused, as its files hold them)."""


def synthetic_tensor_shapes(spec: SyntheticSpec) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (rows first), in file order."""
    h, q, kv, i = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (spec.vocab_size, h)}
    for layer in range(spec.num_layers):
        p = f"blk.{layer}."
        fused = spec.architecture == "phi3"
        shapes[p + "attn_norm.weight"] = (h,)
        if fused:
            shapes[p + "attn_qkv.weight"] = (q + 2 * kv, h)
        else:
            shapes |= {p + "attn_q.weight": (q, h), p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h)}
        if spec.attention_bias:
            shapes |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)}
        if spec.architecture == "qwen3":  # per-head query / key norms
            shapes |= {p + "attn_q_norm.weight": (spec.head_dim,), p + "attn_k_norm.weight": (spec.head_dim,)}
        shapes |= {p + "attn_output.weight": (h, q), p + "ffn_norm.weight": (h,)}
        shapes |= {p + "ffn_up.weight": (2 * i, h)} if fused else {p + "ffn_gate.weight": (i, h), p + "ffn_up.weight": (i, h)}
        shapes[p + "ffn_down.weight"] = (h, i)
    shapes["output_norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["output.weight"] = (spec.vocab_size, h)
    return shapes


def _vocabulary(size: int) -> list[str]:
    """The 256 byte-level letters (every text encodes), ``ab`` (the file's one merge, ``a b``), then
    ``t257``, ``t258``, ... (never produced by a merge)."""
    return list(_byte_alphabet().values()) + ["ab"] + [f"t{n}" for n in range(257, size)]


# Phi-3's added tokens (ids 32000-32010) after its 32000 SentencePiece pieces; llama.cpp loads a phi3 file
# only with such a vocabulary.
_PHI3_ADDED = ("<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
               "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>")
_PHI3_VOCAB = 32000 + len(_PHI3_ADDED)


def _phi3_vocabulary(size: int) -> dict[str, Any]:
    """A SentencePiece vocabulary laid out as Phi-3's: ``<unk>``, ``<s>``, ``</s>``, the 256 byte pieces,
    ``▁t259`` ... up to id 32000 (scores falling), Phi-3's added tokens, then padding pieces to ``size``."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [f"\u2581t{n}" for n in range(len(pieces), 32000)]
    tokens = pieces + list(_PHI3_ADDED) + [f"<|dummy{n}|>" for n in range(size - _PHI3_VOCAB)]
    types = [2, 3, 3] + [6] * 256 + [1] * (32000 - 259) + [3] * (size - 32000)
    scores = [0.0] * 259 + [-float(n) for n in range(32000 - 259)] + [0.0] * (size - 32000)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 32000, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.padding_token_id": 32000, "tokenizer.ggml.add_bos_token": False}


def _random_blocks(rng: np.random.Generator, qtype: str, shape: tuple[int, int]) -> np.ndarray:
    """``shape`` weights as ``qtype`` blocks: uniform random code bytes (the k-quants' sub-block
    scales included), f16 scales of about ``_WEIGHT_STD / code std`` (x0.5..1.5), Q4_1's and
    Q4_K's / Q5_K's minimum centring the codes."""
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    n_blocks = shape[0] * shape[1] // block
    blocks = np.frombuffer(bytearray(rng.bytes(n_blocks * type_size)), np.uint8).reshape(n_blocks, type_size)
    d = (_WEIGHT_STD / _CODE_STD[qtype] * rng.uniform(0.5, 1.5, n_blocks)).astype(np.float16)
    at = _SCALE_AT.get(qtype, 0)
    blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    if qtype in _MIN_OVER_D:
        m = _MIN_OVER_D[qtype] * d.astype(np.float32)
        blocks[:, 2:4] = m.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(shape[0], -1)


def _more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every third between."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def tensor_type(name: str, qtype: str, num_layers: int, tied: bool = False) -> str:
    """The type of 2-D weight ``name`` (GGUF name) in a file of ``qtype``: ``qtype`` itself, or for
    ``"Q4_K_M"`` / ``"Q5_K_M"`` what llama.cpp's quantizer picks (simplified to the Llama tensors): Q6_K
    for the output head (the token embedding where the head is tied to it, ``tied``) and for ``attn_v``
    / ``ffn_down`` in the layers of ``use_more_bits``, the base type (Q4_K / Q5_K) elsewhere."""
    if qtype not in _MIXTURES:
        return qtype
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K"
    parts = name.split(".")
    if len(parts) == 4 and parts[2] in ("attn_v", "ffn_down") and _more_bits(int(parts[1]), num_layers):
        return "Q6_K"
    return _MIXTURES[qtype]


def _tensor(name: str, shape: tuple[int, ...], qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Tensor ``name``'s data: F32 norms (ones) and biases (zeros), else random ``qtype`` blocks."""
    if len(shape) == 1:
        return np.zeros(shape, np.float32) if name.endswith(".bias") else np.ones(shape, np.float32)
    return _random_blocks(rng, qtype, shape)  # type: ignore[arg-type]


def _add_model(w: GGUFWriter, spec: SyntheticSpec, rms_norm_eps: float) -> None:
    """The model's shape, RoPE base and norm epsilon, as llama.cpp's converter names them."""
    w.add_block_count(spec.num_layers)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.hidden_size)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    if spec.architecture == "qwen3" or spec.key_length is not None:  # as llama.cpp's converter writes them
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_layer_norm_rms_eps(rms_norm_eps)
    w.add_vocab_size(spec.vocab_size)


def add_metadata(w: GGUFWriter, spec: SyntheticSpec, rms_norm_eps: float, tokens: list[str], merges: list[str],
                 token_types: list[int], bos: int, eos: int) -> None:
    """Add the metadata ``gguf_config`` and ``Tokenizer.from_gguf_metadata`` read (model shape, RoPE
    base, norm epsilon, a byte-level BPE vocabulary, BOS / EOS) to ``w``, as llama.cpp's converter names it."""
    _add_model(w, spec, rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(token_types)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)


# The tokenizer keys ``write_synthetic_gguf(tokenizer=...)`` writes, each by the writer's method for its type.
_TOKENIZER_KEYS: dict[str, Callable[[GGUFWriter, Any], None]] = {
    "tokenizer.ggml.model": GGUFWriter.add_tokenizer_model,
    "tokenizer.ggml.pre": GGUFWriter.add_tokenizer_pre,
    "tokenizer.ggml.tokens": GGUFWriter.add_token_list,
    "tokenizer.ggml.scores": GGUFWriter.add_token_scores,
    "tokenizer.ggml.token_type": GGUFWriter.add_token_types,
    "tokenizer.ggml.merges": GGUFWriter.add_token_merges,
    "tokenizer.ggml.bos_token_id": GGUFWriter.add_bos_token_id,
    "tokenizer.ggml.eos_token_id": GGUFWriter.add_eos_token_id,
    "tokenizer.ggml.unknown_token_id": GGUFWriter.add_unk_token_id,
    "tokenizer.ggml.padding_token_id": GGUFWriter.add_pad_token_id,
    "tokenizer.ggml.add_bos_token": GGUFWriter.add_add_bos_token,
    "tokenizer.ggml.add_space_prefix": GGUFWriter.add_add_space_prefix,
    "tokenizer.chat_template": GGUFWriter.add_chat_template,
}


def _check_tokenizer(tokenizer: Mapping[str, Any], vocab_size: int) -> None:
    unknown = sorted(set(tokenizer) - set(_TOKENIZER_KEYS))
    if unknown:
        raise ValueError(f"tokenizer keys must be among {sorted(_TOKENIZER_KEYS)}, got {unknown}")
    tokens = tokenizer.get("tokenizer.ggml.tokens")
    if "tokenizer.ggml.model" not in tokenizer or tokens is None or len(tokens) != vocab_size:
        got = "none" if tokens is None else len(tokens)
        raise ValueError(f"tokenizer must give tokenizer.ggml.model and {vocab_size} tokenizer.ggml.tokens, got {got}")


def write_synthetic_gguf(path: str | Path, spec: str | SyntheticSpec = "llama-3.2-1b", qtype: str = "Q4_0",
                         seed: int = 0, num_layers: int | None = None,
                         tokenizer: Mapping[str, Any] | None = None) -> Path:
    """Write the synthetic GGUF file of ``spec`` (a name of ``SPECS`` or a ``SyntheticSpec``) to ``path``.

    ``qtype``: one of :data:`QTYPES` (``"Q4_0"``, ``"Q4_1"``, ``"Q8_0"``, ``"Q4_K"``, ``"Q5_K"``, ``"Q6_K"``
    for every 2-D weight, or the ``"Q4_K_M"`` / ``"Q5_K_M"`` mixtures; the k-quants need widths that are
    multiples of 256, as every spec's are); ``seed``: the codes;
    ``num_layers``: keep only the first layers (a smaller file of the same widths); ``tokenizer``: the
    ``tokenizer.*`` keys to write instead of the byte-level BPE stand-in (e.g. a SentencePiece
    vocabulary's ``tokenizer.ggml.model``, ``tokens``, ``scores``, ``token_type``, its token ids;
    ``spec.vocab_size`` tokens). ``ValueError`` names a bad ``spec``, ``qtype``, ``num_layers`` or
    ``tokenizer``. Returns ``path``."""
    if isinstance(spec, str):
        if spec not in SPECS:
            raise ValueError(f"spec must be one of {sorted(SPECS)} or a SyntheticSpec, got {spec!r}")
        spec = SPECS[spec]
    if qtype not in QTYPES:
        raise ValueError(f"qtype must be one of {sorted(QTYPES)}, got {qtype!r}")
    if num_layers is not None:
        if not 1 <= num_layers <= spec.num_layers:
            raise ValueError(f"num_layers must be in [1, {spec.num_layers}], got {num_layers}")
        spec = SyntheticSpec(**{**{f: getattr(spec, f) for f in SyntheticSpec.__slots__}, "num_layers": num_layers})
    if tokenizer is not None:
        _check_tokenizer(tokenizer, spec.vocab_size)
    path = Path(path)
    w = GGUFWriter(str(path), spec.architecture)
    w.add_name(f"synthetic-{spec.architecture}-{qtype}-seed{seed}")
    eps = 1e-5 if spec.architecture in ("llama", "phi3") else 1e-6
    if tokenizer is None and spec.architecture == "phi3" and spec.vocab_size >= _PHI3_VOCAB:
        tokenizer = _phi3_vocabulary(spec.vocab_size)
    if tokenizer is None:
        add_metadata(w, spec, eps, _vocabulary(spec.vocab_size), ["a b"], [1] * spec.vocab_size,
                     bos=spec.vocab_size - 2, eos=spec.vocab_size - 1)
    else:
        _add_model(w, spec, eps)
        for key, value in tokenizer.items():
            _TOKENIZER_KEYS[key](w, value)
    shapes = synthetic_tensor_shapes(spec)
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            raw = GGMLQuantizationType[tensor_type(name, qtype, spec.num_layers, spec.tie_word_embeddings)]
            block, type_size = GGML_QUANT_SIZES[raw]
            byte_shape = (shape[0], shape[1] // block * type_size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for index, (name, shape) in enumerate(shapes.items()):
        rng = np.random.default_rng([seed, index])
        kind = tensor_type(name, qtype, spec.num_layers, spec.tie_word_embeddings)
        w.write_tensor_data(_tensor(name, shape, kind, rng))
    w.close()
    return path
