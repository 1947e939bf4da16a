// Input checks and output allocation shared by the CPU and CUDA kernels of the soft ops.
#include "op_io.h"

namespace fastlapsum {

void check_rows(const at::Tensor& x,
                std::initializer_list<std::pair<const at::Tensor*, const char*>> per_row) {
  TORCH_CHECK(x.dim() == 2, "fastlapsum: expected x of shape [rows, n], got ", x.dim(), " dims");
  TORCH_CHECK(x.is_floating_point(), "fastlapsum: x must be a floating-point tensor");
  for (const auto& item : per_row) {
    const at::Tensor& v = *item.first;
    TORCH_CHECK(v.scalar_type() == at::kDouble, "fastlapsum: ", item.second, " must be float64");
    TORCH_CHECK(v.numel() == x.size(0), "fastlapsum: ", item.second, " needs one value per row (",
                x.size(0), "), got ", v.numel());
    TORCH_CHECK(v.device() == x.device(), "fastlapsum: ", item.second, " must be on x's device");
  }
}

BackwardIO backward_io(const at::Tensor& x, const at::Tensor& b, const at::Tensor& t) {
  check_rows(x, {{&b, "b"}, {&t, "t"}});
  BackwardIO io{x.contiguous(), b.contiguous(), t.contiguous(), {}, {}, {}};
  io.gx = at::empty_like(io.x);
  io.gk = at::zeros({x.size(0)}, io.b.options());
  io.gt = at::zeros({x.size(0)}, io.b.options());
  return io;
}

}  // namespace fastlapsum
