"""Load a Llama-family GGUF file: configuration, dequantized weights and tokenizer metadata.

The header is parsed by :mod:`treeserve.models.gguf_file` (0.1 s instead of ``gguf.GGUFReader``'s
4-6 s for a 49k-token vocabulary). Weights are dequantized with ``gguf.quants.dequantize`` (vectorized numpy; a
chunk of rows at a time for quantized loads) and handed to ``build_model`` under HF names. llama.cpp stores the Q/K projections of ``llama`` models
permuted for its interleaved RoPE; they are permuted back here to the rotate-half layout.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from treeserve.models.config import ModelConfig, cap_to_window
from treeserve.models.gguf_convert import as_blocks, converted_type
from treeserve.models.gguf_file import GGUFTensor, map_gguf, release_pages
from treeserve.models.llama import LlamaForCausalLM
from treeserve.models.parallel import TPShard, check_shard_quantization
from treeserve.models.gguf_op import BLOCK_BYTES, GROUP, GGUFWeight, gguf_op_available
from treeserve.models.blocks_cache import cached_blocks
from treeserve.models.blocks_cache import source_id as blocks_source
from treeserve.models.int8_cache import source_id
from treeserve.models.quant import PACKABLE, Int4Planes, pack_model, planes_from_gguf
from treeserve.models.vocab_codes import CodesEmbedding, CodesHead, head_from_codes
from treeserve.models.weights import build_model, expected_hf_shapes, fused_names

log = logging.getLogger("treeserve.models")

__all__ = ["GGUFContents", "gguf_config", "load_gguf_model", "open_gguf", "unpermute_qk"]

_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")

# GGUF tensor-name suffix per block -> HF name suffix.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# phi3's ffn_up holds gate|up (its HF gate_up_proj: the first half gated by SiLU).
_FUSED_BLOCK_NAMES = {**_BLOCK_NAMES, "attn_qkv.weight": "self_attn.qkv_proj.weight",
                      "ffn_up.weight": "mlp.gate_up_proj.weight"}
# Phi-3's files name no end-of-turn token: its turns end with <|end|> (its generation_config, llama.cpp).
_END_OF_TURN_NAMES = {"phi3": ("<|end|>", "<|endoftext|>")}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFContents(NamedTuple):
    """An opened GGUF file: its metadata as plain Python values, its tensors by GGUF name, and the
    mapped file's stat (the weight caches' keys: the bytes mapped, whatever replaces ``path`` later)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    stat: os.stat_result | None = None


def open_gguf(path: str | Path) -> GGUFContents:
    """Parse a GGUF file (memory-mapped; tensors are not read yet).

    Raises ``ValueError`` when the file is missing, not GGUF, or truncated (a tensor's data
    would extend past the end of the file).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file {path} does not exist")
    try:
        metadata, tensors, st = map_gguf(path)
    except ValueError as exc:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {exc}") from exc
    return GGUFContents(path, metadata, tensors, st)


def gguf_config(g: GGUFContents) -> ModelConfig:
    """The ``ModelConfig`` described by GGUF metadata (``{arch}.*`` and ``tokenizer.ggml.*`` keys)."""
    md = g.metadata
    arch = md.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"{g.path}: general.architecture must be one of {_GGUF_ARCHITECTURES}, got {arch!r}"
        )

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in md:
            raise ValueError(f"{g.path}: GGUF metadata is missing {full!r}")
        return md[full]

    experts = md.get(f"{arch}.expert_count")
    if experts or any("_exps." in name for name in g.tensors):  # Mixtral-style files say "llama" too
        raise ValueError(f"{g.path}: mixture-of-experts GGUF files ({arch}.expert_count = {experts}) are not supported")
    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // num_heads))
    rotary = int(md.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:  # Phi-4-mini's partial rotary
        raise ValueError(f"{g.path}: {arch}.rope.dimension_count must be head_dim ({head_dim}: RoPE on whole heads), "
                         f"got {rotary}")
    vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", ()))
    scaling_type = md.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"{g.path}: {arch}.rope.scaling.type must be 'none' or 'linear', got {scaling_type!r}")
    rope_scaling = (
        {"rope_type": "linear", "factor": float(md[f"{arch}.rope.scaling.factor"])}
        if scaling_type == "linear" else None
    )
    if "rope_freqs.weight" in g.tensors:  # Llama 3.1+'s llama3 scaling, as llama.cpp's converter writes it
        if rope_scaling is not None:
            raise ValueError(f"{g.path}: rope_freqs.weight with {arch}.rope.scaling.type 'linear' is not supported")
        rope_scaling = {"rope_type": "freq_factors", "factors": _factor_table(g, "rope_freqs.weight", head_dim)}
    if "rope_factors_long.weight" in g.tensors or "rope_factors_short.weight" in g.tensors:
        rope_scaling = _longrope(g, arch, head_dim, rope_scaling)
    eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md]
    names = _END_OF_TURN_NAMES.get(arch)
    if names:
        eos += [i for i, text in enumerate(md.get("tokenizer.ggml.tokens", ())) if text in names]
    context = int(need("context_length"))
    window = md.get(f"{arch}.attention.sliding_window") if arch == "phi3" else None  # Qwen's may be switched off
    if window is not None and int(window) > 0:
        longrope = rope_scaling if rope_scaling is not None and rope_scaling["rope_type"] == "longrope" else None
        context = cap_to_window(context, window, f"{arch}.attention.sliding_window", longrope)
    return ModelConfig(
        architecture=arch,
        num_layers=int(need("block_count")),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(md.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate_size=int(need("feed_forward_length")),
        vocab_size=int(vocab),
        rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in g.tensors,
        attention_bias="blk.0.attn_q.bias" in g.tensors,
        max_position_embeddings=context,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
    )


def _factor_table(g: GGUFContents, name: str, head_dim: int) -> list[float]:
    """Tensor ``name``: ``head_dim // 2`` F32 RoPE factors, else a ``ValueError`` naming it."""
    t = g.tensors.get(name)
    if t is None or t.tensor_type != GGMLQuantizationType.F32 or t.n_elements != head_dim // 2:
        got = "missing" if t is None else f"{t.n_elements} {t.tensor_type.name}"
        raise ValueError(f"{g.path}: {name} must be {head_dim // 2} F32 factors (head_dim // 2), got {got}")
    return [float(f) for f in t.data.reshape(-1)]


def _longrope(g: GGUFContents, arch: str, head_dim: int, other: dict[str, Any] | None) -> dict[str, Any]:
    """Phi-3's longrope from ``rope_factors_short`` / ``rope_factors_long`` (F32, ``head_dim // 2`` each) and
    ``{arch}.rope.scaling.original_context_length`` / ``attn_factor``, as llama.cpp's converter writes them."""
    if other is not None:
        raise ValueError(f"{g.path}: rope_factors_long/short.weight with another RoPE scaling is not supported")
    factors = {f"{k}_factor": _factor_table(g, f"rope_factors_{k}.weight", head_dim) for k in ("short", "long")}
    key = f"{arch}.rope.scaling.original_context_length"
    if key not in g.metadata:
        raise ValueError(f"{g.path}: GGUF metadata is missing {key!r} (longrope's original context)")
    out = {"rope_type": "longrope", **factors, "original_max_position_embeddings": int(g.metadata[key])}
    if f"{arch}.rope.scaling.attn_factor" in g.metadata:
        out["attention_factor"] = float(g.metadata[f"{arch}.rope.scaling.attn_factor"])
    return out


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation: per head, rows ``(pair, 2)`` -> ``(2, pair)``.

    llama.cpp interleaves the two rotate-half halves of each head so that its RoPE can rotate
    adjacent elements; works for weights ``[rows, cols]`` and biases ``[rows]`` (a new array)."""
    out = np.empty_like(w)
    unpermute_into(out, w, n_heads)
    return out


def unpermute_into(out: np.ndarray, w: np.ndarray, n_heads: int) -> None:
    """``out[...] = unpermute_qk(w, n_heads)`` in one copy (``out`` of ``w``'s shape, e.g. a slice of
    a preallocated buffer)."""
    rows = w.shape[0]
    pair = rows // n_heads // 2
    np.copyto(out.reshape(n_heads, 2, pair, *w.shape[1:]), w.reshape(n_heads, pair, 2, *w.shape[1:]).swapaxes(1, 2))


def _hf_name(gguf_name: str, fused: bool = False) -> str | None:
    """The HF name of a GGUF tensor (``fused``: a checkpoint with fused projections, phi3), or None."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _FUSED_BLOCK_NAMES if fused else _BLOCK_NAMES
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def _dequantize(t: GGUFTensor, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor as float32 (only ``rows = (start, stop)`` of its first dim when given: each row
    is quantized on its own, so only those rows are read)."""
    qtype = GGMLQuantizationType(t.tensor_type)
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the fastest-varying dim first
    # A plain ndarray view: numpy.memmap slicing overhead dominates otherwise.
    data = np.asarray(t.data).view(np.ndarray)
    if rows is not None:
        data = data.reshape(shape[0], -1)[rows[0] : rows[1]]
        shape = (rows[1] - rows[0], *shape[1:])
    try:
        flat = dequantize(data, qtype)
    except NotImplementedError as exc:
        raise ValueError(f"tensor {t.name!r}: quantization type {qtype.name} is not supported") from exc
    return np.ascontiguousarray(flat, dtype=np.float32).reshape(shape)


def load_gguf_model(
    g: GGUFContents,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    shard: TPShard | None = None,
) -> LlamaForCausalLM:
    """Dequantize ``g``'s tensors into a model (see ``build_model`` for the errors it raises).

    With ``quantization`` (see ``treeserve.models.quant.pack_model``) the decoder projections
    whose tensors are all Q4_0 / Q4_1 / Q8_0 also keep the file's codes, packed, for decode steps.
    Where the C++ GGUF operator multiplies them (CPU), those projections are built from the codes
    alone, one at a time (``pack_model(unloaded=...)``): no dense copy of them is ever made beyond
    what their large batches keep, and the file's pages of every tensor that was copied or
    dequantized leave the resident set (``release_pages``).
    ``shard``: build that tensor-parallel rank's shard (dense only); row slices (QKV, gate|up,
    vocab) are read and dequantized alone, column slices (o_proj, down_proj) from the whole tensor.
    """
    check_shard_quantization(shard, quantization)
    config = gguf_config(g)
    by_hf = {hf: t for name, t in g.tensors.items() if (hf := _hf_name(name, config.fused_checkpoint)) is not None}
    permute_heads = {
        "self_attn.q_proj": config.num_heads,
        "self_attn.k_proj": config.num_kv_heads,
    }

    use_op = quantization is not None and gguf_op_available()
    cache_source = blocks_source(g.path, g.stat)  # the built blocks' cache key, None where not cached
    shapes = expected_hf_shapes(config)

    def file_shape(hf: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(by_hf[hf].shape))  # GGUF lists the fastest-varying dim first

    def heads_of(hf: str) -> int | None:
        """The head count whose llama.cpp row permutation ``hf`` carries, or None."""
        if config.architecture != "llama":
            return None
        return next((h for proj, h in permute_heads.items() if f".{proj}." in hf), None)

    def codes_of(hf: str, keep: bool = True) -> Int4Planes | GGUFWeight | None:
        """One tensor's shipped codes (rows unpermuted): its blocks as they are for the C++ operator
        (``keep=False``: only to be dequantized, so never stored in the blocks cache), else int4 planes
        for torch's kernel; None for another type."""
        if use_op:
            return blocks_for([hf], keep)
        t = by_hf[hf]
        qtype = GGMLQuantizationType(t.tensor_type).name
        if qtype not in BLOCK_BYTES:
            return None
        shape = file_shape(hf)
        raw = np.asarray(t.data).view(np.ndarray)
        heads = heads_of(hf)
        planes = planes_from_gguf(qtype, raw, shape)
        if heads is not None:
            planes = planes.permute_rows(lambda a, h=heads: unpermute_qk(a, h))
        return planes

    head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"

    def get(hf: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """``hf`` dequantized (a copy); its pages of the file leave the resident set (the head's
        codes, where a first pass reads them, come back page by page when it does: a head whose
        measured passes never read them costs no resident memory for them)."""
        w = _get(hf, rows)
        release_pages(by_hf[hf])
        return w

    def _get(hf: str, rows: tuple[int, int] | None) -> torch.Tensor:
        # Quantized loads: float32 blocks a chunk at a time, bitwise gguf's for the shipped types; a converted
        # type's (gguf_convert) only where the model keeps codes beside the dense weight (CPU), elsewhere exact.
        shipped = by_hf[hf].tensor_type.name in BLOCK_BYTES or torch.device(device).type == "cpu"
        if use_op and rows is None and shipped and file_shape(hf) == shapes.get(hf):
            codes = codes_of(hf, keep=False)
            if isinstance(codes, GGUFWeight):
                return codes.dequantize()
        w = _dequantize(by_hf[hf], rows)
        full_rows = int(by_hf[hf].shape[-1])
        heads = heads_of(hf)
        # A wrong row count is left for build_model to report with the tensor's name;
        # a head-aligned row slice is unpermuted head by head like the whole tensor.
        if heads is not None and full_rows == heads * config.head_dim:
            w = unpermute_qk(w, w.shape[0] // config.head_dim)
        # F32 tensors come back as read-only views of the mapped file: copy those.
        return torch.from_numpy(w if w.flags.writeable else w.copy())

    def get_slice(hf: str, dim: int, start: int, stop: int) -> tuple[torch.Tensor, tuple[int, ...]]:
        full = file_shape(hf)
        if dim == 0 and full[0] >= stop:
            return get(hf, (start, stop)), full
        return get(hf), full  # build_model narrows it

    sources = dict(fused_names(config))

    def blocks_for(hfs: list[str], keep: bool = True) -> GGUFWeight | None:
        """The fused codes of ``hfs`` (one K) for the C++ operator, else None: each tensor as the
        blocks the operator multiplies (``gguf_convert.as_blocks``: Q4_0 / Q4_1 / Q8_0 as shipped,
        Q4_K repacked as Q4_1, other quantized types requantized to Q8_0; a group whose tensors end
        in different types all Q8_0), its rows written once, unpermuted on the way, into one
        buffer, which ``blocks_cache`` keeps on disk and maps on the next load of the file (unless
        ``keep`` is False: blocks only dequantized); a single shipped tensor without a permutation is
        the file's pages (no copy)."""
        if any(len(file_shape(hf)) != 2 for hf in hfs) or len({file_shape(hf)[1] for hf in hfs}) != 1:
            return None
        k = file_shape(hfs[0])[1]
        types = {converted_type(by_hf[hf].tensor_type.name) for hf in hfs}
        if None in types:
            return None
        qtype = "Q8_0" if len(types) > 1 else types.pop()
        if len(hfs) == 1 and heads_of(hfs[0]) is None and by_hf[hfs[0]].tensor_type.name == qtype:
            found = as_blocks(by_hf[hfs[0]], file_shape(hfs[0]))
            return None if found is None else GGUFWeight.from_bytes(found[0], found[1], (file_shape(hfs[0])[0], k))

        def build(out: torch.Tensor) -> bool:
            """Each part converted (or copied) straight into its rows of ``out``, or, where llama.cpp's Q/K
            row permutation must be undone, converted alone and unpermuted into them."""
            start = 0
            for hf in hfs:
                rows, heads = file_shape(hf)[0], heads_of(hf)
                dest = out[start : start + rows]
                start += rows
                found = as_blocks(by_hf[hf], file_shape(hf), qtype, into=dest if heads is None else None)
                if found is None:
                    return False
                if heads is not None:
                    unpermute_into(dest.numpy(), found[1], heads)
            return True

        rows = sum(file_shape(hf)[0] for hf in hfs)
        out = cached_blocks(cache_source if keep else None, hfs, qtype, rows, k // GROUP * BLOCK_BYTES[qtype], build)
        return None if out is None else GGUFWeight.from_bytes(qtype, out, (rows, k))

    def planes_for(name: str) -> Int4Planes | GGUFWeight | None:
        if use_op:
            return blocks_for(sources[name + ".weight"])
        parts = [codes_of(hf) for hf in sources[name + ".weight"]]
        if any(p is None for p in parts):
            return None
        return Int4Planes.cat_rows(parts)  # type: ignore[arg-type]

    # Projections whose codes the C++ operator multiplies are built from the codes alone, one at a
    # time (``pack_model``): their dense weights are never loaded (a tensor of the wrong shape is
    # loaded, for build_model to report).
    codes: dict[str, GGUFWeight] = {}
    if use_op and torch.device(device).type == "cpu":
        for i in range(config.num_layers):
            for sub in PACKABLE:
                name = f"layers.{i}.{sub}"
                if all(hf in by_hf and file_shape(hf) == shapes[hf] for hf in sources[name + ".weight"]):
                    found = planes_for(name)
                    if isinstance(found, GGUFWeight):
                        codes[name] = found
                        if not _file_view(found, by_hf[sources[name + ".weight"][0]]):
                            for hf in sources[name + ".weight"]:  # fused, unpermuted or converted: a copy
                                release_pages(by_hf[hf])
    vocab = _vocab_codes(config, by_hf, shapes, blocks_for) if codes else _VocabCodes(None, None)
    if codes:
        _log_conversions(g.path, by_hf.values())
    skip = {name + ".weight" for name in codes}
    if vocab.embedding is not None:
        skip.add("embed_tokens.weight")
    if vocab.head is not None and not config.tie_word_embeddings:
        skip.add("lm_head.weight")
    model = build_model(config, get, by_hf, dtype=dtype, device=device, shard=shard, get_slice=get_slice, skip=skip)
    if vocab.embedding is not None:
        model.embed_tokens = CodesEmbedding(vocab.embedding)
    if vocab.head is not None:
        model.lm_head = CodesHead(vocab.head)
    head = codes_of(head_name) if use_op and head_name in by_hf and vocab.head is None else None
    return pack_model(model, lambda name: codes[name] if name in codes else planes_for(name), quantization,
                      head_codes=head if isinstance(head, GGUFWeight) else None, unloaded=codes.keys(),
                      source=source_id(g.path, g.stat))


def _log_conversions(path: Path, tensors: Iterable[GGUFTensor]) -> None:
    """One INFO line naming the tensor types of ``path`` the operator gets converted (``gguf_convert``)."""
    names = (t.tensor_type.name for t in tensors)
    counts = Counter(q for q in names if converted_type(q) not in (None, q))
    if counts:
        kinds = ", ".join(f"{n} {q} as {converted_type(q)}" for q, n in sorted(counts.items()))
        log.info("%s: converted at load: %s (fused groups of mixed types as Q8_0)", path.name, kinds)


def _file_view(w: GGUFWeight, t: GGUFTensor) -> bool:
    """Whether ``w``'s bytes are ``t``'s pages of the mapped file (not a copy)."""
    return w.raw.data_ptr() == np.asarray(t.data).__array_interface__["data"][0]


class _VocabCodes(NamedTuple):
    embedding: GGUFWeight | None
    head: GGUFWeight | None


def _vocab_codes(config: ModelConfig, by_hf: dict[str, GGUFTensor], shapes: dict[str, tuple[int, ...]],
                 blocks_for: Callable[[list[str]], GGUFWeight | None]) -> _VocabCodes:
    """The token embedding and LM head a CPU load with the GGUF operator keeps as the file's blocks
    (``treeserve.models.vocab_codes``): the head when ``head_from_codes`` says so, the embedding
    unless it is also the float32 head (tied), as the load's ``blocks_for`` gives them (the file's
    pages, or a converted tensor kept by ``blocks_cache``). Either is None where its tensor is not
    quantized or not of the expected shape (``build_model`` then loads it, or reports the bad shape)."""

    def codes(hf: str) -> GGUFWeight | None:
        t = by_hf.get(hf)
        if t is None or tuple(int(d) for d in reversed(t.shape)) != shapes[hf]:
            return None
        w = blocks_for([hf])
        if w is not None and not _file_view(w, t):
            release_pages(t)
        return w

    embedding = codes("model.embed_tokens.weight")
    head_hf = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    head = codes(head_hf) if head_from_codes(config.vocab_size, config.hidden_size) else None
    if config.tie_word_embeddings and head is None:
        embedding = None  # the float32 ExactHead's matrix serves the lookups too
    return _VocabCodes(embedding, head)
