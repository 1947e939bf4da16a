// What the CUDA per-element passes over a row share (threshold levels, mask, VJPs):
// the precision policy of their exponentials, and the streaming of a row in 16-byte
// vectors (the vector access itself is row_vec.cuh's).
#pragma once

#include <cstdint>
#include <type_traits>

#include "lapsum_math.h"
#include "row_vec.cuh"

namespace fastlapsum {

// The exponentials of the per-element passes: fp64 for fp64 scores; fp32 (exp_f, ~2 ulp)
// for fp32/fp16/bf16 scores, whose budget bound (1e-6) that meets with room to spare and
// whose fp64 exponentials would make the passes compute-bound. Sums stay fp64.
template <typename scalar_t>
__device__ __forceinline__ double exp_term(double u) {
  if constexpr (std::is_same<scalar_t, double>::value) return exp(u);
  else return static_cast<double>(exp_f(u));
}

template <typename scalar_t>
__device__ __forceinline__ double mask_prob(double s, double b, double t, double inv_t, double edge) {
  if constexpr (std::is_same<scalar_t, double>::value) return lapsum_prob(s, b, t, edge);
  else return static_cast<double>(lapsum_prob_f(s, b, inv_t, edge));
}

// e^{-x/t} for a distance x >= 0 in the compute type. fp32: one MUFU op (ex2.approx.ftz,
// the ~2 ulp of exp2f) of a prescaled argument (its rounding moves x by 6e-8 relative);
// terms below 2^-126 flush to 0 (exp2f's subnormals carry few bits anyway, and an offset
// in the argument would cost it precision). fp64: exp. Either gives 0 for x = +inf.
template <typename F>
struct ScaledExp;
template <>
struct ScaledExp<float> {
  float scale;  // log2(e)/t, capped: a subnormal t must not give 0 * inf
  __device__ explicit ScaledExp(double inv_t) {
    const double s = inv_t * 1.4426950408889634;
    scale = s < 3.4028234663852886e38 ? static_cast<float>(s) : 3.4028234663852886e38f;
  }
  __device__ float operator()(float x) const {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(-x * scale));
    return y;
  }
};
template <>
struct ScaledExp<double> {
  double inv_t;
  __device__ explicit ScaledExp(double inv) : inv_t(inv) {}
  __device__ double operator()(double x) const { return exp(-x * inv_t); }
};

// 1 where x > 0, else 0 (NaN: 0). fp32: a saturating multiply in the FMA pipe (x at least
// the smallest subnormal times 2^252 saturates to 1), not a compare and a select, which run
// at half rate on sm_90.
__device__ __forceinline__ float positive_indicator(float x) { return __saturatef(x * 0x1p126f * 0x1p126f); }
__device__ __forceinline__ double positive_indicator(double x) { return x > 0.0 ? 1.0 : 0.0; }
// The same for x = s - e (or e - s), one rounding of the difference of two floats, when the
// range end e is at least kFarEnd in magnitude (the usual case): the floats next to e are
// at least 2^-124 from it, so a positive x is too, and one multiply saturates it.
constexpr float kFarEnd = 0x1p-100f;
__device__ __forceinline__ float positive_indicator_far(float x) { return __saturatef(x * 0x1p126f); }
__device__ __forceinline__ double positive_indicator_far(double x) { return positive_indicator(x); }

// Vectors per thread per step of the streaming passes: their loads are issued together,
// because bandwidth needs bytes in flight, not just threads.
constexpr int kStreamUnroll = 2;

// Streams a row (and its upstream gradient when gr != nullptr) in tiles of kUnroll
// 16-byte vectors per thread, the loads of a tile issued together, and calls
// f(x values [kUnroll][V], g values (0 without gr), valid counts [kUnroll], first index of
// the tile) once per tile; vector u of a thread starts at t0 + (u * blockDim.x + threadIdx.x) * V.
// Values as Val (double, or the compute type: fp32<->fp64 conversions run at quarter rate).
// Block c of the row's gridDim.x blocks takes tiles c, c + gridDim.x, ...
template <typename scalar_t, typename Val = double, int kUnroll = kStreamUnroll, typename F>
__device__ __forceinline__ void stream_row_tiles(const scalar_t* __restrict__ xr, const scalar_t* __restrict__ gr,
                                                 int64_t n, F&& f) {
  constexpr int V = vec_width<scalar_t>();
  const bool aligned = is_aligned16(xr) && (gr == nullptr || is_aligned16(gr));
  const int64_t tile = int64_t(blockDim.x) * V * kUnroll;
  for (int64_t t0 = int64_t(blockIdx.x) * tile; t0 < n; t0 += int64_t(gridDim.x) * tile) {
    Val xv[kUnroll][V], gv[kUnroll][V];
    int valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i0 = t0 + (int64_t(u) * blockDim.x + threadIdx.x) * V;
#pragma unroll
      for (int q = 0; q < V; ++q) gv[u][q] = xv[u][q] = Val(0);
      valid[u] = i0 < n ? load_vec<scalar_t, V>(xr, n, i0, aligned, xv[u]) : 0;
      if (gr != nullptr && valid[u] > 0) load_vec<scalar_t, V>(gr, n, i0, aligned, gv[u]);
    }
    f(xv, gv, valid, t0);
  }
}

// The same, f(x values, g values, valid count, first index) called per vector that holds
// an element.
template <typename scalar_t, typename Val = double, int kUnroll = kStreamUnroll, typename F>
__device__ __forceinline__ void stream_row(const scalar_t* __restrict__ xr, const scalar_t* __restrict__ gr,
                                           int64_t n, F&& f) {
  constexpr int V = vec_width<scalar_t>();
  stream_row_tiles<scalar_t, Val, kUnroll>(xr, gr, n, [&](const Val(&xv)[kUnroll][V], const Val(&gv)[kUnroll][V],
                                                          const int(&valid)[kUnroll], int64_t t0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (valid[u] > 0) f(xv[u], gv[u], valid[u], t0 + (int64_t(u) * blockDim.x + threadIdx.x) * V);
  });
}

}  // namespace fastlapsum
