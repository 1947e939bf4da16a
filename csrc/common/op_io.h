// Input checks and output allocation shared by the CPU and CUDA kernels of the soft ops.
#pragma once

#include <torch/types.h>

#include <initializer_list>
#include <utility>

namespace fastlapsum {

// x is [rows, n] floating point and each per-row tensor is float64 with one value per row.
inline void check_rows(const at::Tensor& x, std::initializer_list<std::pair<const at::Tensor*, const char*>> per_row) {
  TORCH_CHECK(x.dim() == 2, "fastlapsum: expected x of shape [rows, n], got ", x.dim(), " dims");
  TORCH_CHECK(x.is_floating_point(), "fastlapsum: x must be a floating-point tensor");
  for (const auto& [v, name] : per_row) {
    TORCH_CHECK(v->scalar_type() == at::kDouble, "fastlapsum: ", name, " must be float64");
    TORCH_CHECK(v->numel() == x.size(0), "fastlapsum: ", name, " needs one value per row (",
                x.size(0), "), got ", v->numel());
    TORCH_CHECK(v->device() == x.device(), "fastlapsum: ", name, " must be on x's device");
  }
}

struct BackwardIO {
  at::Tensor x, b, t;     // contiguous inputs
  at::Tensor gx, gk, gt;  // outputs: like x, and float64 [rows] for k and t
};

inline BackwardIO backward_io(const at::Tensor& x, const at::Tensor& b, const at::Tensor& t) {
  check_rows(x, {{&b, "b"}, {&t, "t"}});
  BackwardIO io{x.contiguous(), b.contiguous(), t.contiguous(), {}, {}, {}};
  io.gx = at::empty_like(io.x);
  io.gk = at::zeros({x.size(0)}, io.b.options());
  io.gt = at::zeros({x.size(0)}, io.b.options());
  return io;
}

}  // namespace fastlapsum
