// The storage types of treeserve's CPU operators (float32, and the 16-bit bfloat16 and float16) as the
// raw lanes treeserve_vec's loads and stores take: lanes(p) maps a c10 element pointer to its lane
// pointer (float*, uint16_t* for bfloat16 bit patterns, treeserve_vec::fp16* for IEEE halves), so a
// template over the element type picks the right conversion; to_float widens one element; half_at reads
// an IEEE half at any byte address (a GGUF block's f16 scale); by_storage runs a generic function with
// the element type of a tensor's scalar type.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#ifdef __F16C__
#include <immintrin.h>
#endif

#include "treeserve_vec.h"

namespace treeserve_lanes {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// The IEEE half at p (any alignment) as float32, exactly (F16C's vcvtph2ps where compiled for it).
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline const float* lanes(const float* p) { return p; }
inline float* lanes(float* p) { return p; }
inline const uint16_t* lanes(const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline uint16_t* lanes(c10::BFloat16* p) { return reinterpret_cast<uint16_t*>(p); }
inline const treeserve_vec::fp16* lanes(const c10::Half* p) { return reinterpret_cast<const treeserve_vec::fp16*>(p); }
inline treeserve_vec::fp16* lanes(c10::Half* p) { return reinterpret_cast<treeserve_vec::fp16*>(p); }

// A storage type as a value: by_storage's argument (Storage<T>::type is T).
template <typename T>
struct Storage {
  using type = T;
};

// fn(Storage<T>{}) for the element type T of `type` (float32, bfloat16 or float16); false, without a
// call, for any other type (the caller names it in its error).
template <typename Fn>
bool by_storage(c10::ScalarType type, Fn&& fn) {
  switch (type) {
    case c10::ScalarType::Float: fn(Storage<float>{}); return true;
    case c10::ScalarType::BFloat16: fn(Storage<c10::BFloat16>{}); return true;
    case c10::ScalarType::Half: fn(Storage<c10::Half>{}); return true;
    default: return false;
  }
}

// out[0, n) = in[0, n) widened to float32 (exact), 16 or 8 lanes at a time where compiled for them.
template <typename T>
void widen(const T* in, float* out, int64_t n) {
  int64_t i = 0;
#if defined(TREESERVE_AVX512)
  for (; i + 16 <= n; i += 16) treeserve_vec::store16(out + i, treeserve_vec::load16(lanes(in + i)));
#elif defined(TREESERVE_AVX2)
  for (; i + 8 <= n; i += 8) treeserve_vec::store8(out + i, treeserve_vec::load8(lanes(in + i)));
#endif
  for (; i < n; ++i) out[i] = to_float(in[i]);
}

// out[0, n) = in[0, n) rounded to T to nearest even, as static_cast<T> and torch's Tensor.to round
// (treeserve_vec's stores; bit for bit on finite values, a NaN stays a NaN), 16 or 8 lanes at a time
// where compiled for them.
template <typename T>
void narrow(const float* in, T* out, int64_t n) {
  int64_t i = 0;
#if defined(TREESERVE_AVX512)
  for (; i + 16 <= n; i += 16) treeserve_vec::store16(lanes(out + i), treeserve_vec::load16(in + i));
#elif defined(TREESERVE_AVX2)
  for (; i + 8 <= n; i += 8) treeserve_vec::store8(lanes(out + i), treeserve_vec::load8(in + i));
#endif
  for (; i < n; ++i) out[i] = static_cast<T>(in[i]);
}

}  // namespace treeserve_lanes
