// Kernel entry points behind the schemas of ops.cpp (one per device).
//
// Conventions shared by every soft op: x is a contiguous [rows, n] tensor (the Python
// layer moves the selection dim last), k and t are float64 [rows] tensors, b is the
// threshold in x's units (float64 [rows]), and `largest=false` means the operator on -x.
#pragma once

#include <torch/types.h>

#include <tuple>
#include <vector>

namespace fastlapsum {

// soft_topk_forward modes
enum MaskMode : int64_t { kModeSoft = 0, kModeLog = 1, kModeHard = 2 };

// ---- CPU -------------------------------------------------------------------------
// -> (b, edge, diag): edge is the mask value of infinite scores when b is infinite,
// diag is int64 [rows, 3] = (SolvePath, middle-set size, bracket attempts).
std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_threshold_cpu(const at::Tensor& x,
                                                                    const at::Tensor& k,
                                                                    const at::Tensor& t,
                                                                    bool largest, int64_t method);
at::Tensor lapsum_mask_cpu(const at::Tensor& x, const at::Tensor& b, const at::Tensor& t,
                           const at::Tensor& edge, bool largest, bool log_mode);
// hard=true mask: exactly k_r ones per row (smaller index wins ties); a NaN row where
// b_r is NaN or k_r is not an integer in [0, n]. kth (optional, float64 [rows]): the row's
// k_r-th largest finite score (times -1 for largest=false) where known, NaN where the mask
// must select it.
at::Tensor hard_mask_cpu(const at::Tensor& x, const at::Tensor& k, const at::Tensor& b, bool largest,
                         const at::Tensor* kth = nullptr);
std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_topk_forward_cpu(
    const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest, int64_t method,
    int64_t mode, int64_t k_max);
std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_topk_backward_cpu(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& b, const at::Tensor& t,
    bool largest, bool log_mode);
std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_threshold_backward_cpu(
    const at::Tensor& grad_b, const at::Tensor& x, const at::Tensor& b, const at::Tensor& t,
    bool largest);
std::tuple<at::Tensor, at::Tensor> topk_cpu(const at::Tensor& x, int64_t k, bool largest,
                                            bool sorted, const std::optional<at::Tensor>& lengths);
// The _topk_cuda_plan test op (hard_topk/topk_cpu.cpp): the CUDA top-k plan's host arithmetic.
std::vector<int64_t> topk_cuda_plan_op(int64_t rows, int64_t n, int64_t k, at::ScalarType dtype, bool hard_mask,
                                       bool sorted, int64_t sm_count, int64_t grid_ctas_per_sm);

// ---- CUDA ------------------------------------------------------------------------
#ifdef FASTLAPSUM_WITH_CUDA
std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_threshold_cuda(const at::Tensor& x,
                                                                     const at::Tensor& k,
                                                                     const at::Tensor& t,
                                                                     bool largest, int64_t method);
std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_topk_forward_cuda(
    const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest, int64_t method,
    int64_t mode, int64_t k_max);
at::Tensor lapsum_mask_cuda(const at::Tensor& x, const at::Tensor& b, const at::Tensor& t,
                            const at::Tensor& edge, bool largest, bool log_mode);
std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_topk_backward_cuda(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& b, const at::Tensor& t,
    bool largest, bool log_mode);
std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_threshold_backward_cuda(
    const at::Tensor& grad_b, const at::Tensor& x, const at::Tensor& b, const at::Tensor& t,
    bool largest);
// Exact hard top-k (csrc/cuda/topk/topk_cuda.cu); lengths read on the device.
std::tuple<at::Tensor, at::Tensor> topk_cuda(const at::Tensor& x, int64_t k, bool largest,
                                             bool sorted, const std::optional<at::Tensor>& lengths);
// hard=true mask on the GPU, as hard_mask_cpu: exactly k_r ones per row (smaller index wins
// ties); a NaN row where b_r is NaN or k_r is not an integer in [0, n]. Inputs as
// threshold_io returns them (x floating [rows, n], k and b contiguous float64 [rows] on
// x's device; b may be undefined: no NaN-row rule from it), not re-checked; the caller
// holds x's device guard. k_max: a bound on every k_r for the launch plan, or -1 (unknown);
// a row above it is still exact, on a slower path.
at::Tensor hard_mask_cuda(const at::Tensor& x, const at::Tensor& k, const at::Tensor& b, bool largest,
                          int64_t k_max);
#endif

}  // namespace fastlapsum
