// Internal entry points of the CUDA threshold solvers, shared by the threshold op
// (threshold_cuda.cu) and the fused forward (forward_cuda.cu).
#pragma once

#include <torch/types.h>

#include "../../common/op_io.h"
#include "../../common/plan.h"
#include "tuning.cuh"

namespace fastlapsum {

// Rows that the plan sorts are solved on chip (short_rows_cuda.cu).
constexpr int64_t kShortRowMax = kAutoSortMaxNCuda;

// The CUDA regime of rows of n scores, decided here only (the threshold op, the fused forward
// and the soft_regime op): rows the plan sorts run on chip, a warp per row where the row fits
// a warp's registers (SoftTuning), else a CTA per row; the others the certified bracket, or
// for method "sort" on rows too long for the chip the exact radix bracket alone.
inline SoftRegime soft_regime_cuda(int64_t n, at::ScalarType dtype, int64_t method) {
  if (!plan_sorts(n, method, kAutoSortMaxNCuda)) return kSoftLongRows;
  if (n > kShortRowMax) return kSoftRadixRows;
  return n <= SoftTuning::warp_row_max(dtype == at::kDouble) ? kSoftWarpRows : kSoftCtaRows;
}
inline bool on_chip(SoftRegime regime) { return regime == kSoftWarpRows || regime == kSoftCtaRows; }

// The sort solver of DESIGN §1.1 for rows of n <= kShortRowMax in an on-chip regime
// (kSoftWarpRows: sort in registers, kSoftCtaRows: in shared memory; closed-form scan as a
// parallel scan). Writes b, edge and diag; when p is given, also the soft (or log) mask in
// the same kernel.
void solve_short_rows_cuda(const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest,
                           SoftRegime regime, at::Tensor& b, at::Tensor& edge, at::Tensor& diag, at::Tensor* p,
                           bool log_mode);

// The certified sample bracket of DESIGN §1.2 for rows of any length (sort=true: the
// exact radix bracket alone). Writes b, edge and diag.
void solve_long_rows_cuda(const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest,
                          bool sort, at::Tensor& b, at::Tensor& edge, at::Tensor& diag);

// The threshold op's solve on io from threshold_io (checked, contiguous): the short-row
// solver where the method sorts rows of this length, else the long-row one. Writes io.b,
// io.edge and io.diag; the caller holds x's device guard.
void solve_rows_cuda(ThresholdIO& io, bool largest, int64_t method);

}  // namespace fastlapsum
