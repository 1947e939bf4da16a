// CPU mask writers: the soft (or log) LapSum mask from a row's fp64 threshold, and the
// straight-through hard mask with exactly k ones.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "../common/cpu_rows.h"
#include "../common/cpu_vec.h"
#include "../common/lapsum_math.h"
#include "../hard_topk/select_cpu.h"
#include "../common/op_io.h"
#include "../ops.h"

namespace fastlapsum {
namespace {

// p = F(u), u = (s - b)/t, on a row segment with a finite b: 1/2 e^{-|u|} below b, one minus
// it above (one exponential, no branch: the loop vectorizes). Outputs narrower than fp64 take
// the shorter polynomial, whose error is far below their rounding, and u = (s - b) / t as a
// product with 1/t (its extra rounding moves e^u by |u| 2^-53, within fp32's); fp64 divides.
template <typename scalar_t>
FLS_CPU_CLONES void soft_mask_segment(const scalar_t* x, int64_t len, double sign, double b, double t,
                                      scalar_t* p) {
  constexpr bool kF64 = std::is_same_v<scalar_t, double>;
  constexpr int kDegree = kF64 ? kExpDegreeF64 : kExpDegreeF32;
  const double inv_t = inv_temperature(t);
  for (int64_t i = 0; i < len; ++i) {
    const double d = sign * static_cast<double>(x[i]) - b, u = kF64 ? d / t : d * inv_t;
    const double h = 0.5 * exp_nonpos<kDegree>(-std::fabs(u));
    p[i] = static_cast<scalar_t>(u <= 0.0 ? h : 1.0 - h);
  }
}

}  // namespace

at::Tensor lapsum_mask_cpu(const at::Tensor& x_in, const at::Tensor& b_in, const at::Tensor& t_in,
                           const at::Tensor& edge_in, bool largest, bool log_mode) {
  check_rows(x_in, {{&b_in, kBadB}, {&t_in, kBadT}, {&edge_in, kBadEdge}});
  const at::Tensor x = x_in.contiguous(), b = b_in.contiguous(), t = t_in.contiguous(),
                   edge = edge_in.contiguous();
  const int64_t n = x.size(1);
  at::Tensor p = at::empty_like(x);
  const double sign = largest ? 1.0 : -1.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "lapsum_mask", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* pp = p.mutable_data_ptr<scalar_t>();
    const double* bp = b.const_data_ptr<double>();
    const double* tp = t.const_data_ptr<double>();
    const double* ep = edge.const_data_ptr<double>();
    // Chunks of the flattened rows, walked a row segment at a time (the row's b, t and edge
    // read once a segment). A row with an infinite b (its budget held by infinite scores)
    // takes the scalar formula.
    at::parallel_for(0, x.numel(), 1 << 14, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1;) {
        const int64_t r = i / n, end = std::min(i1, (r + 1) * n);
        const double br = sign * bp[r], tr = tp[r], er = ep[r];
        if (log_mode) {
          for (; i < end; ++i)
            pp[i] = static_cast<scalar_t>(lapsum_log_prob(sign * static_cast<double>(xp[i]), br, tr, er));
        } else if (std::isinf(br)) {
          for (; i < end; ++i) pp[i] = static_cast<scalar_t>(lapsum_prob(sign * static_cast<double>(xp[i]), br, tr, er));
        } else {
          soft_mask_segment(xp + i, end - i, sign, br, tr, pp + i);
          i = end;
        }
      }
    });
  });
  return p;
}

at::Tensor hard_mask_cpu(const at::Tensor& x_in, const at::Tensor& k_in, const at::Tensor& b_in,
                         bool largest, const at::Tensor* kth_in) {
  const at::Tensor x = x_in.contiguous(), k = k_in.contiguous(), b = b_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  const double sign = largest ? 1.0 : -1.0;
  at::Tensor p = at::empty_like(x);  // each row written once below: no fill, no masked_fill pass
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "hard_mask", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const double* kp = k.const_data_ptr<double>();
    const double* bp = b.const_data_ptr<double>();
    const double* kthp = kth_in ? kth_in->const_data_ptr<double>() : nullptr;
    scalar_t* pp = p.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, rows_grain(n), [&](int64_t r0, int64_t r1) {
      std::vector<int64_t> idx;
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* row = xp + r * n;
        scalar_t* row_out = pp + r * n;
        const double kr = kp[r];
        if (std::isnan(bp[r]) || !(kr >= 0 && kr <= n) || kr != std::nearbyint(kr)) {
          std::fill(row_out, row_out + n, static_cast<scalar_t>(NAN));
          continue;
        }
        const double v = kthp ? kthp[r] : NAN;
        if (!std::isnan(v)) {  // the k-th score known: every score above it, then its first ties
          int64_t above = 0;
          for (int64_t i = 0; i < n; ++i) above += sign * static_cast<double>(row[i]) > v;
          int64_t ties = static_cast<int64_t>(kr) - above;
          for (int64_t i = 0; i < n; ++i) {
            const double s = sign * static_cast<double>(row[i]);
            const bool take = s > v || (s == v && ties-- > 0);
            row_out[i] = static_cast<scalar_t>(take ? 1 : 0);
          }
          continue;
        }
        std::fill(row_out, row_out + n, static_cast<scalar_t>(0));
        idx.resize(static_cast<int64_t>(kr));
        select_top_indices(row, n, static_cast<int64_t>(kr), largest, false, idx.data());
        for (int64_t i : idx) row_out[i] = static_cast<scalar_t>(1);
      }
    });
  });
  return p;
}

}  // namespace fastlapsum
