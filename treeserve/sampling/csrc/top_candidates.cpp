// treeserve::top_candidates: the k largest values of each row of a [R, V] float32/float64 tensor,
// descending, with their ids -- torch.topk(x, k, dim=1) with ties ordered by id (lower first) and
// NaN the largest value. No sort of the row:
//   1. one pass takes the max of every block of BLOCK values (AVX2 for float32) and spots NaN;
//   2. a cutoff c that at least k block maxima reach (a strided sample of the block maxima gives
//      a candidate, a count checks it, the exact k-th largest block max is the fallback): then at
//      least k row values are >= c, so the top k are among them;
//   3. the values >= c, read from the blocks whose max reaches c (about k of them), are selected
//      and sorted.
// A row with a NaN, or too short to have k blocks, selects from every value. The answer is exact
// for every input; only the time depends on the data.
// With with_mass, it also returns mass [R] (float64): sum_i exp(x_i - max) over the whole row,
// accumulated in float64 (AVX2: an 8-wide exp, ~2 ulp; elsewhere std::exp) -- top-p's
// normalizer for rows without top-k, while the row is still in cache. NaN for a row whose max is
// not finite.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "treeserve_vec.h"

namespace {

constexpr int64_t BLOCK = 16;   // values per block maximum
constexpr int64_t SAMPLE = 8;   // one block maximum in SAMPLE feeds the cutoff's first guess

template <typename T>
using Item = std::pair<T, int64_t>;

template <typename T>
struct Greater {  // strict weak order: NaN first, then larger value, then lower id
  bool operator()(const Item<T>& a, const Item<T>& b) const {
    const bool na = std::isnan(a.first), nb = std::isnan(b.first);
    if (na != nb) return na;
    if (!na && a.first != b.first) return a.first > b.first;
    return a.second < b.second;
  }
};

// Max of each of the nb blocks of x into bm; true when x[0, nb * BLOCK) holds a NaN.
template <typename T>
bool block_max(const T* x, int64_t nb, T* bm) {
  bool nan = false;
  for (int64_t b = 0; b < nb; ++b) {
    T m = x[b * BLOCK];
    for (int64_t j = 1; j < BLOCK; ++j) m = std::max(m, x[b * BLOCK + j]);
    for (int64_t j = 0; j < BLOCK; ++j) nan |= std::isnan(x[b * BLOCK + j]);
    bm[b] = m;
  }
  return nan;
}

#ifdef TREESERVE_AVX2
template <>
bool block_max<float>(const float* x, int64_t nb, float* bm) {
  static_assert(BLOCK == 16, "two 8-wide vectors per block");
  __m256 unordered = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 lo = _mm256_loadu_ps(x + b * BLOCK), hi = _mm256_loadu_ps(x + b * BLOCK + 8);
    unordered = _mm256_or_ps(unordered, _mm256_or_ps(_mm256_cmp_ps(lo, lo, _CMP_UNORD_Q),
                                                     _mm256_cmp_ps(hi, hi, _CMP_UNORD_Q)));
    const __m256 m = _mm256_max_ps(lo, hi);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    bm[b] = _mm_cvtss_f32(h);
  }
  return _mm256_movemask_ps(unordered) != 0;
}
#endif

// sum_i exp(x_i - m), accumulated in double.
template <typename T>
double exp_mass(const T* x, int64_t n, T m) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(x[i] - m));
  return sum;
}

#ifdef TREESERVE_AVX2
template <>
double exp_mass<float>(const float* x, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256d acc = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = treeserve_vec::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv));
    acc = _mm256_add_pd(acc, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)),
                                           _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1))));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, acc);
  double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < n; ++i) sum += std::exp(static_cast<double>(x[i] - m));
  return sum;
}
#endif

// A value that at least k of the nb block maxima reach, as large as cheaply found.
template <typename T>
T block_cutoff(const std::vector<T>& bm, int64_t nb, int64_t k, std::vector<T>& scratch) {
  const int64_t m = nb / SAMPLE, rank = (5 * k) / (4 * SAMPLE) + 2;
  if (rank < m) {  // guess from every SAMPLE-th block maximum, keep it if enough blocks reach it
    scratch.resize(m);
    for (int64_t j = 0; j < m; ++j) scratch[j] = bm[j * SAMPLE];
    std::nth_element(scratch.begin(), scratch.begin() + (rank - 1), scratch.end(), std::greater<T>());
    const T guess = scratch[rank - 1];
    int64_t reach = 0;
    for (int64_t b = 0; b < nb; ++b) reach += bm[b] >= guess;
    if (reach >= k) return guess;
  }
  scratch.assign(bm.begin(), bm.begin() + nb);
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<T>());
  return scratch[k - 1];
}

// The k first items of buf in Greater order into values/ids.
template <typename T>
void order_pairs(std::vector<Item<T>>& buf, int64_t k, T* values, int64_t* ids) {
  Greater<T> greater;
  if (static_cast<int64_t>(buf.size()) > k) std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), greater);
  std::sort(buf.begin(), buf.begin() + k, greater);
  for (int64_t j = 0; j < k; ++j) {
    values[j] = buf[j].first;
    ids[j] = buf[j].second;
  }
}

// The same order for NaN-free float32 rows (ids < 2^32), sorting one 64-bit key per item: the
// float's order-preserving bits (-0 as +0, so they tie as floats do) above the complemented id.
inline void order_packed(const float* row, const std::vector<Item<float>>& buf, int64_t k, float* values,
                         int64_t* ids, std::vector<uint64_t>& keys) {
  keys.resize(buf.size());
  for (size_t j = 0; j < buf.size(); ++j) {
    uint32_t u;
    std::memcpy(&u, &buf[j].first, sizeof(u));
    if (u == 0x80000000u) u = 0;
    const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    keys[j] = (static_cast<uint64_t>(ordered) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(buf[j].second));
  }
  std::greater<uint64_t> greater;
  if (static_cast<int64_t>(keys.size()) > k) std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), greater);
  std::sort(keys.begin(), keys.begin() + k, greater);
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = 0xFFFFFFFFu - static_cast<uint32_t>(keys[j]);
    values[j] = row[ids[j]];
  }
}

template <typename T>
void top_row(const T* row, int64_t n, int64_t k, T* values, int64_t* ids, double* mass, std::vector<Item<T>>& buf,
             std::vector<T>& bm, std::vector<T>& scratch, std::vector<uint64_t>& keys) {
  const int64_t nb = n / BLOCK;
  buf.clear();
  bm.resize(nb);
  const bool nan = block_max(row, nb, bm.data());
  if (!nan && nb >= k) {
    const T cut = block_cutoff(bm, nb, k, scratch);
    for (int64_t b = 0; b < nb; ++b) {
      if (bm[b] < cut) continue;
      for (int64_t i = b * BLOCK; i < (b + 1) * BLOCK; ++i)
        if (row[i] >= cut) buf.emplace_back(row[i], i);
    }
    for (int64_t i = nb * BLOCK; i < n; ++i)  // the tail outside whole blocks
      if (row[i] >= cut) buf.emplace_back(row[i], i);
  } else {
    buf.resize(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = {row[i], i};
  }
  if constexpr (std::is_same_v<T, float>) {
    if (!nan && n <= 0xFFFFFFFFll) {
      order_packed(row, buf, k, values, ids, keys);
    } else {
      order_pairs(buf, k, values, ids);
    }
  } else {
    order_pairs(buf, k, values, ids);
  }
  if (mass != nullptr) {
    const T m = values[0];
    *mass = std::isfinite(m) ? exp_mass(row, n, m) : std::nan("");
  }
}

template <typename T>
void top_rows(const T* x, T* values, int64_t* ids, double* mass, int64_t rows, int64_t n, int64_t k) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<Item<T>> buf;
    std::vector<T> bm, scratch;
    std::vector<uint64_t> keys;
    for (int64_t r = begin; r < end; ++r) {
      double* row_mass = mass == nullptr ? nullptr : mass + r;
      top_row(x + r * n, n, k, values + r * k, ids + r * k, row_mass, buf, bm, scratch, keys);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> top_candidates(const at::Tensor& x, int64_t k, bool with_mass) {
  TORCH_CHECK(x.dim() == 2, "x must be [R, V], got ", x.dim(), " dims");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(k >= 1 && k <= n, "k must be in [1, ", n, "], got ", k);
  auto xc = x.contiguous();
  auto values = at::empty({rows, k}, x.options());
  auto ids = at::empty({rows, k}, x.options().dtype(at::kLong));
  auto mass = at::empty({with_mass ? rows : 0}, x.options().dtype(at::kDouble));
  double* mass_ptr = with_mass ? mass.data_ptr<double>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    top_rows<float>(xc.data_ptr<float>(), values.data_ptr<float>(), ids.data_ptr<int64_t>(), mass_ptr, rows, n, k);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kDouble, "top_candidates supports float32 and float64, got ", x.scalar_type());
    top_rows<double>(xc.data_ptr<double>(), values.data_ptr<double>(), ids.data_ptr<int64_t>(), mass_ptr, rows, n,
                     k);
  }
  return {values, ids, mass};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treeserve, m) {
  m.def("top_candidates(Tensor x, int k, bool with_mass) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(treeserve, CPU, m) { m.impl("top_candidates", &top_candidates); }
