// CPU closed-form VJPs (DESIGN §1.3): of the soft (or log) mask and of the threshold.
//
// Both need the same per-row reductions over the weights tw_i = t w_i = e^{-|s_i-b|/t}/2,
// kept relative to the row's largest weight (vjp_math.h), computed from the saved scores
// and b (never re-solving), then one elementwise pass.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/types.h>

#include "../common/cpu_rows.h"
#include "../common/op_io.h"
#include "../common/vjp_math.h"
#include "../ops.h"

namespace fastlapsum {
namespace {

// sums over one row; term(i) is element i's VjpTerm.
template <typename Term>
VjpSums row_sums(int64_t n, double inv_t, const Term& term) {
  VjpSums tot;
  for (const VjpSums& s : over_parts<VjpSums>(n, VjpSums{}, [&](int64_t i0, int64_t i1, VjpSums& acc) {
         for (int64_t i = i0; i < i1; ++i) acc.add(term(i), inv_t);
       }))
    tot.merge(s, inv_t);
  return tot;
}

// Both VJPs: per row, reduce the elements' terms, turn the sums into the row's result
// (grad_k, grad_t and d L / d s_i from an element's term), then write d L / d x_i.
// term(r, i, b_s, 1/t) gives element i's VjpTerm, up(r, i) its upstream gradient;
// solve(r, sums, b_s, t) the row's result.
template <typename scalar_t, typename Term, typename Up, typename Solve>
void vjp_rows(BackwardIO& io, double sign, const Term& term, const Up& up, const Solve& solve) {
  const int64_t rows = io.x.size(0), n = io.x.size(1);
  const double* bp = io.b.const_data_ptr<double>();
  const double* tp = io.t.const_data_ptr<double>();
  double* gkp = io.gk.mutable_data_ptr<double>();
  double* gtp = io.gt.mutable_data_ptr<double>();
  scalar_t* op = io.gx.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, rows, rows_grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const double br = sign * bp[r], tr = tp[r], inv_t = inv_temperature(tr);
      const auto element = [&](int64_t i) { return term(r, i, br, inv_t); };
      const RowVjp v = solve(r, row_sums(n, inv_t, element), br, tr);
      gkp[r] = v.grad_k;
      gtp[r] = v.grad_t;
      at::parallel_for(0, n, kPartSize, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const VjpTerm e = element(i);
          const double wh = 0.5 * exp(-(e.a - v.m) * inv_t);
          op[r * n + i] = static_cast<scalar_t>(sign * v.grad_score(wh, up(r, i), e.d, e.a));
        }
      });
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_topk_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& b_in,
    const at::Tensor& t_in, bool largest, bool log_mode) {
  BackwardIO io = backward_io(x_in, b_in, t_in);
  TORCH_CHECK(grad_in.sizes() == io.x.sizes(), "fastlapsum: grad must have the shape of x");
  const at::Tensor g = grad_in.to(io.x.scalar_type()).contiguous();
  const double sign = largest ? 1.0 : -1.0;
  const int64_t n = io.x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, io.x.scalar_type(), "soft_topk_backward", [&] {
    const scalar_t* xp = io.x.const_data_ptr<scalar_t>();
    const scalar_t* gp = g.const_data_ptr<scalar_t>();
    vjp_rows<scalar_t>(
        io, sign,
        [&](int64_t r, int64_t i, double b, double inv_t) {
          return vjp_term(sign * static_cast<double>(xp[r * n + i]), b, inv_t,
                          static_cast<double>(gp[r * n + i]), log_mode);
        },
        [&](int64_t r, int64_t i) { return static_cast<double>(gp[r * n + i]); },
        [&](int64_t, const VjpSums& s, double b, double t) { return mask_vjp(s, b, t, log_mode); });
  });
  return {io.gx, io.gk, io.gt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_threshold_backward_cpu(
    const at::Tensor& grad_b_in, const at::Tensor& x_in, const at::Tensor& b_in,
    const at::Tensor& t_in, bool largest) {
  BackwardIO io = backward_io(x_in, b_in, t_in);
  TORCH_CHECK(grad_b_in.numel() == io.x.size(0), "fastlapsum: grad_b needs one value per row");
  const at::Tensor gb = grad_b_in.to(at::kDouble).contiguous();
  const double* gbp = gb.const_data_ptr<double>();
  const double sign = largest ? 1.0 : -1.0;
  const int64_t n = io.x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, io.x.scalar_type(), "threshold_backward", [&] {
    const scalar_t* xp = io.x.const_data_ptr<scalar_t>();
    vjp_rows<scalar_t>(
        io, sign,
        [&](int64_t r, int64_t i, double b, double inv_t) {
          return vjp_term(sign * static_cast<double>(xp[r * n + i]), b, inv_t, 0.0, false);
        },
        [](int64_t, int64_t) { return 0.0; },
        [&](int64_t r, const VjpSums& s, double b, double t) {
          return threshold_vjp(s, gbp[r], b, t, sign);
        });
  });
  return {io.gx, io.gk, io.gt};
}

}  // namespace fastlapsum
