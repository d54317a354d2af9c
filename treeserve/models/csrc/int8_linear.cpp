// treeserve::int8_linear: y = x @ W^T for many rows (prefill, batched decode) as an int8 GEMM.
//
// Both operands are first rotated by the same orthogonal transform R (x W^T = (x R)(W R)^T): 64 x 64
// Walsh-Hadamard blocks scaled by 1/8, then an orthogonal B x B matrix `mix` across the B = K / 64
// blocks (out block c = sum_b mix[c, b] * block b). The rotation spreads the few large activation
// channels of LLM hidden states over the whole row, which is what makes per-row int8 accurate. The weight side, W R rounded to per-output-channel int8 codes with
// scales w_scales [N], is prepared once in Python (int8_op.Int8Weight) and prepacked by
// onednn::qlinear_prepack. Here each row of x R is rounded symmetrically, q = round(x R * x_max() /
// amax|x R|), stored as uint8 q + x_zero(), so every row has its own scale and a row's result never
// depends on the other rows of the batch. The integer product runs in oneDNN
// (onednn::qlinear_pointwise through the dispatcher: torch's kernel, exact int32 accumulation)
// and each output row is multiplied by its activation scale. treeserve::int8_swiglu_linear takes
// [gate | up] [M, 2K] and multiplies silu(gate) * up, computed row by row on the way into the
// rotation (a SwiGLU MLP's down projection without the [M, K] activation tensor).
//
// Saturation: without VNNI, x86 int8 GEMMs multiply with vpmaddubsw, which adds two u8 x s8
// products into a saturating int16. There activation codes are 7 bits, in [1, 127] (x_max() = 63,
// zero point 64): times weight codes in [-127, 127], 2 * 127 * 127 = 32258 stays below 32767. With
// VNNI (vpdpbusd adds u8 x s8 products straight into int32) they are 8 bits, in [1, 255] (x_max()
// = 127, zero point 128): half the rounding error (SmolLM2-135M, 1,023 tokens of prefill scored:
// perplexity +0.71% over the dense weights instead of +1.71%). So the int32 result is exact on every
// x86 ISA: 8 bits where this source is compiled for VNNI and oneDNN may use it (ONEDNN_MAX_CPU_ISA /
// DNNL_MAX_CPU_ISA, when set, names an ISA with VNNI), 7 elsewhere. TREESERVE_INT8_VNNI_CODES=0|1
// sets the width at build time instead (the tests' variant builds).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "treeserve_library.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "treeserve_vec.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#ifndef TREESERVE_INT8_VNNI_CODES
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define TREESERVE_INT8_VNNI_CODES 1
#else
#define TREESERVE_INT8_VNNI_CODES 0
#endif
#endif

namespace {

// Whether oneDNN may pick a VNNI kernel: no ISA cap set, or a cap whose name includes VNNI (AVX512_CORE_VNNI,
// AVX2_VNNI, ...) or an ISA above it (AVX512_CORE_BF16 / _FP16 / _AMX..., AVX10_*, ALL, DEFAULT).
bool onednn_may_use_vnni() {
  for (const char* var : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    const char* cap = std::getenv(var);
    if (cap == nullptr || *cap == '\0') continue;
    std::string isa(cap);
    for (char& c : isa) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    for (const char* above : {"VNNI", "BF16", "FP16", "AMX", "AVX10", "ALL", "DEFAULT"})
      if (isa.find(above) != std::string::npos) return true;
    return false;
  }
  return true;
}

// Largest activation code magnitude: 127 (8 bits) where the product is VNNI's, else 63 (see the top).
int64_t x_max() {
  static const int64_t v = TREESERVE_INT8_VNNI_CODES && onednn_may_use_vnni() ? 127 : 63;
  return v;
}

// The activation codes' zero point: codes are stored as uint8 q + x_zero(), in [1, 2 x_max() + 1].
int64_t x_zero() { return x_max() + 1; }
constexpr int64_t BLOCK = 64;  // Walsh-Hadamard block (K must be a multiple)

// The Hadamard butterfly stages whose partners lie whole registers apart (stride h = 1, 2, ... < n
// registers): r[j], r[j + h] <- r[j] + r[j + h], r[j] - r[j + h], for registers of any width.
template <typename V, typename Add, typename Sub>
inline void butterflies_across(V* r, int n, Add add, Sub sub) {
  for (int h = 1; h < n; h *= 2)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const V a = r[j], b = r[j + h];
        r[j] = add(a, b);
        r[j + h] = sub(a, b);
      }
}

const c10::OperatorHandle& qlinear() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  return op;
}

#ifdef TREESERVE_AVX512
// One 64-float block in four 16-lane registers -> the block times H / 8: the same butterflies, in the
// same order, as hadamard64 (bitwise equal). Stages h = 1, 2, 4, 8 inside each register (b = v with
// partners swapped; lanes whose bit is set in Upper take partner - self), h = 16, 32 across them.
template <int Upper>
inline __m512 in_register16(__m512 v, __m512 b) {
  return _mm512_mask_sub_ps(_mm512_add_ps(v, b), static_cast<__mmask16>(Upper), b, v);
}

inline void hadamard64_16(const float* in, __m512 r[4]) {
  for (int i = 0; i < 4; ++i) {
    __m512 v = _mm512_loadu_ps(in + 16 * i);
    v = in_register16<0xAAAA>(v, _mm512_permute_ps(v, 0b10110001));            // h = 1
    v = in_register16<0xCCCC>(v, _mm512_permute_ps(v, 0b01001110));            // h = 2
    v = in_register16<0xF0F0>(v, _mm512_shuffle_f32x4(v, v, 0b10110001));      // h = 4
    v = in_register16<0xFF00>(v, _mm512_shuffle_f32x4(v, v, 0b01001110));      // h = 8
    r[i] = v;
  }
  butterflies_across(r, 4, [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); },
                     [](__m512 a, __m512 b) { return _mm512_sub_ps(a, b); });  // h = 16, 32 floats
  const __m512 eighth = _mm512_set1_ps(0.125f);
  for (int i = 0; i < 4; ++i) r[i] = _mm512_mul_ps(r[i], eighth);
}

// Output blocks c .. c + N - 1 of one row: block c + n = sum_b mix[c + n, b] * block b (fused
// multiply-adds in b order, as the portable loop compiles), accumulated in registers, stored to
// `row`; returns `amax` raised to their largest |.|. With N = 2 each loaded input block feeds eight
// accumulators.
template <int N>
inline __m512 mix_blocks(const float* blocks, const float* mix, int64_t nb, int64_t c, float* row, __m512 amax) {
  __m512 acc[N][4];
  for (int n = 0; n < N; ++n)
    for (int i = 0; i < 4; ++i) acc[n][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 w[N];
    for (int n = 0; n < N; ++n) w[n] = _mm512_set1_ps(mix[(c + n) * nb + b]);
    for (int i = 0; i < 4; ++i) {
      const __m512 in = _mm512_loadu_ps(blocks + b * BLOCK + 16 * i);
      for (int n = 0; n < N; ++n) acc[n][i] = _mm512_fmadd_ps(w[n], in, acc[n][i]);
    }
  }
  for (int n = 0; n < N; ++n)
    for (int i = 0; i < 4; ++i) {
      _mm512_storeu_ps(row + (c + n) * BLOCK + 16 * i, acc[n][i]);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(acc[n][i]));
    }
  return amax;
}

// One row (AVX-512): the Hadamard blocks into `blocks`, the mixed blocks into `row` (two output
// blocks at a time, then the odd one), |.| max tracked, then the codes.
void quantize_row(const float* x, const float* mix, float* blocks, float* row, uint8_t* q, float* scale, int64_t k) {
  const int64_t nb = k / BLOCK;
  for (int64_t b = 0; b < nb; ++b) {
    __m512 r[4];
    hadamard64_16(x + b * BLOCK, r);
    for (int i = 0; i < 4; ++i) _mm512_storeu_ps(blocks + b * BLOCK + 16 * i, r[i]);
  }
  __m512 amax = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 2 <= nb; c += 2) amax = mix_blocks<2>(blocks, mix, nb, c, row, amax);
  if (c < nb) amax = mix_blocks<1>(blocks, mix, nb, c, row, amax);
  const float m = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(m > 0.f ? static_cast<float>(x_max()) / m : 0.f);
  const __m512i zero = _mm512_set1_epi32(x_zero());
  for (int64_t j = 0; j < k; j += 16) {
    const __m512i code = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + j), inv)), zero);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtepi32_epi8(code));
  }
  *scale = m / static_cast<float>(x_max());
}

#else  // AVX2 or scalar
// x <- in H / 8 on one block of 64 (H the Sylvester Hadamard matrix of order 64): butterfly
// stages h = 1, 2, ..., 32, each x[j], x[j + h] <- x[j] + x[j + h], x[j] - x[j + h]. The AVX2 and the
// scalar version perform the same additions in the same order (bitwise equal results).
#ifdef __AVX2__
// One butterfly stage inside each 8-lane register: b is v with partners swapped; lanes whose bit
// in `upper` is set take (partner - self), the others (self + partner).
template <int Upper>
inline __m256 in_register(__m256 v, __m256 b) {
  return _mm256_blend_ps(_mm256_add_ps(v, b), _mm256_sub_ps(b, v), Upper);
}

void hadamard64(const float* in, float* x) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) {
    __m256 v = _mm256_loadu_ps(in + 8 * i);
    v = in_register<0b10101010>(v, _mm256_permute_ps(v, 0b10110001));      // h = 1
    v = in_register<0b11001100>(v, _mm256_permute_ps(v, 0b01001110));      // h = 2
    v = in_register<0b11110000>(v, _mm256_permute2f128_ps(v, v, 0x01));    // h = 4
    r[i] = v;
  }
  butterflies_across(r, 8, [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); },
                     [](__m256 a, __m256 b) { return _mm256_sub_ps(a, b); });  // h = 8, 16, 32 floats
  const __m256 eighth = _mm256_set1_ps(0.125f);
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(x + 8 * i, _mm256_mul_ps(r[i], eighth));
}
#else
void hadamard64(const float* in, float* x) {
  std::copy(in, in + BLOCK, x);
  for (int64_t h = 1; h < BLOCK; h *= 2)
    for (int64_t i = 0; i < BLOCK; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  for (int64_t j = 0; j < BLOCK; ++j) x[j] *= 0.125f;
}
#endif


// max |x_j| over k (a multiple of 32) floats, and the codes out_j = round(x_j * inv) + x_zero()
// (round half to even, as the AVX2 conversion does under the default rounding mode).
#ifdef __AVX2__
float amax_abs(const float* x, int64_t k) {
  const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + j), mask));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  return *std::max_element(lanes, lanes + 8);
}

void to_codes(const float* x, float inv, uint8_t* out, int64_t k) {
  const __m256 s = _mm256_set1_ps(inv);
  const __m256i zero = _mm256_set1_epi32(x_zero());
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' lane interleave
  for (int64_t j = 0; j < k; j += 32) {
    __m256i c[4];
    for (int i = 0; i < 4; ++i)
      c[i] = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * i), s)), zero);
    const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), _mm256_permutevar8x32_epi32(bytes, order));
  }
}
#else
float amax_abs(const float* x, int64_t k) {
  float m = 0.f;
  for (int64_t j = 0; j < k; ++j) m = std::max(m, std::fabs(x[j]));
  return m;
}

void to_codes(const float* x, float inv, uint8_t* out, int64_t k) {
  const int32_t zero = static_cast<int32_t>(x_zero());
  for (int64_t j = 0; j < k; ++j) out[j] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(x[j] * inv)) + zero);
}
#endif

// One row, portable: the Hadamard blocks into `blocks`, the mixed blocks into `row`, then the codes.
void quantize_row(const float* x, const float* mix, float* blocks, float* row, uint8_t* q, float* scale, int64_t k) {
  const int64_t nb = k / BLOCK;
  for (int64_t b = 0; b < k; b += BLOCK) hadamard64(x + b, blocks + b);
  for (int64_t c = 0; c < nb; ++c) {  // out block c = sum_b mix[c, b] * block b, summed in registers
    float acc[BLOCK] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const float w = mix[c * nb + b];
      const float* in = blocks + b * BLOCK;
      for (int64_t j = 0; j < BLOCK; ++j) acc[j] += w * in[j];
    }
    std::copy(acc, acc + BLOCK, row + c * BLOCK);
  }
  const float amax = amax_abs(row, k);
  to_codes(row, amax > 0.f ? static_cast<float>(x_max()) / amax : 0.f, q, k);
  *scale = amax / static_cast<float>(x_max());
}
#endif  // TREESERVE_AVX512

// act[j] = silu(gate[j]) * up[j] = gate[j] / (1 + exp(-gate[j])) * up[j] over k floats.
void swiglu_row(const float* gate, const float* up, float* act, int64_t k) {
  int64_t j = 0;
#ifdef TREESERVE_AVX512
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; j + 16 <= k; j += 16) {
    const __m512 g = _mm512_loadu_ps(gate + j);
    const __m512 e = treeserve_vec::exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
    // sigmoid(g) = 1 / (1 + e^-g) for g >= 0, e^g / (1 + e^g) below: exp of a non-positive argument either way
    const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));
    _mm512_storeu_ps(act + j, _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_loadu_ps(up + j)));
  }
#endif
  for (; j < k; ++j) act[j] = gate[j] / (1.0f + std::exp(-gate[j])) * up[j];
}

// Row-wise rotation and quantization into q (uint8, zero point x_zero()); scale[i] = amax(|a_i R|) / x_max(),
// where a_i is row i of x [m, k] or, with swiglu, silu(x[i, :k]) * x[i, k:] of x [m, 2k].
void quantize_rows(const float* x, bool swiglu, const float* mix, uint8_t* q, float* scale, int64_t m, int64_t k) {
  const int64_t width = swiglu ? 2 * k : k;
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> blocks(static_cast<size_t>(k)), row(static_cast<size_t>(k)), act;
    if (swiglu) act.resize(static_cast<size_t>(k));
    for (int64_t r = r0; r < r1; ++r) {
      const float* in = x + r * width;
      if (swiglu) {
        swiglu_row(in, in + k, act.data(), k);
        in = act.data();
      }
      quantize_row(in, mix, blocks.data(), row.data(), q + r * k, scale + r, k);
    }
  });
}

// The int8 product of x's rows (or their SwiGLU) with the prepacked weight, scaled back.
at::Tensor int8_product(const at::Tensor& x, bool swiglu, const at::Tensor& w, const at::Tensor& w_scales,
                        const at::Tensor& w_zeros, const at::Tensor& mix) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.device().is_cpu(), "x must be a 2-D CPU tensor, got ", x.sizes());
  TORCH_CHECK_VALUE(w_scales.dim() == 1 && w_scales.scalar_type() == at::kFloat,
                    "w_scales must be a 1-D float32 tensor, got ", w_scales.sizes(), " ", w_scales.scalar_type());
  const at::Tensor xc = x.contiguous();
  TORCH_CHECK_VALUE(!swiglu || xc.size(1) % 2 == 0, "gate_up must have an even number of columns, got ", xc.size(1));
  const int64_t m = xc.size(0), k = swiglu ? xc.size(1) / 2 : xc.size(1), n = w_scales.size(0);
  TORCH_CHECK_VALUE(k % BLOCK == 0, swiglu ? "gate_up must have 2 x a multiple of " : "x must have a multiple of ",
                    BLOCK, " columns, got ", xc.size(1));
  TORCH_CHECK_VALUE(mix.dim() == 2 && mix.size(0) == k / BLOCK && mix.size(1) == k / BLOCK &&
                        mix.scalar_type() == at::kFloat && mix.is_contiguous(),
                    "mix must be a contiguous float32 [K/64, K/64] = [", k / BLOCK, ", ", k / BLOCK, "], got ",
                    mix.sizes(), " ", mix.scalar_type());
  if (m == 0) return at::empty({0, n}, xc.options());
  at::Tensor q = at::empty({m, k}, xc.options().dtype(at::kByte));
  std::vector<float> scale(static_cast<size_t>(m));
  quantize_rows(xc.data_ptr<float>(), swiglu, mix.data_ptr<float>(), q.data_ptr<uint8_t>(), scale.data(), m, k);
  torch::jit::Stack stack{q,
                          1.0,  // the row scales are applied afterwards
                          x_zero(),
                          w,
                          w_scales,
                          w_zeros,
                          c10::IValue(),
                          1.0,
                          static_cast<int64_t>(0),
                          c10::IValue(at::kFloat),
                          c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()),
                          c10::IValue(std::string(""))};
  qlinear().callBoxed(&stack);
  at::Tensor y = stack.back().toTensor();
  TORCH_CHECK(y.dim() == 2 && y.size(0) == m && y.size(1) == n && y.is_contiguous() && y.scalar_type() == at::kFloat,
              "onednn::qlinear_pointwise returned ", y.sizes(), " ", y.scalar_type(), " for [", m, ", ", n, "]");
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = yp + r * n;
      const float s = scale[r];
      for (int64_t j = 0; j < n; ++j) row[j] *= s;
    }
  });
  return y;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scales,
                       const at::Tensor& w_zeros, const at::Tensor& mix) {
  return int8_product(x, false, w, w_scales, w_zeros, mix);
}

at::Tensor int8_swiglu_linear(const at::Tensor& gate_up, const at::Tensor& w, const at::Tensor& w_scales,
                              const at::Tensor& w_zeros, const at::Tensor& mix) {
  return int8_product(gate_up, true, w, w_scales, w_zeros, mix);
}

int64_t int8_activation_max() { return x_max(); }

}  // namespace

TREESERVE_FRAGMENT(TREESERVE_LIBRARY, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor w_scales, Tensor w_zeros, Tensor mix) -> Tensor");
  m.def("int8_swiglu_linear(Tensor gate_up, Tensor w, Tensor w_scales, Tensor w_zeros, Tensor mix) -> Tensor");
  m.def("int8_activation_max() -> int", &int8_activation_max);  // the activation codes' largest magnitude
}

// The prepacked weight is a MkldnnCPU tensor, which makes the call dispatch to that key.
TREESERVE_IMPL(TREESERVE_LIBRARY, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_swiglu_linear", &int8_swiglu_linear);
}
TREESERVE_IMPL(TREESERVE_LIBRARY, MkldnnCPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_swiglu_linear", &int8_swiglu_linear);
}
