// Exact selection of a row's top-k indices on the CPU, shared by fastlapsum.topk and
// the straight-through hard mask. Expected O(n) (nth_element) on order-preserving
// keys with the index as tie-break, so the answer is deterministic: among tied
// scores the smaller index wins, and NaN ranks above +inf as in torch.topk.
// Integer and bool rows get exact keys of their own (int64 is not exact in a double).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/order_keys.h"

namespace fastlapsum {

template <typename scalar_t>
void select_top_indices(const scalar_t* row, int64_t n, int64_t k, bool largest, bool sorted,
                        int64_t* out) {
  using Entry = std::pair<uint64_t, int64_t>;
  std::vector<Entry> e(n);
  const uint64_t flip = direction_flip<uint64_t>(largest);
  for (int64_t i = 0; i < n; ++i) e[i] = Entry{order_key(row[i]) ^ flip, i};
  const auto better = [](const Entry& a, const Entry& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (k < n) std::nth_element(e.begin(), e.begin() + k, e.end(), better);
  if (sorted) std::sort(e.begin(), e.begin() + k, better);
  for (int64_t i = 0; i < k; ++i) out[i] = e[i].second;
}

}  // namespace fastlapsum
