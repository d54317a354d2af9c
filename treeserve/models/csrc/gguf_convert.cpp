// treeserve::gguf_convert(src, qtype, K, out, dst): GGUF rows of another type written into dst (uint8, contiguous
// [N, K/32 * out's block bytes]: a fused buffer's rows, or a buffer of their own) as the blocks the GGUF operator
// multiplies (treeserve/models/gguf_convert.py states the conversions and their error):
// - qtype "Q4_K", out "Q4_1": uint8 [N, K/256 * 144] -> [N, K/32 * 20]: per 32-weight sub-block
//   d' = f16(d sc), m' = f16(-dmin m) (float32 products rounded to nearest even, as numpy's astype
//   rounds), the same 4-bit codes moved from Q4_K's order (sub-blocks 2c / 2c + 1: the low / high
//   nibbles of 32 bytes) to Q4_1's (element j in byte j's low nibble, j + 16 in its high one);
// - qtype "Q4_K" / "Q5_K" / "Q6_K", out "Q8_0": each super-block decoded to float32 as gguf.quants
//   does ((d sc) q - (dmin m), (d sc) q), then requantized as "F32" is;
// - qtype "F32" (float32 [N, K]), out "Q8_0": d = f16(max|w| / 127), codes round(w / d) (to nearest,
//   ties to even) clipped to +-127, an all-zero block d = 0; a non-finite weight (or Q4_K d / dmin) is an
//   error.
// Parallel over rows. Every argument is checked before any byte is read.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "treeserve_library.h"
#include "treeserve_lanes.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#ifdef __F16C__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GROUP = 32, SUPER = 256;
constexpr int64_t Q4_1_BYTES = 20, Q8_0_BYTES = 34;

using treeserve_lanes::half_at;

// Sub-block j's 6-bit scale and minimum from a Q4_K / Q5_K super-block's 12 bytes (gguf's get_scale_min).
inline void scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One Q4_K super-block (256 weights) as eight Q4_1 blocks: the eight scales and minima rounded to f16 at
// once (F16C's vcvtps2ph, to nearest even as c10::Half rounds), the codes' nibbles moved a sub-block at a
// time. False where d or dmin is not finite (a corrupt file, refused as the Q8_0 paths refuse one).
bool q4_1_from_q4_k(const uint8_t* in, uint8_t* out) {
  const float d = half_at(in), dmin = half_at(in + 2);
  float scale[8], minimum[8];
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min(in + 4, j, sc, m);
    scale[j] = d * static_cast<float>(sc);
    minimum[j] = -(dmin * static_cast<float>(m));
  }
  uint16_t hs[8], hm[8];
#ifdef __F16C__
  constexpr int NEAREST = _MM_FROUND_TO_NEAREST_INT;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hs), _mm256_cvtps_ph(_mm256_loadu_ps(scale), NEAREST));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hm), _mm256_cvtps_ph(_mm256_loadu_ps(minimum), NEAREST));
#else
  for (int j = 0; j < 8; ++j) {
    hs[j] = c10::Half(scale[j]).x;
    hm[j] = c10::Half(minimum[j]).x;
  }
#endif
  const uint8_t* qs = in + 16;
  for (int j = 0; j < 8; ++j) {
    uint8_t* o = out + j * Q4_1_BYTES;
    std::memcpy(o, &hs[j], 2);
    std::memcpy(o + 2, &hm[j], 2);
    const uint8_t* src = qs + (j / 2) * 32;
    const int shift = (j % 2) * 4;
    for (int i = 0; i < 16; ++i)
      o[4 + i] = static_cast<uint8_t>(((src[i] >> shift) & 15) | (((src[i + 16] >> shift) & 15) << 4));
  }
  return std::isfinite(d) && std::isfinite(dmin);
}

// One Q4_K (high == nullptr) or Q5_K super-block as float32, in gguf.quants' arithmetic: (d sc) q - (dmin m);
// sub-block j: the low (j even) / high (j odd) nibbles of bytes [32 (j / 2), + 32), and Q5_K's bit j of qh.
void decode_q45_k(const uint8_t* in, const uint8_t* high, const uint8_t* qs, float* w) {
  const float d = half_at(in), dmin = half_at(in + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min(in + 4, j, sc, m);
    const float a = d * static_cast<float>(sc), b = dmin * static_cast<float>(m);
    const uint8_t* src = qs + (j / 2) * 32;
    for (int l = 0; l < 32; ++l) {
      int q = (src[l] >> (4 * (j % 2))) & 15;
      if (high != nullptr) q |= ((high[l] >> j) & 1) << 4;
      w[32 * j + l] = a * static_cast<float>(q) - b;
    }
  }
}

// One Q6_K super-block (256 weights) as float32, in gguf.quants' order and arithmetic: (d sc) q.
void decode_q6_k(const uint8_t* in, float* w) {
  const uint8_t* ql = in;
  const uint8_t* qh = in + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(in + 192);
  const float d = half_at(in + 208);
  for (int h = 0; h < 2; ++h) {
    for (int g = 0; g < 4; ++g) {  // 32 weights each: ql's low / high nibbles of bytes [0, 32) / [32, 64)
      const uint8_t* lo = ql + 64 * h + 32 * (g % 2);
      const uint8_t* hi = qh + 32 * h;
      const int shift = 4 * (g / 2), hshift = 2 * g;
      for (int half = 0; half < 2; ++half) {  // 16 weights of one scale
        const int e0 = 128 * h + 32 * g + 16 * half;
        const float scale = d * static_cast<float>(sc[e0 / 16]);
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          const int q = (((lo[l] >> shift) & 15) | (((hi[l] >> hshift) & 3) << 4)) - 32;
          w[e0 + l - 16 * half] = scale * static_cast<float>(q);
        }
      }
    }
  }
}

// One 32-block of float32 as Q8_0 (false: a non-finite weight). Written for the vectorizer: the maximum
// skips a NaN, which the product by zero catches; codes round to nearest, ties to even (the float32
// trick below, exact for |v| < 2^22), as llama.cpp's AVX2 quantizer rounds.
bool q8_0_block(const float* w, uint8_t* out) {
  float amax = 0.0f, poison = 0.0f;
  for (int i = 0; i < GROUP; ++i) {
    amax = std::max(amax, std::fabs(w[i]));
    poison += w[i] * 0.0f;  // NaN when any weight is infinite or NaN
  }
  const c10::Half d(amax / 127.0f);
  std::memcpy(out, &d.x, 2);
  const float df = static_cast<float>(d);
  const float inv = df != 0.0f ? 1.0f / df : 0.0f;
  constexpr float MAGIC = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  int8_t* q = reinterpret_cast<int8_t*>(out + 2);
  for (int i = 0; i < GROUP; ++i) {
    const float v = std::min(127.0f, std::max(-127.0f, w[i] * inv));
    q[i] = static_cast<int8_t>(static_cast<int>((v + MAGIC) - MAGIC));
  }
  return poison == 0.0f;
}

enum class Src { Q4_K, Q5_K, Q6_K, F32 };

int64_t super_bytes(Src t) { return t == Src::Q4_K ? 144 : (t == Src::Q5_K ? 176 : 210); }

void gguf_convert(const at::Tensor& src, std::string qtype, int64_t K, std::string out_type, const at::Tensor& dst) {
  TORCH_CHECK_VALUE(qtype == "Q4_K" || qtype == "Q5_K" || qtype == "Q6_K" || qtype == "F32",
                    "gguf_convert: qtype must be 'Q4_K', 'Q5_K', 'Q6_K' or 'F32', got '", qtype, "'");
  const Src t = qtype == "Q4_K" ? Src::Q4_K : qtype == "Q5_K" ? Src::Q5_K : qtype == "Q6_K" ? Src::Q6_K : Src::F32;
  TORCH_CHECK_VALUE(out_type == "Q8_0" || (out_type == "Q4_1" && t == Src::Q4_K),
                    "gguf_convert: out must be 'Q8_0' (or 'Q4_1' from 'Q4_K'), got '", out_type, "' from '", qtype,
                    "'");
  const bool plain = t == Src::F32, repack = out_type == "Q4_1";
  const int64_t unit = plain ? GROUP : SUPER;
  TORCH_CHECK_VALUE(K > 0 && K % unit == 0, "gguf_convert: K must be a positive multiple of ", unit, " for ",
                    qtype, ", got ", K);
  const int64_t in_width = plain ? K : K / SUPER * super_bytes(t);
  TORCH_CHECK_TYPE(src.device().is_cpu() && src.scalar_type() == (plain ? at::kFloat : at::kByte),
                   "gguf_convert: src must be a ", plain ? "float32" : "uint8", " CPU tensor, got ",
                   src.scalar_type());
  TORCH_CHECK_VALUE(src.dim() == 2 && src.size(1) == in_width, "gguf_convert: src must be [N, ", in_width,
                    "] for K = ", K, ", got ", src.sizes());
  const at::Tensor in = src.contiguous();
  const int64_t N = in.size(0), blocks = K / GROUP, out_bytes = repack ? Q4_1_BYTES : Q8_0_BYTES;
  TORCH_CHECK_TYPE(dst.device().is_cpu() && dst.scalar_type() == at::kByte, "gguf_convert: dst must be a uint8 CPU "
                   "tensor, got ", dst.scalar_type());
  TORCH_CHECK_VALUE(dst.dim() == 2 && dst.size(0) == N && dst.size(1) == blocks * out_bytes && dst.is_contiguous(),
                    "gguf_convert: dst must be a contiguous [", N, ", ", blocks * out_bytes, "], got ", dst.sizes());
  uint8_t* op = dst.data_ptr<uint8_t>();
  std::atomic<bool> finite{true};
  at::parallel_for(0, N, std::max<int64_t>(1, 65536 / K), [&](int64_t n0, int64_t n1) {
    bool ok = true;
    float w[SUPER];
    for (int64_t n = n0; n < n1; ++n) {
      uint8_t* orow = op + n * blocks * out_bytes;
      if (plain) {
        const float* x = in.data_ptr<float>() + n * K;
        for (int64_t b = 0; b < blocks; ++b) ok &= q8_0_block(x + b * GROUP, orow + b * Q8_0_BYTES);
        continue;
      }
      const uint8_t* irow = in.data_ptr<uint8_t>() + n * in_width;
      for (int64_t s = 0; s < K / SUPER; ++s) {
        const uint8_t* blk = irow + s * super_bytes(t);
        if (repack) {
          ok &= q4_1_from_q4_k(blk, orow + s * 8 * Q4_1_BYTES);
          continue;
        }
        if (t == Src::Q6_K)
          decode_q6_k(blk, w);
        else if (t == Src::Q5_K)
          decode_q45_k(blk, blk + 16, blk + 48, w);
        else
          decode_q45_k(blk, nullptr, blk + 16, w);
        for (int b = 0; b < 8; ++b) ok &= q8_0_block(w + b * GROUP, orow + (s * 8 + b) * Q8_0_BYTES);
      }
    }
    if (!ok) finite.store(false);
  });
  TORCH_CHECK_VALUE(finite.load(), "gguf_convert: the tensor holds a non-finite weight: the file is corrupt");
}

}  // namespace

TREESERVE_FRAGMENT(TREESERVE_LIBRARY, m) {
  m.def("gguf_convert(Tensor src, str qtype, int K, str out, Tensor(a!) dst) -> ()");
}

TREESERVE_IMPL(TREESERVE_LIBRARY, CPU, m) { m.impl("gguf_convert", &gguf_convert); }
