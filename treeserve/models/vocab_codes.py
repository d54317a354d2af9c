"""Token embedding and LM head kept as a GGUF file's codes (issue 33): no float32 vocabulary matrix.

A Llama-3-8B GGUF holds two ``[128256, 4096]`` matrices; as float32 they take 4.2 GB beside a
4.3 GiB Q4_0 file. Here they stay as the file's blocks (``GGUFWeight``, read in place from the
mapping):

- ``CodesEmbedding``: a lookup dequantizes the looked-up rows only (``GGUFWeight.dequantize_rows``),
  bitwise the rows of the dequantized matrix, so a model's outputs do not change;
- ``CodesHead``: logits from ``treeserve::gguf_linear`` (Q4_0 / Q8_0: activations rounded to int16
  codes per 32-block, bound ``(2 (K + 2) 2^-24 (|x| + e) + e) |W_j|`` with ``e`` the rounding's
  norm, ``CodesHead.row_bound``; from ``q8_min_rows`` rows, where set, ``gguf_linear_q8``'s int8
  codes, the same bound with int8's wider ``e``) or ``gguf_linear_exact`` (Q4_1: float32 activations, the float32
  product of the dequantized head up to summation order, bound ``2 (K + 2) 2^-24 |x| |W_j|``), then
  every entry the bound cannot rule out of the argmax re-scored in float32 from its dequantized row
  (``treeserve::codes_head_rescore``, one C++ call per step; ``ExactHead``'s contract: greedy picks
  the float32 head's token), for every batch size. The
  other logits differ from the float32 head's by at most that bound.

Which models (``vocab_from_codes``): the embedding is read from its codes whenever it is not also
the float32 head; the head is read from its codes when its float32 copy would exceed
``HEAD_CODES_MIN_BYTES`` (512 MiB: SmolLM2-135M's 113 MB head stays the float32 ``ExactHead``, so
its outputs are unchanged; Llama-3.2-1B's 1.05 GB and larger heads take codes).
``TREESERVE_HEAD_CODES=0|1`` overrides the size rule.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from treeserve.models.gguf_op import GGUFWeight, gguf_op_available

__all__ = ["HEAD_CODES_MIN_BYTES", "INT16_HEAD_QTYPES", "CodesEmbedding", "CodesHead", "head_from_codes", "row_norms"]

HEAD_CODES_MIN_BYTES = 1 << 29
"""A head whose float32 copy (``4 * vocab * hidden`` bytes) is larger is kept as codes (``head_from_codes``)."""

_tracing = torch.compiler.is_compiling
"""True while Dynamo traces (``CodesHead`` then re-scores with static shapes); tests patch it."""


INT16_HEAD_QTYPES = ("Q4_0", "Q8_0")
"""Head qtypes whose first pass may round x to int16 codes per 32-block (``gguf_linear``, ~2-3x faster
than float32 activations): the rounding bound (``CodesHead.row_bound``) covers their integer products;
Q4_1's offset term ``m sum(x)`` is not covered, so a Q4_1 head keeps float32 activations."""


def head_from_codes(vocab_size: int, hidden_size: int) -> bool:
    """Whether a loader keeps a ``[vocab_size, hidden_size]`` LM head as codes (``CodesHead``): its float32
    copy would exceed ``HEAD_CODES_MIN_BYTES``, unless ``TREESERVE_HEAD_CODES`` is ``0`` (never) or
    ``1`` (always; any other value is a ``ValueError``). Needs the C++ GGUF operator either way."""
    env = os.environ.get("TREESERVE_HEAD_CODES")
    if env not in (None, "0", "1"):
        raise ValueError(f"TREESERVE_HEAD_CODES must be '0' or '1', got {env!r}")
    if env is not None:
        return env == "1"
    return 4 * vocab_size * hidden_size > HEAD_CODES_MIN_BYTES


def row_norms(codes: GGUFWeight) -> torch.Tensor:
    """``|W_j|`` of every row of the dequantized weight, float32 ``[N]``: the squares of the float32
    dequantization (bitwise gguf's) summed in float64, the root rounded once to float32, by
    ``treeserve::codes_row_norms`` (parallel over rows, no dequantized matrix). Needs the C++ GGUF
    operator, as ``CodesHead`` does (``RuntimeError`` otherwise)."""
    if not gguf_op_available():
        raise RuntimeError("row_norms needs the C++ GGUF operator (treeserve::codes_row_norms), which is not built")
    return torch.ops.treeserve.codes_row_norms(codes.raw, codes.qtype, codes.shape[1])


class _Codes(nn.Module):
    """A module holding one ``GGUFWeight`` as its ``raw`` buffer (no copy: the file's pages when mapped)."""

    def __init__(self, codes: GGUFWeight) -> None:
        super().__init__()
        if not isinstance(codes, GGUFWeight):
            raise TypeError(f"codes must be a GGUFWeight, got {type(codes).__name__}")
        self.qtype, self.in_features = codes.qtype, codes.in_features
        self.register_buffer("raw", codes.raw, persistent=False)

    @property
    def codes(self) -> GGUFWeight:
        """The blocks as a ``GGUFWeight`` (the same storage)."""
        return GGUFWeight(self.qtype, self.raw, self.in_features)


class CodesEmbedding(_Codes):
    """``forward(ids [*S]) -> float32 [*S, K]``: rows of a ``[V, K]`` embedding held as GGUF blocks."""

    def __init__(self, codes: GGUFWeight) -> None:
        super().__init__(codes)
        self.num_embeddings = codes.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.codes.dequantize_rows(ids)


class CodesHead(_Codes):
    """LM head ``x [M, K] -> float32 logits [M, V]`` over GGUF blocks, greedy-exact (module docstring).

    Requires the C++ GGUF operator (``gguf_op_available()``; ``RuntimeError`` otherwise: a loader
    without it keeps the float32 head). ``row_norms`` (``|W_j|``, float32 ``[V]``) are computed
    once from the codes (:func:`row_norms`).
    """

    def __init__(self, codes: GGUFWeight) -> None:
        if not gguf_op_available():
            raise RuntimeError("CodesHead needs the C++ GGUF operator (treeserve::gguf_linear_exact), which is not built")
        super().__init__(codes)
        self.out_features = codes.shape[0]
        self.register_buffer("row_norms", row_norms(codes), persistent=False)
        self.bound_factor = 2 * (codes.in_features + 2) * 2.0**-24
        self.max_candidates = 64  # per row, in a traced step (``_rescore_static``)
        self.int16 = codes.qtype in INT16_HEAD_QTYPES  # the first pass rounds x to int16 codes
        self.q8_min_rows: int | None = None
        """Batches of at least this many rows round x to int8 codes instead (``gguf_linear_q8``: more
        entries to re-score, a faster pass; ``quant.use_q8_head`` measures where it pays). None: never.
        Eager steps of Q4_0 / Q8_0 heads only (a traced step re-scores a fixed number per row)."""

    def _q8(self, x: torch.Tensor) -> bool:
        return self.int16 and self.q8_min_rows is not None and x.shape[0] >= self.q8_min_rows and not _tracing()

    def row_bound(self, x: torch.Tensor, q8: bool = False) -> torch.Tensor:
        """``[M, 1]``: the first pass's logit ``j`` of row ``m`` is within ``row_bound(x)[m] * |W_j|`` of
        the float32 head's. Float32 activations: ``2 (K + 2) 2^-24 |x|``. Integer codes ``x'`` (Q4_0,
        Q8_0): ``|x - x'| <= e = sqrt(9 sum_b s_b^2)`` (each element within ``s_b / 2``, ``s_b = max|x_b|
        / 32767`` for int16, ``/ 127`` for int8 (``q8``), float rounding included) adds ``e`` and
        ``2 (K + 2) 2^-24 e`` to it (the integer dot products are exact; the float32 sum of the block
        terms, at most ``|x'| |W_j|`` in all, is within the same factor)."""
        norm = x.norm(dim=1, keepdim=True)
        if not self.int16:
            return self.bound_factor * norm
        s = x.view(x.shape[0], x.shape[1] // 32, 32).abs().amax(-1) / (127 if q8 else 32767)  # rows may be 0
        e = (9 * s.square().sum(-1, keepdim=True)).sqrt()
        return self.bound_factor * (norm + e) + e

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x, self._q8(x))

    def logits(self, x: torch.Tensor, q8: bool) -> torch.Tensor:
        """``forward`` with the first pass chosen: ``q8`` the int8 codes (Q4_0 / Q8_0, eager; a
        ``ValueError`` for a Q4_1 head, whose offset term the bound does not cover), else the default
        (int16 codes, float32 for Q4_1)."""
        if q8 and not self.int16:
            raise ValueError(f"q8: the int8 first pass needs a Q4_0 or Q8_0 head, this one is {self.qtype}")
        x = x.float().contiguous()
        if q8:
            first = torch.ops.treeserve.gguf_linear_q8
        else:
            first = torch.ops.treeserve.gguf_linear if self.int16 else torch.ops.treeserve.gguf_linear_exact
        logits = first(x, self.raw, self.qtype, self.in_features)
        bound = self.row_bound(x, q8)
        if _tracing():
            return self._rescore_static(x, logits, bound * self.row_norms)
        torch.ops.treeserve.codes_head_rescore(logits, x, self.raw, self.qtype, self.in_features, bound.view(-1),
                                               self.row_norms)
        return logits

    def _rescore_static(self, x: torch.Tensor, logits: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
        """The re-scoring with static shapes, for a traced step (``torch.compile(fullgraph=True)``):
        the ``max_candidates`` entries of highest upper bound per row are re-scored, which covers
        every entry the bound cannot rule out unless a row has more of them (that row then keeps
        first-pass values, within the bound, for the rest)."""
        idx = (logits + bound).topk(min(self.max_candidates, logits.shape[1]), dim=1).indices  # [M, C]
        exact = torch.einsum("mk,mck->mc", x, self.codes.dequantize_rows(idx))
        return logits.scatter(1, idx, exact)
