// The exact radix select of both paths: the digits of the 64-bit composite (key, ~index)
// (order_keys.h), the row streaming loop, and the block-wide select (block_select).
#pragma once

#include <cub/block/block_scan.cuh>
#include <cstdint>

#include "../../common/lapsum_math.h"
#include "../../common/order_keys.h"
#include "../../common/row_vec.cuh"
#include "tuning.cuh"

namespace fastlapsum {
namespace {

// Warp scans: one barrier per scan (raking has two).
template <int kT>
using BlockScanT = cub::BlockScan<uint32_t, kT, cub::BLOCK_SCAN_WARP_SCANS>;
using BlockScan = BlockScanT<kBlock>;

struct FindResult {
  uint32_t digit, above, count;
};

__device__ __forceinline__ int digit_shift(int p) {
  return p == 0 ? 53 : p == 1 ? 42 : p == 2 ? 32 : p == 3 ? 21 : p == 4 ? 10 : 0;
}
__device__ __forceinline__ int digit_width(int p) { return (p == 2 || p == 5) ? 10 : 11; }
__device__ __forceinline__ bool prefix_match(uint64_t c, uint64_t prefix, int hi) {
  return hi >= 64 || (c >> hi) == (prefix >> hi);
}
__device__ __forceinline__ bool selected(uint64_t c, uint64_t prefix, int ks) {
  return (c >> ks) >= (prefix >> ks);
}

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}

// Vector v (V = 16/sizeof(T) scores) of a row of length L, raw (lanes past L read as 0;
// callers skip them).
template <typename T>
__device__ __forceinline__ RawVec<T> load_raw_vec(const T* __restrict__ xr, int64_t v, int64_t L, bool aligned) {
  constexpr int V = vec_width<T>();
  if (aligned && (v + 1) * V <= L) return {ldg16(reinterpret_cast<const uint4*>(xr) + v)};
  return load_raw_scalar(xr, L, v * V, T(0.0f));
}

struct NoTileEnd {
  __device__ void operator()() const {}
};

// f(score, index) for every index < L handled by CTA `blk` of `nblk` (kT threads each), then
// tile_end() after each tile of kT * U vectors (uniform trip count within the CTA: the loop
// bound does not depend on the thread, so tile_end may synchronise the block).
template <typename T, int U = row_unroll<T>(), int kT = kBlock, typename F, typename TileEnd = NoTileEnd>
__device__ __forceinline__ void for_row(const T* __restrict__ xr, int64_t L, bool aligned, int64_t blk,
                                        int64_t nblk, F&& f, TileEnd&& tile_end = TileEnd{}) {
  constexpr int V = 16 / sizeof(T);
  const int64_t nv = (L + V - 1) / V;
  const int64_t step = nblk * kT * U;
  for (int64_t v0 = blk * kT * U; v0 < nv; v0 += step) {
    float vals[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * kT + threadIdx.x;
      // load_raw_vec spelled out, scalar tail included: through it g_hist takes 34 registers
      // for fp16/bf16, not 31 (3 CTAs of 512 threads an SM instead of 4)
      if (v < nv) {
        uint4 q;
        if (aligned && (v + 1) * V <= L) {
          q = ldg16(reinterpret_cast<const uint4*>(xr) + v);
        } else {
          T t[V];
#pragma unroll
          for (int e = 0; e < V; ++e) t[e] = v * V + e < L ? xr[v * V + e] : T(0.0f);
          memcpy(&q, t, 16);
        }
#pragma unroll
        for (int e = 0; e < V; ++e) vals[u][e] = to_float(raw_elem<T>(q, e));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * kT + threadIdx.x;
      if (v < nv) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int64_t i = v * V + e;
          if (i < L) f(vals[u][e], i);
        }
      }
    }
    tile_end();
  }
}

// Block-wide: the bin (scanning from the top) that holds rank `need` (1-based) of the
// histogram, the count above it and its own count. Ends with a barrier.
template <int kT = kBlock>
__device__ void find_bin(const uint32_t* hist, uint32_t need, typename BlockScanT<kT>::TempStorage& tmp,
                         FindResult& res) {
  constexpr int kPer = kBins / kT;
  uint32_t c[kPer];
  uint32_t s = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    c[j] = hist[kBins - 1 - (threadIdx.x * kPer + j)];
    s += c[j];
  }
  uint32_t run;
  BlockScanT<kT>(tmp).ExclusiveSum(s, run);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (run < need && run + c[j] >= need) {
      res.digit = kBins - 1 - (threadIdx.x * kPer + j);
      res.above = run;
      res.count = c[j];
    }
    run += c[j];
  }
  __syncthreads();
}

template <int kT>
struct RowShared {
  typename BlockScanT<kT>::TempStorage scan;  // find_bin and the output compaction
  uint32_t tile_tot[2][kT / 32];              // ordered_row_compact: warp totals, two in turn
  FindResult res;
};

// Exact block-wide radix select of the top `need` composites of the elements that
// `each(f)` visits (f(key, index)). hist_ready: pass 0's histogram is already in `hist`.
template <int kT, typename Each>
__device__ void block_select(Each&& each, uint32_t need, bool hist_ready, uint32_t* hist, RowShared<kT>& sh,
                             uint64_t& prefix_out, int& ks_out) {
  uint64_t prefix = 0;
  int ks = 0;
  for (int p = 0; p < 6; ++p) {
    const int s = digit_shift(p);
    const int hi = s + digit_width(p);
    const uint64_t mask = (1ull << digit_width(p)) - 1;
    if (!(p == 0 && hist_ready)) {
      for (int i = threadIdx.x; i < kBins; i += kT) hist[i] = 0;
      __syncthreads();
      each([&](uint32_t key, uint32_t idx) {
        const uint64_t c = composite(key, idx);
        if (prefix_match(c, prefix, hi)) atomicAdd(&hist[(c >> s) & mask], 1u);
      });
      __syncthreads();
    }
    find_bin<kT>(hist, need, sh.scan, sh.res);
    const FindResult r = sh.res;
    prefix |= static_cast<uint64_t>(r.digit) << s;
    need -= r.above;
    ks = s;
    __syncthreads();  // sh.res is read by all before the next find_bin writes it
    if (r.count == need) break;
  }
  prefix_out = prefix;
  ks_out = ks;
}

}  // namespace
}  // namespace fastlapsum
