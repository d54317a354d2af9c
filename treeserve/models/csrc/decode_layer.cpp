// treeserve::decode_layers: every decoder layer of a float32 Llama model for one decode step (M
// tokens, one per request), in one call. Per layer, exactly the Python path's sequence:
//   normed = rms_norm(x)                        treeserve::add_rms_norm
//   qkv    = normed @ Wqkv^T                     treeserve::gguf_linear (GGUF blocks), gguf_linear_q8 (GGUF
//                                                blocks, int8 activations), treeserve::int8_linear
//                                                (prepacked int8) or at::linear
//   q, k   = rms_norm per head (Qwen3, when      add_rms_norm on the [rows * heads, head_dim] views
//            norms holds 4L tensors)
//   q, k   = rope(q, k) (rotate-half); store k, v at slots[i] of the layer's caches
//   o      = paged decode attention(q)           treeserve::paged_decode_attention
//   x, normed = x + o @ Wo^T, rms_norm(...)      gguf_linear, add_rms_norm
//   x      = x + down(silu(gate) * up)           int8_swiglu_linear, or at::silu / mul_ then gguf_linear;
//                                                add_rms_norm of the next layer (the add folded into
//                                                its input norm)
// The existing operators are called through the dispatcher (their kernels, not copies). RoPE is
// computed as torch's mul/addcmul round it, so the result equals the Python path bit for bit.
// float32 activations; the caches (float32, bfloat16 or float16, written in place) as the Python layer keeps
// them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "treeserve_checks.h"
#include "treeserve_lanes.h"
#include "treeserve_vec.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, std::string, int64_t);
using Norm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                const at::Tensor&, double);
using Int8Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&);
using Attn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, double);

struct Ops {
  c10::TypedOperatorHandle<Linear> linear;
  c10::TypedOperatorHandle<Linear> linear_q8;
  c10::TypedOperatorHandle<Norm> norm;
  c10::TypedOperatorHandle<Attn> attn;
};

const Ops& ops() {
  static const Ops o{
      c10::Dispatcher::singleton().findSchemaOrThrow("treeserve::gguf_linear", "").typed<Linear>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("treeserve::gguf_linear_q8", "").typed<Linear>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("treeserve::add_rms_norm", "").typed<Norm>(),
      c10::Dispatcher::singleton().findSchemaOrThrow("treeserve::paged_decode_attention", "").typed<Attn>()};
  return o;
}

// a*c - b*s and b*c + a*s as torch's mul then addcmul compute them: the first product rounded, the
// second fused into the add where the host has FMA (torch's vectorized kernels are contracted).
__attribute__((optimize("fp-contract=off"))) void rotate(const float* x, const float* cs, const float* sn,
                                                         float* out, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[half + i];
    const float ac = a * cs[i], bc = b * cs[i];
#ifdef __FMA__
    out[i] = std::fma(-b, sn[i], ac);
    out[half + i] = std::fma(a, sn[i], bc);
#else
    out[i] = ac - b * sn[i];
    out[half + i] = bc + a * sn[i];
#endif
  }
}

template <typename Index>
void check_slots(const Index* slot, int64_t m, int64_t num_slots) {
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK_VALUE(slot[i] >= 0 && slot[i] < num_slots, "out_slots must lie in [0, ", num_slots, "), got ",
                      static_cast<int64_t>(slot[i]));
}

// RoPE on the q and k heads of qkv [M, (Hq + 2 Hkv) D]: q into q_out [M, Hq, D], k and v into the
// caches' rows slot[i] ([num_slots, Hkv, D] views); q, k and v in the caches' type: float32, or
// rounded to bfloat16 / float16 the way torch's Tensor.to rounds (c10::BFloat16's and c10::Half's round
// to nearest even).
template <typename C>
void rope_store(const float* qkv, const float* table, const int64_t* pos, const int64_t* slot, C* q_out,
                C* kc, C* vc, int64_t m, int64_t hq, int64_t hkv, int64_t dim) {
  const int64_t half = dim / 2, width = (hq + 2 * hkv) * dim;
  // Rows write distinct slots (padding rows may share the dummy slot 0, whose content is never read).
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> q(static_cast<size_t>(hq * dim)), k(static_cast<size_t>(hkv * dim));
    for (int64_t i = r0; i < r1; ++i) {
      const float* row = qkv + i * width;
      const float* cs = table + pos[i] * dim;  // [2, D/2]: cos then sin
      for (int64_t h = 0; h < hq; ++h) rotate(row + h * dim, cs, cs + half, q.data() + h * dim, half);
      for (int64_t h = 0; h < hkv; ++h) rotate(row + (hq + h) * dim, cs, cs + half, k.data() + h * dim, half);
      treeserve_lanes::narrow(q.data(), q_out + i * hq * dim, hq * dim);
      treeserve_lanes::narrow(k.data(), kc + slot[i] * hkv * dim, hkv * dim);
      treeserve_lanes::narrow(row + (hq + hkv) * dim, vc + slot[i] * hkv * dim, hkv * dim);
    }
  });
}

// t as float32: itself, or a bfloat16 / float16 tensor widened in one loop (exact; at::Tensor::to took
// ~45 us for the [64, 9, 64] attention output of a batch-64 step).
at::Tensor widen(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat) return t;
  const at::Tensor src = t.contiguous();
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(at::kFloat));
  treeserve_lanes::by_storage(src.scalar_type(), [&](auto storage) {
    using T = typename decltype(storage)::type;
    treeserve_lanes::widen(src.const_data_ptr<T>(), out.data_ptr<float>(), src.numel());
  });
  return out;
}

// Operands a projection of this qtype takes from projs: "int8" = treeserve::int8_linear's prepacked
// codes, scales, zero points and block mixer; every other qtype one tensor.
int64_t operand_count(const std::string& qtype) { return qtype == "int8" ? 4 : 1; }

const c10::TypedOperatorHandle<Int8Linear>& int8_op() {  // looked up on first use: loaded from Python
  static const auto o =
      c10::Dispatcher::singleton().findSchemaOrThrow("treeserve::int8_linear", "").typed<Int8Linear>();
  return o;
}

const c10::TypedOperatorHandle<Int8Linear>& int8_swiglu_op() {  // same library as int8_linear
  static const auto o =
      c10::Dispatcher::singleton().findSchemaOrThrow("treeserve::int8_swiglu_linear", "").typed<Int8Linear>();
  return o;
}

// x @ w^T with the operands at projs[at]: qtype "dense" = a float32 weight [N, K] through at::linear
// (what F.linear runs), "int8" through treeserve::int8_linear, "q8:" + a GGUF qtype its blocks through
// treeserve::gguf_linear_q8 (int8 activations), else GGUF blocks through treeserve::gguf_linear.
at::Tensor project(const Ops& op, const at::Tensor& x, at::TensorList projs, int64_t at, const std::string& qtype,
                   int64_t k) {
  const at::Tensor& w = projs[at];
  if (qtype == "int8") return int8_op().call(x, w, projs[at + 1], projs[at + 2], projs[at + 3]);
  if (qtype == "dense") {
    TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == k && w.scalar_type() == at::kFloat,
                      "a dense projection must be a float32 [N, ", k, "] weight, got ", w.sizes(), " ", w.scalar_type());
    return at::linear(x, w);
  }
  if (qtype.rfind("q8:", 0) == 0) return op.linear_q8.call(x, w, qtype.substr(3), k);
  return op.linear.call(x, w, qtype, k);
}

// down(silu(gate) * up) for gu = [gate | up] [M, 2 I] with down's operands at projs[at]: an "int8"
// projection through treeserve::int8_swiglu_linear (the SwiGLU computed inside, as
// PackedLinear.swiglu_forward does), every other one after at::silu and mul_.
at::Tensor swiglu_down(const Ops& op, const at::Tensor& gu, at::TensorList projs, int64_t at,
                       const std::string& qtype) {
  if (qtype == "int8") return int8_swiglu_op().call(gu, projs[at], projs[at + 1], projs[at + 2], projs[at + 3]);
  const int64_t inter = gu.size(1) / 2;
  at::Tensor act = at::silu(gu.narrow(1, 0, inter));
  act.mul_(gu.narrow(1, inter, inter));
  return project(op, act, projs, at, qtype, inter);
}

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
}

at::Tensor decode_layers(const at::Tensor& h, const at::Tensor& rope_table, const at::Tensor& positions,
                         at::TensorList norms, at::TensorList projs, c10::List<std::string> qtypes,
                         at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& out_slots,
                         const at::Tensor& kv_indptr, const at::Tensor& kv_page_indices,
                         const at::Tensor& kv_last_page_len, int64_t num_heads, int64_t num_kv_heads, double eps,
                         double scale) {
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK_VALUE(layers >= 1 && static_cast<int64_t>(v_caches.size()) == layers &&
                        (static_cast<int64_t>(norms.size()) == 2 * layers ||
                         static_cast<int64_t>(norms.size()) == 4 * layers) &&
                        static_cast<int64_t>(qtypes.size()) == 4 * layers,
                    "need L >= 1 k_caches and v_caches, 2L norms (4L with per-head query / key norms) and 4L "
                    "qtypes; got L=", layers, ", ",
                    v_caches.size(), " v_caches, ", norms.size(), " norms, ", qtypes.size(), " qtypes");
  std::vector<int64_t> first(qtypes.size() + 1, 0);  // projection i's operands start at projs[first[i]]
  for (size_t i = 0; i < qtypes.size(); ++i) first[i + 1] = first[i] + operand_count(qtypes.get(i));
  TORCH_CHECK_VALUE(static_cast<int64_t>(projs.size()) == first.back(), "projs must hold ", first.back(),
                    " tensors for these qtypes (4 per \"int8\", 1 per other), got ", projs.size());
  check_f32(h, "h");
  check_f32(rope_table, "rope_table");
  TORCH_CHECK_VALUE(h.dim() == 2, "h must be [M, hidden], got ", h.sizes());
  const int64_t m = h.size(0), hidden = h.size(1);
  TORCH_CHECK_VALUE(num_heads >= 1 && num_kv_heads >= 1 && num_heads % num_kv_heads == 0,
                    "num_heads must be a positive multiple of num_kv_heads, got ", num_heads, " and ",
                    num_kv_heads);
  const auto& kc0 = k_caches[0];
  TORCH_CHECK_VALUE(kc0.dim() == 4 && kc0.size(2) == num_kv_heads, "k_caches must be [P, page_size, ",
                    num_kv_heads, ", head_dim], got ", kc0.sizes());
  const int64_t dim = kc0.size(3), num_slots = kc0.size(0) * kc0.size(1);
  TORCH_CHECK_VALUE(dim % 2 == 0 && rope_table.dim() == 3 && rope_table.size(1) == 2 &&
                        rope_table.size(2) == dim / 2,
                    "rope_table must be [positions, 2, head_dim/2 = ", dim / 2, "], got ", rope_table.sizes());
  const at::ScalarType cache_type = kc0.scalar_type();
  TORCH_CHECK_TYPE(cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kHalf,
                   "caches must be float32, bfloat16 or float16, got ", cache_type);
  for (int64_t l = 0; l < layers; ++l) {
    for (const auto& c : {k_caches[l], v_caches[l]}) {
      TORCH_CHECK_TYPE(c.scalar_type() == cache_type && c.device().is_cpu() && c.is_contiguous(),
                       "every layer's caches must be contiguous CPU tensors of one dtype, got ", c.scalar_type(),
                       " at layer ", l);
      TORCH_CHECK_VALUE(c.sizes() == kc0.sizes(), "every layer's caches must have shape ", kc0.sizes(),
                        ", got ", c.sizes(), " at layer ", l);
    }
  }
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt,
                   "positions must be int32 or int64");
  TORCH_CHECK_TYPE(out_slots.scalar_type() == at::kLong || out_slots.scalar_type() == at::kInt,
                   "out_slots must be int32 or int64");
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == m && out_slots.dim() == 1 &&
                        out_slots.size(0) == m,
                    "positions and out_slots must be [M=", m, "], got ", positions.sizes(), " and ",
                    out_slots.sizes());
  const at::Tensor pos = positions.to(at::kLong).contiguous(), slot = out_slots.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slot.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK_VALUE(pp[i] >= 0 && pp[i] < rope_table.size(0), "positions must lie in [0, ",
                      rope_table.size(0), "), got ", pp[i]);
  check_slots(sp, m, num_slots);
  // Checked before the first layer writes any KV (paged_decode_attention checks it again per layer).
  treeserve_checks::check_page_table(kv_indptr, kv_page_indices, kv_last_page_len, m, kc0.size(0), kc0.size(1));

  const Ops& op = ops();
  const int64_t q_size = num_heads * dim;
  const bool qk_norms = static_cast<int64_t>(norms.size()) == 4 * layers;
  for (int64_t i = 0; i < static_cast<int64_t>(norms.size()); ++i) {  // before any layer writes its KV
    check_f32(norms[i], "norms");
    const int64_t width = i < 2 * layers ? hidden : dim;  // the layer norms, then the per-head q / k norms
    TORCH_CHECK_VALUE(norms[i].dim() == 1 && norms[i].size(0) == width, "norms[", i, "] must be [",
                      i < 2 * layers ? "hidden = " : "head_dim = ", width, "], got ", norms[i].sizes());
  }
  at::Tensor x = h.contiguous();
  at::Tensor normed = std::get<1>(op.norm.call(x, std::nullopt, norms[0], eps));
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor qkv = project(op, normed, projs, first[4 * l], qtypes.get(4 * l), hidden);
    TORCH_CHECK_VALUE(qkv.size(1) == q_size + 2 * num_kv_heads * dim, "layer ", l,
                      "'s qkv projection must have (num_heads + 2 num_kv_heads) * head_dim rows, got ", qkv.size(1));
    if (qk_norms) {  // Qwen3: each q and k head normalized over head_dim, by the Python layer's operator
      const int64_t kv_size = num_kv_heads * dim;
      for (const auto& [start, size, heads, w] : {std::tuple(int64_t{0}, q_size, num_heads, norms[2 * layers + 2 * l]),
                                                  std::tuple(q_size, kv_size, num_kv_heads, norms[2 * layers + 2 * l + 1])}) {
        const at::Tensor part = qkv.narrow(1, start, size);
        part.copy_(std::get<1>(op.norm.call(part.reshape({m * heads, dim}), std::nullopt, w, eps)).view({m, size}));
      }
    }
    at::Tensor q = at::empty({m, num_heads, dim}, h.options().dtype(cache_type));
    treeserve_lanes::by_storage(cache_type, [&](auto storage) {  // checked above: one of the three
      using C = typename decltype(storage)::type;
      rope_store(qkv.data_ptr<float>(), rope_table.data_ptr<float>(), pp, sp, q.data_ptr<C>(),
                 k_caches[l].data_ptr<C>(), v_caches[l].data_ptr<C>(), m, num_heads, num_kv_heads, dim);
    });
    // A 16-bit cache attends with q rounded to it, the output back in float32 (as the Python layer).
    const at::Tensor o = widen(op.attn.call(q, k_caches[l], v_caches[l], kv_indptr, kv_page_indices,
                                            kv_last_page_len, scale));
    const at::Tensor attn = project(op, o.view({m, q_size}), projs, first[4 * l + 1], qtypes.get(4 * l + 1), q_size);
    std::tie(x, normed) = op.norm.call(x, attn, norms[2 * l + 1], eps);
    const at::Tensor gu = project(op, normed, projs, first[4 * l + 2], qtypes.get(4 * l + 2), hidden);
    const at::Tensor down = swiglu_down(op, gu, projs, first[4 * l + 3], qtypes.get(4 * l + 3));
    if (l + 1 < layers) {
      std::tie(x, normed) = op.norm.call(x, down, norms[2 * l + 2], eps);
    } else {
      x = x + down;
    }
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treeserve, m) {
  m.def(
      "decode_layers(Tensor h, Tensor rope_table, Tensor positions, Tensor[] norms, Tensor[] projs, str[] qtypes, "
      "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor out_slots, Tensor kv_indptr, Tensor kv_page_indices, "
      "Tensor kv_last_page_len, int num_heads, int num_kv_heads, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(treeserve, CPU, m) { m.impl("decode_layers", &decode_layers); }
// int8 projections pass oneDNN-prepacked (MkldnnCPU) weights, which make the call dispatch there.
TORCH_LIBRARY_IMPL(treeserve, MkldnnCPU, m) { m.impl("decode_layers", &decode_layers); }
