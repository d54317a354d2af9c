// treeserve::paged_decode_attention: one-token-per-request attention reading the paged KV cache
// in place (no gather into padded batches, no mask). One task per (request, kv head): the G query
// heads sharing that KV head read each K/V row once; online softmax over blocks of keys walked
// across pages; float32 accumulation for float32, bfloat16 and float16 caches. For head_dim 64 / 128 a wide
// path (decode_attention_wide below) scores several keys at a time and keeps the P.V accumulators in
// registers: 16 lanes on AVX-512 hosts (1.5-1.7x the 8-lane path on an AVX-512 EPYC), 8 lanes on
// AVX2+FMA hosts without it (1.25-1.5x the 8-lane path at batch 16 or 1-2k-token contexts on the Zen 3
// EPYC, about the same at a few hundred tokens, where the K/V reads bound both). Other head sizes take
// the 8-lane path on AVX2+FMA hosts (16-bit rows widened on load), the same loops scalar elsewhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "treeserve_library.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "treeserve_checks.h"
#include "treeserve_lanes.h"
#include "treeserve_vec.h"

namespace {

constexpr int64_t BLOCK = 64;
constexpr int64_t AHEAD = 8;  // K rows requested this many keys ahead (pages sit anywhere in memory)

// Ask for the cache lines of row[0, dim) (a hint: pages are scattered, the hardware prefetcher
// cannot guess the next one).
template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

using treeserve_lanes::lanes;
using treeserve_lanes::to_float;

#ifdef TREESERVE_AVX2
using treeserve_vec::load8;
#endif

// sum_d q[d] * row[d] (q already float32).
template <typename T>
inline float dot(const float* q, const T* row, int64_t dim) {
  int64_t d = 0;
  float sum = 0.0f;
#ifdef TREESERVE_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; d + 16 <= dim; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(lanes(row + d)), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(lanes(row + d + 8)), a1);
  }
  for (; d + 8 <= dim; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(lanes(row + d)), a0);
  sum = treeserve_vec::hsum(_mm256_add_ps(a0, a1));
#endif
  for (; d < dim; ++d) sum += q[d] * to_float(row[d]);
  return sum;
}

// acc[d] += p * row[d].
template <typename T>
inline void add_scaled(float p, const T* row, float* acc, int64_t dim) {
  int64_t d = 0;
#ifdef TREESERVE_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + 8 <= dim; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, load8(lanes(row + d)), _mm256_loadu_ps(acc + d)));
#endif
  for (; d < dim; ++d) acc[d] += p * to_float(row[d]);
}

// s[i] = exp(s[i] - m) for i < n (every s[i] <= m); returns their sum.
inline float exp_shifted(float* s, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.0f;
#ifdef TREESERVE_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = treeserve_vec::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = treeserve_vec::hsum(acc);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// Tasks per parallel chunk: a step with under ~32k multiply-adds of attention in all (a few dozen
// tokens of context for a small model) runs on the calling thread, where waking the pool would cost
// more than it saves (and, on a shared machine, a time slice per call). Above it the tasks (request,
// KV head) spread over the pool: a decode step's pool is awake from its projections, and SmolLM2's
// one request (3 KV heads, 150-280 tokens) ran 1.04-1.07x faster per token on a Zen 4 EPYC than
// with the earlier 256k threshold, which kept it on one thread. Every task computes the same values
// either way.
inline int64_t task_grain(const int32_t* indptr, int64_t batch, int64_t hq, int64_t dim, int64_t page_size) {
  const int64_t macs = static_cast<int64_t>(indptr[batch] - indptr[0]) * page_size * hq * dim;
  return macs < (int64_t{1} << 15) ? std::max<int64_t>(1, batch * hq) : 1;
}

// DIM > 0: head_dim known at compile time (the row loops unroll); 0: dim at run time.
template <typename T, int64_t DIM>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int32_t* indptr, const int32_t* pages,
                      const int32_t* last_len, T* out, int64_t batch, int64_t hq, int64_t hkv, int64_t dim_rt,
                      int64_t page_size, float scale) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  const int64_t groups = hq / hkv;
  at::parallel_for(0, batch * hkv, task_grain(indptr, batch, hq, dim, page_size), [&](int64_t begin, int64_t end) {
    std::vector<float> qf(groups * dim), acc(groups * dim), scores(groups * BLOCK);
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
      int64_t page_no = 0, in_page = 0;  // key t0 + i sits at (page_no, in_page): no division per key
      for (int64_t t0 = 0; t0 < len; t0 += BLOCK) {
        const int64_t n = std::min(BLOCK, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t page = pages[first_page + page_no];
          offsets[i] = ((page * page_size + in_page) * hkv + h) * dim;
          if (++in_page == page_size) {
            in_page = 0;
            ++page_no;
          }
        }
        for (int64_t i = 0; i < std::min(AHEAD, n); ++i) prefetch_row(k_cache + offsets[i], dim);
        for (int64_t i = 0; i < n; ++i) {  // scores: each K row read once (L1) for its G query heads
          if (i + AHEAD < n) prefetch_row(k_cache + offsets[i + AHEAD], dim);
          prefetch_row(v_cache + offsets[i], dim);  // for the P.V pass below
          const T* k = k_cache + offsets[i];
          for (int64_t g = 0; g < groups; ++g) scores[g * BLOCK + i] = dot(qf.data() + g * dim, k, dim);
        }
        for (int64_t g = 0; g < groups; ++g) {  // online softmax: one rescale per block
          float* s = scores.data() + g * BLOCK;
          float block_max = run_max[g];
          for (int64_t i = 0; i < n; ++i) block_max = std::max(block_max, s[i]);
          const float corr = std::exp(run_max[g] - block_max);
          run_sum[g] = run_sum[g] * corr + exp_shifted(s, n, block_max);
          run_max[g] = block_max;
          if (corr != 1.0f) {
            float* a = acc.data() + g * dim;
            for (int64_t d = 0; d < dim; ++d) a[d] *= corr;
          }
        }
        for (int64_t i = 0; i < n; ++i) {  // acc += p * v, each V row read once
          const T* v = v_cache + offsets[i];
          for (int64_t g = 0; g < groups; ++g) add_scaled(scores[g * BLOCK + i], v, acc.data() + g * dim, dim);
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

#if defined(TREESERVE_AVX512) || defined(TREESERVE_AVX2)
// One online-softmax block of one head for the wide paths, V the vector width (Lanes16 / Lanes8): the
// block's scaled scores s[0, V::W nvec) (lanes past the block's keys -inf) become exp(s - m), m the larger
// of run_max and the block's max; run_sum = run_sum exp(run_max - m) + their sum, run_max = m. Returns
// exp(old run_max - m), the factor the head's P.V accumulators are to be scaled by.
template <typename V>
inline float softmax_block(float* s, int64_t nvec, float& run_max, float& run_sum) {
  using F = typename V::F;
  F mx = V::set1(-std::numeric_limits<float>::infinity());
  for (int64_t v = 0; v < nvec; ++v) mx = V::max(mx, V::load(s + V::W * v));
  const float block_max = std::max(run_max, V::reduce_max(mx));
  const F bm = V::set1(block_max);
  F sum = V::set1(0.0f);
  for (int64_t v = 0; v < nvec; ++v) {
    const F e = V::exp_shifted(V::load(s + V::W * v), bm);
    V::store(s + V::W * v, e);
    sum = V::add(sum, e);
  }
  const float corr = std::exp(run_max - block_max);
  run_sum = run_sum * corr + V::reduce_add(sum);
  run_max = block_max;
  return corr;
}
#endif

#ifdef TREESERVE_AVX512
// ---- AVX-512 path, head_dim 64 or 128. Per (request, kv head) task and per chunk of at most
// 256 / D query heads: blocks of WBLOCK keys, the scores of 16 keys reduced together (treeserve_vec::sum16x16), the P.V
// accumulators of the chunk held in 16 registers, bfloat16 dot products one vdpbf16ps per 32
// values where the CPU has AVX-512 BF16 (products exact, float32 sums). The scale multiplies the
// dot products, not the query.

constexpr int64_t WAHEAD = 32;  // K rows requested this many keys ahead (16: 20% slower for bf16, 8: 30%)
constexpr int64_t WBLOCK = 32;  // keys per online-softmax block (32: fastest of 16 / 32 / 64, bf16 and float32)

// softmax_block's 16 lanes (aligned loads and stores).
struct Lanes16 {
  using F = __m512;
  static constexpr int64_t W = 16;
  static F load(const float* p) { return _mm512_load_ps(p); }
  static void store(float* p, F v) { _mm512_store_ps(p, v); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F exp_shifted(F s, F m) { return treeserve_vec::exp_nonpositive16(_mm512_sub_ps(s, m)); }
  static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
};

// Partial (16-lane) dot products of one key row with NG query heads.
template <typename T, int D, int NG>
struct Scorer {
  __m512 q[NG][D / 16];
  Scorer(const float* qf, const T*) {
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < D / 16; ++j) q[g][j] = _mm512_loadu_ps(qf + g * D + 16 * j);
  }
  void partials(const T* row, float* slot) const {  // head g's lanes go to slot[256 g, 256 g + 16)
    __m512 k[D / 16];
    for (int j = 0; j < D / 16; ++j) k[j] = treeserve_vec::load16(lanes(row + 16 * j));
    for (int g = 0; g < NG; ++g) {
      __m512 a = _mm512_mul_ps(q[g][0], k[0]);
      for (int j = 1; j < D / 16; ++j) a = _mm512_fmadd_ps(q[g][j], k[j], a);
      _mm512_store_ps(slot + 256 * g, a);
    }
  }
};

#ifdef __AVX512BF16__
template <int D, int NG>
struct Scorer<c10::BFloat16, D, NG> {
  __m512bh q[NG][D / 32];
  Scorer(const float*, const c10::BFloat16* qb) {
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < D / 32; ++j) q[g][j] = (__m512bh)_mm512_loadu_si512(qb + g * D + 32 * j);
  }
  void partials(const c10::BFloat16* row, float* slot) const {
    __m512bh k[D / 32];
    for (int j = 0; j < D / 32; ++j) k[j] = (__m512bh)_mm512_loadu_si512(row + 32 * j);
    for (int g = 0; g < NG; ++g) {
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g][0], k[0]);
      for (int j = 1; j < D / 32; ++j) a = _mm512_dpbf16_ps(a, q[g][j], k[j]);
      _mm512_store_ps(slot + 256 * g, a);
    }
  }
};
#endif

// Heads [0, NG) of one task over its `len` keys at k_cache/v_cache + offsets[t]. qf: the float32
// query rows, qt: the same rows as stored; out: NG rows of D.
template <typename T, int D, int NG>
void heads_avx512(const float* qf, const T* qt, const T* k_cache, const T* v_cache, const int64_t* offsets, int64_t len,
                  float scale, T* out, float* slots, float* scores) {
  const Scorer<T, D, NG> scorer(qf, qt);
  __m512 acc[NG][D / 16];
  float run_max[NG], run_sum[NG];
  for (int g = 0; g < NG; ++g) {
    for (int j = 0; j < D / 16; ++j) acc[g][j] = _mm512_setzero_ps();
    run_max[g] = -std::numeric_limits<float>::infinity();
    run_sum[g] = 0.0f;
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < std::min(WAHEAD, len); ++i) prefetch_row(k_cache + offsets[i], D);
  for (int64_t t0 = 0; t0 < len; t0 += WBLOCK) {
    const int64_t n = std::min(WBLOCK, len - t0);
    const int64_t nvec = (n + 15) / 16;
    for (int64_t v = 0; v < nvec; ++v) {  // scores, 16 keys at a time
      const int64_t m = std::min<int64_t>(16, n - 16 * v);
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t t = t0 + 16 * v + i;
        float* slot = slots + 16 * treeserve_vec::SUM16_SLOT[i];
        if (i >= m) {
          for (int g = 0; g < NG; ++g) _mm512_store_ps(slot + 256 * g, _mm512_setzero_ps());
          continue;
        }
        if (t + WAHEAD < len) prefetch_row(k_cache + offsets[t + WAHEAD], D);
        prefetch_row(v_cache + offsets[t], D);
        scorer.partials(k_cache + offsets[t], slot);
      }
      const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1u);
      for (int g = 0; g < NG; ++g) {
        const __m512 s = _mm512_mul_ps(treeserve_vec::sum16x16(slots + 256 * g), scale_v);
        _mm512_store_ps(scores + g * WBLOCK + 16 * v, _mm512_mask_blend_ps(valid, neg_inf, s));
      }
    }
    for (int g = 0; g < NG; ++g) {  // online softmax: one rescale per block
      const float corr = softmax_block<Lanes16>(scores + g * WBLOCK, nvec, run_max[g], run_sum[g]);
      if (corr != 1.0f) {
        const __m512 c = _mm512_set1_ps(corr);
        for (int j = 0; j < D / 16; ++j) acc[g][j] = _mm512_mul_ps(acc[g][j], c);
      }
    }
    for (int64_t i = 0; i < n; ++i) {  // acc += p * v, each V row read once
      const T* row = v_cache + offsets[t0 + i];
      __m512 vr[D / 16];
      for (int j = 0; j < D / 16; ++j) vr[j] = treeserve_vec::load16(lanes(row + 16 * j));
      for (int g = 0; g < NG; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * WBLOCK + i]);
        for (int j = 0; j < D / 16; ++j) acc[g][j] = _mm512_fmadd_ps(p, vr[j], acc[g][j]);
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m512 inv = _mm512_set1_ps(run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f);
    for (int j = 0; j < D / 16; ++j)
      treeserve_vec::store16(lanes(out + g * D + 16 * j), _mm512_mul_ps(acc[g][j], inv));
  }
}

// The AVX-512 heads for decode_attention_wide: chunks of 256 / D heads (16 accumulator registers).
template <typename T, int D>
struct Avx512Heads {
  static constexpr int64_t GMAX = 256 / D;
  struct Scratch {
    alignas(64) float slots[GMAX * 256];
    alignas(64) float scores[GMAX * WBLOCK];
  };
  template <int NG>
  static void run(const float* qf, const T* qt, const T* k_cache, const T* v_cache, const int64_t* offsets,
                  int64_t len, float scale, T* out, Scratch& s) {
    heads_avx512<T, D, NG>(qf, qt, k_cache, v_cache, offsets, len, scale, out, s.slots, s.scores);
  }
};
#endif

#if defined(TREESERVE_AVX2) && !defined(TREESERVE_AVX512)
// ---- AVX2 path (hosts without AVX-512), head_dim 64 or 128. Per (request, kv head) task and per chunk
// of at most GMAX2 query heads: blocks of ABLOCK keys; each key's K row read once for the chunk's heads
// into one 8-lane partial sum per head, the scores of 8 keys reduced together (treeserve_vec::sum8x8)
// where the 8-lane path above reduces every key alone; P.V per head with 64 of its accumulators in
// registers at a time (the 8-lane path keeps them in memory: a store and a reload per key and head).
// The scale multiplies the dot products, not the query.

constexpr int64_t GMAX2 = 4;     // query heads per chunk: one partial-sum register each, and one for K
constexpr int64_t ABLOCK = 32;   // keys per online-softmax block
constexpr int64_t AAHEAD = 16;   // K rows requested this many keys ahead

// softmax_block's 8 lanes (aligned loads and stores).
struct Lanes8 {
  using F = __m256;
  static constexpr int64_t W = 8;
  static F load(const float* p) { return _mm256_load_ps(p); }
  static void store(float* p, F v) { _mm256_store_ps(p, v); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F exp_shifted(F s, F m) { return treeserve_vec::exp_nonpositive(_mm256_sub_ps(s, m)); }
  static float reduce_max(F v) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    return *std::max_element(lanes, lanes + 8);
  }
  static float reduce_add(F v) { return treeserve_vec::hsum(v); }
};

// Heads [0, NG) of one task over its `len` keys at k_cache/v_cache + offsets[t]. qf: the float32 query
// rows; out: NG rows of D. part (64 NG floats) and scores (ABLOCK NG), acc (D NG): scratch, 32-byte aligned.
template <typename T, int D, int NG>
void heads_avx2(const float* qf, const T* k_cache, const T* v_cache, const int64_t* offsets, int64_t len,
                float scale, T* out, float* part, float* scores, float* acc) {
  float run_max[NG], run_sum[NG];
  for (int g = 0; g < NG; ++g) {
    run_max[g] = -std::numeric_limits<float>::infinity();
    run_sum[g] = 0.0f;
  }
  std::fill(acc, acc + NG * D, 0.0f);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 scale_v = _mm256_set1_ps(scale);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t i = 0; i < std::min(AAHEAD, len); ++i) prefetch_row(k_cache + offsets[i], D);
  for (int64_t t0 = 0; t0 < len; t0 += ABLOCK) {
    const int64_t n = std::min(ABLOCK, len - t0);
    const int64_t nvec = (n + 7) / 8;
    for (int64_t v = 0; v < nvec; ++v) {  // scores, 8 keys at a time
      const int64_t m = std::min<int64_t>(8, n - 8 * v);
      for (int64_t i = 0; i < 8; ++i) {
        if (i >= m) {
          for (int g = 0; g < NG; ++g) _mm256_store_ps(part + 64 * g + 8 * i, _mm256_setzero_ps());
          continue;
        }
        const int64_t t = t0 + 8 * v + i;
        if (t + AAHEAD < len) prefetch_row(k_cache + offsets[t + AAHEAD], D);
        prefetch_row(v_cache + offsets[t], D);
        const T* row = k_cache + offsets[t];
        __m256 a[NG];
        for (int j = 0; j < D / 8; ++j) {
          const __m256 k = treeserve_vec::load8(lanes(row + 8 * j));
          for (int g = 0; g < NG; ++g)
            a[g] = j == 0 ? _mm256_mul_ps(_mm256_loadu_ps(qf + g * D), k)
                          : _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + 8 * j), k, a[g]);
        }
        for (int g = 0; g < NG; ++g) _mm256_store_ps(part + 64 * g + 8 * i, a[g]);
      }
      const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m)), lane));
      for (int g = 0; g < NG; ++g) {
        const __m256 s = _mm256_mul_ps(treeserve_vec::sum8x8(part + 64 * g), scale_v);
        _mm256_store_ps(scores + g * ABLOCK + 8 * v, _mm256_blendv_ps(neg_inf, s, valid));
      }
    }
    for (int g = 0; g < NG; ++g) {  // online softmax: one rescale per block
      float* s = scores + g * ABLOCK;
      const float corr = softmax_block<Lanes8>(s, nvec, run_max[g], run_sum[g]);
      for (int c = 0; c < D; c += 64) {  // acc = acc corr + sum_i p_i v_i, 64 accumulators in registers
        float* ac = acc + g * D + c;
        __m256 r[8];
        for (int j = 0; j < 8; ++j) r[j] = _mm256_load_ps(ac + 8 * j);
        if (corr != 1.0f) {
          const __m256 cv = _mm256_set1_ps(corr);
          for (int j = 0; j < 8; ++j) r[j] = _mm256_mul_ps(r[j], cv);
        }
        for (int64_t i = 0; i < n; ++i) {
          const T* row = v_cache + offsets[t0 + i] + c;
          const __m256 p = _mm256_set1_ps(s[i]);
          for (int j = 0; j < 8; ++j) r[j] = _mm256_fmadd_ps(p, treeserve_vec::load8(lanes(row + 8 * j)), r[j]);
        }
        for (int j = 0; j < 8; ++j) _mm256_store_ps(ac + 8 * j, r[j]);
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m256 inv = _mm256_set1_ps(run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f);
    for (int j = 0; j < D / 8; ++j)
      treeserve_vec::store8(lanes(out + g * D + 8 * j), _mm256_mul_ps(_mm256_load_ps(acc + g * D + 8 * j), inv));
  }
}

// The AVX2 heads for decode_attention_wide: chunks of GMAX2 heads.
template <typename T, int D>
struct Avx2Heads {
  static constexpr int64_t GMAX = GMAX2;
  struct Scratch {
    alignas(32) float part[GMAX2 * 64];
    alignas(32) float scores[GMAX2 * ABLOCK];
    alignas(32) float acc[GMAX2 * D];
  };
  template <int NG>
  static void run(const float* qf, const T*, const T* k_cache, const T* v_cache, const int64_t* offsets, int64_t len,
                  float scale, T* out, Scratch& s) {
    heads_avx2<T, D, NG>(qf, k_cache, v_cache, offsets, len, scale, out, s.part, s.scores, s.acc);
  }
};
#endif

#if defined(TREESERVE_AVX512) || defined(TREESERVE_AVX2)
// The wide paths' tasks: per (request, kv head), the key offsets listed once, then the query heads in
// chunks of H::GMAX, each chunk by H::run<heads in the chunk>.
template <typename T, int D, typename H>
void decode_attention_wide(const T* q, const T* k_cache, const T* v_cache, const int32_t* indptr, const int32_t* pages,
                           const int32_t* last_len, T* out, int64_t batch, int64_t hq, int64_t hkv, int64_t page_size,
                           float scale) {
  const int64_t groups = hq / hkv;
  at::parallel_for(0, batch * hkv, task_grain(indptr, batch, hq, D, page_size), [&](int64_t begin, int64_t end) {
    typename H::Scratch scratch;
    std::vector<float> qf(groups * D);
    std::vector<int64_t> offsets;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hkv, h = task % hkv;
      const T* qt = q + (b * hq + h * groups) * D;
      for (int64_t i = 0; i < groups * D; ++i) qf[i] = to_float(qt[i]);
      const int64_t first_page = indptr[b], num_pages = indptr[b + 1] - first_page;
      const int64_t len = num_pages > 0 ? (num_pages - 1) * page_size + last_len[b] : 0;
      offsets.resize(len);
      for (int64_t t = 0, page_no = 0, in_page = 0; t < len; ++t) {
        offsets[t] = ((pages[first_page + page_no] * page_size + in_page) * hkv + h) * D;
        if (++in_page == page_size) {
          in_page = 0;
          ++page_no;
        }
      }
      for (int64_t g0 = 0; g0 < groups; g0 += H::GMAX) {
        const float* qg = qf.data() + g0 * D;
        const T* tg = qt + g0 * D;
        T* dst = out + (b * hq + h * groups + g0) * D;
        const int64_t* off = offsets.data();
        switch (std::min(H::GMAX, groups - g0)) {
          case 1: H::template run<1>(qg, tg, k_cache, v_cache, off, len, scale, dst, scratch); break;
          case 2: H::template run<2>(qg, tg, k_cache, v_cache, off, len, scale, dst, scratch); break;
          case 3: H::template run<3>(qg, tg, k_cache, v_cache, off, len, scale, dst, scratch); break;
          default: H::template run<H::GMAX>(qg, tg, k_cache, v_cache, off, len, scale, dst, scratch); break;
        }
      }
    }
  });
}
#endif

// The common head sizes get their own instantiation.
template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& indptr, const at::Tensor& pages,
         const at::Tensor& last, at::Tensor& out, int64_t batch, int64_t hq, int64_t hkv, int64_t dim,
         int64_t page_size, float scale) {
#if defined(TREESERVE_AVX512) || defined(TREESERVE_AVX2)
  if (dim == 64 || dim == 128) {
#ifdef TREESERVE_AVX512
    auto* wide = dim == 64 ? &decode_attention_wide<T, 64, Avx512Heads<T, 64>>
                           : &decode_attention_wide<T, 128, Avx512Heads<T, 128>>;
#else
    auto* wide = dim == 64 ? &decode_attention_wide<T, 64, Avx2Heads<T, 64>>
                           : &decode_attention_wide<T, 128, Avx2Heads<T, 128>>;
#endif
    wide(q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), indptr.data_ptr<int32_t>(), pages.data_ptr<int32_t>(),
         last.data_ptr<int32_t>(), out.data_ptr<T>(), batch, hq, hkv, page_size, scale);
    return;
  }
#endif
  auto* fn = dim == 64 ? &decode_attention<T, 64> : (dim == 128 ? &decode_attention<T, 128> : &decode_attention<T, 0>);
  fn(q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), indptr.data_ptr<int32_t>(), pages.data_ptr<int32_t>(),
     last.data_ptr<int32_t>(), out.data_ptr<T>(), batch, hq, hkv, dim, page_size, scale);
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
  TORCH_CHECK_VALUE(hkv >= 1 && dim >= 1, "caches must have >= 1 KV head of head_dim >= 1, got ", k_cache.sizes());
  TORCH_CHECK(k_cache.size(3) == dim && hq % hkv == 0, "head_dim must match and Hq be a multiple of Hkv");
  TORCH_CHECK(kv_indptr.numel() == batch + 1 && kv_last_page_len.numel() == batch, "metadata sizes must match B");
  const auto i32 = at::kInt;
  TORCH_CHECK(kv_indptr.scalar_type() == i32 && kv_page_indices.scalar_type() == i32 &&
                  kv_last_page_len.scalar_type() == i32,
              "kv_indptr, kv_page_indices and kv_last_page_len must be int32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  auto qc = q.contiguous();
  auto indptr = kv_indptr.contiguous(), pages = kv_page_indices.contiguous(), last = kv_last_page_len.contiguous();
  treeserve_checks::check_page_table(indptr, pages, last, batch, k_cache.size(0), page_size);
  auto out = at::empty_like(qc);
  const float s = static_cast<float>(scale);
  const bool supported = treeserve_lanes::by_storage(q.scalar_type(), [&](auto storage) {
    using T = typename decltype(storage)::type;
    run<T>(qc, k_cache, v_cache, indptr, pages, last, out, batch, hq, hkv, dim, page_size, s);
  });
  TORCH_CHECK(supported, "paged_decode_attention supports float32, bfloat16 and float16, got ", q.scalar_type());
  return out;
}

}  // namespace

TREESERVE_FRAGMENT(TREESERVE_LIBRARY, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indptr, "
      "Tensor kv_page_indices, Tensor kv_last_page_len, float scale) -> Tensor");
}

TREESERVE_IMPL(TREESERVE_LIBRARY, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
