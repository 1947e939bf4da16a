// CPU closed-form VJPs (DESIGN §1.3): of the soft (or log) mask and of the threshold.
//
// Both need the same per-row reductions over the weights tw_i = t w_i = e^{-|s_i-b|/t}/2,
// kept relative to the row's largest weight (vjp_math.h), computed from the saved scores
// and b (never re-solving), then one elementwise pass. Three passes over a row, each
// vectorized on four fp64 lanes (cpu_vec.h): the nearest score to b (m, dref), the sums about
// it (no rescaling: every exponent is <= 0), and the gradient of every score.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/types.h>

#include "../common/cpu_rows.h"
#include "../common/cpu_vec.h"
#include "../common/op_io.h"
#include "../common/vjp_math.h"
#include "../ops.h"

namespace fastlapsum {
namespace {

// A row's scores and what the VJP needs of them: s = sign x against b_s, upstream g (none for
// the threshold's VJP, whose terms have g = 0), the mask's mode.
template <typename scalar_t>
struct VjpRow {
  const scalar_t* x;
  const scalar_t* g;  // nullptr: 0
  double sign, b, inv_t;
  bool log_mode;
};

// Elements i..i+3 (those at or past `end` absent) as vjp_term's VjpTerm in lanes, with the
// upstream g; `weighted` marks the finite d = s - b (a = +inf and no term otherwise).
struct TermLanes {
  F64x4 a, d, gw, ga, g;
  I64x4 weighted;
};

template <typename scalar_t>
[[gnu::always_inline]] inline TermLanes term_lanes(const VjpRow<scalar_t>& row, int64_t i, int64_t end) {
  const F64x4 s = load_lanes_tail(row.x, i, end, row.sign, NAN);  // absent lanes NaN: no term
  const F64x4 g = row.g ? load_lanes_tail(row.g, i, end, 1.0, 0.0) : F64x4{};
  const F64x4 d = s - row.b;
  const I64x4 weighted = d - d == 0.0;
  const F64x4 a = weighted ? (d < 0.0 ? -d : d) : INFINITY;
  F64x4 gw = g, ga{};
  if (row.log_mode) {  // above b, d log p / d u = f / F: g / p; below, log p = u + log 1/2: g absolute
    const F64x4 p = 1.0 - 0.5 * exp_nonpos(-a * row.inv_t);
    gw = d > 0.0 ? g / p : 0.0;
    ga = d > 0.0 ? 0.0 : g;
  }
  return TermLanes{a, d, weighted ? gw : 0.0, weighted ? ga : 0.0, g, weighted};
}

// The nearest weighted element of [i0, i1): the smallest a, the first such on ties.
struct Nearest {
  double a = INFINITY, d = 0;
  int64_t index = -1;
};

template <typename scalar_t>
FLS_CPU_CLONES Nearest nearest_part(const VjpRow<scalar_t>& row, int64_t i0, int64_t i1) {
  F64x4 a = F64x4{} + INFINITY, d{}, index = F64x4{} - 1.0;
  const F64x4 lane = {0.0, 1.0, 2.0, 3.0};
  for (int64_t i = i0; i < i1; i += kLanes) {
    const TermLanes e = term_lanes(row, i, i1);
    const I64x4 nearer = e.a < a;  // strict: a lane keeps its first
    a = nearer ? e.a : a;
    d = nearer ? e.d : d;
    index = nearer ? lane + static_cast<double>(i) : index;
  }
  Nearest best;
  for (int l = 0; l < kLanes; ++l)
    if (a[l] < best.a || (a[l] == best.a && a[l] < INFINITY && index[l] < static_cast<double>(best.index)))
      best = Nearest{a[l], d[l], static_cast<int64_t>(index[l])};
  return best;
}

// VjpSums of [i0, i1) about the row's nearest (m, dref): every weight wh = e^{-(a - m)/t}/2 <= 1/2.
template <typename scalar_t>
FLS_CPU_CLONES VjpSums sums_part(const VjpRow<scalar_t>& row, int64_t i0, int64_t i1, double m, double dref) {
  F64x4 tw{}, G{}, twd{}, Gd{}, Ga{}, Gad{};
  for (int64_t i = i0; i < i1; i += kLanes) {
    const TermLanes e = term_lanes(row, i, i1);
    const F64x4 wh = 0.5 * exp_nonpos((m - e.a) * row.inv_t), dd = e.weighted ? e.d - dref : 0.0;
    accumulate_term(tw, twd, G, Gd, Ga, Gad, wh, dd, e.gw, e.ga);
  }
  VjpSums s;
  s.m = m;
  s.dref = dref;
  s.tw = lane_sum(tw);
  s.G = lane_sum(G);
  s.twd = lane_sum(twd);
  s.Gd = lane_sum(Gd);
  s.Ga = lane_sum(Ga);
  s.Gad = lane_sum(Gad);
  return s;
}

// d L / d x_i = sign * v.grad_score(wh_i, g_i, d_i, a_i) over [i0, i1) (RowVjp, vjp_math.h);
// gradients narrower than fp64 take the shorter polynomial (the row's sums keep fp64's).
template <typename scalar_t>
FLS_CPU_CLONES void apply_part(const VjpRow<scalar_t>& row, const RowVjp& v, int64_t i0, int64_t i1, scalar_t* out) {
  constexpr int kDegree = std::is_same_v<scalar_t, double> ? kExpDegreeF64 : kExpDegreeF32;
  for (int64_t i = i0; i < i1; i += kLanes) {
    const TermLanes e = term_lanes(row, i, i1);
    const F64x4 wh = 0.5 * exp_nonpos<kDegree>((v.m - e.a) * row.inv_t);
    F64x4 grad;
    if (!v.log_mode) grad = wh * (e.g * v.c - v.K);
    else grad = e.d > 0.0 ? wh * (e.g * v.c / (1.0 - wh * v.E) - v.K) : e.g * v.inv_t - wh * v.K;
    grad = e.weighted ? row.sign * grad : 0.0;
    for (int l = 0; l < kLanes && i + l < i1; ++l) out[i + l] = static_cast<scalar_t>(v.nan ? NAN : grad[l]);
  }
}

// Both VJPs: per row, the nearest element and the sums about it over a fixed split of the row,
// the row's result from them (solve(r, sums, b_s, t): grad_k, grad_t and the coefficients of
// d L / d s_i), then d L / d x_i.
template <typename scalar_t, typename Solve>
void vjp_rows(BackwardIO& io, const scalar_t* xp, const scalar_t* gp, double sign, bool log_mode,
              const Solve& solve) {
  const int64_t rows = io.x.size(0), n = io.x.size(1);
  const double* bp = io.b.const_data_ptr<double>();
  const double* tp = io.t.const_data_ptr<double>();
  double* gkp = io.gk.mutable_data_ptr<double>();
  double* gtp = io.gt.mutable_data_ptr<double>();
  scalar_t* op = io.gx.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, rows, rows_grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const double br = sign * bp[r], tr = tp[r];
      const VjpRow<scalar_t> row{xp + r * n, gp ? gp + r * n : nullptr, sign, br, inv_temperature(tr), log_mode};
      Nearest near;
      for (const Nearest& q : over_parts<Nearest>(n, Nearest{}, [&](int64_t i0, int64_t i1, Nearest& q) {
             q = nearest_part(row, i0, i1);
           }))
        if (q.a < near.a) near = q;  // parts in order: the first on ties
      VjpSums sums;
      sums.m = near.a;
      sums.dref = near.d;
      if (near.a < INFINITY) {
        for (const VjpSums& q : over_parts<VjpSums>(n, VjpSums{}, [&](int64_t i0, int64_t i1, VjpSums& q) {
               q = sums_part(row, i0, i1, near.a, near.d);
             })) {
          sums.tw += q.tw; sums.G += q.G; sums.twd += q.twd;
          sums.Gd += q.Gd; sums.Ga += q.Ga; sums.Gad += q.Gad;
        }
      }
      const RowVjp v = solve(r, sums, br, tr);
      gkp[r] = v.grad_k;
      gtp[r] = v.grad_t;
      at::parallel_for(0, n, kPartSize, [&](int64_t i0, int64_t i1) { apply_part(row, v, i0, i1, op + r * n); });
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, io.x.scalar_type(), "soft_topk_backward", [&] {
    vjp_rows<scalar_t>(io, io.x.const_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), sign, log_mode,
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, io.x.scalar_type(), "threshold_backward", [&] {
    vjp_rows<scalar_t>(io, io.x.const_data_ptr<scalar_t>(), nullptr, sign, false,
                       [&](int64_t r, const VjpSums& s, double b, double t) {
                         return threshold_vjp(s, gbp[r], b, t, sign);
                       });
  });
  return {io.gx, io.gk, io.gt};
}

}  // namespace fastlapsum
