// Block-wide exclusive prefix sum with one barrier, for the per-tile compactions of the
// long-row passes (topk's row pass, the soft forward's gathering pass): one call per tile
// of a row, so its instruction count is paid per tile.
#pragma once

#include <cstdint>

namespace fastlapsum {

// Exclusive prefix sum of `count` over the CTA's kThreads threads in thread order, and the
// block's total (agg): warp scans by shuffles, the warp totals through `tot` (kThreads / 32
// words of shared memory), then each warp scans those totals by shuffles too. (cub's
// warp-scans block scan picks a warp's prefix out of all the totals, ~25 more instructions
// per call.) `tot` is written before the one barrier and read after it, so a caller that
// calls again before another barrier alternates two arrays.
template <int kThreads>
__device__ __forceinline__ uint32_t tile_exclusive_sum(uint32_t count, uint32_t* tot, uint32_t& agg) {
  constexpr int kWarps = kThreads / 32;
  static_assert(kThreads % 32 == 0 && kWarps <= 32, "whole warps, at most 32");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t incl = count;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += y;
  }
  if (lane == 31) tot[warp] = incl;
  __syncthreads();
  const uint32_t t = lane < kWarps ? tot[lane] : 0u;
  uint32_t w = t;
#pragma unroll
  for (int d = 1; d < kWarps; d <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, w, d);
    if (lane >= d) w += y;
  }
  agg = __shfl_sync(0xffffffffu, w, kWarps - 1);
  return __shfl_sync(0xffffffffu, w - t, warp) + incl - count;
}

}  // namespace fastlapsum
