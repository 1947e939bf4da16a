// CPU helpers shared by the row kernels: a signed row view and a fixed split of a long
// row into parts run in parallel (fixed, so results do not depend on the thread count).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace fastlapsum {

constexpr int64_t kPartSize = 1 << 15;
constexpr int64_t kMaxParts = 64;

// Scores of one row as the operator sees them: sign = -1 for largest=False.
template <typename scalar_t>
struct Row {
  const scalar_t* p;
  int64_t n;
  double sign;
  double operator()(int64_t i) const { return sign * static_cast<double>(p[i]); }
};

// Rows a parallel task takes at least: a task of fewer than ~kPartSize scores costs less
// than the fork and join of a parallel region (tiny rows run serially).
inline int64_t rows_grain(int64_t n) { return std::max<int64_t>(1, kPartSize / std::max<int64_t>(n, 1)); }

// Run f(begin, end, part) over a fixed split of [0, n) and return the parts in order.
template <typename Part, typename F>
std::vector<Part> over_parts(int64_t n, const Part& init, const F& f) {
  const int64_t parts = std::max<int64_t>(1, std::min(kMaxParts, (n + kPartSize - 1) / kPartSize));
  const int64_t len = (n + parts - 1) / parts;
  std::vector<Part> out(parts, init);
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) f(std::min(n, p * len), std::min(n, (p + 1) * len), out[p]);
  });
  return out;
}

}  // namespace fastlapsum
