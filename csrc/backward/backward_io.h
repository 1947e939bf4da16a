// Checked inputs and allocated outputs of the VJP ops, shared by the CPU and CUDA kernels.
#pragma once

#include <torch/types.h>

namespace fastlapsum {

struct BackwardIO {
  at::Tensor x, b, t;     // contiguous inputs
  at::Tensor gx, gk, gt;  // outputs: like x, and float64 [rows] for k and t
};

inline BackwardIO backward_io(const at::Tensor& x, const at::Tensor& b, const at::Tensor& t) {
  TORCH_CHECK(x.dim() == 2, "fastlapsum: expected x of shape [rows, n]");
  TORCH_CHECK(b.scalar_type() == at::kDouble && t.scalar_type() == at::kDouble,
              "fastlapsum: b and t must be float64");
  TORCH_CHECK(b.numel() == x.size(0) && t.numel() == x.size(0),
              "fastlapsum: b and t need one value per row");
  BackwardIO io{x.contiguous(), b.contiguous(), t.contiguous(), {}, {}, {}};
  io.gx = at::empty_like(io.x);
  io.gk = at::zeros({x.size(0)}, io.b.options());
  io.gt = at::zeros({x.size(0)}, io.b.options());
  return io;
}

}  // namespace fastlapsum
