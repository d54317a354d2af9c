// Argument checks shared by treeserve's C++ CPU operators: every one runs before any data is read,
// and raises (c10::ValueError / c10::TypeError) instead of reading out of bounds.
#pragma once

#include <ATen/ATen.h>

namespace treeserve_checks {

// A paged-KV table (FlashInfer's layout: kv_indptr [B + 1], kv_page_indices, kv_last_page_len [B],
// all contiguous 1-D int32) describes only pages of a cache of num_pages pages of page_size tokens.
inline void check_page_table(const at::Tensor& indptr, const at::Tensor& pages, const at::Tensor& last,
                             int64_t batch, int64_t num_pages, int64_t page_size) {
  for (const auto* t : {&indptr, &pages, &last})
    TORCH_CHECK_TYPE(t->scalar_type() == at::kInt && t->dim() == 1 && t->is_contiguous() && t->device().is_cpu(),
                     "kv_indptr, kv_page_indices and kv_last_page_len must be contiguous 1-D int32 CPU tensors");
  TORCH_CHECK_VALUE(page_size >= 1, "page_size must be >= 1, got ", page_size);
  TORCH_CHECK_VALUE(indptr.size(0) == batch + 1 && last.size(0) == batch, "kv_indptr must be [B + 1 = ",
                    batch + 1, "] and kv_last_page_len [B], got ", indptr.sizes(), " and ", last.sizes());
  const int32_t* ip = indptr.data_ptr<int32_t>();
  const int32_t* lp = last.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(ip[0] == 0 && ip[batch] <= pages.size(0), "kv_indptr must start at 0 and end at most at ",
                    pages.size(0), " (the page indices), got ", ip[0], " .. ", ip[batch]);
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK_VALUE(ip[b + 1] > ip[b] && lp[b] >= 1 && lp[b] <= page_size, "request ", b,
                      " must own >= 1 page and a last-page length in [1, ", page_size, "], got ", ip[b + 1] - ip[b],
                      " pages, last ", lp[b]);
  const int32_t* pp = pages.data_ptr<int32_t>();
  for (int64_t i = 0; i < ip[batch]; ++i)
    TORCH_CHECK_VALUE(pp[i] >= 0 && pp[i] < num_pages, "kv_page_indices must lie in [0, ", num_pages, "), got ",
                      pp[i]);
}

}  // namespace treeserve_checks
