// The per-element work of the CUDA VJPs for fp32/fp16/bf16 rows (fp64 rows use vjp_math.h's
// vjp_term directly).
//
// Every sum is relative to a nearby score (vjp_math.h), so what must be exact per element is
// its distance d = s - b and the offsets of |d| and d from the reference's. In a saturated row
// the weighted scores sit many t from b, where an fp32 d would move a weight by |d|/t fp32
// ulps. An fp64 d is exact enough but costs quarter-rate fp32<->fp64 conversions per score;
// here d is an unevaluated pair of floats instead (b = b_hi + b_lo, s - b_hi split exactly by
// TwoSum), exact to ~2^-48 (|d| + |b|), and the offsets are differences of pairs. The pairs
// need b and log2(e)/t well inside the fp32 range; a row outside it (RowF32::pairs false)
// takes the fp64 distances of the *_f64d functions.
#pragma once

#include <cfloat>

#include "../common/vjp_math.h"

namespace fastlapsum {

// e^{-x} for x >= 0 (+inf: 0) in fp32, one MUFU op (ex2.approx.ftz, ~2 ulp) of an argument
// prescaled in fp64.
__device__ __forceinline__ float exp2_neg(double x2) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(-static_cast<float>(x2)));
  return y;
}
// 2^x in fp32 (x <= 0 here; -inf gives 0)
__device__ __forceinline__ float exp2_f(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
constexpr double kLog2e = 1.4426950408889634;

// e^{-x} for folding a group's sums into a thread's: one MUFU op where an fp64 exp costs
// tens. Its ~2^-22 relative error moves a group's weight against the others' by as much as
// rounding the group's fp32 sums already does.
struct ExpNegF32 {
  __device__ double operator()(double x) const { return static_cast<double>(exp2_neg(x * kLog2e)); }
};

// hi + lo, unevaluated
struct F2 {
  float hi, lo;
};
__device__ __forceinline__ float approx(const F2& a) { return a.hi + a.lo; }
__device__ __forceinline__ double exact(const F2& a) { return static_cast<double>(a.hi) + static_cast<double>(a.lo); }
// |a| as a pair
__device__ __forceinline__ F2 abs2(const F2& a) {
  const float s = approx(a) < 0.0f ? -1.0f : 1.0f;
  return F2{s * a.hi, s * a.lo};
}
// a - b, one rounding at the end: a.hi - b.hi is exact where they are within a factor 2 of
// each other, and otherwise rounds a difference at least half of a.hi.
__device__ __forceinline__ float sub2(const F2& a, const F2& b) { return (a.hi - b.hi) + (a.lo - b.lo); }

// A row's constants for its fp32 elements.
struct RowF32 {
  float sign, b_hi, b_lo, l2;  // l2 = log2(e)/t
  double b, inv_t;
  bool pairs;  // b and l2 inside the range where the pairs hold (else the fp64 distances)
  __device__ RowF32(double sign_d, double b_, double inv_t_)
      : sign(static_cast<float>(sign_d)), b(b_), inv_t(inv_t_) {
    const double l2d = inv_t_ * kLog2e;
    pairs = !(fabs(b_) > 0x1p100 && is_finite(b_)) && l2d <= 0x1p100;
    b_hi = static_cast<float>(b_);
    b_lo = is_finite(b_) ? static_cast<float>(b_ - static_cast<double>(b_hi)) : 0.0f;
    l2 = static_cast<float>(fmin(l2d, 3.0e38));
  }
  // x as stored (the row's sign not yet applied): d = sign x - b. Non-finite hi: no weight.
  __device__ __forceinline__ F2 dist(float x) const {
    const float s = sign * x, y = s - b_hi, bv = y - s;
    return F2{y, ((s - (y - bv)) + (-b_hi - bv)) - b_lo};
  }
  // the fp64 distance of the fallback (and its |d|, +inf for an infinite or NaN d)
  __device__ __forceinline__ double dist_f64d(float x) const { return static_cast<double>(sign * x) - b; }
  __device__ __forceinline__ static double abs_f64d(double d) { return is_finite(d) ? fabs(d) : INFINITY; }
  // e^{-x/t} for an offset x >= 0 given in fp64 (+inf: 0)
  __device__ __forceinline__ float exp_neg_f64d(double x) const { return exp2_neg(x * fmin(inv_t * kLog2e, 1.7976931348623157e308)); }
};

// Sums of elements about a reference element, in fp32 (the fields of VjpSums past m and dref).
struct SumsF32 {
  float tw = 0.0f, G = 0.0f, twd = 0.0f, Gd = 0.0f, Ga = 0.0f, Gad = 0.0f;
  // one element of weight wh, offset dd from the reference, upstream g, distance d > 0 or not
  __device__ __forceinline__ void add(float wh, float dd, float g, bool above, bool log_mode, float p) {
    float gw = g;
    if (log_mode) {
      if (!above) {  // log p = u + log 1/2: an absolute term
        Ga += g;
        Gad += g * dd;
        gw = 0.0f;
      } else {  // d log p / d u = tw / p
        gw = g / p;
      }
    }
    tw += wh;
    twd += wh * dd;
    G += gw * wh;
    Gd += gw * wh * dd;
  }
  // as VjpSums about the reference (|d| = m, d = dref); no reference (m = +inf): empty
  __device__ __forceinline__ VjpSums about(double m, double dref) const {
    VjpSums v;
    if (!(m < INFINITY)) return v;
    v.m = m;
    v.dref = dref;
    v.tw = tw; v.G = G; v.twd = twd; v.Gd = Gd; v.Ga = Ga; v.Gad = Gad;
    return v;
  }
};

// An element nearest b among some: its |d| (+inf: none weighted) and d. nearer() is a total
// order (ties by d), so a reduction in any tree gives every lane the same element.
struct Nearest {
  double a = INFINITY, d = 0.0;
};
__device__ __forceinline__ Nearest nearer(const Nearest& x, const Nearest& y) {
  return x.a < y.a || (x.a == y.a && x.d <= y.d) ? x : y;
}

// The float-pair distance of an element and the fp32 key that orders it (+inf: no weight).
__device__ __forceinline__ float pair_key(const F2& d, bool valid) {
  return valid && fabsf(d.hi) <= FLT_MAX ? fabsf(approx(d)) : INFINITY;
}
// The pair of a double (the reference's, exact to ~2^-48 |d|).
__device__ __forceinline__ F2 split(double v) {
  const float hi = static_cast<float>(v);
  return F2{hi, static_cast<float>(v - static_cast<double>(hi))};
}

// The float-pair distances of N elements (the first pass computes them, the second reuses them).
template <int N>
__device__ __forceinline__ void pair_dists(const RowF32& row, const float (&xv)[N], F2 (&d)[N]) {
#pragma unroll
  for (int q = 0; q < N; ++q) d[q] = row.dist(xv[q]);
}

// The nearest of N elements by their float-pair distances (valid[q]: element q exists).
template <int N>
__device__ __forceinline__ Nearest nearest_of_dists(const F2 (&d)[N], const bool (&valid)[N]) {
  float kmin = INFINITY;
  F2 ref{0.0f, 0.0f};
#pragma unroll
  for (int q = 0; q < N; ++q) {
    const float key = pair_key(d[q], valid[q]);
    if (key < kmin) {
      kmin = key;
      ref = d[q];
    }
  }
  return kmin < INFINITY ? Nearest{fabs(exact(ref)), exact(ref)} : Nearest{};
}
template <int N>
__device__ __forceinline__ Nearest nearest_pairs(const RowF32& row, const float (&xv)[N], const bool (&valid)[N]) {
  F2 d[N];
  pair_dists<N>(row, xv, d);
  return nearest_of_dists<N>(d, valid);
}

// The sums of N elements of float-pair distances d about the reference `ref` (an element
// nearest b, as a pair).
template <int N>
__device__ __forceinline__ SumsF32 sums_about_dists(const RowF32& row, const F2& ref, const F2 (&d)[N],
                                                    const float (&gv)[N], const bool (&valid)[N], bool log_mode) {
  const F2 aref = abs2(ref);
  SumsF32 s;
#pragma unroll
  for (int q = 0; q < N; ++q) {
    const float key = pair_key(d[q], valid[q]);
    if (!(key < INFINITY)) continue;
    const float wh = exp2_f(fmaf(-sub2(abs2(d[q]), aref), row.l2, -1.0f));  // e^{-(|d| - m)/t} / 2
    const bool above = approx(d[q]) > 0.0f;
    s.add(wh, sub2(d[q], ref), gv[q], above, log_mode, log_mode && above ? 1.0f - 0.5f * exp2_f(-key * row.l2) : 1.0f);
  }
  return s;
}
template <int N>
__device__ __forceinline__ SumsF32 sums_about_pairs(const RowF32& row, const F2& ref, const float (&xv)[N],
                                                    const float (&gv)[N], const bool (&valid)[N], bool log_mode) {
  F2 d[N];
  pair_dists<N>(row, xv, d);
  return sums_about_dists<N>(row, ref, d, gv, valid, log_mode);
}

// The same two passes with fp64 distances (rows outside the pairs' range); d is recomputed
// in the second pass (an fp64 array would halve occupancy).
template <int N>
__device__ __forceinline__ Nearest nearest_f64d(const RowF32& row, const float (&xv)[N], const bool (&valid)[N]) {
  Nearest best;
#pragma unroll
  for (int q = 0; q < N; ++q) {
    const double d = row.dist_f64d(xv[q]), a = valid[q] ? RowF32::abs_f64d(d) : INFINITY;
    if (a < best.a) best = Nearest{a, d};
  }
  return best;
}
template <int N>
__device__ __forceinline__ SumsF32 sums_about_f64d(const RowF32& row, const Nearest& ref, const float (&xv)[N],
                                                   const float (&gv)[N], const bool (&valid)[N], bool log_mode) {
  SumsF32 s;
#pragma unroll
  for (int q = 0; q < N; ++q) {
    const double d = row.dist_f64d(xv[q]), a = valid[q] ? RowF32::abs_f64d(d) : INFINITY;
    if (!(a < INFINITY)) continue;
    const bool above = d > 0.0;
    s.add(0.5f * row.exp_neg_f64d(a - ref.a), static_cast<float>(d - ref.d), gv[q], above, log_mode,
          log_mode && above ? 1.0f - 0.5f * row.exp_neg_f64d(a) : 1.0f);
  }
  return s;
}

// A group's sums about its nearest element by the row's rule (streaming VJP): float-pair
// distances where the row allows them (RowF32::pairs), else fp64 distances. ok[q]: element q
// exists.
template <int G>
__device__ __forceinline__ VjpSums row_group_sums(const RowF32& row, const float (&xv)[G], const float (&gv)[G],
                                                  const bool (&ok)[G], bool log_mode) {
  if (row.pairs) {
    F2 d[G];
    pair_dists<G>(row, xv, d);
    const Nearest ref = nearest_of_dists<G>(d, ok);
    return sums_about_dists<G>(row, split(ref.d), d, gv, ok, log_mode).about(ref.a, ref.d);
  }
  const Nearest ref = nearest_f64d<G>(row, xv, ok);
  return sums_about_f64d<G>(row, ref, xv, gv, ok, log_mode).about(ref.a, ref.d);
}

// A row's coefficients of d L / d s_i (RowVjp::grad_score) in fp32, for the rows whose
// coefficients fit fp32 with room (else `fits` is false and the elements use grad_score).
struct RowCoefF32 {
  F2 m;  // the reference |d| of the weights
  float c, K, inv_t, E;
  bool fits;
  __device__ explicit RowCoefF32(const RowVjp& v) {
    const auto room = [](double y) { return y == 0.0 || (fabs(y) >= 0x1p-100 && fabs(y) <= 0x1p100); };
    fits = !v.nan && v.m < 0x1p100 && room(v.c) && room(v.K) && room(v.inv_t);
    m.hi = static_cast<float>(fmin(v.m, 3.0e38));
    m.lo = fits ? static_cast<float>(v.m - static_cast<double>(m.hi)) : 0.0f;
    c = static_cast<float>(v.c);
    K = static_cast<float>(v.K);
    inv_t = static_cast<float>(v.inv_t);
    E = static_cast<float>(v.E);
  }
  // d L / d s for one element (the row's sign not yet applied); no weight: 0
  __device__ __forceinline__ float grad_score(const RowF32& row, float x, float g, bool log_mode) const {
    const F2 d = row.dist(x);
    if (!(fabsf(d.hi) <= FLT_MAX)) return 0.0f;
    const float wh = exp2_f(fmaf(-sub2(abs2(d), m), row.l2, -1.0f));
    if (!log_mode) return wh * (g * c - K);
    if (approx(d) <= 0.0f) return g * inv_t - wh * K;
    return wh * (g * c / (1.0f - wh * E) - K);
  }
};

// d L / d x of one element of an fp32/fp16/bf16 row (x as stored): in fp32 where the row's
// pairs and coefficients allow (the usual row), else with fp64 distances and coefficients.
__device__ __forceinline__ float grad_f32(const RowF32& row, const RowCoefF32& cf, const RowVjp& v, float x, float g,
                                          bool log_mode) {
  if (row.pairs && cf.fits) return row.sign * cf.grad_score(row, x, g, log_mode);
  const double d = row.dist_f64d(x), a = RowF32::abs_f64d(d);
  return static_cast<float>(static_cast<double>(row.sign) * v.grad_score(0.5f * row.exp_neg_f64d(a - v.m), g, d, a));
}

// The same for an fp64 row.
__device__ __forceinline__ double grad_f64(double sign, double b, double inv_t, const RowVjp& v, double x, double g) {
  const VjpTerm e = vjp_term(sign * x, b, inv_t, 0.0, false);  // a and d only
  return sign * v.grad_score(0.5 * exp(-(e.a - v.m) * inv_t), g, e.d, e.a);
}

}  // namespace fastlapsum
