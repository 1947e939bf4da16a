// Warp-level building blocks of the on-chip solvers (sorted_solve.cuh, warp_rows.cuh):
// integer reductions and the affine-map scans of §1.1's recurrences across a warp's lanes.
#pragma once

#include <cstdint>

namespace fastlapsum {

constexpr unsigned kFullMask = 0xffffffffu;

// Warp-wide integer reductions (one REDUX on sm_80+; a butterfly before).
template <typename T, typename Op>
__device__ __forceinline__ T warp_fold(T x, Op op) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) x = op(x, __shfl_xor_sync(kFullMask, x, d));
  return x;
}
__device__ __forceinline__ uint32_t warp_sum(uint32_t x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_add_sync(kFullMask, x);
#else
  return warp_fold(x, [](uint32_t a, uint32_t b) { return a + b; });
#endif
}
__device__ __forceinline__ uint32_t warp_and(uint32_t x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_and_sync(kFullMask, x);
#else
  return warp_fold(x, [](uint32_t a, uint32_t b) { return a & b; });
#endif
}
__device__ __forceinline__ uint32_t warp_or(uint32_t x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_or_sync(kFullMask, x);
#else
  return warp_fold(x, [](uint32_t a, uint32_t b) { return a | b; });
#endif
}
__device__ __forceinline__ uint64_t warp_and(uint64_t x) {
  return (uint64_t(warp_and(uint32_t(x >> 32))) << 32) | warp_and(uint32_t(x));
}
__device__ __forceinline__ uint64_t warp_or(uint64_t x) {
  return (uint64_t(warp_or(uint32_t(x >> 32))) << 32) | warp_or(uint32_t(x));
}
__device__ __forceinline__ int warp_max(int x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_max_sync(kFullMask, x);
#else
  return static_cast<int>(warp_fold(static_cast<uint32_t>(x), [](uint32_t a, uint32_t b) {
    return static_cast<int>(a) > static_cast<int>(b) ? a : b;
  }));
#endif
}
__device__ __forceinline__ uint32_t warp_min(uint32_t x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_min_sync(kFullMask, x);
#else
  return warp_fold(x, [](uint32_t a, uint32_t b) { return a < b ? a : b; });
#endif
}
__device__ __forceinline__ uint32_t warp_max(uint32_t x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_max_sync(kFullMask, x);
#else
  return warp_fold(x, [](uint32_t a, uint32_t b) { return a > b ? a : b; });
#endif
}
__device__ __forceinline__ uint64_t warp_min(uint64_t x) {
  return warp_fold(x, [](uint64_t a, uint64_t b) { return a < b ? a : b; });
}
__device__ __forceinline__ uint64_t warp_max(uint64_t x) {
  return warp_fold(x, [](uint64_t a, uint64_t b) { return a > b ? a : b; });
}
// Inclusive Kogge-Stone scans of one affine map x -> a x + c per lane: (ua, uc) composed up
// the lanes (earlier lanes first, then this one), (da, dc) down (later lanes first). A map
// (a1, c1) then (a2, c2) is (a1 a2, a2 c1 + c2). The whole warp calls.
__device__ __forceinline__ void warp_scan_maps(double& ua, double& uc, double& da, double& dc) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const double pa = __shfl_up_sync(kFullMask, ua, d), pc = __shfl_up_sync(kFullMask, uc, d);
    const double na = __shfl_down_sync(kFullMask, da, d), nc = __shfl_down_sync(kFullMask, dc, d);
    if (lane >= d) {
      uc = fma(ua, pc, uc);
      ua *= pa;
    }
    if (lane + d < 32) {
      dc = fma(da, nc, dc);
      da *= na;
    }
  }
}

// The values entering each lane's run of positions, given its composite maps upward
// x -> a x + fc and downward x -> a x + rc: from below, the earlier lanes' maps applied to
// x0 (the value entering lane 0); from above, the later lanes' applied to y0 (entering lane
// 31). Sums of nonnegative terms: no cancellation. The whole warp calls.
__device__ __forceinline__ void warp_enter_maps(double a, double fc, double rc, double x0, double y0, double* x,
                                                double* y) {
  const int lane = threadIdx.x & 31;
  double ga = a, gc = fc, ha = a, hc = rc;
  warp_scan_maps(ga, gc, ha, hc);
  const double xa = __shfl_up_sync(kFullMask, ga, 1), xc = __shfl_up_sync(kFullMask, gc, 1);
  const double ya = __shfl_down_sync(kFullMask, ha, 1), yc = __shfl_down_sync(kFullMask, hc, 1);
  *x = lane == 0 ? x0 : fma(xa, x0, xc);
  *y = lane == 31 ? y0 : fma(ya, y0, yc);
}

}  // namespace fastlapsum
