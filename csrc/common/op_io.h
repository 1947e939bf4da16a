// Input checks and output allocation shared by the CPU and CUDA kernels of the soft ops.
#pragma once

#include <torch/types.h>

#include <initializer_list>
#include <utility>

namespace fastlapsum {

// x is [rows, n] floating point and each per-row tensor is float64 with one value per row.
// Defined once in op_io.cpp (host code shared by .cpp and .cu translation units).
void check_rows(const at::Tensor& x,
                std::initializer_list<std::pair<const at::Tensor*, const char*>> per_row);

struct BackwardIO {
  at::Tensor x, b, t;     // contiguous inputs
  at::Tensor gx, gk, gt;  // outputs: like x, and float64 [rows] for k and t
};

BackwardIO backward_io(const at::Tensor& x, const at::Tensor& b, const at::Tensor& t);

}  // namespace fastlapsum
