// The bins of a level's key range: their geometry and sums (flat or atom frame), the
// shared-memory bin add, and the fixed-order block reduction (level, scan, sides, solve).
#pragma once

#include <cub/block/block_reduce.cuh>

#include "../../common/atom_scan.h"
#include "../../common/gpu_rows.cuh"
#include "gpu_keys.cuh"
#include "params.cuh"

namespace fastlapsum {
namespace {

// Block-wide reduction in a fixed order with a short chain of dependent merges: a shuffle
// tree in each warp, then one over the warps' results (cub::BlockReduce merges those one
// after another: 15 in a row at 512 threads, each several fp64 exponentials for atoms).
// The result is valid in thread 0; scratch holds a value per warp.
template <int kThreads, typename T, typename Op>
__device__ T tree_reduce(T v, Op op, T* scratch) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int d = 16; d > 0; d /= 2) {
    const T other = cub::ShuffleDown<32>(v, d, 31, 0xffffffffu);
    if (lane + d < 32) v = op(v, other);
  }
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = scratch[lane < kWarps ? lane : 0];
    for (int d = kWarps / 2; d > 0; d /= 2) {
      const T other = cub::ShuffleDown<32>(v, d, 31, 0xffffffffu);
      if (lane + d < kWarps) v = op(v, other);
    }
  }
  return v;
}

template <typename scalar_t>
__host__ __device__ constexpr int64_t level_tile() {
  return level_tile_for(sizeof(scalar_t));
}

// Bins of a key range: width 2^shift keys, at most kBins of them.
__device__ inline int bin_shift(uint64_t lo, uint64_t hi) {
  int shift = 0;
  while (((hi - lo) >> shift) >= static_cast<uint64_t>(kBins)) ++shift;
  return shift;
}

// Keys [first, last] of bin `bin` of the range [lo, hi]: 2^shift keys, the last bin cut at hi.
struct BinKeys {
  uint64_t first, last;
};
__device__ inline BinKeys bin_keys(uint64_t lo, uint64_t hi, int shift, int bin) {
  const uint64_t first = lo + (static_cast<uint64_t>(bin) << shift);
  const uint64_t last_full = first + ((uint64_t(1) << shift) - 1);
  return BinKeys{first, last_full > hi || last_full < first ? hi : last_full};
}

// A level's bins over a range that spans at most kFlatSpan temperatures hold their sums
// against the range's ends (BinSums::U against a_lo, L against a_hi: each block converts its
// edge-relative sums once when it adds them), so the scan's flat path reads them as they are.
__device__ inline bool flat_range(double a_lo, double a_hi, double inv_t) { return (a_hi - a_lo) * inv_t <= kFlatSpan; }

template <typename KT>
__device__ inline FlatAtom flat_bin(const BinSums& h, uint64_t lo, uint64_t hi, int shift, int bin) {
  if (h.count == 0) return FlatAtom{0.0, 0.0, 0.0, INFINITY, -INFINITY};
  using Key = typename KT::Key;
  const BinKeys b = bin_keys(lo, hi, shift, bin);
  return FlatAtom{static_cast<double>(h.count), h.U, h.L, KT::value(Key(b.first)), KT::value(Key(b.last))};
}

// A bin as an atom (sums against its own edges); `flat` bins are converted back.
template <typename KT>
__device__ inline Atom bin_atom(const BinSums& h, uint64_t lo, uint64_t hi, int shift, int bin, bool flat,
                                const FlatFrame& f) {
  if (h.count == 0) return Atom{0, 0, 0, 0, 0};
  using Key = typename KT::Key;
  const BinKeys b = bin_keys(lo, hi, shift, bin);
  const double e_lo = KT::value(Key(b.first)), e_hi = KT::value(Key(b.last));
  if (!flat) return Atom{e_lo, e_hi, static_cast<double>(h.count), h.U, h.L};
  return Atom{e_lo, e_hi, static_cast<double>(h.count), h.U * exp((e_lo - f.a_lo) * f.inv_t),
              h.L * exp((f.a_hi - e_hi) * f.inv_t)};
}

// Adds one score's terms to a shared-memory bin. Float atomics on shared memory are CAS loops
// on sm_90; with kAggregate the lanes of a warp that hit the same bin (ties, a narrow
// cluster) add theirs together first: one atomic per bin per warp, not one per lane spinning
// on one word. (No warp match before Volta: plain atomics there.)
template <bool kAggregate>
__device__ inline void bin_add(unsigned* count, double* U, double* L, int bin, double u, double l) {
  unsigned lanes = 1;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
  if constexpr (kAggregate) {
    const unsigned lane = threadIdx.x % 32;
    const unsigned peers = __match_any_sync(__activemask(), bin);
    lanes = __popc(peers);
    if (peers != (1u << lane)) {  // the lowest lane gathers the others' terms, in lane order
      const double own_u = u, own_l = l;
      for (unsigned rest = peers & (peers - 1); rest != 0; rest &= rest - 1) {
        const int src = __ffs(rest) - 1;
        const double ou = __shfl_sync(peers, own_u, src), ol = __shfl_sync(peers, own_l, src);
        u += ou;
        l += ol;
      }
      if (lane != static_cast<unsigned>(__ffs(peers) - 1)) return;
    }
  }
#endif
  atomicAdd(&count[bin], lanes);
  atomicAdd(&U[bin], u);
  atomicAdd(&L[bin], l);
}

}  // namespace
}  // namespace fastlapsum
