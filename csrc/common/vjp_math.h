// Closed-form VJP algebra of DESIGN §1.3, shared by the CPU and CUDA backward kernels
// (docs/GRADIENTS.md derives it).
//
// With d_i = s_i - b and tw_i = t w_i = e^{-|d_i|/t}/2, every row quantity is a ratio of
// sums over tw or an absolute term. The sums are kept relative to the row's largest weight,
// as log-sum-exp does: m = min |d_i| (the score nearest b) and wh_i = e^{-(|d_i| - m)/t}/2
// = tw_i e^{m/t}, so a ratio never underflows to 0/0 however far the scores sit from b.
// The log mask also has absolute terms (below b, d log p_i / d u_i = 1), summed apart.
#pragma once

#include "lapsum_math.h"

namespace fastlapsum {

// e^{-x} in fp64 (x >= 0, +inf gives 0). The GPU's fp32 paths pass a cheaper one.
struct ExpNegF64 {
  FLS_HD double operator()(double x) const { return exp(-x); }
};

// x e^{y} without a spurious overflow or underflow of e^{y} alone (x = 0 gives 0).
FLS_HD double times_exp(double x, double y) {
  if (x == 0.0) return x;
  if (fabs(y) < 700.0 || x != x) return x * exp(y);
  return copysign(exp(log(fabs(x)) + y), x);
}

// One element: a = |d| (+inf for an infinite score or threshold: no weight, no term), d, and
// its upstream coefficients: gw multiplies its weight in the sums of G, ga is absolute.
//   mask:            gw = g,           ga = 0
//   log mask, d > 0: gw = g / p,       ga = 0      (d log p / d u = f/F = tw / p)
//   log mask, d <= 0: gw = 0,          ga = g      (log p = u + log 1/2)
struct VjpTerm {
  double a, d, gw, ga;
};
template <typename Exp = ExpNegF64>
FLS_HD VjpTerm vjp_term(double s, double b, double inv_t, double g, bool log_mode, Exp ex = Exp{}) {
  const double d = s - b;
  if (!is_finite(d)) return VjpTerm{INFINITY, 0.0, 0.0, 0.0};
  if (!log_mode) return VjpTerm{fabs(d), d, g, 0.0};
  if (d <= 0.0) return VjpTerm{-d, d, 0.0, g};
  return VjpTerm{d, d, g / (1.0 - 0.5 * ex(d * inv_t)), 0.0};
}

// Per row: m = min |d| over the weighted elements (+inf: none) and dref = the d of that
// element; relative to them tw = sum wh, G = sum gw wh, and, centred on dref so that the
// temperature gradient does not cancel where one score holds all the weight,
// twd = sum wh (d - dref), Gd = sum gw wh (d - dref); absolute Ga = sum ga,
// Gad = sum ga (d - dref). add / merge rescale the side with the larger m (online, as
// online softmax does), so one pass suffices; ex(x) = e^{-x}.
// One weighted element into the six running sums of VjpSums: wh its weight about the row's
// nearest, dd = d - dref; T is a double or the CPU's lanes (vjp_cpu.cpp: by reference, so that
// an uninlined call passes no vector between builds for different ISAs).
template <typename T>
FLS_HD void accumulate_term(T& tw, T& twd, T& G, T& Gd, T& Ga, T& Gad, const T& wh, const T& dd, const T& gw,
                            const T& ga) {
  tw += wh;
  twd += wh * dd;
  G += gw * wh;
  Gd += gw * wh * dd;
  Ga += ga;
  Gad += ga * dd;
}

struct VjpSums {
  double m = INFINITY, dref = 0;
  double tw = 0, G = 0, twd = 0, Gd = 0, Ga = 0, Gad = 0;
  // move the reference to (m2, d2), the weights shrinking by f
  FLS_HD void rebase(double m2, double d2, double f) {
    const double sh = dref - d2;
    twd = f * (twd + sh * tw);
    Gd = f * (Gd + sh * G);
    Gad += sh * Ga;
    tw *= f;
    G *= f;
    m = m2;
    dref = d2;
  }
  template <typename Exp = ExpNegF64>
  FLS_HD void add(const VjpTerm& e, double inv_t, Exp ex = Exp{}) {
    if (!(e.a <= 1.7976931348623157e308)) return;
    if (e.a < m) rebase(e.a, e.d, ex((m - e.a) * inv_t));
    const double wh = 0.5 * ex((e.a - m) * inv_t), dd = e.d - dref;
    accumulate_term(tw, twd, G, Gd, Ga, Gad, wh, dd, e.gw, e.ga);
  }
  template <typename Exp = ExpNegF64>
  FLS_HD void merge(const VjpSums& o, double inv_t, Exp ex = Exp{}) {
    if (!(o.m < INFINITY)) return;  // o holds nothing
    if (o.m < m) rebase(o.m, o.dref, ex((m - o.m) * inv_t));
    const double f = ex((o.m - m) * inv_t), sh = o.dref - dref;
    tw += f * o.tw;
    G += f * o.G;
    twd += f * (o.twd + sh * o.tw);
    Gd += f * (o.Gd + sh * o.G);
    Ga += o.Ga;
    Gad += o.Gad + sh * o.Ga;
  }
};

// A row's result and its d L / d s_i = wh_i (g_i cw_i - K) + g_i ca_i, where for the mask
// cw = c = e^{-m/t}/t, ca = 0; log mask d > 0: cw = c / p_i, ca = 0; d <= 0: cw = 0, ca = 1/t;
// threshold: g = 0. Elements without weight (a = +inf) get 0.
struct RowVjp {
  double grad_k, grad_t;
  double K, c, E, inv_t;  // E = e^{-m/t}: tw = wh E
  double m;
  bool log_mode, nan;
  FLS_HD double grad_score(double wh, double g, double d, double a) const {
    if (nan) return NAN;
    if (!(a <= 1.7976931348623157e308)) return 0.0;
    if (!log_mode) return wh * (g * c - K);
    if (d <= 0.0) return g * inv_t - wh * K;
    return wh * (g * c / (1.0 - wh * E) - K);
  }
};

FLS_HD RowVjp nan_row(bool log_mode) {
  return RowVjp{NAN, NAN, 0, 0, 0, 0, INFINITY, log_mode, true};
}
// No weighted element (b infinite, or every score infinite): the mask does not move.
FLS_HD RowVjp still_row(bool log_mode, double inv_t) {
  return RowVjp{0, 0, 0, 0, 0, inv_t, INFINITY, log_mode, false};
}

// Mask and log mask (G, Ga from their terms):
//   d L/dk = <q, 1> / sum tw = G/tw + Ga e^{m/t}/tw (log mask: may overflow to +-inf)
//   d L/dt = -(1/t^2) sum q_i (d_i - dbar),  dbar = dref + twd / tw
//   d L/ds_i = (q_i - tw_i d L/dk) / t
// with q_i = g_i tw_i (mask) or g_i f(u_i)/F(u_i) (log mask).
FLS_HD RowVjp mask_vjp(const VjpSums& s, double b, double t, bool log_mode) {
  const double inv_t = inv_temperature(t);
  if (b != b) return nan_row(log_mode);
  if (!(s.m < INFINITY)) return still_row(log_mode, inv_t);
  const double lm = s.m * inv_t, dc = s.twd / s.tw, rw = s.G / s.tw, ra = s.Ga / s.tw;
  const double grad_k = rw + times_exp(ra, lm);
  const double grad_t = -(s.Gad - s.Ga * dc) * inv_t * inv_t -
                        times_exp(s.Gd - s.G * dc, -lm - 2.0 * log(t));
  const double c = times_exp(inv_t, -lm);
  return RowVjp{grad_k, grad_t, ra * inv_t + rw * c, c, exp(-lm), inv_t, s.m, log_mode, false};
}

// b_s solves sum F((s_i - b_s)/t) = k: db_s/ds_i = w_i/W = wh_i/tw, db_s/dk = -1/W
// = -t e^{m/t}/tw (may overflow to -inf), db_s/dt = -dbar/t; b = sign * b_s, s = sign * x.
FLS_HD RowVjp threshold_vjp(const VjpSums& s, double grad_b, double b, double t, double sign) {
  const double inv_t = inv_temperature(t);
  if (b != b) return nan_row(false);
  if (!(s.m < INFINITY)) return still_row(false, inv_t);
  const double lm = s.m * inv_t, gs = grad_b * sign;
  return RowVjp{times_exp(-gs * t / s.tw, lm), -gs * (s.dref + s.twd / s.tw) * inv_t, -gs / s.tw, 0, 0,
                inv_t, s.m, false, false};
}

}  // namespace fastlapsum
