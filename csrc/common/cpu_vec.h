// The CPU's vectorized per-score loops: e^x for x <= 0 in branch-free fp64 arithmetic, and
// the attribute that compiles a loop twice, for AVX2 + FMA and for the baseline ISA.
//
// std::exp is a library call per score, which no compiler vectorizes without fast-math;
// exp_nonpos is plain arithmetic with selects instead of branches, so the loops that call it
// vectorize (with -fno-trapping-math, setup.py: a select may then evaluate both sides).
// Range reduction
// x = n ln2 + r, |r| <= ln2/2, then Taylor to degree D: degree 13 is within ~1 ulp of
// e^x (the truncation is r^14/14! < 5e-18), degree 7 within 6e-9 relative, enough for a
// value rounded to fp32 or narrower. Subnormal results are kept (a two-step scale), below
// -745.2 the result is 0 as exp's, -inf gives 0 and NaN stays NaN.
#pragma once

#include <cstdint>
#include <type_traits>

// A function with this attribute is built for x86-64-v3 (AVX2, FMA: 4 fp64 lanes, ~4x the
// baseline's throughput of exp_nonpos) and for the baseline, and the loader picks one for
// the CPU it runs on (an ifunc). The AVX2 build contracts a * b + c into FMAs, so its
// results can differ from the baseline build's in the last bits: deterministic on one
// machine, not bitwise across CPUs of different ISAs.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define FLS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FLS_CPU_CLONES
#endif

namespace fastlapsum {

constexpr int kExpDegreeF64 = 13;  // results kept in fp64 (sums, fp64 masks)
constexpr int kExpDegreeF32 = 7;   // results rounded to fp32, fp16 or bf16

// Four fp64 lanes (GCC/clang vector extensions: AVX2 registers in the x86-64-v3 build, pairs
// of SSE2 registers in the baseline one), for the reductions: a sum over a row keeps one
// partial per lane, added in lane order at the end, so its rounding is fixed by the code,
// not by the compiler's choice of vector width.
typedef double F64x4 __attribute__((vector_size(32)));
typedef int64_t I64x4 __attribute__((vector_size(32)));
constexpr int kLanes = 4;

template <typename V> struct LaneInt { using type = int64_t; };
template <> struct LaneInt<F64x4> { using type = I64x4; };

// four scores from p[i..i+3] as fp64 lanes, times sign
template <typename scalar_t>
[[gnu::always_inline]] inline F64x4 load_lanes(const scalar_t* p, int64_t i, double sign) {
  return F64x4{static_cast<double>(p[i]), static_cast<double>(p[i + 1]), static_cast<double>(p[i + 2]),
               static_cast<double>(p[i + 3])} * sign;
}

// the scores p[i..end), four or fewer, as fp64 lanes times sign; the absent lanes hold `fill`
template <typename scalar_t>
[[gnu::always_inline]] inline F64x4 load_lanes_tail(const scalar_t* p, int64_t i, int64_t end, double sign,
                                                    double fill) {
  if (i + kLanes <= end) return load_lanes(p, i, sign);
  F64x4 s = F64x4{} + fill;
  for (int l = 0; i + l < end; ++l) s[l] = sign * static_cast<double>(p[i + l]);
  return s;
}

[[gnu::always_inline]] inline double lane_sum(F64x4 v) { return (v[0] + v[1]) + (v[2] + v[3]); }

// 1/j! for the Taylor coefficients
inline constexpr auto kInvFactorial = [] {
  struct { double c[kExpDegreeF64 + 1]; constexpr double operator[](int j) const { return c[j]; } } f{};
  double v = 1.0;
  for (int j = 0; j <= kExpDegreeF64; ++j) {
    if (j > 0) v /= j;
    f.c[j] = v;
  }
  return f;
}();

// e^x, x <= 0, for a double or for F64x4 lanes.
template <int Degree = kExpDegreeF64, typename V>
[[gnu::always_inline]] inline V exp_nonpos(V x) {
  static_assert(std::is_same_v<V, double> || std::is_same_v<V, F64x4>, "exp_nonpos: a double or F64x4 lanes");
  using I = typename LaneInt<V>::type;
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;  // 32 significant bits: n * kLn2Hi is exact
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShift = 0x1.8p52;                    // adding it rounds to an integer in the low bits
  constexpr int64_t kShiftBits = __builtin_bit_cast(int64_t, kShift);
  const V lo = V{} - 746.0;
  const V xc = x < lo ? lo : x;  // NaN passes through
  const V z = xc * kLog2e + kShift;
  const V n = z - kShift;  // round(x log2 e)
  const V r = (xc - n * kLn2Hi) - n * kLn2Lo;
  V p = V{} + kInvFactorial[Degree];
#pragma GCC unroll 16
  for (int j = Degree - 1; j >= 0; --j) p = p * r + kInvFactorial[j];  // Horner, unrolled: the loop over scores vectorizes
  // (__builtin_bit_cast, not std::bit_cast: a call to a function built for the baseline ISA
  // would pass the AVX2 build's vectors by another ABI at -O0)
  // 2^n as 2^n1 2^n2 with n1 = round(n/2), both exponents in range (subnormal results for
  // n < -1022; the clamp's n = -1076 gives 0)
  const V z1 = n * 0.5 + kShift, n2 = n - (z1 - kShift);
  const V s1 = __builtin_bit_cast(V, (__builtin_bit_cast(I, z1) - kShiftBits + 1023) << 52);
  const V s2 = __builtin_bit_cast(V, (__builtin_bit_cast(I, n2 + kShift) - kShiftBits + 1023) << 52);
  return p * s1 * s2;
}

}  // namespace fastlapsum
