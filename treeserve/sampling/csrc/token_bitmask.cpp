// treeserve::apply_token_bitmask_: set every token a packed bitmask disallows to -inf, in place.
// x [R, V] float32 or bfloat16 (contiguous CPU), bitmask [R, ceil(V / 32)] int32 (xgrammar's layout:
// token t is allowed iff bit t % 32 of word t / 32 is set). One pass over the row, a word at a
// time: a word of all ones (-1) is skipped, a word of zeros writes 32 -inf, any other word selects
// per bit without a branch (a blend the compiler vectorizes). Rows run in parallel (ATen's pool).
// The values are exactly the reference's (torch.where over the unpacked mask): a kept value is not
// touched, a banned one becomes -inf (its bit pattern: 0xFF800000 in float32, 0xFF80 in bfloat16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

template <typename Bits>
void mask_rows(Bits* x, const int32_t* mask, int64_t rows, int64_t vocab, int64_t words, Bits neg_inf) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      Bits* row = x + r * vocab;
      const int32_t* m = mask + r * words;
      for (int64_t w = 0; w < words; ++w) {
        const uint32_t bits = static_cast<uint32_t>(m[w]);
        if (bits == 0xFFFFFFFFu) continue;
        Bits* p = row + w * 32;
        const int64_t n = std::min<int64_t>(32, vocab - w * 32);
        if (bits == 0) {
          std::fill(p, p + n, neg_inf);
          continue;
        }
        for (int64_t j = 0; j < n; ++j) p[j] = ((bits >> j) & 1u) ? p[j] : neg_inf;
      }
    }
  });
}

at::Tensor apply_token_bitmask_(at::Tensor x, const at::Tensor& bitmask) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.device().is_cpu() && x.is_contiguous(),
                    "x must be a contiguous 2-D CPU tensor [R, V], got ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t rows = x.size(0), vocab = x.size(1), words = (vocab + 31) / 32;
  TORCH_CHECK_TYPE(bitmask.scalar_type() == at::kInt && bitmask.device().is_cpu(),
                   "bitmask must be an int32 CPU tensor, got ", bitmask.scalar_type());
  TORCH_CHECK_VALUE(bitmask.dim() == 2 && bitmask.size(0) == rows && bitmask.size(1) == words,
                    "bitmask must be [", rows, ", ", words, "], got ", bitmask.sizes());
  const auto mc = bitmask.contiguous();
  const int32_t* m = mc.data_ptr<int32_t>();
  if (x.scalar_type() == at::kFloat) {
    mask_rows<uint32_t>(static_cast<uint32_t*>(x.data_ptr()), m, rows, vocab, words, 0xFF800000u);
  } else {
    mask_rows<uint16_t>(static_cast<uint16_t*>(x.data_ptr()), m, rows, vocab, words, uint16_t{0xFF80});
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(treeserve, m) { m.def("apply_token_bitmask_(Tensor(a!) x, Tensor bitmask) -> Tensor(a!)"); }

TORCH_LIBRARY_IMPL(treeserve, CPU, m) { m.impl("apply_token_bitmask_", &apply_token_bitmask_); }
