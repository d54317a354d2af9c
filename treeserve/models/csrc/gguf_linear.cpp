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
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
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

inline __m256 bytes8_u(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 bytes8_s(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

// Decode one block into four vectors of 8 weights (elements 0-7, 8-15, 16-23, 24-31).
inline void decode_avx2(QType t, const uint8_t* blk, __m256 (&wv)[4]) {
  const __m256 d = _mm256_set1_ps(half_at(blk));
  if (t == QType::Q8_0) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    wv[0] = _mm256_mul_ps(d, bytes8_s(lo));
    wv[1] = _mm256_mul_ps(d, bytes8_s(_mm_srli_si128(lo, 8)));
    wv[2] = _mm256_mul_ps(d, bytes8_s(hi));
    wv[3] = _mm256_mul_ps(d, bytes8_s(_mm_srli_si128(hi, 8)));
    return;
  }
  const bool q41 = t == QType::Q4_1;
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (q41 ? 4 : 2)));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(qs, mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
  const __m256 off = q41 ? _mm256_set1_ps(half_at(blk + 2)) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
  wv[0] = _mm256_fmadd_ps(d, bytes8_u(lo), off);
  wv[1] = _mm256_fmadd_ps(d, bytes8_u(_mm_srli_si128(lo, 8)), off);
  wv[2] = _mm256_fmadd_ps(d, bytes8_u(hi), off);
  wv[3] = _mm256_fmadd_ps(d, bytes8_u(_mm_srli_si128(hi, 8)), off);
}

// Accumulators per x row: up to 4 independent FMA chains in all rows together.
template <int MC>
void rows_avx2(QType t, const float* x, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int A = MC >= 4 ? 1 : (MC >= 2 ? 2 : 4);
  const int64_t nb = K / GROUP, bb = block_bytes(t);
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[MC][A];
    for (int m = 0; m < MC; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
    const uint8_t* row = w + n * nb * bb;
    for (int64_t b = 0; b < nb; ++b) {
      __m256 wv[4];
      decode_avx2(t, row + b * bb, wv);
      for (int m = 0; m < MC; ++m) {
        const float* xb = x + m * K + b * GROUP;
        for (int i = 0; i < 4; ++i) acc[m][i % A] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xb + 8 * i), acc[m][i % A]);
      }
    }
    for (int m = 0; m < MC; ++m) {
      __m256 s = acc[m][0];
      for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[m][a]);
      y[m * N + n] = hsum(s);
    }
  }
}
#endif

template <int MC>
void rows(QType t, const float* x, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
#ifdef __AVX2__
  rows_avx2<MC>(t, x, w, y, K, N, n0, n1);
#else
  rows_scalar<MC>(t, x, w, y, K, N, n0, n1);
#endif
}

void dispatch(int64_t mc, QType t, const float* x, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t n0,
              int64_t n1) {
  switch (mc) {
    case 1: return rows<1>(t, x, w, y, K, N, n0, n1);
    case 2: return rows<2>(t, x, w, y, K, N, n0, n1);
    case 3: return rows<3>(t, x, w, y, K, N, n0, n1);
    case 4: return rows<4>(t, x, w, y, K, N, n0, n1);
    case 5: return rows<5>(t, x, w, y, K, N, n0, n1);
    case 6: return rows<6>(t, x, w, y, K, N, n0, n1);
    case 7: return rows<7>(t, x, w, y, K, N, n0, n1);
    default: return rows<8>(t, x, w, y, K, N, n0, n1);
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
  // Grain: at least ~32k weights per task.
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
      const int64_t mc = std::min(MAX_ROWS, M - m0);
      dispatch(mc, t, xp + m0 * K, wp, yp + m0 * N, K, N, n0, n1);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treeserve, m) { m.def("gguf_linear(Tensor x, Tensor w, str qtype, int K) -> Tensor"); }

TORCH_LIBRARY_IMPL(treeserve, CPU, m) { m.impl("gguf_linear", &gguf_linear); }
