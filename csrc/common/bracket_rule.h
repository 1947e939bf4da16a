// The sample-bracket rule of DESIGN §1.2, shared by the CPU and CUDA solvers.
//
// A systematic sample (fixed stride, per-row offset) of the row is noised with
// Laplace noise of scale t; the bracket is a pair of order statistics of the noised
// sample around the budget quantile q = (n - k)/n, z binomial standard deviations
// apart. Only the bracket's width depends on the sample: certification decides.
#pragma once

#include "lapsum_math.h"

namespace fastlapsum {

constexpr double kBracketZ = 5.16;   // z of the binomial bracket (paper's value)
constexpr int kBracketAttempts = 4;  // tries (first + widenings) before the exact fallback
constexpr int64_t kMinSample = 1024;
constexpr int64_t kMaxSample = 1 << 16;

struct SampleGeometry {
  int64_t stride;
  int64_t offset;
  int64_t count;
};

// Sample about kSampleScale * n^(2/3) scores (clamped), at a row-dependent offset. The
// middle set shrinks as 1/sqrt(m): at 4 n^(2/3) a Gaussian row of 1e6 (k = n/16) gathers
// ~2.6K scores instead of ~6K, and rows up to 2^21 fit the CUDA solver's on-chip sort, for
// a sample that is still a small fraction of the row (4% at 1e6, about 65536 at most: the
// stride is rounded down).
constexpr double kSampleScale = 4.0;
FLS_HD SampleGeometry sample_geometry(int64_t n, int64_t row) {
  double target = cbrt(static_cast<double>(n));
  int64_t m = static_cast<int64_t>(kSampleScale * target * target);
  m = m < kMinSample ? kMinSample : (m > kMaxSample ? kMaxSample : m);
  int64_t stride = n / m;
  if (stride < 1) stride = 1;
  const int64_t offset = static_cast<int64_t>(mix32(static_cast<uint32_t>(row) ^ 0x5bd1e995u) %
                                              static_cast<uint32_t>(stride));
  const int64_t count = (n - offset + stride - 1) / stride;
  return SampleGeometry{stride, offset, count};
}

// Indices into the ascending noised sample of size m for the bracket ends on the
// given attempt (the margin doubles each time). lo < 0 means -inf, hi >= m means +inf.
FLS_HD void bracket_indices(int64_t m, double n, double k, int attempt, int64_t* lo,
                            int64_t* hi) {
  const double q = (n - k) / n;
  const double center = q * static_cast<double>(m);
  const double half = (kBracketZ * sqrt(static_cast<double>(m) * q * (1.0 - q)) + 2.0) *
                      static_cast<double>(1 << attempt);
  *lo = static_cast<int64_t>(floor(center - half));
  *hi = static_cast<int64_t>(ceil(center + half));
}

// Bound on the gathered middle set for a bracket covering (hi - lo) of m samples:
// a generous multiple of the expected share, so that exceeding it means ties or a
// sample that missed the row's structure, and the exact fallback is cheaper.
FLS_HD int64_t middle_capacity(int64_t n, int64_t m, int64_t lo, int64_t hi) {
  const double share = static_cast<double>(hi - lo + 1) / static_cast<double>(m);
  const double cap = 8.0 * share * static_cast<double>(n) + 4096.0;
  return cap >= static_cast<double>(n) ? n : static_cast<int64_t>(cap);
}

}  // namespace fastlapsum
