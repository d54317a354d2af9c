// Small SIMD helpers shared by treeserve's C++ CPU operators (include "treeserve_vec.h"; the
// builder treeserve/_cpp.py puts this folder on the include path and hashes it into the cache key).
// The 8-lane helpers exist only when the compiler targets AVX2 (__AVX2__, with FMA), the 16-lane
// ones only under AVX-512F (TREESERVE_AVX512); callers keep a scalar path for other hosts.
#pragma once

#include <cstdint>

namespace treeserve_vec {
// IEEE half-precision storage (a float16 cache's lanes), kept apart from bfloat16's uint16_t bit
// patterns so that each storage type picks its own load and store.
struct fp16 {
  uint16_t bits;
};

// exp(x) for x <= 0, Cephes expf: x = n ln2 + r (ln2 split in a high and a low part), exp(r) by a
// degree-5 polynomial in r (coefficients highest first) times r^2, plus 1 + r.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace treeserve_vec

#if defined(__AVX2__) && defined(__FMA__)
#define TREESERVE_AVX2 1
#include <immintrin.h>

namespace treeserve_vec {

// exp(x) for x <= 0 on 8 lanes (Cephes expf polynomial after a base-2 range reduction, ~2 ulp);
// lanes below -87 (where exp underflows float; -inf included) give exactly 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// Sum of the 8 lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The 8 lane sums of 8 vectors stored at v[0..63] (vector j at v + 8 j, 32-byte aligned): lane j of
// the result is the sum of vector j (pairs added by vhaddps, then the two 128-bit halves).
inline __m256 sum8x8(const float* v) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_load_ps(v), _mm256_load_ps(v + 8));
  const __m256 t1 = _mm256_hadd_ps(_mm256_load_ps(v + 16), _mm256_load_ps(v + 24));
  const __m256 t2 = _mm256_hadd_ps(_mm256_load_ps(v + 32), _mm256_load_ps(v + 40));
  const __m256 t3 = _mm256_hadd_ps(_mm256_load_ps(v + 48), _mm256_load_ps(v + 56));
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 8 floats from float32 or bfloat16 storage (bfloat16 -> float32 is a 16-bit left shift).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Store 8 floats as float32, or as bfloat16 rounded to nearest even (NaN stays a quiet NaN) -- the
// rounding of c10::BFloat16(float).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i hi = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  hi = _mm256_blendv_epi8(hi, _mm256_set1_epi32(0x7FC0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// 8 floats from float16 storage (exact), and stored as float16 rounded to nearest even (F16C, which every
// AVX2 CPU has; overflow gives +-inf, as c10::Half(float)).
inline __m256 load8(const fp16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store8(fp16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

}  // namespace treeserve_vec
#endif

// ---- AVX-512 (16 lanes): present when the compiler targets AVX-512F (-march=native on such a host).
#if defined(__AVX512F__)
#define TREESERVE_AVX512 1
#include <immintrin.h>

namespace treeserve_vec {

// exp(x) for x <= 0 on 16 lanes: the same reduction, polynomial and underflow rule as the 8-lane one.
inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), p, _mm512_castsi512_ps(bits));
}

// 16 floats from float32 or bfloat16 storage.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Store 16 floats as float32, or as bfloat16 rounded like c10::BFloat16(float) (see store8).
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i hi = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  hi = _mm512_mask_mov_epi32(hi, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(hi));
}

// 16 floats from float16 storage, and stored as float16 (see load8 / store8).
inline __m512 load16(const fp16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16(fp16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The 16 lane sums of 16 vectors stored at v[0..255] (vector j at v + 16 j), as one vector whose
// lane l is the sum of vector SUM16_SLOT[l]: a 4 x 4 transpose of 128-bit lanes, so a caller that
// stores item i at slot SUM16_SLOT[i] gets item i's sum in lane i.
constexpr int SUM16_SLOT[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
inline __m512 sum16x16(const float* v) {
  __m512 w[8], z[4], u[2];
  for (int j = 0; j < 8; ++j) {
    const __m512 a = _mm512_load_ps(v + 32 * j), b = _mm512_load_ps(v + 32 * j + 16);
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int j = 0; j < 4; ++j)
    z[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)
    u[j] = _mm512_add_ps(_mm512_unpacklo_ps(z[2 * j], z[2 * j + 1]), _mm512_unpackhi_ps(z[2 * j], z[2 * j + 1]));
  const __m512d a = _mm512_castps_pd(u[0]), b = _mm512_castps_pd(u[1]);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

}  // namespace treeserve_vec
#endif
