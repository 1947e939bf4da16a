// CPU closed-form VJPs (DESIGN §1.3): of the soft (or log) mask and of the threshold.
//
// Both need the same per-row reductions over the weights tw_i = t w_i = e^{-|s_i-b|/t}/2,
// computed from the saved scores and b (never re-solving), then one elementwise pass.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/types.h>

#include "../common/cpu_rows.h"
#include "../common/vjp_math.h"
#include "../common/op_io.h"
#include "../ops.h"

namespace fastlapsum {
namespace {

// sums over one row; term(i) is element i's VjpTerm.
template <typename Term>
VjpSums row_sums(int64_t n, const Term& term) {
  VjpSums tot;
  for (const VjpSums& s : over_parts<VjpSums>(n, VjpSums{}, [&](int64_t i0, int64_t i1, VjpSums& acc) {
         for (int64_t i = i0; i < i1; ++i) acc.add(term(i));
       }))
    tot.merge(s);
  return tot;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_topk_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& b_in,
    const at::Tensor& t_in, bool largest, bool log_mode) {
  auto [x, b, t, gx, gk, gt] = backward_io(x_in, b_in, t_in);
  TORCH_CHECK(grad_in.sizes() == x.sizes(), "fastlapsum: grad must have the shape of x");
  const at::Tensor g = grad_in.to(x.scalar_type()).contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  const double sign = largest ? 1.0 : -1.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "soft_topk_backward", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    scalar_t* op = gx.mutable_data_ptr<scalar_t>();
    const double* bp = b.const_data_ptr<double>();
    const double* tp = t.const_data_ptr<double>();
    double* gkp = gk.mutable_data_ptr<double>();
    double* gtp = gt.mutable_data_ptr<double>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const Row<scalar_t> row{xp + r * n, n, sign};
        const scalar_t* gr = gp + r * n;
        const double br = sign * bp[r], tr = tp[r];
        const auto term = [&](int64_t i) {
          return vjp_term(row(i), br, tr, static_cast<double>(gr[i]), log_mode);
        };
        const MaskVjp v = mask_vjp(row_sums(n, term), br, tr);
        gkp[r] = v.grad_k;
        gtp[r] = v.grad_t;
        at::parallel_for(0, n, kPartSize, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i) {
            const VjpTerm e = term(i);
            op[r * n + i] = static_cast<scalar_t>(sign * v.grad_score(e.G, e.tw));
          }
        });
      }
    });
  });
  return {gx, gk, gt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_threshold_backward_cpu(
    const at::Tensor& grad_b_in, const at::Tensor& x_in, const at::Tensor& b_in,
    const at::Tensor& t_in, bool largest) {
  auto [x, b, t, gx, gk, gt] = backward_io(x_in, b_in, t_in);
  TORCH_CHECK(grad_b_in.numel() == x.size(0), "fastlapsum: grad_b needs one value per row");
  const at::Tensor gb = grad_b_in.to(at::kDouble).contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  const double sign = largest ? 1.0 : -1.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "threshold_backward", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = gx.mutable_data_ptr<scalar_t>();
    const double* gbp = gb.const_data_ptr<double>();
    const double* bp = b.const_data_ptr<double>();
    const double* tp = t.const_data_ptr<double>();
    double* gkp = gk.mutable_data_ptr<double>();
    double* gtp = gt.mutable_data_ptr<double>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const Row<scalar_t> row{xp + r * n, n, sign};
        const double br = sign * bp[r], tr = tp[r];
        const auto term = [&](int64_t i) { return vjp_term(row(i), br, tr, 0.0, false); };
        const ThresholdVjp v = threshold_vjp(row_sums(n, term), gbp[r], br, tr, sign);
        gkp[r] = v.grad_k;
        gtp[r] = v.grad_t;
        at::parallel_for(0, n, kPartSize, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i)
            op[r * n + i] = static_cast<scalar_t>(v.scale * term(i).tw);
        });
      }
    });
  });
  return {gx, gk, gt};
}

}  // namespace fastlapsum
