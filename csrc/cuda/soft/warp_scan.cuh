// Warp-level building blocks of the on-chip solvers (sorted_solve.cuh, warp_rows.cuh):
// integer reductions, lane groups, and the affine-map scans of §1.1's recurrences across a
// warp's (or a lane group's) lanes.
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

// A group of kLanes consecutive lanes (8, 16 or the whole warp) that works as one: the
// group-relative lane, and ballots, shuffles and reductions within the group (the group's
// mask: groups of one warp may take different paths). Ballots come back group-relative.
template <int kLanes>
struct LaneGroup {
  static_assert(kLanes == 8 || kLanes == 16 || kLanes == 32, "a power-of-two share of the warp");
  __device__ static int lane() { return threadIdx.x & (kLanes - 1); }
  __device__ static int base() { return threadIdx.x & 31 & ~(kLanes - 1); }
  __device__ static unsigned mask() { return (kFullMask >> (32 - kLanes)) << base(); }
  __device__ static unsigned ballot(bool p) { return __ballot_sync(mask(), p) >> base(); }
  template <typename T>
  __device__ static T up(T v, int d) { return __shfl_up_sync(mask(), v, d, kLanes); }
  template <typename T>
  __device__ static T down(T v, int d) { return __shfl_down_sync(mask(), v, d, kLanes); }
  template <typename T>
  __device__ static T exchange(T v, int m) { return __shfl_xor_sync(mask(), v, m, kLanes); }
  template <typename T>
  __device__ static T from(T v, int src) { return __shfl_sync(mask(), v, src, kLanes); }  // group-relative src
  // 32-bit values: one REDUX on sm_80+; others (and older GPUs): a butterfly.
  template <typename T>
  __device__ static T max(T x) {
#if __CUDA_ARCH__ >= 800
    if constexpr (sizeof(T) == 4) return __reduce_max_sync(mask(), x);
    else
#endif
    {
      for (int d = kLanes / 2; d > 0; d >>= 1) {
        const T y = exchange(x, d);
        x = x > y ? x : y;
      }
      return x;
    }
  }
  __device__ static uint32_t sum(uint32_t x) {
#if __CUDA_ARCH__ >= 800
    return __reduce_add_sync(mask(), x);
#else
    for (int d = kLanes / 2; d > 0; d >>= 1) x += exchange(x, d);
    return x;
#endif
  }
};

// Inclusive Kogge-Stone scans of one affine map x -> a x + c per lane of a group: (ua, uc)
// composed up the lanes (earlier lanes first, then this one), (da, dc) down (later lanes
// first). A map (a1, c1) then (a2, c2) is (a1 a2, a2 c1 + c2). Where the lanes at and past
// kSpan hold the identity, kSpan < kLanes takes only the steps that lanes below kSpan need:
// theirs come out exact, and the down scan of every lane at or past kSpan stays the identity
// (the up scan there is left partial). The whole group calls.
template <int kLanes = 32, int kSpan = kLanes>
__device__ __forceinline__ void warp_scan_maps(double& ua, double& uc, double& da, double& dc) {
  static_assert(kSpan >= 1 && kSpan <= kLanes, "a span of the group");
  using G = LaneGroup<kLanes>;
  const int lane = G::lane();
#pragma unroll
  for (int d = 1; d < kSpan; d <<= 1) {
    const double pa = G::up(ua, d), pc = G::up(uc, d);
    const double na = G::down(da, d), nc = G::down(dc, d);
    if (lane >= d) {
      uc = fma(ua, pc, uc);
      ua *= pa;
    }
    if (lane + d < kLanes) {
      dc = fma(da, nc, dc);
      da *= na;
    }
  }
}

// The values entering each lane's run of positions, given its composite maps upward
// x -> a x + fc and downward x -> a x + rc: from below, the earlier lanes' maps applied to
// x0 (the value entering the group's first lane); from above, the later lanes' applied to
// y0 (entering its last). Sums of nonnegative terms: no cancellation. The whole group calls.
template <int kLanes = 32>
__device__ __forceinline__ void warp_enter_maps(double a, double fc, double rc, double x0, double y0, double* x,
                                                double* y) {
  using G = LaneGroup<kLanes>;
  const int lane = G::lane();
  double ga = a, gc = fc, ha = a, hc = rc;
  warp_scan_maps<kLanes>(ga, gc, ha, hc);
  const double xa = G::up(ga, 1), xc = G::up(gc, 1);
  const double ya = G::down(ha, 1), yc = G::down(hc, 1);
  *x = lane == 0 ? x0 : fma(xa, x0, xc);
  *y = lane == kLanes - 1 ? y0 : fma(ya, y0, yc);
}

}  // namespace fastlapsum
