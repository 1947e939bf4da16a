// Exact selection of a row's top-k indices on the CPU, shared by fastlapsum.topk and
// the straight-through hard mask. Expected O(n) (nth_element) on order-preserving
// keys with the index as tie-break, so the answer is deterministic: among tied
// scores the smaller index wins, and NaN ranks above +inf as in torch.topk.
// Integer and bool rows get exact keys of their own (int64 is not exact in a double).
//
// Scores of at most 32 bits (fp32, fp16, bf16, int8-int32, uint8, bool) select on one
// 64-bit composite (32-bit key, ~index): one integer compare, half the bytes of a
// (key, index) pair. Long rows with a small budget first keep only the scores at or above
// a key taken from a strided sample (the budget's share of it plus a margin), then select
// among those; where fewer than k pass (a sample the row's period fools), the whole row.
// Timed against the pair selection in benchmarks/results/cpu_select_ab.txt.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/order_keys.h"

namespace fastlapsum {

// The sampled pre-filter: rows of at least kSelectFilterMinN scores with k <= n / kSelectFilterMaxShare,
// a sample of one score in kSelectSampleStride, kSelectSampleMin to kSelectSampleMax of them.
constexpr int64_t kSelectFilterMinN = 1024, kSelectFilterMaxShare = 8;
constexpr int64_t kSelectSampleStride = 16, kSelectSampleMin = 64, kSelectSampleMax = 256;
constexpr int64_t kSelectKeepN = int64_t(1) << 20;  // 8 MiB a thread at most

template <typename scalar_t>
void select_top_indices_composite(const scalar_t* row, int64_t n, int64_t k, bool largest, bool sorted,
                                  int64_t* out) {
  if (k == 0) return;
  // a thread's buffer kept between rows up to kSelectKeepN scores (longer rows free theirs)
  thread_local std::vector<uint64_t> kept;
  std::vector<uint64_t> own;
  std::vector<uint64_t>& c = n <= kSelectKeepN ? kept : own;
  const uint32_t flip = direction_flip<uint32_t>(largest);
  const auto key = [&](int64_t i) { return order_key32(row[i]) ^ flip; };
  if (c.size() < static_cast<size_t>(n)) c.resize(static_cast<size_t>(n));
  int64_t m = 0;  // composites in c; 0: the whole row's, below
  if (n >= kSelectFilterMinN && k * kSelectFilterMaxShare <= n) {
    // The sample's r-th key, r = the sample's expected count at or above the k-th score plus
    // ~3 sigma: ~n r / S scores pass.
    const int64_t S = std::min(kSelectSampleMax, std::max(kSelectSampleMin, n / kSelectSampleStride));
    uint32_t s[kSelectSampleMax];
    for (int64_t j = 0; j < S; ++j) s[j] = key(j * n / S);
    const double mean = static_cast<double>(k) * static_cast<double>(S) / static_cast<double>(n);
    const int64_t r = std::min<int64_t>(S, static_cast<int64_t>(mean + 3.0 * std::sqrt(mean)) + 2);
    std::nth_element(s, s + (r - 1), s + S, std::greater<uint32_t>());
    const uint32_t lo = s[r - 1];
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t q = key(i);
      c[m] = composite(q, static_cast<uint32_t>(i));
      m += q >= lo ? 1 : 0;  // branch-free compaction: the slot is overwritten unless it passes
    }
    if (m < k) m = 0;  // fewer than k at or above lo: the whole row below
  }
  if (m == 0) {
    for (int64_t i = 0; i < n; ++i) c[i] = composite(key(i), static_cast<uint32_t>(i));
    m = n;
  }
  if (k < m) std::nth_element(c.begin(), c.begin() + k, c.begin() + m, std::greater<uint64_t>());
  if (sorted) std::sort(c.begin(), c.begin() + k, std::greater<uint64_t>());
  for (int64_t i = 0; i < k; ++i) out[i] = static_cast<uint32_t>(~c[i]);
}

template <typename scalar_t>
void select_top_indices(const scalar_t* row, int64_t n, int64_t k, bool largest, bool sorted,
                        int64_t* out) {
  if constexpr (sizeof(scalar_t) <= 4) {
    if (n < (int64_t(1) << 32)) return select_top_indices_composite(row, n, k, largest, sorted, out);
  }
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
