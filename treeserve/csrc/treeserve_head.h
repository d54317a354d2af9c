// The candidate search of the exact LM heads' re-scoring (ExactHead: exact_head.cpp; CodesHead:
// gguf_linear.cpp's codes_head_rescore), shared. A first pass's logits a[j] are within fx rn[j] of the
// exact ones (fx: the row's bound factor, rn[j] = |W_j|); every j whose upper bound a[j] + fx rn[j]
// reaches the best lower bound max_i (a[i] - fx rn[i]) may be the exact argmax and is re-scored.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace treeserve_head {

// max_j (a[j] - fx rn[j]) (NaN entries ignored, as std::max(threshold, NaN) does).
inline float best_lower_bound(const float* a, const float* rn, float fx, int64_t v) {
  float threshold = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 f = _mm512_set1_ps(fx);
  __m512 t = _mm512_set1_ps(threshold);
  for (; j + 16 <= v; j += 16)  // max_ps returns its second operand when either is NaN
    t = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(a + j), _mm512_mul_ps(f, _mm512_loadu_ps(rn + j))), t);
  threshold = _mm512_reduce_max_ps(t);
#endif
  for (; j < v; ++j) threshold = std::max(threshold, a[j] - fx * rn[j]);
  return threshold;
}

// Appends every j with a[j] + fx rn[j] >= threshold to cand, in increasing order.
inline void collect_candidates(const float* a, const float* rn, float fx, float threshold, int64_t v,
                               std::vector<int64_t>& cand) {
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 f = _mm512_set1_ps(fx), t = _mm512_set1_ps(threshold);
  for (; j + 16 <= v; j += 16) {
    const __m512 upper = _mm512_add_ps(_mm512_loadu_ps(a + j), _mm512_mul_ps(f, _mm512_loadu_ps(rn + j)));
    for (uint32_t bits = _mm512_cmp_ps_mask(upper, t, _CMP_GE_OQ); bits; bits &= bits - 1)
      cand.push_back(j + __builtin_ctz(bits));
  }
#endif
  for (; j < v; ++j)
    if (a[j] + fx * rn[j] >= threshold) cand.push_back(j);
}

}  // namespace treeserve_head
