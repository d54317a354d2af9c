// treeserve::exact_head_rescore: ExactHead's re-scoring after its approximate first pass, in two
// passes over each logits row instead of torch's seven.
//
// approx [M, V] (float32 or bfloat16) holds the first pass's logits, out [M, V] (float32; may be
// approx itself) receives them (widened) and then the re-scored entries, x [M, K] is the head's
// input, weight [V, K] the float32 head, row_norms [V] = |W_j|. With b_j = (factor |x_m|) |W_j|
// (the first pass's error bound), every entry j whose upper bound approx_j + b_j reaches the best
// lower bound max_i (approx_i - b_i) is recomputed in float32 (x_m . W_j). A row with more than
// max_candidates such entries keeps the first pass's values in out and is flagged in the returned
// bool [M]: the caller computes it in float32 entirely (one GEMM over those rows).
//
// treeserve::head_rows: y [M, V] = x [M, K] @ weight [V, K]^T in float32 for a few rows of x (a
// speculative verify step, a small decode batch), reading each weight row once for all of them;
// every y[m, j] is exactly dot(x_m, W_j) below (the value the re-scoring computes), whatever M is.
// BLAS turns a few-row product into a GEMM that re-reads or repacks the weight (~3.6x the one-row
// time at 4-8 rows on an AVX2 EPYC, the vocabulary head being 113 MB of float32 for SmolLM2).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "treeserve_head.h"
#include "treeserve_lanes.h"
#include "treeserve_vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// y[m * ldy] = x_m . w for the MC rows x_m = x + m k, the weight row read once for all of them; each
// row's sum in one fixed order, whatever MC is (two 8-lane chains over 16-float steps, the lanes summed
// in order, then the tail), so a row's value does not depend on the rows beside it.
template <int MC>
void dot_rows(const float* x, const float* w, int64_t k, float* y, int64_t ldy) {
  int64_t j = 0;
  float s[MC];
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0[MC], acc1[MC];
  for (int m = 0; m < MC; ++m) acc0[m] = acc1[m] = _mm256_setzero_ps();
  for (; j + 16 <= k; j += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + j), w1 = _mm256_loadu_ps(w + j + 8);
    for (int m = 0; m < MC; ++m) {
      acc0[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + j), w0, acc0[m]);
      acc1[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + j + 8), w1, acc1[m]);
    }
  }
  for (int m = 0; m < MC; ++m) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(acc0[m], acc1[m]));
    s[m] = 0.f;
    for (float v : lanes) s[m] += v;
  }
#else
  for (int m = 0; m < MC; ++m) s[m] = 0.f;
#endif
  for (int m = 0; m < MC; ++m) {
    float t = s[m];
    for (int64_t i = j; i < k; ++i) t += x[m * k + i] * w[i];
    y[m * ldy] = t;
  }
}

// a . b in dot_rows' order (the re-scoring's value equals head_rows').
float dot(const float* a, const float* b, int64_t k) {
  float s;
  dot_rows<1>(a, b, k, &s, 0);
  return s;
}

// out[0, v) = row r of approx [M, v] (float32, or bfloat16 widened).
void copy_row(const at::Tensor& approx, int64_t r, float* out, int64_t v) {
  if (approx.scalar_type() == at::kFloat) {
    const float* a = approx.const_data_ptr<float>() + r * v;
    std::copy(a, a + v, out);
  } else {
    treeserve_lanes::widen(approx.const_data_ptr<c10::BFloat16>() + r * v, out, v);
  }
}

at::Tensor exact_head_rescore(const at::Tensor& approx, const at::Tensor& out, const at::Tensor& x,
                              const at::Tensor& weight, const at::Tensor& row_norms, double factor,
                              int64_t max_candidates) {
  for (const at::Tensor* t : {&out, &x, &weight, &row_norms})
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous(),
                     "out, x, weight and row_norms must be contiguous float32 CPU tensors");
  TORCH_CHECK_TYPE((approx.scalar_type() == at::kFloat || approx.scalar_type() == at::kBFloat16) &&
                       approx.device().is_cpu() && approx.is_contiguous(),
                   "approx must be a contiguous float32 or bfloat16 CPU tensor, got ", approx.scalar_type());
  TORCH_CHECK_VALUE(approx.dim() == 2 && out.sizes() == approx.sizes() && x.dim() == 2 && weight.dim() == 2 &&
                        row_norms.dim() == 1 && approx.size(0) == x.size(0) && approx.size(1) == weight.size(0) &&
                        x.size(1) == weight.size(1) && row_norms.size(0) == weight.size(0),
                    "need approx and out [M, V], x [M, K], weight [V, K], row_norms [V]; got ", approx.sizes(),
                    ", ", out.sizes(), ", ", x.sizes(), ", ", weight.sizes(), ", ", row_norms.sizes());
  const bool in_place = approx.data_ptr() == out.data_ptr();
  TORCH_CHECK_VALUE(max_candidates >= 0, "max_candidates must be >= 0, got ", max_candidates);
  const int64_t m = x.size(0), k = x.size(1), v = weight.size(0);
  at::Tensor full = at::zeros({m}, x.options().dtype(at::kBool));
  float* ap = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* rn = row_norms.data_ptr<float>();
  bool* fp = full.data_ptr<bool>();
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> cand;
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * k;
      float* a = ap + r * v;
      if (!in_place) copy_row(approx, r, a, v);
      const float fx = static_cast<float>(factor) * std::sqrt(dot(xr, xr, k));
      const float threshold = treeserve_head::best_lower_bound(a, rn, fx, v);
      cand.clear();
      treeserve_head::collect_candidates(a, rn, fx, threshold, v, cand);
      if (static_cast<int64_t>(cand.size()) > max_candidates) {
        fp[r] = true;
        continue;
      }
      for (int64_t j : cand) a[j] = dot(xr, wp + j * k, k);
    }
  });
  return full;
}

at::Tensor head_rows(const at::Tensor& x, const at::Tensor& weight) {
  for (const at::Tensor* t : {&x, &weight})
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous(),
                     "x and weight must be contiguous float32 CPU tensors");
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
                    "need x [M, K] and weight [V, K]; got ", x.sizes(), " and ", weight.sizes());
  const int64_t m = x.size(0), k = x.size(1), v = weight.size(0);
  at::Tensor y = at::empty({m, v}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Rows of x four at a time (eight accumulators fit the 16 AVX2 registers); the weight row stays
  // in L1 between the groups.
  at::parallel_for(0, v, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t r = 0; r < m; r += 4) {
        const float* xr = xp + r * k;
        float* yr = yp + r * v + j;
        switch (std::min<int64_t>(4, m - r)) {
          case 1: dot_rows<1>(xr, wp + j * k, k, yr, v); break;
          case 2: dot_rows<2>(xr, wp + j * k, k, yr, v); break;
          case 3: dot_rows<3>(xr, wp + j * k, k, yr, v); break;
          default: dot_rows<4>(xr, wp + j * k, k, yr, v);
        }
      }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treeserve, m) {
  m.def("exact_head_rescore(Tensor approx, Tensor(a!) out, Tensor x, Tensor weight, Tensor row_norms, "
        "float factor, int max_candidates) -> Tensor");
  m.def("head_rows(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(treeserve, CPU, m) {
  m.impl("exact_head_rescore", &exact_head_rescore);
  m.impl("head_rows", &head_rows);
}
