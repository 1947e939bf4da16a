// soft_topk_forward on CUDA: the threshold and the mask in as few passes as the row
// shape allows. Short rows run the fused on-chip kernel (one read, one write); longer
// rows solve for b and then write the mask; hard mode takes its mask from the exact
// selector (../topk/topk_cuda.cu) and still solves b for the backward.
#include <torch/library.h>

#include "../../common/cuda_launch.cuh"
#include "../../common/lapsum_math.h"
#include "../../common/op_io.h"
#include "../../ops.h"
#include "threshold_cuda.h"

namespace fastlapsum {

std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_topk_forward_cuda(
    const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest, int64_t method,
    int64_t mode) {
  TORCH_CHECK(mode >= kModeSoft && mode <= kModeHard, "fastlapsum: mode must be 0 (soft), 1 (log) or 2 (hard)");
  const c10::cuda::CUDAGuard guard(x.device());
  const SoftRegime regime = x.dim() == 2 ? soft_regime_cuda(x.size(1), x.scalar_type(), method) : kSoftLongRows;
  if (mode != kModeHard && on_chip(regime)) {
    ThresholdIO io = threshold_io(x, k, t, method);
    at::Tensor p = at::empty_like(io.x);
    if (io.x.size(0) > 0)
      solve_short_rows_cuda(io.x, io.k, io.t, largest, regime, io.b, io.edge, io.diag, &p, mode == kModeLog);
    return {p, io.b, io.diag};
  }
  auto [b, edge, diag] = lapsum_threshold_cuda(x, k, t, largest, method);
  at::Tensor p;
  if (mode == kModeHard)  // a NaN row stays NaN; otherwise exactly k ones
    p = hard_mask_cuda(x, k, largest).masked_fill_(b.isnan().unsqueeze(1), NAN);
  else
    p = lapsum_mask_cuda(x, b, t, edge, largest, mode == kModeLog);
  return {p, b, diag};
}

TORCH_LIBRARY_IMPL(fastlapsum, CUDA, m) { m.impl("soft_topk_forward", &soft_topk_forward_cuda); }

}  // namespace fastlapsum
