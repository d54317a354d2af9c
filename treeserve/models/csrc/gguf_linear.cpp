// treeserve::gguf_linear: y[M, N] = x[M, K] @ dequant(W)[N, K]^T with W held as GGUF blocks as shipped
// (one row of N: K/32 blocks; Q4_0 18 B = f16 d + 16 B nibbles, w = d (q - 8); Q4_1 20 B = f16 d, f16 m
// + 16 B nibbles, w = d q + m; Q8_0 34 B = f16 d + 32 int8, w = d q; nibble byte j holds element j
// (low) and j + 16 (high)). Three operators, three activation modes:
// - gguf_linear_exact: float32 activations and accumulation; each block is decoded once into float32 and
//   used for up to 8 rows of x.
// - gguf_linear (the decoder layers'): int16 activations; each 32-block b of each row of x is rounded once per call to int16 codes
//   xq = round(x / s_b), s_b = max|x_b| / 32767 (|x - s_b xq| <= s_b / 2 up to float rounding of 1/s_b);
//   per weight block the integer dot product sum q xq is exact in int32 (and in the float it is converted
//   to: |sum| < 2^24), then y += (d s_b) * sum in float32; Q4_1's offset adds m * sum(x) with the float32
//   block sums of the unrounded x. Q4_0 codes are q - 8 in integers.
// - gguf_linear_q8 (large batches of models whose codes serve every batch): int8 activations, below.
// Parallel over N. Beside them: gguf_dequantize, codes_row_norms (CodesHead's |W_j|) and codes_head_rescore
// (CodesHead's exact re-scoring).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "treeserve_library.h"

#include "treeserve_head.h"
#include "treeserve_lanes.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t MAX_ROWS = 8;  // rows of x per register block (gguf_linear_exact)
// Rows of x per register block of the int16 path (gguf_linear): two accumulator chains per row take 2 INT_ROWS
// vector registers, which AVX2's 16 hold for 4 rows and AVX-512's 32 for 8.
#if defined(__AVX2__) && !defined(__AVX512VL__)
constexpr int64_t INT_ROWS = 4;
#else
constexpr int64_t INT_ROWS = MAX_ROWS;
#endif

enum class QType { Q4_0, Q4_1, Q8_0 };

inline int64_t block_bytes(QType t) { return t == QType::Q4_0 ? 18 : (t == QType::Q4_1 ? 20 : 34); }

using treeserve_lanes::half_at;

// Scalar decode of one block into w[32].
inline void decode_scalar(QType t, const uint8_t* blk, float* w) {
  const float d = half_at(blk);
  if (t == QType::Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int i = 0; i < 32; ++i) w[i] = d * static_cast<float>(q[i]);
    return;
  }
  const float m = t == QType::Q4_1 ? half_at(blk + 2) : -8.0f * d;
  const uint8_t* qs = blk + (t == QType::Q4_1 ? 4 : 2);
  for (int j = 0; j < 16; ++j) {
    w[j] = d * static_cast<float>(qs[j] & 15) + m;
    w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
  }
}

// Rows [m0, m0 + MC) of x against weight rows [n0, n1).
template <int MC>
void rows_scalar(QType t, const float* x, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / GROUP, bb = block_bytes(t);
  float wf[GROUP];
  for (int64_t n = n0; n < n1; ++n) {
    float acc[MC] = {};
    const uint8_t* row = w + n * nb * bb;
    for (int64_t b = 0; b < nb; ++b) {
      decode_scalar(t, row + b * bb, wf);
      for (int m = 0; m < MC; ++m) {
        const float* xb = x + m * K + b * GROUP;
        for (int i = 0; i < GROUP; ++i) acc[m] += wf[i] * xb[i];
      }
    }
    for (int m = 0; m < MC; ++m) y[m * N + n] = acc[m];
  }
}

#ifdef __AVX2__
// The weights stream from memory once per call: ask for the bytes ahead of the block in hand (the rest
// of this row and the next ones, which follow it in memory), which the hardware prefetcher alone does
// not keep up with at one or two rows of x (Zen 4: 1.1-1.6x on 8B's shapes, one thread): into L1, 4 KiB
// ahead, or into L2, 8 KiB ahead, so that the streamed weights do not push out of L1 what a block reuses:
// the int16 path's rounded x where it takes X_L1_BYTES or more in a call bound by memory (at most 4 rows;
// 8B's down projection, K = 14336: Zen 4, one row, 1.3x on that shape, 1.4x for Q8_0, the same elsewhere),
// and always the int8 path's lanes of x and decoded codes (1.05-1.1x on 8B's gate|up, the same elsewhere).
constexpr int64_t X_L1_BYTES = 16384;
__attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* p, bool to_l2 = false) {
  if (to_l2)
    _mm_prefetch(reinterpret_cast<const char*>(p) + 8192, _MM_HINT_T1);
  else
    _mm_prefetch(reinterpret_cast<const char*>(p) + 4096, _MM_HINT_T0);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One block's codes as four float vectors: elements XO[i] .. XO[i] + 7 (for 4-bit codes the low and
// high nibbles of bytes 0-7, then of bytes 8-15).
// Q4_0: q - 8 in -8..7, Q8_0: q in -128..127 (w = d q for both); Q4_1: q in 0..15 (w = d q + m).
constexpr int XO[4] = {0, 16, 8, 24};

inline void codes_avx2(QType t, const uint8_t* blk, __m256 (&qv)[4]) {
  if (t == QType::Q8_0) {
    for (int i = 0; i < 4; ++i)
      qv[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + XO[i]))));
    return;
  }
  const uint8_t* qs = blk + (t == QType::Q4_1 ? 4 : 2);
  const __m256i mask = _mm256_set1_epi32(15), bias = _mm256_set1_epi32(t == QType::Q4_0 ? 8 : 0);
  for (int h = 0; h < 2; ++h) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * h)));
    qv[2 * h] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(e, mask), bias));
    qv[2 * h + 1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(e, 4), bias));
  }
}

// Rows x[0, MC) against weight rows [n0, n1). Up to 3 rows, per block y += d * sum(q x) (+ m * sum(x)
// for Q4_1, the block sums of x precomputed in xsum[m * nb + b]): fewer operations per weight; from 4
// rows on the block is decoded to floats once and shared.
template <int MC>
void rows_avx2(QType t, const float* x, const float* xsum, const uint8_t* w, float* y, int64_t K, int64_t N,
               int64_t n0, int64_t n1) {
  const int64_t nb = K / GROUP, bb = block_bytes(t);
  const bool q41 = t == QType::Q4_1;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[MC], acc2[MC];
    float off_acc[MC];
    for (int m = 0; m < MC; ++m) {
      acc[m] = acc2[m] = _mm256_setzero_ps();
      off_acc[m] = 0.0f;
    }
    const uint8_t* row = w + n * nb * bb;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * bb;
      prefetch_ahead(blk);
      __m256 qv[4];
      codes_avx2(t, blk, qv);
      const float d = half_at(blk);
      const __m256 dv = _mm256_set1_ps(d);
      if constexpr (MC >= 4) {  // enough rows: decode the weights once (w = d q [+ m]), one FMA each per row
        const __m256 mv = _mm256_set1_ps(q41 ? half_at(blk + 2) : 0.0f);
        for (int i = 0; i < 4; ++i) qv[i] = _mm256_fmadd_ps(dv, qv[i], mv);
        for (int m = 0; m < MC; ++m) {
          const float* xb = x + m * K + b * GROUP;
          // Two chains per row below 8 rows (FMA latency would bound 4 rows); one at 8 (16 registers).
          __m256& second = MC >= 8 ? acc[m] : acc2[m];
          for (int i = 0; i < 4; i += 2) {
            acc[m] = _mm256_fmadd_ps(qv[i], _mm256_loadu_ps(xb + XO[i]), acc[m]);
            second = _mm256_fmadd_ps(qv[i + 1], _mm256_loadu_ps(xb + XO[i + 1]), second);
          }
        }
        continue;
      }
      for (int m = 0; m < MC; ++m) {
        const float* xb = x + m * K + b * GROUP;
        __m256 s0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(xb + XO[0]));
        __m256 s1 = _mm256_mul_ps(qv[1], _mm256_loadu_ps(xb + XO[1]));
        s0 = _mm256_fmadd_ps(qv[2], _mm256_loadu_ps(xb + XO[2]), s0);
        s1 = _mm256_fmadd_ps(qv[3], _mm256_loadu_ps(xb + XO[3]), s1);
        acc[m] = _mm256_fmadd_ps(dv, _mm256_add_ps(s0, s1), acc[m]);
      }
      if (q41) {
        const float off = half_at(blk + 2);
        for (int m = 0; m < MC; ++m) off_acc[m] += off * xsum[m * nb + b];
      }
    }
    for (int m = 0; m < MC; ++m) y[m * N + n] = hsum(_mm256_add_ps(acc[m], acc2[m])) + off_acc[m];
  }
}
#endif

// ---- int16 activations (gguf_linear) ----

template <QType T>
constexpr int64_t BB = T == QType::Q4_0 ? 18 : (T == QType::Q4_1 ? 20 : 34);  // block bytes
constexpr int64_t CHUNK = 64;  // blocks of a weight row whose scales are prepared at once

// Block scales of the int16 path for blocks [b0, b1) of one weight row (a chunk starting at block c0):
// ds[m][b - c0] = d_b * s_{m,b} (float32), and the Q4_1 offsets m_b * xsum_{m,b} added to off[m].
template <QType T, int MC>
void block_scales_scalar(const uint8_t* row, const float* xs, const float* xsum, int64_t nb, int64_t c0, int64_t b0,
                         int64_t b1, float (*ds)[CHUNK], float* off) {
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk = row + b * BB<T>;
    const float d = half_at(blk);
    for (int m = 0; m < MC; ++m) ds[m][b - c0] = d * xs[m * nb + b];
    if constexpr (T == QType::Q4_1) {
      const float mo = half_at(blk + 2);
      for (int m = 0; m < MC; ++m) off[m] += mo * xsum[m * nb + b];
    }
  }
}

// The signed integer codes of one block (Q4_0: q - 8, Q4_1: q, Q8_0: q), element order.
template <QType T>
inline void codes_int(const uint8_t* blk, int32_t* q) {
  if constexpr (T == QType::Q8_0) {
    for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(blk[2 + i]);
  } else {
    const uint8_t* qs = blk + (T == QType::Q4_1 ? 4 : 2);
    const int32_t bias = T == QType::Q4_0 ? 8 : 0;
    for (int j = 0; j < 16; ++j) {
      q[j] = (qs[j] & 15) - bias;
      q[j + 16] = (qs[j] >> 4) - bias;
    }
  }
}

template <QType T, int MC>
void rows_int_scalar(const int16_t* xq, const float* xs, const float* xsum, const uint8_t* w, float* y, int64_t K,
                     int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / GROUP;
  float ds[MC][CHUNK];
  int32_t q[GROUP];
  for (int64_t n = n0; n < n1; ++n) {
    float acc[MC] = {}, off[MC] = {};
    const uint8_t* row = w + n * nb * BB<T>;
    for (int64_t c0 = 0; c0 < nb; c0 += CHUNK) {
      const int64_t c1 = std::min(nb, c0 + CHUNK);
      block_scales_scalar<T, MC>(row, xs, xsum, nb, c0, c0, c1, ds, off);
      for (int64_t b = c0; b < c1; ++b) {
        codes_int<T>(row + b * BB<T>, q);
        for (int m = 0; m < MC; ++m) {
          const int16_t* xb = xq + (m * nb + b) * GROUP;
          int32_t s = 0;
          for (int i = 0; i < GROUP; ++i) s += q[i] * xb[i];
          acc[m] += static_cast<float>(s) * ds[m][b - c0];
        }
      }
    }
    for (int m = 0; m < MC; ++m) y[m * N + n] = acc[m] + off[m];
  }
}

#ifdef __AVX2__
// The f16 at p of eight consecutive blocks (p, p + BB, ...: their d, or at + 2 Q4_1's m) as float32,
// converted by one F16C instruction. With AVX-512 BW and blocks of at most 20 bytes (Q4_0, Q4_1), picked
// by one two-register word permutation from the 64 bytes at p and at p + 4 BB (inside the eight blocks).
template <QType T>
inline __m256 halves8(const uint8_t* p) {
#ifdef __AVX512BW__
  if constexpr (BB<T> <= 20) {
    constexpr int16_t S = BB<T> / 2;  // the stride in words
    alignas(64) static constexpr int16_t pick[32] = {0, S, 2 * S, 3 * S, 32, 32 + S, 32 + 2 * S, 32 + 3 * S};
    const __m512i h = _mm512_permutex2var_epi16(_mm512_loadu_si512(p), _mm512_load_si512(pick),
                                                _mm512_loadu_si512(p + 4 * BB<T>));
    return _mm256_cvtph_ps(_mm512_castsi512_si128(h));
  }
#endif
  uint16_t h[8];
  for (int i = 0; i < 8; ++i) std::memcpy(&h[i], p + i * BB<T>, 2);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

// block_scales_scalar eight blocks at a time (halves8). Inlined: called once per weight row, as a call it took
// a vzeroupper and the row's sums saved and restored around it (Zen 3: the tile 1.03-1.25x at K = 576, as fast
// elsewhere).
template <QType T, int MC>
__attribute__((always_inline)) inline void block_scales_avx2(const uint8_t* row, const float* xs, const float* xsum,
                                                             int64_t nb, int64_t c0, int64_t c1, float (*ds)[CHUNK],
                                                             __m256 (&offv)[MC], float* off) {
  int64_t b = c0;
  for (; b + 8 <= c1; b += 8) {
    const __m256 dv = halves8<T>(row + b * BB<T>);
    for (int m = 0; m < MC; ++m) _mm256_storeu_ps(ds[m] + (b - c0), _mm256_mul_ps(dv, _mm256_loadu_ps(xs + m * nb + b)));
    if constexpr (T == QType::Q4_1) {
      const __m256 mv = halves8<T>(row + b * BB<T> + 2);
      for (int m = 0; m < MC; ++m) offv[m] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xsum + m * nb + b), offv[m]);
    }
  }
  block_scales_scalar<T, MC>(row, xs, xsum, nb, c0, b, c1, ds, off);
}

// madd(a, x) + madd(b, y) per int32 lane (pairs of int16 products, exact): with AVX-512 VNNI (or AVX-VNNI)
// the second product and the add are one vpdpwssd, the same lanes and values (no saturation: |sum| < 2^31).
inline __m256i dot_pairs(__m256i a, __m256i x, __m256i b, __m256i y) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(a, x), b, y);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(a, x), b, y);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(a, x), _mm256_madd_epi16(b, y));
#endif
}

// Per block: the codes widened to 2 x 16 int16, _mm256_madd_epi16 with the row's int16 x (exact int32),
// one conversion and one FMA by d s_b per row, in two accumulator chains per row (even / odd blocks),
// whatever the register block's row count (INT_ROWS keeps the blocks small enough for the registers):
// each row of every call is summed as it is alone.
constexpr int CHAINS = 2;

template <QType T, int MC, bool L2>
void rows_int_avx2(const int16_t* xq, const float* xs, const float* xsum, const uint8_t* w, float* y, int64_t K,
                   int64_t N, int64_t n0, int64_t n1) {
  constexpr int CH = CHAINS;
  const int64_t nb = K / GROUP;
  const __m256i low4 = _mm256_set1_epi16(15), bias = _mm256_set1_epi16(8);
  float ds[MC][CHUNK];
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[CH][MC], offv[MC];
    float off[MC] = {};
    for (int m = 0; m < MC; ++m) {
      offv[m] = _mm256_setzero_ps();
      for (int c = 0; c < CH; ++c) acc[c][m] = _mm256_setzero_ps();
    }
    const uint8_t* row = w + n * nb * BB<T>;
    auto step = [&](int64_t b, int64_t c0, __m256(&a)[MC]) __attribute__((always_inline)) {
      const uint8_t* blk = row + b * BB<T>;
      prefetch_ahead(blk, L2);
      __m256i lo, hi;
      if constexpr (T == QType::Q8_0) {
        lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
        hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
      } else {
        const __m256i e =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (T == QType::Q4_1 ? 4 : 2))));
        lo = _mm256_and_si256(e, low4);
        hi = _mm256_srli_epi16(e, 4);
        if constexpr (T == QType::Q4_0) {
          lo = _mm256_sub_epi16(lo, bias);
          hi = _mm256_sub_epi16(hi, bias);
        }
      }
      for (int m = 0; m < MC; ++m) {
        const __m256i* xb = reinterpret_cast<const __m256i*>(xq + (m * nb + b) * GROUP);
        const __m256i p = dot_pairs(lo, _mm256_loadu_si256(xb), hi, _mm256_loadu_si256(xb + 1));
        a[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&ds[m][b - c0]), a[m]);
      }
    };
    for (int64_t c0 = 0; c0 < nb; c0 += CHUNK) {
      const int64_t c1 = std::min(nb, c0 + CHUNK);
      block_scales_avx2<T, MC>(row, xs, xsum, nb, c0, c1, ds, offv, off);
      int64_t b = c0;
      for (; b + CH <= c1; b += CH)
        for (int c = 0; c < CH; ++c) step(b + c, c0, acc[c]);
      for (; b < c1; ++b) step(b, c0, acc[0]);
    }
    for (int m = 0; m < MC; ++m) {
      __m256 s = acc[0][m];
      for (int c = 1; c < CH; ++c) s = _mm256_add_ps(s, acc[c][m]);
      y[m * N + n] = hsum(s) + (hsum(offv[m]) + off[m]);
    }
  }
}
#endif

template <QType T, int MC>
void rows_int(const int16_t* xq, const float* xs, const float* xsum, const uint8_t* w, float* y, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
#ifdef __AVX2__
  if constexpr (MC <= 4) {  // bound by memory: into L2 where x would not stay in L1 (prefetch_ahead)
    if (MC * K * static_cast<int64_t>(sizeof(int16_t)) >= X_L1_BYTES)
      return rows_int_avx2<T, MC, true>(xq, xs, xsum, w, y, K, N, n0, n1);
  }
  rows_int_avx2<T, MC, false>(xq, xs, xsum, w, y, K, N, n0, n1);
#else
  rows_int_scalar<T, MC>(xq, xs, xsum, w, y, K, N, n0, n1);
#endif
}

template <int MC>
void rows(QType t, const float* x, const float* xsum, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t n0,
          int64_t n1) {
#ifdef __AVX2__
  rows_avx2<MC>(t, x, xsum, w, y, K, N, n0, n1);
#else
  rows_scalar<MC>(t, x, w, y, K, N, n0, n1);
#endif
}

// fn(std::integral_constant<int, mc>) for mc in 1..MAX (larger counts: MAX).
template <int MAX, int MC = 1, typename Fn>
void by_rows(int64_t mc, Fn&& fn) {
  if constexpr (MC < MAX) {
    if (mc > MC) return by_rows<MAX, MC + 1>(mc, fn);
  }
  fn(std::integral_constant<int, MC>{});
}

template <typename Fn>
void by_qtype(QType t, Fn&& fn) {
  switch (t) {
    case QType::Q4_0: return fn(std::integral_constant<QType, QType::Q4_0>{});
    case QType::Q4_1: return fn(std::integral_constant<QType, QType::Q4_1>{});
    default: return fn(std::integral_constant<QType, QType::Q8_0>{});
  }
}

// One 32-block of x rounded to Q codes (int16 for gguf_linear, int8 for gguf_linear_q8): q = round(x / s),
// s = max|x| / QMAX (QMAX = 32767 or 127) returned; s = 0 for an all-zero block, NaN (codes 0) for a block
// with a non-finite value, which then makes the outputs NaN as float32 would. The same values with AVX2
// (clamp, then round to nearest even) as without.
template <typename Q>
inline float quantize_block(const float* xb, Q* q) {
  constexpr float QMAX = static_cast<float>(std::numeric_limits<Q>::max());
#ifdef __AVX2__
  const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 v[4], amax = _mm256_setzero_ps();
  int finite = 0xff;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 a = _mm256_andnot_ps(sign, v[i]);
    amax = _mm256_max_ps(amax, a);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ));
  }
  if (finite != 0xff) {
    std::fill(q, q + GROUP, Q{0});
    return std::nanf("");
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float am = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 inv = _mm256_set1_ps(am > 0.0f ? QMAX / am : 0.0f), hi = _mm256_set1_ps(QMAX), lo = _mm256_set1_ps(-QMAX);
  __m256i r[4];
  for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_mul_ps(v[i], inv))));
  const __m256i p0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(r[0], r[1]), 0xd8);
  const __m256i p1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(r[2], r[3]), 0xd8);
  if constexpr (sizeof(Q) == 2) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), p1);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(_mm256_packs_epi16(p0, p1), 0xd8));
  }
  return am / QMAX;
#else
  float am = 0.0f;
  for (int64_t j = 0; j < GROUP; ++j) {
    if (!std::isfinite(xb[j])) {
      std::fill(q, q + GROUP, Q{0});
      return std::nanf("");
    }
    am = std::max(am, std::fabs(xb[j]));
  }
  const float inv = am > 0.0f ? QMAX / am : 0.0f;
  for (int64_t j = 0; j < GROUP; ++j) q[j] = static_cast<Q>(std::rint(std::min(QMAX, std::max(-QMAX, xb[j] * inv))));
  return am / QMAX;
#endif
}

// x [blocks * 32] rounded per 32-block (quantize_block): codes xq, scales xs.
template <typename Q>
void quantize_rows(const float* x, int64_t blocks, Q* xq, float* xs) {
  for (int64_t i = 0; i < blocks; ++i) xs[i] = quantize_block(x + i * GROUP, xq + i * GROUP);
}

QType parse_qtype(const std::string& s) {
  if (s == "Q4_0") return QType::Q4_0;
  if (s == "Q4_1") return QType::Q4_1;
  TORCH_CHECK(s == "Q8_0", "gguf_linear: qtype must be Q4_0, Q4_1 or Q8_0, got ", s);
  return QType::Q8_0;
}

// The float32 sum of each 32-block of x [blocks * 32] (the Q4_1 offsets' factor).
inline float block_sum(const float* xb) {
  float sum = 0.0f;
  for (int64_t j = 0; j < GROUP; ++j) sum += xb[j];
  return sum;
}

std::vector<float> block_sums(const float* x, int64_t blocks) {
  std::vector<float> sums(blocks);
  for (int64_t i = 0; i < blocks; ++i) sums[i] = block_sum(x + i * GROUP);
  return sums;
}

// The qtype of a checked call: x float32 [M, K], K a multiple of 32, w uint8 [N, K/32 * block bytes].
QType checked_qtype(const at::Tensor& x, const at::Tensor& w, const std::string& qtype, int64_t K) {
  const QType t = parse_qtype(qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == K, "gguf_linear: x must be float32 [M, K]");
  TORCH_CHECK(K % GROUP == 0, "gguf_linear: K must be a multiple of 32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == K / GROUP * block_bytes(t),
              "gguf_linear: w must be uint8 [N, K/32 * block bytes]");
  return t;
}

at::Tensor gguf_linear_impl(const at::Tensor& x, const at::Tensor& w, const std::string& qtype, int64_t K, bool exact) {
  const QType t = checked_qtype(x, w, qtype, K);
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t nb = K / GROUP;
  // Only Q4_1's offsets read x's block sums (the other types' kernels never do: none computed).
  const std::vector<float> xsum = t == QType::Q4_1 ? block_sums(xp, M * nb) : std::vector<float>();
  const auto sums = [&](int64_t m0) { return xsum.empty() ? nullptr : xsum.data() + m0 * nb; };
  std::vector<float> xs;
  std::vector<int16_t> xq;
  if (!exact) {
    xq.resize(M * K);
    xs.resize(M * nb);
    quantize_rows(xp, M * nb, xq.data(), xs.data());
  }
  // Grain: at least ~32k weights per task.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1));
  // More rows than a register block: each span of weight rows (~64 KiB, in L2) serves every register block
  // of x before the next span is read from memory, instead of one pass over the weights per block.
  const int64_t block = exact ? MAX_ROWS : INT_ROWS;
  const int64_t span = M > block ? std::max<int64_t>(1, 65536 / (nb * block_bytes(t))) : N;
  at::parallel_for(0, N, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t n0 = p0; n0 < p1; n0 += span) {
      const int64_t n1 = std::min(p1, n0 + span);
      for (int64_t m0 = 0; m0 < M; m0 += block) {
        const int64_t mc = std::min(block, M - m0);
        if (exact) {
          by_rows<MAX_ROWS>(mc, [&](auto r) { rows<r.value>(t, xp + m0 * K, sums(m0), wp, yp + m0 * N, K, N, n0, n1); });
          continue;
        }
        by_rows<INT_ROWS>(mc, [&](auto r) {
          by_qtype(t, [&](auto qt) {
            rows_int<qt.value, r.value>(xq.data() + m0 * K, xs.data() + m0 * nb, sums(m0), wp, yp + m0 * N, K, N, n0,
                                        n1);
          });
        });
      }
    }
  });
  return y;
}

// One block as 32 float32 weights with gguf.quants' arithmetic, one float32 rounding per operation
// (Q4_0 d * (q - 8), Q4_1 the product d * q then + m, Q8_0 q * d): bitwise the torch path
// (dequantize_blocks). No FMA: ISO C++ (-std=c++XX) leaves GCC's fp-contract off.
inline void dequantize_block(QType t, const uint8_t* blk, float* o) {
  const float d = half_at(blk);
  if (t == QType::Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < 32; ++j) o[j] = static_cast<float>(q[j]) * d;
  } else if (t == QType::Q4_0) {
    const uint8_t* qs = blk + 2;
    for (int j = 0; j < 16; ++j) {
      o[j] = d * static_cast<float>((qs[j] & 15) - 8);
      o[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  } else {
    const float m = half_at(blk + 2);
    const uint8_t* qs = blk + 4;
    for (int j = 0; j < 16; ++j) {
      o[j] = d * static_cast<float>(qs[j] & 15) + m;
      o[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
}

// w [N, K/32 * block bytes] as float32 [N, K] (dequantize_block). Parallel over N.
at::Tensor gguf_dequantize(const at::Tensor& w, std::string qtype, int64_t K) {
  const QType t = parse_qtype(qtype);
  TORCH_CHECK(K > 0 && K % GROUP == 0, "gguf_dequantize: K must be a positive multiple of 32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == K / GROUP * block_bytes(t),
              "gguf_dequantize: w must be uint8 [N, K/32 * block bytes]");
  const at::Tensor wc = w.contiguous();
  const int64_t N = w.size(0), nb = K / GROUP, bb = block_bytes(t);
  at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / K), [&](int64_t n0, int64_t n1) {
    for (int64_t i = n0 * nb; i < n1 * nb; ++i) dequantize_block(t, wp + i * bb, op + i * GROUP);
  });
  return out;
}

// x . w for one dequantized row w of nb blocks (dequantize_block) in one fixed order: two chains of 8
// lanes (elements 0-7 and 16-23 of each block in the first, 8-15 and 24-31 in the second), each lane
// one std::fma per element, then lane by lane the two chains added and the lanes summed in order. The
// same value on every build (std::fma is exact rounding; GCC vectorizes the lanes where it can).
float codes_dot(QType t, const uint8_t* row, const float* x, int64_t nb) {
  float acc[2][8] = {};
  float w[GROUP];
  for (int64_t b = 0; b < nb; ++b) {
    dequantize_block(t, row + b * block_bytes(t), w);
    const float* xb = x + b * GROUP;
    for (int i = 0; i < GROUP; ++i) acc[(i / 8) % 2][i % 8] = std::fma(w[i], xb[i], acc[(i / 8) % 2][i % 8]);
  }
  float s = 0.0f;
  for (int l = 0; l < 8; ++l) s += acc[0][l] + acc[1][l];
  return s;
}

// treeserve::codes_row_norms: |W_j| of every row of w [N, K/32 * block bytes] as float32 [N]: the squares of the
// row's dequantized float32 weights (dequantize_block, bitwise gguf's) summed in float64, in block order, then
// the square root rounded once to float32. Parallel over rows.
at::Tensor codes_row_norms(const at::Tensor& w, std::string qtype, int64_t K) {
  TORCH_CHECK_VALUE(qtype == "Q4_0" || qtype == "Q4_1" || qtype == "Q8_0",
                    "codes_row_norms: qtype must be Q4_0, Q4_1 or Q8_0, got ", qtype);
  const QType t = parse_qtype(qtype);
  TORCH_CHECK_VALUE(K > 0 && K % GROUP == 0, "codes_row_norms: K must be a positive multiple of 32, got ", K);
  TORCH_CHECK_VALUE(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == K / GROUP * block_bytes(t),
                    "codes_row_norms: w must be uint8 [N, K/32 * block bytes] = [N, ", K / GROUP * block_bytes(t),
                    "], got ", w.scalar_type(), " ", w.sizes());
  const at::Tensor wc = w.contiguous();
  const int64_t N = w.size(0), nb = K / GROUP, bb = block_bytes(t);
  at::Tensor out = at::empty({N}, w.options().dtype(at::kFloat));
  const uint8_t* wp = wc.const_data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / K), [&](int64_t n0, int64_t n1) {
    float v[GROUP];
    for (int64_t n = n0; n < n1; ++n) {
      double sum = 0.0;
      for (int64_t b = 0; b < nb; ++b) {
        dequantize_block(t, wp + (n * nb + b) * bb, v);
        for (int i = 0; i < GROUP; ++i) sum += static_cast<double>(v[i]) * v[i];
      }
      op[n] = static_cast<float>(std::sqrt(sum));
    }
  });
  return out;
}

// treeserve::codes_head_rescore: CodesHead's re-scoring after its first pass (gguf_linear or
// gguf_linear_q8 on the head's codes w [V, K/32 * block bytes]), in place in logits [M, V] (float32):
// with fx = bound[m] (the first pass's error bound per unit of |W_j|, CodesHead.row_bound) and
// row_norms [V] = |W_j|, every entry the bound cannot rule out (treeserve_head.h) becomes x_m . W_j in
// float32 on the dequantized row (codes_dot). Rows in parallel for the search, entries for the dots.
void codes_head_rescore(const at::Tensor& logits, const at::Tensor& x, const at::Tensor& w, std::string qtype,
                        int64_t K, const at::Tensor& bound, const at::Tensor& row_norms) {
  const QType t = checked_qtype(x, w, qtype, K);
  const int64_t M = x.size(0), V = w.size(0), nb = K / GROUP, bb = block_bytes(t);
  for (const at::Tensor* a : {&logits, &x, &bound, &row_norms})
    TORCH_CHECK_TYPE(a->scalar_type() == at::kFloat && a->device().is_cpu() && a->is_contiguous(),
                     "codes_head_rescore: logits, x, bound and row_norms must be contiguous float32 CPU tensors");
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(0) == M && logits.size(1) == V && bound.dim() == 1 &&
                        bound.size(0) == M && row_norms.dim() == 1 && row_norms.size(0) == V,
                    "codes_head_rescore: need logits [M, V] = [", M, ", ", V, "], bound [M] and row_norms [V]; got ",
                    logits.sizes(), ", ", bound.sizes(), ", ", row_norms.sizes());
  const at::Tensor wc = w.contiguous();
  float* lp = logits.data_ptr<float>();
  const float* xp = x.const_data_ptr<float>();
  const float* bp = bound.const_data_ptr<float>();
  const float* rn = row_norms.const_data_ptr<float>();
  const uint8_t* wp = wc.const_data_ptr<uint8_t>();
  std::vector<std::vector<int64_t>> cand(M);
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* a = lp + r * V;
      const float threshold = treeserve_head::best_lower_bound(a, rn, bp[r], V);
      treeserve_head::collect_candidates(a, rn, bp[r], threshold, V, cand[r]);
    }
  });
  std::vector<int64_t> entries;  // r * V + j
  for (int64_t r = 0; r < M; ++r)
    for (int64_t j : cand[r]) entries.push_back(r * V + j);
  at::parallel_for(0, static_cast<int64_t>(entries.size()), 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = entries[i] / V, j = entries[i] % V;
      lp[entries[i]] = codes_dot(t, wp + j * nb * bb, xp + r * K, nb);
    }
  });
}

// ---- int8 activations (gguf_linear_q8: large batches of models whose codes serve every batch) ----
// Each 32-block b of each row of x is rounded to int8, xq = round(x / s_b), s_b = max|x_b| / 127
// (|x - s_b xq| <= s_b / 2 up to float rounding). Per weight block the signed integer codes c (Q4_0: q - 8,
// Q4_1: q, Q8_0: q) and D = sum c xq, exact in int32 (|D| <= 128 * 127 * 32 < 2^24: exact in float32 too).
// Per row of x, in block order: acc = fma(float(D), d * s_b, acc) and for Q4_1 off = fma(m, sum(x_b), off)
// with the float32 sums of the unrounded x; y = acc + off. Every row of x goes through the same operations
// in the same order whatever the call's other rows: a row of any call is bit for bit the row alone, and
// the vector kernels' rows (VNNI or not) are the scalar loop's.
// Where the host has AVX2, the rows of x lie in the lanes of a vector register (8 per ymm; with AVX-512 VNNI
// 16 per zmm, 8 per ymm for calls of at most 8 rows); each 4-byte group of a weight block's codes, as unsigned
// bytes u, is broadcast across the lanes and multiplied with the lanes' 4 signed bytes of x:
// - with AVX-512 VNNI or AVX-VNNI, by vpdpbusd (4 products added into int32): u = c + bias (Q4_0, Q4_1: the
//   nibbles q, bias 8 / 0; Q8_0: q + 128, bias 128), and bias * sum(xq), per row and block of x, is
//   subtracted in int32;
// - with AVX2 alone, by vpmaddubsw, which adds pairs of products into saturating int16: Q4's nibbles q in
//   order (u <= 15, bias 8 / 0) so that a block's 16 products per int16 lane stay below 2^15 (16 * 15 * 127)
//   and are summed in int16 before one vpmaddwd widens them; Q8_0 by the sign trick, |c| against x with c's
//   sign (pairs at most 2 * 128 * 127 < 2^15), widened per step.
// A tile of Q8_ROWS weight rows against one lane group (calls of at most L rows: batched decode) decodes each
// block's codes one block ahead inside the loop that multiplies them (rows_q8_one); against several, it
// decodes Q8_CHUNK blocks at a time and serves every group with them (rows_q8_lanes; with AVX2 alone, Q4's groups
// two at a time, two rows each, so that one broadcast of a row's codes serves both). Without AVX2 the scalar
// loop (correct, slow: the caller measures).

template <QType T>
void rows_q8_scalar(const int8_t* xq, const float* xs, const float* xsum, const uint8_t* w, float* y, int64_t M,
                    int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / GROUP;
  int32_t c[GROUP];
  std::vector<float> acc(M), off(M);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(off.begin(), off.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + (n * nb + b) * BB<T>;
      codes_int<T>(blk, c);
      const float d = half_at(blk);
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xb = xq + (m * nb + b) * GROUP;
        int32_t dot = 0;
        for (int i = 0; i < GROUP; ++i) dot += c[i] * xb[i];
        acc[m] = std::fma(static_cast<float>(dot), d * xs[m * nb + b], acc[m]);
        if constexpr (T == QType::Q4_1) off[m] = std::fma(half_at(blk + 2), xsum[m * nb + b], off[m]);
      }
    }
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = acc[m] + off[m];
  }
}

#ifdef __AVX2__
#define TREESERVE_Q8_LANES 1
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define TREESERVE_Q8_VNNI 1
#endif
// L rows of x per register: 16 (a zmm, AVX-512 VNNI) or 8 (a ymm: AVX2, AVX-VNNI, or AVX-512 VL for calls of
// at most 8 rows, where a zmm would compute 8 empty lanes). GCC vector types, so that the arithmetic is
// written once; the instructions that need a width, by intrinsics.
#if defined(TREESERVE_Q8_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TREESERVE_Q8_ZMM 1
constexpr int MAX_LANES = 16;
#else
constexpr int MAX_LANES = 8;
#endif

template <int L>
struct Lanes {
  typedef int32_t I __attribute__((vector_size(4 * L)));
  typedef float F __attribute__((vector_size(4 * L)));
  template <typename V>
  static V load(const void* p) {
    V v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
#ifdef TREESERVE_Q8_VNNI
  // acc + per lane the dot product of the 4 unsigned bytes at u4 with x's 4 signed bytes (vpdpbusd).
  static I dot(I acc, const uint8_t* u4, I x) {
    int32_t v;
    std::memcpy(&v, u4, 4);
    if constexpr (L == 16) {
      return reinterpret_cast<I>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc), _mm512_set1_epi32(v),
                                                     reinterpret_cast<__m512i>(x)));
    } else {
#ifdef TREESERVE_Q8_ZMM
      return reinterpret_cast<I>(_mm256_dpbusd_epi32(reinterpret_cast<__m256i>(acc), _mm256_set1_epi32(v),
                                                     reinterpret_cast<__m256i>(x)));
#else
      return reinterpret_cast<I>(_mm256_dpbusd_avx_epi32(reinterpret_cast<__m256i>(acc), _mm256_set1_epi32(v),
                                                         reinterpret_cast<__m256i>(x)));
#endif
    }
  }
#else
  // Per lane the two int16 sums of the pairs of products of the 4 unsigned bytes at u4 with x's 4 signed
  // bytes (vpmaddubsw: saturating, the caller bounds u). AVX2 alone: L == 8.
  static __m256i pairs(const uint8_t* u4, I x) {
    int32_t v;
    std::memcpy(&v, u4, 4);
    return _mm256_maddubs_epi16(_mm256_set1_epi32(v), reinterpret_cast<__m256i>(x));
  }
  // Per lane the int32 sum of its two int16 sums.
  static I widen(__m256i p) { return reinterpret_cast<I>(_mm256_madd_epi16(p, _mm256_set1_epi16(1))); }
#endif
  // a b + c rounded once (std::fma per lane).
  static F fma(F a, F b, F c) {
    if constexpr (L == 16) {
      return reinterpret_cast<F>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                 reinterpret_cast<__m512>(c)));
    } else {
      return reinterpret_cast<F>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                 reinterpret_cast<__m256>(c)));
    }
  }
};
#endif

#ifdef TREESERVE_Q8_LANES
constexpr int Q8_ROWS = 4;         // weight rows of a tile
constexpr int64_t Q8_CHUNK = 8;    // blocks whose codes a tile decodes at a time
static_assert(Q8_CHUNK == 8, "a full chunk's scales are one halves8");
constexpr int64_t Q8_GROUPS = 8;   // lane groups of x (Q8_GROUPS * L rows) served per pass over the weights

// Products added in int16 pairs (vpmaddubsw, no VNNI): Q4's nibbles in order, Q8_0's codes as |c| and c (the
// sign trick, no bias).
#ifdef TREESERVE_Q8_VNNI
constexpr bool Q8_PAIRS = false;
#else
constexpr bool Q8_PAIRS = true;
#endif
template <QType T>
constexpr int32_t Q8_BIAS = T == QType::Q4_0 ? 8 : (T == QType::Q8_0 && !Q8_PAIRS ? 128 : 0);  // u = c + bias
// Bytes of one block's decoded codes (codes_u8_vec): Q8_0 with the sign trick keeps |c| and c.
template <QType T>
constexpr int64_t UB = T == QType::Q8_0 && Q8_PAIRS ? 2 * GROUP : GROUP;

// x in lanes: group g (rows g L .. g L + L - 1, zero-padded), block b, 4-byte step j: L lanes of 4 bytes
// xq at xt[((g nb + b) 8 + j) 4 L]; per lane at [(g nb + b) L] the block's scale, bias * sum(xq) (xc)
// and (Q4_1) the float32 sum of its unrounded x.
struct LaneX {
  std::unique_ptr<int8_t[]> xt;
  std::unique_ptr<float[]> xs, xsum;
  std::unique_ptr<int32_t[]> xc;
};

// x [M, nb * 32] rounded to int8 per block (quantize_block) into groups of L lanes, the lanes past row M
// zero. Blocks in parallel, each with all its lanes: a task writes whole cache lines of the lane arrays (rows
// in parallel would have two cores writing lanes of one line). Every entry written once, none zeroed first.
template <QType T, int L>
LaneX lanes_of(const float* x, int64_t M, int64_t nb) {
  const int64_t G = (M + L - 1) / L;
  LaneX lx{std::unique_ptr<int8_t[]>(new int8_t[G * nb * GROUP * L]), std::unique_ptr<float[]>(new float[G * nb * L]),
           std::unique_ptr<float[]>(T == QType::Q4_1 ? new float[G * nb * L] : nullptr),
           std::unique_ptr<int32_t[]>(new int32_t[G * nb * L])};
  at::parallel_for(0, G * nb, 16, [&](int64_t gb0, int64_t gb1) {
    alignas(32) int8_t q[GROUP];
    for (int64_t gb = gb0; gb < gb1; ++gb) {
      const int64_t g = gb / nb, b = gb % nb;
      for (int64_t lane = 0; lane < L; ++lane) {
        const int64_t m = g * L + lane;
        float s = 0.0f, xsum = 0.0f;
        int32_t sum = 0;
        if (m < M) {
          const float* xb = x + (m * nb + b) * GROUP;
          s = quantize_block(xb, q);
          for (int64_t j = 0; j < GROUP; ++j) sum += q[j];
          if constexpr (T == QType::Q4_1) xsum = block_sum(xb);
        } else {
          std::memset(q, 0, GROUP);
        }
        lx.xs[gb * L + lane] = s;
        lx.xc[gb * L + lane] = Q8_BIAS<T> * sum;
        if constexpr (T == QType::Q4_1) lx.xsum[gb * L + lane] = xsum;
        for (int64_t j = 0; j < 8; ++j) std::memcpy(&lx.xt[((gb * 8 + j) * L + lane) * 4], q + 4 * j, 4);
      }
    }
  });
  return lx;
}

// One block's codes stored at out (UB<T> bytes). With VNNI, as unsigned bytes: Q8_0 u = c + 128 in order; Q4
// the 16 code bytes masked twice, the low nibbles q_0..q_15 (u = c + bias) then the high nibbles times 16
// (16 q_16..16 q_31, at most 240: still unsigned bytes), a broadcast and one mask where the nibbles in order
// took a shift and an insert more (block_dot divides the high half's sum by 16: exact, a multiple of 16).
// With AVX2 alone: Q4's nibbles in order (u <= 15), Q8_0's |c| then c.
template <QType T>
inline void codes_u8_vec(const uint8_t* blk, uint8_t* out) {
  __m256i u;
  if constexpr (T == QType::Q8_0) {
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    if constexpr (Q8_PAIRS) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + GROUP), c);
      u = _mm256_abs_epi8(c);
    } else {
      u = _mm256_xor_si256(c, _mm256_set1_epi8(-128));
    }
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (T == QType::Q4_1 ? 4 : 2)));
    if constexpr (Q8_PAIRS) {
      u = _mm256_and_si256(_mm256_srlv_epi32(_mm256_broadcastsi128_si256(v), _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0)),
                           _mm256_set1_epi8(0x0f));
    } else {
      const __m256i low_high = _mm256_set_m128i(_mm_set1_epi8(static_cast<char>(0xf0)), _mm_set1_epi8(0x0f));
      u = _mm256_and_si256(_mm256_broadcastsi128_si256(v), low_high);
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), u);
}

// The scales d (and Q4_1's offsets m) of a weight row's next min(Q8_CHUNK, left) blocks from first.
template <QType T>
__attribute__((always_inline)) inline void chunk_scales(const uint8_t* first, int64_t left, float* d, float* mo) {
  if (left >= Q8_CHUNK) {  // converted at once
    _mm256_store_ps(d, halves8<T>(first));
    if constexpr (T == QType::Q4_1) _mm256_store_ps(mo, halves8<T>(first + 2));
  } else {
    for (int64_t k = 0; k < left; ++k) {
      d[k] = half_at(first + k * BB<T>);
      if constexpr (T == QType::Q4_1) mo[k] = half_at(first + k * BB<T> + 2);
    }
  }
}

// prefetch_ahead (into L2) for a weight row's Q8_CHUNK blocks from first: one prefetch per 64 bytes, which
// covers every line the chunk spans (and may ask for the line after it: a hint, past the row's end on its last
// chunk); one per block had asked up to 4 times for a line (the chunked tile of every build; Zen 4, AVX2 build,
// 16 rows: 1.02x).
template <QType T>
__attribute__((always_inline)) inline void prefetch_chunk(const uint8_t* first) {
  for (int64_t o = 0; o < Q8_CHUNK * BB<T> + 64; o += 64) prefetch_ahead(first + o, true);
}

// Keeps v in a register: the compiler would otherwise fold its load into every instruction that reads it.
template <typename V>
inline void in_register(V& v) {
  asm volatile("" : "+v"(v));
}

// D = sum c xq per lane for one block of one weight row: its codes ub (codes_u8_vec) against x's block (its
// steps X, bias * sum(xq) xc). Two chains of four (exact, any order). With VNNI, int32 chains; Q4's second
// runs on the high nibbles times 16. With AVX2 alone, Q8_0's alone (Q4's: q4_dots), its steps widened one by one.
template <QType T, int L>
inline typename Lanes<L>::I block_dot(const uint8_t* ub, const typename Lanes<L>::I* X, typename Lanes<L>::I xc) {
  using V = Lanes<L>;
  using I = typename V::I;
#ifdef TREESERVE_Q8_VNNI
  if constexpr (T == QType::Q8_0) {
    I e = V::dot(I{}, ub, X[0]);
    I od = V::dot(I{}, ub + 4, X[1]);
    for (int j = 2; j < 8; j += 2) {
      e = V::dot(e, ub + 4 * j, X[j]);
      od = V::dot(od, ub + 4 * j + 4, X[j + 1]);
    }
    return e + od - xc;
  } else {
    I e = V::dot(I{}, ub, X[0]);
    I od = V::dot(I{}, ub + 16, X[4]);
    for (int j = 1; j < 4; ++j) {
      e = V::dot(e, ub + 4 * j, X[j]);
      od = V::dot(od, ub + 16 + 4 * j, X[j + 4]);
    }
    if constexpr (Q8_BIAS<T> != 0) e -= xc;
    return e + (od >> 4);
  }
#else
  static_assert(T == QType::Q8_0, "with AVX2 alone, Q4's products are summed by q4_dots");
  const auto signed_x = [&](int j) {  // |c| against x with c's sign
    int32_t c;
    std::memcpy(&c, ub + GROUP + 4 * j, 4);
    return reinterpret_cast<I>(_mm256_sign_epi8(reinterpret_cast<__m256i>(X[j]), _mm256_set1_epi32(c)));
  };
  I e = V::widen(V::pairs(ub, signed_x(0)));
  I od = V::widen(V::pairs(ub + 4, signed_x(1)));
  for (int j = 2; j < 8; j += 2) {
    e += V::widen(V::pairs(ub + 4 * j, signed_x(j)));
    od += V::widen(V::pairs(ub + 4 * j + 4, signed_x(j + 1)));
  }
  return e + od;
#endif
}

// a + D d dx for one block of one weight row, the same operations in the same order for every lane as
// rows_q8_scalar's (Q4_1's offsets: offset_sum). Values in and out: a reference would keep the sums in memory.
template <int L>
inline typename Lanes<L>::F scaled_sum(typename Lanes<L>::F a, typename Lanes<L>::I dot, typename Lanes<L>::F dx,
                                       float d) {
  return Lanes<L>::fma(__builtin_convertvector(dot, typename Lanes<L>::F), dx * d, a);
}

// Q4_1's o + m sum(x_b) for one block gb of x (the float32 sums of the unrounded x).
template <int L>
inline typename Lanes<L>::F offset_sum(typename Lanes<L>::F o, float m, const LaneX& lx, int64_t gb) {
  using F = typename Lanes<L>::F;
  return Lanes<L>::fma(F{} + m, Lanes<L>::template load<F>(lx.xsum.get() + gb * L), o);
}

#ifndef TREESERVE_Q8_VNNI
// AVX2 alone, Q4: D per lane for one block of NG lane groups of x (group g's steps at xt[g], bias * sum(xq) at
// xc[g]) against NR weight rows' codes, step by step: each group's step is loaded once and each row's 4 code
// bytes broadcast once, then multiplied with every group's step, the sums kept in int16 (at most 16 * 15 * 127
// per lane: exact, any order) and widened once. block_dot's form (x's 8 steps held across the rows, two chains
// per row) left too few of AVX2's 16 registers for the rows' float sums: the compiler kept them in memory, and
// each block waited for the store of the one before (Zen 3, 8-64 rows: this form 1.1-1.2x faster, the same
// values). Two groups (rows_q8_lanes) halve the broadcasts, which take a vector pipe each (Zen 4, AVX2 build:
// the 16-row tile 1.03x from this alone).
template <QType T, int NR, int NG>
__attribute__((always_inline)) inline void q4_dots(const uint8_t (*u)[UB<T>], const int8_t* const* xt,
                                                   const int32_t* const* xc, typename Lanes<8>::I (*D)[NR]) {
  using V = Lanes<8>;
  using I = typename V::I;
  __m256i e[NG][NR];
  for (int j = 0; j < 8; ++j) {
    __m256i X[NG];
    for (int g = 0; g < NG; ++g) {
      X[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xt[g] + j * 4 * 8));
      in_register(X[g]);  // one load a step: as a memory operand, the compiler would read it once per row
    }
    for (int r = 0; r < NR; ++r) {
      int32_t v;
      std::memcpy(&v, u[r] + 4 * j, 4);
      __m256i c = _mm256_set1_epi32(v);
      if constexpr (NG > 1) in_register(c);  // broadcast once for the groups
      for (int g = 0; g < NG; ++g) {
        const __m256i p = _mm256_maddubs_epi16(c, X[g]);
        e[g][r] = j == 0 ? p : _mm256_add_epi16(e[g][r], p);
        in_register(e[g][r]);  // in this order: scheduled freely, the products of all steps were kept in memory
      }
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int r = 0; r < NR; ++r) {
      D[g][r] = V::widen(e[g][r]);
      if constexpr (Q8_BIAS<T> != 0) D[g][r] -= V::template load<I>(xc[g]);
    }
}

// AVX2 alone, Q4: block b of NG lane groups of x (gb[g] = g nb + b) against NR weight rows (block_rows' sums).
template <QType T, int NR, int NG>
__attribute__((always_inline)) inline void block_rows_q4(const LaneX& lx, const int64_t* gb, const uint8_t (*u)[UB<T>],
                                                         const float (*d)[Q8_CHUNK], const float (*mo)[Q8_CHUNK],
                                                         int64_t k, typename Lanes<8>::F (*a)[NR],
                                                         typename Lanes<8>::F (*o)[NR]) {
  using V = Lanes<8>;
  using I = typename V::I;
  using F = typename V::F;
  I D[NG][NR];
  const int8_t* xt[NG];
  const int32_t* xc[NG];
  for (int g = 0; g < NG; ++g) {
    xt[g] = lx.xt.get() + gb[g] * 8 * 4 * 8;
    xc[g] = lx.xc.get() + gb[g] * 8;
  }
  q4_dots<T, NR, NG>(u, xt, xc, D);
  for (int g = 0; g < NG; ++g) {
    const F dx = V::template load<F>(lx.xs.get() + gb[g] * 8);
    for (int r = 0; r < NR; ++r) {
      a[g][r] = scaled_sum<8>(a[g][r], D[g][r], dx, d[r][k]);
      if constexpr (T == QType::Q4_1) o[g][r] = offset_sum<8>(o[g][r], mo[r][k], lx, gb[g]);
    }
  }
}
#endif

// Block gb of x (group g, block b: gb = g nb + b) against NR weight rows' codes u[r] (codes_u8_vec), scales
// d[r][k] and Q4_1's offsets mo[r][k]: a[r] + D d dx (o[r] + m sum(x_b)) per lane. x's 8 steps, scales and
// bias sums held in registers across the rows (with AVX2 alone, Q4's D by q4_dots).
template <QType T, int L, int NR>
__attribute__((always_inline)) inline void block_rows(const LaneX& lx, int64_t gb, const uint8_t (*u)[UB<T>],
                                                      const float (*d)[Q8_CHUNK], const float (*mo)[Q8_CHUNK],
                                                      int64_t k, typename Lanes<L>::F (&a)[NR],
                                                      typename Lanes<L>::F (&o)[NR]) {
  using V = Lanes<L>;
  using I = typename V::I;
  using F = typename V::F;
#ifndef TREESERVE_Q8_VNNI
  if constexpr (T != QType::Q8_0) {
    static_assert(L == 8, "with AVX2 alone, 8 lanes");
    block_rows_q4<T, NR, 1>(lx, &gb, u, d, mo, k, &a, &o);
  } else
#endif
  {
    I X[8];
    for (int j = 0; j < 8; ++j) {
      X[j] = V::template load<I>(lx.xt.get() + (gb * 8 + j) * 4 * L);
      in_register(X[j]);
    }
    F dx = V::template load<F>(lx.xs.get() + gb * L);
    I xc = V::template load<I>(lx.xc.get() + gb * L);
    in_register(dx);
    in_register(xc);
    for (int r = 0; r < NR; ++r) {
      a[r] = scaled_sum<L>(a[r], block_dot<T, L>(u[r], X, xc), dx, d[r][k]);
      if constexpr (T == QType::Q4_1) o[r] = offset_sum<L>(o[r], mo[r][k], lx, gb);
    }
  }
}

// Weight rows [n0, n0 + NR) against lane groups [g0, g1) of x: acc / off hold [g - g0][r][L] between chunks
// (the first chunk starts from zero: their entries are never read before this call writes them; filling them
// per tile had cost ~5% of 8B's batch-16 step), y is written for the rows < M.
template <QType T, int L, int NR>
__attribute__((noinline)) void rows_q8_lanes(const LaneX& lx, const uint8_t* w, float* acc, float* off, float* y,
                                             int64_t M, int64_t nb, int64_t N, int64_t n0, int64_t g0, int64_t g1) {
  using V = Lanes<L>;
  using F = typename V::F;
  alignas(64) uint8_t u[Q8_CHUNK][NR][UB<T>];
  alignas(32) float d[NR][Q8_CHUNK], mo[NR][Q8_CHUNK];
  const uint8_t* rows[NR];
  for (int r = 0; r < NR; ++r) rows[r] = w + (n0 + r) * nb * BB<T>;
  for (int64_t c0 = 0; c0 < nb; c0 += Q8_CHUNK) {
    const int64_t cb = std::min(Q8_CHUNK, nb - c0);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* first = rows[r] + c0 * BB<T>;
      prefetch_chunk<T>(first);
      for (int64_t k = 0; k < cb; ++k) codes_u8_vec<T>(first + k * BB<T>, u[k][r]);
      chunk_scales<T>(first, nb - c0, d[r], mo[r]);
    }
    int64_t g = g0;
    // Lane groups [g, g + NG) against the tile's rows [R0, R0 + NS) over this chunk, their sums read from and
    // written back to acc / off (the first chunk starts them: nothing to load).
    const auto groups = [&](auto r0c, auto nsc, auto ngc) __attribute__((always_inline)) {
      constexpr int R0 = decltype(r0c)::value, NS = decltype(nsc)::value, NG = decltype(ngc)::value;
      F a[NG][NS], o[NG][NS];
      for (int h = 0; h < NG; ++h)
        for (int r = 0; r < NS; ++r) {
          const int64_t at = ((g + h - g0) * NR + R0 + r) * L;
          a[h][r] = c0 == 0 ? F{} : V::template load<F>(acc + at);
          o[h][r] = c0 == 0 ? F{} : V::template load<F>(off + at);
        }
      for (int64_t k = 0; k < cb; ++k) {
        if constexpr (NG == 1) {
          block_rows<T, L, NS>(lx, g * nb + c0 + k, u[k] + R0, d + R0, mo + R0, k, a[0], o[0]);
        } else {
#ifndef TREESERVE_Q8_VNNI
          int64_t gb[NG];
          for (int h = 0; h < NG; ++h) gb[h] = (g + h) * nb + c0 + k;
          block_rows_q4<T, NS, NG>(lx, gb, u[k] + R0, d + R0, mo + R0, k, a, o);
#endif
        }
      }
      for (int h = 0; h < NG; ++h)
        for (int r = 0; r < NS; ++r) {
          const int64_t at = ((g + h - g0) * NR + R0 + r) * L;
          std::memcpy(acc + at, &a[h][r], sizeof a[h][r]);
          std::memcpy(off + at, &o[h][r], sizeof o[h][r]);
        }
    };
#ifndef TREESERVE_Q8_VNNI
    if constexpr (T != QType::Q8_0)  // groups in pairs, rows in pairs: each broadcast of a row's codes serves both
      for (; g + 2 <= g1; g += 2) {
        groups(std::integral_constant<int, 0>{}, std::integral_constant<int, std::min(NR, 2)>{},
               std::integral_constant<int, 2>{});
        if constexpr (NR > 2)
          groups(std::integral_constant<int, 2>{}, std::integral_constant<int, NR - 2>{},
                 std::integral_constant<int, 2>{});
      }
#endif
    for (; g < g1; ++g) groups(std::integral_constant<int, 0>{}, std::integral_constant<int, NR>{},
                               std::integral_constant<int, 1>{});
  }
  for (int64_t g = g0; g < g1; ++g)
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < L && g * L + i < M; ++i) {
        const int64_t at = ((g - g0) * NR + r) * L + i;
        y[(g * L + i) * N + n0 + r] = acc[at] + off[at];
      }
}

// Weight rows [n0, n0 + NR) against the one lane group of a call of at most L rows (batched decode): each
// block's codes are decoded a block ahead inside the loop that multiplies them, where their few operations
// fill slots the products leave (decoded a chunk at a time, as rows_q8_lanes does for its groups, the tile
// ran 1.15-1.35x slower at 8-16 rows on Zen 4); the sums stay in registers for the whole row.
template <QType T, int L, int NR>
__attribute__((noinline)) void rows_q8_one(const LaneX& lx, const uint8_t* w, float* y, int64_t M, int64_t nb,
                                           int64_t N, int64_t n0) {
  using F = typename Lanes<L>::F;
  alignas(64) uint8_t u[2][NR][UB<T>];
  alignas(32) float d[NR][Q8_CHUNK], mo[NR][Q8_CHUNK];
  const uint8_t* rows[NR];
  F a[NR], o[NR];
  for (int r = 0; r < NR; ++r) {
    rows[r] = w + (n0 + r) * nb * BB<T>;
    codes_u8_vec<T>(rows[r], u[0][r]);
    a[r] = F{};
    o[r] = F{};
  }
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t k = b % Q8_CHUNK;
    if (k == 0)
      for (int r = 0; r < NR; ++r) chunk_scales<T>(rows[r] + b * BB<T>, nb - b, d[r], mo[r]);
    if (b + 1 < nb)
      for (int r = 0; r < NR; ++r) {
        const uint8_t* blk = rows[r] + (b + 1) * BB<T>;
        prefetch_ahead(blk, true);
        codes_u8_vec<T>(blk, u[(b + 1) & 1][r]);
      }
    block_rows<T, L, NR>(lx, b, u[b & 1], d, mo, k, a, o);
  }
  for (int r = 0; r < NR; ++r) {
    alignas(64) float ar[L], orr[L];
    std::memcpy(ar, &a[r], sizeof ar);
    std::memcpy(orr, &o[r], sizeof orr);
    for (int i = 0; i < L && i < M; ++i) y[i * N + n0 + r] = ar[i] + orr[i];
  }
}

// Weight rows [n0, n1) against every row of x, in passes of Q8_GROUPS lane groups.
template <QType T, int L>
void rows_q8(const LaneX& lx, const uint8_t* w, float* y, int64_t M, int64_t nb, int64_t N, int64_t n0,
             int64_t n1) {
  const int64_t G = (M + L - 1) / L;
  // The chunked tile's sums between chunks; one lane group keeps its sums in registers (rows_q8_one).
  std::vector<float> acc(G == 1 ? 0 : Q8_GROUPS * Q8_ROWS * L), off(acc.size());
  for (int64_t g0 = 0; g0 < G; g0 += Q8_GROUPS) {
    const int64_t g1 = std::min(G, g0 + Q8_GROUPS);
    for (int64_t n = n0; n < n1; n += Q8_ROWS) {
      auto tile = [&](auto nr) {
        if (G == 1)
          rows_q8_one<T, L, nr.value>(lx, w, y, M, nb, N, n);
        else
          rows_q8_lanes<T, L, nr.value>(lx, w, acc.data(), off.data(), y, M, nb, N, n, g0, g1);
      };
      switch (std::min<int64_t>(Q8_ROWS, n1 - n)) {
        case 1: tile(std::integral_constant<int, 1>{}); break;
        case 2: tile(std::integral_constant<int, 2>{}); break;
        case 3: tile(std::integral_constant<int, 3>{}); break;
        default: tile(std::integral_constant<int, Q8_ROWS>{});
      }
    }
  }
}
#endif

// int8 activations: large batches of models whose codes serve every batch (PackedLinear.large_forward).
at::Tensor gguf_linear_q8(const at::Tensor& x, const at::Tensor& w, std::string qtype, int64_t K) {
  const QType t = checked_qtype(x, w, qtype, K);
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = x.size(0), N = w.size(0), nb = K / GROUP;
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
#ifdef TREESERVE_Q8_LANES
  const int64_t tiles = (N + Q8_ROWS - 1) / Q8_ROWS;
  const auto run = [&](auto qt, auto lanes) {
    const LaneX lx = lanes_of<qt.value, lanes.value>(xp, M, nb);
    at::parallel_for(0, tiles, std::max<int64_t>(1, 16384 / K), [&](int64_t p0, int64_t p1) {
      rows_q8<qt.value, lanes.value>(lx, wp, yp, M, nb, N, p0 * Q8_ROWS, std::min(N, p1 * Q8_ROWS));
    });
  };
  by_qtype(t, [&](auto qt) {
    if (M <= 8) return run(qt, std::integral_constant<int, 8>{});
    run(qt, std::integral_constant<int, MAX_LANES>{});
  });
#else
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * nb);
  quantize_rows(xp, M * nb, xq.data(), xs.data());
  const std::vector<float> xsum = t == QType::Q4_1 ? block_sums(xp, M * nb) : std::vector<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / K), [&](int64_t n0, int64_t n1) {
    by_qtype(t, [&](auto qt) { rows_q8_scalar<qt.value>(xq.data(), xs.data(), xsum.data(), wp, yp, M, K, N, n0, n1); });
  });
#endif
  return y;
}

// int16 activations: the quantized decoder layers' path (PackedLinear, decode_layers).
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, std::string qtype, int64_t K) {
  return gguf_linear_impl(x, w, qtype, K, false);
}

// float32 activations: the LM head's first pass (ExactHead's error bound assumes them).
at::Tensor gguf_linear_exact(const at::Tensor& x, const at::Tensor& w, std::string qtype, int64_t K) {
  return gguf_linear_impl(x, w, qtype, K, true);
}

}  // namespace

TREESERVE_FRAGMENT(TREESERVE_LIBRARY, m) {
  m.def("gguf_linear(Tensor x, Tensor w, str qtype, int K) -> Tensor");
  m.def("gguf_linear_exact(Tensor x, Tensor w, str qtype, int K) -> Tensor");
  m.def("gguf_dequantize(Tensor w, str qtype, int K) -> Tensor");
  m.def("gguf_linear_q8(Tensor x, Tensor w, str qtype, int K) -> Tensor");
  m.def("codes_row_norms(Tensor w, str qtype, int K) -> Tensor");
  m.def("codes_head_rescore(Tensor(a!) logits, Tensor x, Tensor w, str qtype, int K, Tensor bound, "
        "Tensor row_norms) -> ()");
}

TREESERVE_IMPL(TREESERVE_LIBRARY, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_linear_exact", &gguf_linear_exact);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_linear_q8", &gguf_linear_q8);
  m.impl("codes_row_norms", &codes_row_norms);
  m.impl("codes_head_rescore", &codes_head_rescore);
}
