// treeserve::paged_decode_attention: one-token-per-request attention reading the paged KV cache
// in place (no gather into padded batches, no mask). One task per (request, kv head): the G query
// heads sharing that KV head read each K/V row once; online softmax over blocks of BLOCK keys
// walked across pages; float32 accumulation for float32 and bfloat16 caches.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t BLOCK = 64;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int32_t* indptr, const int32_t* pages,
                      const int32_t* last_len, T* out, int64_t batch, int64_t hq, int64_t hkv, int64_t dim,
                      int64_t page_size, float scale) {
  const int64_t groups = hq / hkv;
  at::parallel_for(0, batch * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(groups * dim), acc(groups * dim), scores(groups * BLOCK), row(dim);
    std::vector<float> run_max(groups), run_sum(groups);
    std::vector<int64_t> offsets(BLOCK);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hkv, h = task % hkv;
      for (int64_t g = 0; g < groups; ++g) {
        const T* src = q + (b * hq + h * groups + g) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = to_float(src[d]) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(run_sum.begin(), run_sum.end(), 0.0f);
      const int64_t first_page = indptr[b];
      const int64_t num_pages = indptr[b + 1] - first_page;
      const int64_t len = num_pages > 0 ? (num_pages - 1) * page_size + last_len[b] : 0;
      for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int64_t n = std::min(BLOCK, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = t0 + i;
          const int64_t page = pages[first_page + t / page_size];
          offsets[i] = ((page * page_size + t % page_size) * hkv + h) * dim;
        }
        for (int64_t i = 0; i < n; ++i) {  // scores: each K row read once for its G query heads
          const T* k = k_cache + offsets[i];
          for (int64_t d = 0; d < dim; ++d) row[d] = to_float(k[d]);
          for (int64_t g = 0; g < groups; ++g) {
            const float* qg = qf.data() + g * dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qg[d] * row[d];
            scores[g * BLOCK + i] = dot;
          }
        }
        for (int64_t g = 0; g < groups; ++g) {  // online softmax: one rescale per block
          float* s = scores.data() + g * BLOCK;
          float block_max = run_max[g];
          for (int64_t i = 0; i < n; ++i) block_max = std::max(block_max, s[i]);
          const float corr = std::exp(run_max[g] - block_max);
          float sum = 0.0f;
          for (int64_t i = 0; i < n; ++i) {
            s[i] = std::exp(s[i] - block_max);
            sum += s[i];
          }
          run_sum[g] = run_sum[g] * corr + sum;
          run_max[g] = block_max;
          if (corr != 1.0f) {
            float* a = acc.data() + g * dim;
            for (int64_t d = 0; d < dim; ++d) a[d] *= corr;
          }
        }
        for (int64_t i = 0; i < n; ++i) {  // acc += p * v, each V row read once
          const T* v = v_cache + offsets[i];
          for (int64_t d = 0; d < dim; ++d) row[d] = to_float(v[d]);
          for (int64_t g = 0; g < groups; ++g) {
            const float p = scores[g * BLOCK + i];
            float* a = acc.data() + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        const float inv = run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f;
        T* dst = out + (b * hq + h * groups + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& kv_indptr, const at::Tensor& kv_page_indices,
                                  const at::Tensor& kv_last_page_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q must be [B, Hq, D], k_cache/v_cache [P, page_size, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache must share a dtype");
  const int64_t batch = q.size(0), hq = q.size(1), dim = q.size(2);
  const int64_t page_size = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && hq % hkv == 0, "head_dim must match and Hq be a multiple of Hkv");
  TORCH_CHECK(kv_indptr.numel() == batch + 1 && kv_last_page_len.numel() == batch, "metadata sizes must match B");
  const auto i32 = at::kInt;
  TORCH_CHECK(kv_indptr.scalar_type() == i32 && kv_page_indices.scalar_type() == i32 &&
                  kv_last_page_len.scalar_type() == i32,
              "kv_indptr, kv_page_indices and kv_last_page_len must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  auto qc = q.contiguous();
  auto indptr = kv_indptr.contiguous(), pages = kv_page_indices.contiguous(), last = kv_last_page_len.contiguous();
  auto out = at::empty_like(qc);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    decode_attention<float>(qc.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                            indptr.data_ptr<int32_t>(), pages.data_ptr<int32_t>(), last.data_ptr<int32_t>(),
                            out.data_ptr<float>(), batch, hq, hkv, dim, page_size, s);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_decode_attention supports float32 and bfloat16");
    using B16 = c10::BFloat16;
    decode_attention<B16>(qc.data_ptr<B16>(), k_cache.data_ptr<B16>(), v_cache.data_ptr<B16>(),
                          indptr.data_ptr<int32_t>(), pages.data_ptr<int32_t>(), last.data_ptr<int32_t>(),
                          out.data_ptr<B16>(), batch, hq, hkv, dim, page_size, s);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treeserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indptr, "
      "Tensor kv_page_indices, Tensor kv_last_page_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(treeserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
