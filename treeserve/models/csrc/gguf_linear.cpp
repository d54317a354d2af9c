// treeserve::gguf_linear: y[M, N] = x[M, K] @ dequant(W)[N, K]^T with W held as GGUF blocks as shipped
// (one row of N: K/32 blocks; Q4_0 18 B = f16 d + 16 B nibbles, w = d (q - 8); Q4_1 20 B = f16 d, f16 m
// + 16 B nibbles, w = d q + m; Q8_0 34 B = f16 d + 32 int8, w = d q; nibble byte j holds element j
// (low) and j + 16 (high)). float32 activations and accumulation, no activation quantization: each
// block is decoded once into float32 and used for up to 8 rows of x. Parallel over N.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t MAX_ROWS = 8;

enum class QType { Q4_0, Q4_1, Q8_0 };

inline int64_t block_bytes(QType t) { return t == QType::Q4_0 ? 18 : (t == QType::Q4_1 ? 20 : 34); }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

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

template <int MC>
void rows(QType t, const float* x, const float* xsum, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t n0,
          int64_t n1) {
#ifdef __AVX2__
  rows_avx2<MC>(t, x, xsum, w, y, K, N, n0, n1);
#else
  rows_scalar<MC>(t, x, w, y, K, N, n0, n1);
#endif
}

void dispatch(int64_t mc, QType t, const float* x, const float* xsum, const uint8_t* w, float* y, int64_t K,
              int64_t N, int64_t n0, int64_t n1) {
  switch (mc) {
    case 1: return rows<1>(t, x, xsum, w, y, K, N, n0, n1);
    case 2: return rows<2>(t, x, xsum, w, y, K, N, n0, n1);
    case 3: return rows<3>(t, x, xsum, w, y, K, N, n0, n1);
    case 4: return rows<4>(t, x, xsum, w, y, K, N, n0, n1);
    case 5: return rows<5>(t, x, xsum, w, y, K, N, n0, n1);
    case 6: return rows<6>(t, x, xsum, w, y, K, N, n0, n1);
    case 7: return rows<7>(t, x, xsum, w, y, K, N, n0, n1);
    default: return rows<8>(t, x, xsum, w, y, K, N, n0, n1);
  }
}

QType parse_qtype(const std::string& s) {
  if (s == "Q4_0") return QType::Q4_0;
  if (s == "Q4_1") return QType::Q4_1;
  TORCH_CHECK(s == "Q8_0", "gguf_linear: qtype must be Q4_0, Q4_1 or Q8_0, got ", s);
  return QType::Q8_0;
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& w, std::string qtype, int64_t K) {
  const QType t = parse_qtype(qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == K, "gguf_linear: x must be float32 [M, K]");
  TORCH_CHECK(K % GROUP == 0, "gguf_linear: K must be a multiple of 32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == K / GROUP * block_bytes(t),
              "gguf_linear: w must be uint8 [N, K/32 * block bytes]");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = x.size(0), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Block sums of x (the Q4_x offsets' factor), float32 like every other sum.
  const int64_t nb = K / GROUP;
  std::vector<float> xsum(M * nb, 0.0f);
  for (int64_t i = 0; i < M * nb; ++i)
    for (int64_t j = 0; j < GROUP; ++j) xsum[i] += xp[i * GROUP + j];
  // Grain: at least ~32k weights per task.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int64_t mc = std::min(MAX_ROWS, M - m0);
      dispatch(mc, t, xp + m0 * K, xsum.data() + m0 * nb, wp, yp + m0 * N, K, N, n0, n1);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treeserve, m) { m.def("gguf_linear(Tensor x, Tensor w, str qtype, int K) -> Tensor"); }

TORCH_LIBRARY_IMPL(treeserve, CPU, m) { m.impl("gguf_linear", &gguf_linear); }
