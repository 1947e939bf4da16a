// Input checks and output allocation shared by the CPU and CUDA kernels of the soft ops.
#pragma once

#include <torch/types.h>

#include <initializer_list>
#include <utility>

namespace fastlapsum {

// x is [rows, n] floating point and each per-row tensor is float64 with one value per row on
// x's device; the message names the tensor. Messages are plain literals: a message built
// from values goes through std::ostringstream in the extension, which crashed on throw on
// the GPU machine's toolchain (its g++ is newer than the libstdc++ torch loads).
void check_rows(const at::Tensor& x,
                std::initializer_list<std::pair<const at::Tensor*, const char*>> per_row);

#define FLS_PER_ROW(name) "fastlapsum: " name " must be float64 with one value per row, on x's device"
constexpr const char* kBadK = FLS_PER_ROW("k");
constexpr const char* kBadT = FLS_PER_ROW("t");
constexpr const char* kBadB = FLS_PER_ROW("b");
constexpr const char* kBadEdge = FLS_PER_ROW("edge");
#undef FLS_PER_ROW

// Checked inputs and allocated outputs of the threshold op (CPU and CUDA).
struct ThresholdIO {
  at::Tensor x, k, t;         // contiguous inputs
  at::Tensor b, edge, diag;   // float64 [rows] twice, int64 [rows, 3]
};
ThresholdIO threshold_io(const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, int64_t method);

struct BackwardIO {
  at::Tensor x, b, t;     // contiguous inputs
  at::Tensor gx, gk, gt;  // outputs: like x, and float64 [rows] for k and t
};

BackwardIO backward_io(const at::Tensor& x, const at::Tensor& b, const at::Tensor& t);

}  // namespace fastlapsum
