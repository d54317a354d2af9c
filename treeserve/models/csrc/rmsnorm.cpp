// treeserve::add_rms_norm: the pre-norm block's residual add and RMSNorm in one pass over each row.
//   s = x + residual (or x when residual is None), in the tensors' dtype (bfloat16: the float sum
//       rounded, as torch's add);
//   y = s * rsqrt(mean(s^2) + eps) * weight in float32, rounded once to the dtype (as torch's fused
//       CPU F.rms_norm: bfloat16 results match it but for the order of the sum of squares).
// Returns (s, y). float32 and bfloat16; 8 lanes wide on AVX2+FMA hosts, scalar elsewhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>

#include "treeserve_lanes.h"
#include "treeserve_vec.h"

namespace {

using treeserve_lanes::lanes;
using treeserve_lanes::to_float;

template <typename T>
void add_rms_norm_rows(const T* x, const T* res, const T* w, T* s, T* y, int64_t rows, int64_t dim, float eps) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(dim, 1));  // no threads for small batches
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      const T* rr = res == nullptr ? nullptr : res + r * dim;
      T* sr = s + r * dim;
      T* yr = y + r * dim;
      int64_t d = 0;
      float sumsq = 0.0f;
#ifdef TREESERVE_AVX2
      using treeserve_vec::load8;
      using treeserve_vec::store8;
      __m256 acc = _mm256_setzero_ps();
      for (; d + 8 <= dim; d += 8) {
        __m256 v = load8(lanes(xr + d));
        if (rr != nullptr) {
          store8(lanes(sr + d), _mm256_add_ps(v, load8(lanes(rr + d))));
          v = load8(lanes(sr + d));  // the rounded sum, as stored
        } else {
          store8(lanes(sr + d), v);
        }
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      sumsq = treeserve_vec::hsum(acc);
#endif
      for (; d < dim; ++d) {
        const T v = rr == nullptr ? xr[d] : static_cast<T>(to_float(xr[d]) + to_float(rr[d]));
        sr[d] = v;
        sumsq += to_float(v) * to_float(v);
      }
      const float rstd = 1.0f / std::sqrt(sumsq / static_cast<float>(dim) + eps);
      d = 0;
#ifdef TREESERVE_AVX2
      const __m256 rv = _mm256_set1_ps(rstd);
      for (; d + 8 <= dim; d += 8)
        store8(lanes(yr + d), _mm256_mul_ps(_mm256_mul_ps(load8(lanes(sr + d)), rv), load8(lanes(w + d))));
#endif
      for (; d < dim; ++d) yr[d] = static_cast<T>(to_float(sr[d]) * rstd * to_float(w[d]));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "x must be [..., D] and weight [D] with the same D");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight must share a dtype");
  TORCH_CHECK(eps >= 0.0, "eps must be >= 0, got ", eps);
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x in shape and dtype");
  }
  auto xc = x.contiguous();
  auto rc = has_res ? residual->contiguous() : at::Tensor();
  auto wc = weight.contiguous();
  auto s = at::empty_like(xc);
  auto y = at::empty_like(xc);
  const int64_t dim = x.size(-1), rows = dim == 0 ? 0 : xc.numel() / dim;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_rows<float>(xc.data_ptr<float>(), has_res ? rc.data_ptr<float>() : nullptr, wc.data_ptr<float>(),
                             s.data_ptr<float>(), y.data_ptr<float>(), rows, dim, e);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "add_rms_norm supports float32 and bfloat16, got ", x.scalar_type());
    using B16 = c10::BFloat16;
    add_rms_norm_rows<B16>(xc.data_ptr<B16>(), has_res ? rc.data_ptr<B16>() : nullptr, wc.data_ptr<B16>(),
                           s.data_ptr<B16>(), y.data_ptr<B16>(), rows, dim, e);
  }
  return {s, y};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treeserve, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(treeserve, CPU, m) { m.impl("add_rms_norm", &add_rms_norm); }
