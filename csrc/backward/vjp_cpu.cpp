// CPU closed-form VJPs (DESIGN §1.3): of the soft (or log) mask and of the threshold.
//
// Both need the same per-row reductions over the weights tw_i = t w_i = e^{-|s_i-b|/t}/2,
// computed from the saved scores and b (never re-solving), then one elementwise pass.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/types.h>

#include "../common/cpu_rows.h"
#include "../common/vjp_math.h"
#include "../ops.h"
#include "backward_io.h"

namespace fastlapsum {
namespace {

// sums over one row; gw(i, u, tw) is the element's upstream-weighted term G_i.
template <typename scalar_t, typename GW>
VjpSums row_sums(const Row<scalar_t>& row, double b, double t, const GW& gw) {
  VjpSums tot;
  for (const VjpSums& s : over_parts<VjpSums>(row.n, VjpSums{}, [&](int64_t i0, int64_t i1,
                                                                    VjpSums& acc) {
         for (int64_t i = i0; i < i1; ++i) {
           const double si = row(i);
           const double tw = lapsum_weight_scaled(si, b, t);
           if (tw == 0.0) continue;
           acc.add(tw, gw(i, (si - b) / t, tw), si - b);
         }
       }))
    tot.merge(s);
  return tot;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_topk_backward_cpu(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& b_in,
    const at::Tensor& t_in, bool largest, bool log_mode) {
  auto [x, b, t, gx, gk, gt] = backward_io(x_in, b_in, t_in);
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
        const auto gw = [&](int64_t i, double u, double tw) {
          return upstream_weight(static_cast<double>(gr[i]), u, tw, log_mode);
        };
        const VjpSums s = row_sums(row, br, tr, gw);
        const MaskVjp v = mask_vjp(s, br, tr);
        gkp[r] = v.grad_k;
        gtp[r] = v.grad_t;
        at::parallel_for(0, n, kPartSize, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i) {
            const double si = row(i);
            const double tw = lapsum_weight_scaled(si, br, tr);
            const double G = tw == 0.0 ? 0.0 : gw(i, (si - br) / tr, tw);
            op[r * n + i] = static_cast<scalar_t>(sign * v.grad_score(G, tw));
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
        const VjpSums s = row_sums(row, br, tr, [](int64_t, double, double) { return 0.0; });
        const ThresholdVjp v = threshold_vjp(s, gbp[r], br, tr, sign);
        gkp[r] = v.grad_k;
        gtp[r] = v.grad_t;
        at::parallel_for(0, n, kPartSize, [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i)
            op[r * n + i] = static_cast<scalar_t>(v.scale * lapsum_weight_scaled(row(i), br, tr));
        });
      }
    });
  });
  return {gx, gk, gt};
}

}  // namespace fastlapsum
