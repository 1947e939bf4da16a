// Input checks and output allocation shared by the CPU and CUDA kernels of the soft ops.
#include "op_io.h"

#include "lapsum_math.h"

namespace fastlapsum {

void check_rows(const at::Tensor& x,
                std::initializer_list<std::pair<const at::Tensor*, const char*>> per_row) {
  TORCH_CHECK(x.dim() == 2, "fastlapsum: expected x of shape [rows, n]");
  TORCH_CHECK(x.is_floating_point(), "fastlapsum: x must be a floating-point tensor");
  for (const auto& [v, message] : per_row)
    TORCH_CHECK(v->scalar_type() == at::kDouble && v->numel() == x.size(0) && v->device() == x.device(),
                message);
}

ThresholdIO threshold_io(const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, int64_t method) {
  check_rows(x, {{&k, kBadK}, {&t, kBadT}});
  TORCH_CHECK(method >= kMethodAuto && method <= kMethodBracket,
              "fastlapsum: method must be 0 (auto), 1 (sort) or 2 (bracket)");
  const int64_t rows = x.size(0);
  const auto f64 = x.options().dtype(at::kDouble);
  return ThresholdIO{x.contiguous(), k.contiguous(), t.contiguous(), at::empty({rows}, f64),
                     at::empty({rows}, f64), at::empty({rows, 3}, x.options().dtype(at::kLong))};
}

BackwardIO backward_io(const at::Tensor& x, const at::Tensor& b, const at::Tensor& t) {
  check_rows(x, {{&b, kBadB}, {&t, kBadT}});
  BackwardIO io{x.contiguous(), b.contiguous(), t.contiguous(), {}, {}, {}};
  io.gx = at::empty_like(io.x);
  // Every kernel writes grad_k and grad_t of each row it visits, and it visits every row
  // unless x is empty: no fill launches on the common path.
  const bool empty_x = x.numel() == 0;
  io.gk = empty_x ? at::zeros({x.size(0)}, io.b.options()) : at::empty({x.size(0)}, io.b.options());
  io.gt = empty_x ? at::zeros({x.size(0)}, io.b.options()) : at::empty({x.size(0)}, io.b.options());
  return io;
}

}  // namespace fastlapsum
