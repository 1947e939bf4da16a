// Closed-form VJP algebra of DESIGN §1.3, shared by the CPU and CUDA backward kernels.
//
// Per row the kernels reduce, over tw_i = t w_i and the upstream term G_i = g'_i tw_i,
// with d_i = s_i - b:  sum tw, sum G, sum tw d, sum G d.  Everything else is scalar.
#pragma once

#include "lapsum_math.h"

namespace fastlapsum {

// e^u in fp64. The GPU kernels pass their own (fp32 for low-precision scores).
struct ExpF64 {
  FLS_HD double operator()(double u) const { return exp(u); }
};

// One element's terms: tw = t w = e^{-|u|}/2 with u = (s - b)/t, the upstream term G,
// and d = s - b. For the log mask the upstream gradient of p is g / p, and tw / p = 1
// (u <= 0) or e^{-u} / (2 - e^{-u}) (u > 0), without 0/0; so in log mode G does not
// vanish where tw underflows (far below b, log p = (s - b)/t + log 1/2 still moves).
// Infinite scores and rows with an infinite threshold contribute nothing.
// inv_t = inv_temperature(t).
struct VjpTerm {
  double tw, G, d;
};
template <typename Exp = ExpF64>
FLS_HD VjpTerm vjp_term(double s, double b, double inv_t, double g, bool log_mode, Exp ex = Exp{}) {
  if (!is_finite(s) || !is_finite(b)) return VjpTerm{0.0, 0.0, 0.0};
  const double d = s - b, u = d * inv_t, e = ex(-fabs(u)), tw = 0.5 * e;
  const double G = !log_mode ? g * tw : (u <= 0.0 ? g : g * e / (2.0 - e));
  return VjpTerm{tw, G, d};
}

struct VjpSums {
  double tw = 0, G = 0, twd = 0, Gd = 0;
  FLS_HD void add(const VjpTerm& e) {
    tw += e.tw; G += e.G; twd += e.tw * e.d; Gd += e.G * e.d;
  }
  FLS_HD void merge(const VjpSums& o) {
    tw += o.tw; G += o.G; twd += o.twd; Gd += o.Gd;
  }
};

struct MaskVjp {
  double ratio;   // <g', w> / W
  double grad_k;
  double grad_t;
  double t;
  bool nan;
  // d L / d s_i = w_i (g'_i - <g', w>/W) = (G_i - tw_i ratio) / t
  FLS_HD double grad_score(double G, double tw) const {
    return nan ? NAN : (G - tw * ratio) / t;
  }
};

// Rows whose weights all underflow (or whose threshold is infinite) have a hard mask:
// zero gradient. A NaN row gets NaN.
FLS_HD MaskVjp mask_vjp(const VjpSums& s, double b, double t) {
  if (b != b) return MaskVjp{0, NAN, NAN, t, true};
  if (!(s.tw > 0.0)) return MaskVjp{0, 0, 0, t, false};
  const double ratio = s.G / s.tw;
  return MaskVjp{ratio, ratio, -(s.Gd - ratio * s.twd) / (t * t), t, false};
}

struct ThresholdVjp {
  double scale;  // d L / d s_i = scale * tw_i
  double grad_k;
  double grad_t;
  FLS_HD double grad_score(double /*G*/, double tw) const { return scale * tw; }
};

// b_s solves sum F((s_i - b_s)/t) = k: db_s/ds_i = w_i/W, db_s/dk = -1/W,
// db_s/dt = -sum w_i d_i / (t W); b = sign * b_s and s = sign * x.
FLS_HD ThresholdVjp threshold_vjp(const VjpSums& s, double grad_b, double b, double t,
                                  double sign) {
  if (b != b) return ThresholdVjp{NAN, NAN, NAN};
  if (!(s.tw > 0.0)) return ThresholdVjp{0, 0, 0};
  return ThresholdVjp{sign * grad_b / s.tw, -grad_b * sign * t / s.tw,
                      -grad_b * sign * s.twd / (t * s.tw)};
}

}  // namespace fastlapsum
