// LapSum math shared by the CPU and CUDA paths (docs/DESIGN.md §1).
//
// Everything here is a pure function of scalars, compiled for host and device:
// the Laplace CDF / density, the closed-form root on one interval of the budget
// curve, and the deterministic sample noise (the order keys are in order_keys.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "host_device.h"

namespace fastlapsum {

// Solver paths reported in the per-row diagnostics.
enum SolvePath : int64_t {
  kPathDirect = 0,        // answer without a solve: k = 0, k = n, infinities, NaN
  kPathSort = 1,          // full sort + closed-form scan (§1.1)
  kPathBracket = 2,       // certified sample bracket, first try (§1.2)
  kPathBracketRetry = 3,  // certified sample bracket after widening
  kPathRadix = 4,         // exact radix-bracket fallback
  kPathOuterGap = 5,      // closed form beyond the row's max or min, no sort (§1.1.1)
};
constexpr const char* kPathNames[] = {"direct", "sort", "bracket", "bracket-retry", "radix-fallback", "outer-gap"};

// method argument of the threshold ops
enum SolveMethod : int64_t { kMethodAuto = 0, kMethodSort = 1, kMethodBracket = 2 };

// isfinite that means the same in host and device code (x - x is NaN for inf and NaN).
FLS_HD bool is_finite(double x) { return x - x == 0.0; }
FLS_HD bool is_finite(float x) { return x - x == 0.0f; }

// F(u): standard Laplace CDF.
FLS_HD double laplace_cdf(double u) {
  return u <= 0.0 ? 0.5 * exp(u) : 1.0 - 0.5 * exp(-u);
}

// log F(u) without cancellation.
FLS_HD double laplace_log_cdf(double u) {
  return u <= 0.0 ? u - 0.6931471805599453 : log1p(-0.5 * exp(-u));
}

// Mask value for score s given the row's threshold b, temperature t and the mass
// `edge` that infinite scores carry when b itself is infinite (the budget is then
// spread over the tied +inf scores, or the -inf scores get what is left).
FLS_HD double lapsum_prob(double s, double b, double t, double edge) {
  if (b == INFINITY) return s == INFINITY ? edge : 0.0;
  if (b == -INFINITY) return s == -INFINITY ? edge : 1.0;
  return laplace_cdf((s - b) / t);
}

// e^u in fp32 arithmetic for u <= 0 (the GPU kernels of fp32/fp16/bf16 scores): the fp64
// argument is rounded to fp32 and that rounding corrected to first order, so the result
// carries only expf's own error (<= 2 ulp), at a fraction of an fp64 exp's cost.
FLS_HD float exp_f(double u) {
  if (u < -104.0) return 0.0f;  // expf underflows to 0 there anyway
  const float uf = static_cast<float>(u);
  const float du = static_cast<float>(u - static_cast<double>(uf));
  const float e = expf(uf);
  return fmaf(e, du, e);  // e^{uf} (1 + du), one rounding
}

// 1/t for the per-element passes (a multiply, not an fp64 division, per score), capped so
// that a subnormal t gives 0 * big = 0 for a score at b, not 0 * inf = NaN.
FLS_HD double inv_temperature(double t) {
  const double inv = 1.0 / t;
  return inv < 1.7976931348623157e308 ? inv : 1.7976931348623157e308;
}

// The mask value for a low-precision output: u = (s - b)/t in fp64 (an fp32 b alone
// moves the budget when |b| >> t), the exponential with exp_f. inv_t = inv_temperature(t).
FLS_HD float lapsum_prob_f(double s, double b, double inv_t, double edge) {
  if (b == INFINITY) return s == INFINITY ? static_cast<float>(edge) : 0.0f;
  if (b == -INFINITY) return s == -INFINITY ? static_cast<float>(edge) : 1.0f;
  const double u = (s - b) * inv_t;
  const float h = 0.5f * exp_f(-fabs(u));  // one exponential, the tail's: F(u) or 1 - F(u)
  return u <= 0.0 ? h : 1.0f - h;
}

FLS_HD double lapsum_log_prob(double s, double b, double t, double edge) {
  if (b == INFINITY) return s == INFINITY ? log(edge) : -INFINITY;
  if (b == -INFINITY) return s == -INFINITY ? log(edge) : 0.0;
  return laplace_log_cdf((s - b) / t);
}

// Rows with no interior root (DESIGN §1, §6), from the row's non-finite counts: a NaN
// score, an invalid k or t (b = NaN); the budget used up by the +inf scores (b = +inf,
// `edge` = the mass each +inf score gets) or needing the -inf ones (b = -inf). Returns
// false when the finite scores must be solved, with the budget left for them (0 < kf <
// #finite).
FLS_HD bool settle_row(double k, double t, double n, double nan, double pinf, double ninf,
                       double* b, double* edge, double* kf) {
  *b = NAN;
  *edge = NAN;
  *kf = k - pinf;
  if (!(k >= 0.0 && k <= n) || !(t > 0.0) || !is_finite(t) || nan > 0.0) return true;
  if (k <= pinf) {
    *b = INFINITY;
    *edge = pinf > 0.0 ? k / pinf : 0.0;
    return true;
  }
  if (k >= n - ninf) {
    *b = -INFINITY;
    *edge = ninf > 0.0 ? (k - (n - ninf)) / ninf : 1.0;
    return true;
  }
  *edge = 1.0;
  return false;
}

// The budget curve restricted to one interval [lo, hi] that holds no score in its
// interior:  Psi(b) = C - 1/2 e^{(b-hi)/t} A + 1/2 e^{(lo-b)/t} B  with
//   C = #scores >= hi,  A = sum_{s >= hi} e^{(hi-s)/t},  B = sum_{s <= lo} e^{(s-lo)/t}.
// Returns the root of Psi(b) = k on the interval (DESIGN §1.1): a quadratic in
// v = e^{(b-hi)/t} or in u = e^{(lo-b)/t}, whichever side has c = C - k of the sign
// that avoids cancellation. hi may be +inf (A = 0) and lo may be -inf (B = 0).
FLS_HD double solve_interval(double C, double A, double B, double hi, double lo, double k,
                             double t) {
  const double c = C - k;
  if (c > 0.0) {
    const double AG = (B > 0.0) ? A * B * exp((lo - hi) / t) : 0.0;
    const double v = (c + sqrt(c * c + AG)) / A;
    return hi + t * log(v);
  }
  if (c < 0.0) {
    const double cp = -c;
    const double AG = (A > 0.0) ? A * B * exp((lo - hi) / t) : 0.0;
    const double u = (cp + sqrt(cp * cp + AG)) / B;
    return lo - t * log(u);
  }
  // c == 0: v^2 = B G / A, taken in the log domain so that a huge gap cannot underflow.
  return 0.5 * (hi + lo) + 0.5 * t * log(B / A);
}

// e^{d/t} for differences of scores d <= 0 (the sort solvers' scans, the outer-gap sums):
// (d s) / (t s) with a power-of-two s that lifts a subnormal t, whose reciprocal
// inv_temperature caps (right for the mask's 0 * inv_t, wrong for these differences).
// Never NaN for d <= 0 (inv_ts is finite > 0).
struct GapExp {
  double scale, inv_ts;
  FLS_HD explicit GapExp(double t) : scale(t < 0x1p-960 ? 0x1p64 : 1.0), inv_ts(1.0 / (t * scale)) {}
  FLS_HD double operator()(double d) const { return exp(d * scale * inv_ts); }
};

// The outer gap's sum of terms e in [0, 1] (§1.1.1) in 64.64 fixed point: integer adds are
// associative, so the sum, and the root, do not depend on the scores' order or on the
// reduction tree (a permuted row gives bitwise the same b, as the sort solver's does).
// Each term is held to 2^-64, far below an fp64 sum's rounding.
struct GapSum {
  uint64_t whole, frac;
  FLS_HD void add(double e) {  // e = 1 exactly for the extreme score(s), else e < 1
    whole += e >= 1.0;
    merge(0, e < 1.0 ? static_cast<uint64_t>(e * 0x1p64) : 0);
  }
  FLS_HD void merge(uint64_t w, uint64_t f) {
    const uint64_t sum = frac + f;
    whole += w + (sum < frac);  // the carry out of the fraction
    frac = sum;
  }
  FLS_HD double value() const { return static_cast<double>(whole) + static_cast<double>(frac) * 0x1p-64; }
};

// §1.1.1, the outer gap: for b >= m, the max of the finite scores, every term is
// 1/2 e^{(s-b)/t}, so Psi(b) = 1/2 e^{(m-b)/t} S with S = sum e^{(s-m)/t}, and the root is
// b = m + t ln(S / (2 kf)), which lies in the gap iff S >= 2 kf. NaN where it does not hold
// (the sort solver then decides). S <= #finite, so only rows with 2 kf <= #finite can pass;
// the others try the mirror (outer_gap_side).
FLS_HD double outer_gap_root(double m, double S, double kf, double t) {
  return S >= 2.0 * kf ? m + t * log(S / (2.0 * kf)) : NAN;
}

// Which side's gap can hold the root: +1 above the max, -1 below the min. The mirror is the
// same closed form on the negated scores with the complementary budget nf - kf:
//   b = -outer_gap_root(-m', S', nf - kf, t),  m' the min, S' = sum e^{(m'-s)/t}.
FLS_HD double outer_gap_side(double kf, double nf) { return 2.0 * kf <= nf ? 1.0 : -1.0; }

// The root in the gap on `side` (outer_gap_side): m_side = side * (the max or min), S_side =
// sum e^{(side * s - m_side)/t}; NaN where that gap does not hold it.
FLS_HD double outer_gap_root_on(double side, double m_side, double S_side, double kf, double nf, double t) {
  return side * outer_gap_root(m_side, S_side, side > 0.0 ? kf : nf - kf, t);
}

// Psi at the two ends of an interval described as for solve_interval.
FLS_HD double psi_at_hi(double C, double A, double B, double hi, double lo, double t) {
  const double G = (B > 0.0 && A >= 0.0) ? exp((lo - hi) / t) : 0.0;
  return C - 0.5 * A + 0.5 * G * B;
}
FLS_HD double psi_at_lo(double C, double A, double B, double hi, double lo, double t) {
  const double G = (A > 0.0) ? exp((lo - hi) / t) : 0.0;
  return C - 0.5 * G * A + 0.5 * B;
}

// Deterministic 32-bit mixing (a counter-based generator: no state, same on CPU/GPU).
FLS_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Standard Laplace noise for sample slot s: the inverse CDF at a hashed uniform.
FLS_HD double laplace_noise(uint32_t s) {
  const double u = (static_cast<double>(mix32(s * 2654435761u + 0x9e3779b9u)) + 0.5) *
                   (1.0 / 4294967296.0);  // in (0, 1)
  return u < 0.5 ? log(2.0 * u) : -log(2.0 * (1.0 - u));
}

// The same noise in fp32 arithmetic, for the GPU's sample (only the bracket's width
// depends on it; an fp64 log per sample would dominate the proposal kernel).
FLS_HD float laplace_noise_f(uint32_t s) {
  const float u = (static_cast<float>(mix32(s * 2654435761u + 0x9e3779b9u) >> 8) + 0.5f) *
                  (1.0f / 16777216.0f);  // in (0, 1)
  return u < 0.5f ? logf(2.0f * u) : -logf(2.0f * (1.0f - u));
}

}  // namespace fastlapsum
