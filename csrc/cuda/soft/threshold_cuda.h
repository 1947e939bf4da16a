// Internal entry points of the CUDA threshold solvers, shared by the threshold op
// (threshold_cuda.cu) and the fused forward (forward_cuda.cu).
#pragma once

#include <torch/types.h>

#include "../../common/op_io.h"
#include "../../common/plan.h"
#include "plan_soft.h"

namespace fastlapsum {

// The plan of a [rows, n] call of dtype and method on the current device (plan_soft.h): the
// threshold op, the fused forward and the soft_regime op all take their regime from it.
SoftPlan plan_soft_cuda(int64_t rows, int64_t n, at::ScalarType dtype, int64_t method);

// The sort solver of DESIGN §1.1 for rows of n <= kShortRowMax in an on-chip plan
// (kSoftWarpRows: sort in registers, kSoftCtaRows: in shared memory; closed-form scan as a
// parallel scan). Writes b, edge and diag; when p is given, also the soft (or log) mask in
// the same kernel.
void solve_short_rows_cuda(const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest,
                           const SoftPlan& plan, at::Tensor& b, at::Tensor& edge, at::Tensor& diag, at::Tensor* p,
                           bool log_mode);

// The certified sample bracket of DESIGN §1.2 for rows of any length (plan.sort: the exact
// radix bracket alone). Writes b, edge and diag.
void solve_long_rows_cuda(const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest,
                          const LongRowsPlan& plan, at::Tensor& b, at::Tensor& edge, at::Tensor& diag);

// The threshold op's solve on io from threshold_io (checked, contiguous) by plan: the short-
// row solver on chip, else the long-row one. Writes io.b, io.edge and io.diag; the caller
// holds x's device guard.
void solve_rows_cuda(ThresholdIO& io, bool largest, const SoftPlan& plan);

}  // namespace fastlapsum
