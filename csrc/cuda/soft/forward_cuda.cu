// soft_topk_forward on CUDA: the threshold and the mask in as few passes as the row
// shape allows. Short rows run the fused on-chip kernel (one read, one write); longer
// rows solve for b and then write the mask; hard mode takes its mask from the exact
// selector (../topk/topk_cuda.cu), which also writes the NaN rows of NaN thresholds, and
// still solves b for the backward. The inputs are checked and made contiguous once
// (threshold_io); every kernel after that reads them as they are.
#include <torch/library.h>

#include "../../common/cuda_launch.cuh"
#include "../../common/lapsum_math.h"
#include "../../common/op_io.h"
#include "../../ops.h"
#include "threshold_cuda.h"

namespace fastlapsum {

std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_topk_forward_cuda(
    const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest, int64_t method,
    int64_t mode, int64_t k_max) {
  TORCH_CHECK(mode >= kModeSoft && mode <= kModeHard, "fastlapsum: mode must be 0 (soft), 1 (log) or 2 (hard)");
  const c10::cuda::CUDAGuard guard(x.device());
  ThresholdIO io = threshold_io(x, k, t, method);
  const SoftPlan plan = plan_soft_cuda(io.x.size(0), io.x.size(1), io.x.scalar_type(), method);
  if (mode != kModeHard && on_chip(plan.regime)) {
    at::Tensor p = at::empty_like(io.x);
    if (io.x.size(0) > 0)
      solve_short_rows_cuda(io.x, io.k, io.t, largest, plan, io.b, io.edge, io.diag, &p, mode == kModeLog);
    return {p, io.b, io.diag};
  }
  solve_rows_cuda(io, largest, plan);
  // hard: a NaN row where b is NaN (row_budget), otherwise exactly k ones
  at::Tensor p = mode == kModeHard ? hard_mask_cuda(io.x, io.k, io.b, largest, k_max)
                                   : lapsum_mask_cuda(io.x, io.b, io.t, io.edge, largest, mode == kModeLog);
  return {p, io.b, io.diag};
}

TORCH_LIBRARY_IMPL(fastlapsum, CUDA, m) { m.impl("soft_topk_forward", &soft_topk_forward_cuda); }

}  // namespace fastlapsum
