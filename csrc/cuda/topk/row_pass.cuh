// Helpers of the passes over a row: the fp32 bound of a threshold key (both paths), the
// ordered block-wide compaction (the per-row kernel), the fixed-stride sample's stride and
// offset (both paths).
#pragma once

#include "../../common/tile_scan.cuh"
#include "params.cuh"

namespace fastlapsum {
namespace {

// The fp32 score of a threshold key, so that key(v) >= key becomes v >= it (and key(v) <=
// key, v <= it), at worst for a superset: the key below +0's decodes to -0, and keys that
// decode to NaN (beyond +inf's or -inf's) bound at that infinity.
__device__ __forceinline__ float key_bound(uint32_t key) {
  const float f = key_to_float(key);
  return f == f ? f : (key >= 0x80000000u ? INFINITY : -INFINITY);
}

// A thread's U vectors of the tile at vector v0 (vector v0 + u * kT + threadIdx.x; vector
// indices in 32 bits: a row has < 2^32 scores): plain 16-byte loads where the whole tile is
// aligned and inside the row (uniform in the block), else loads checked per vector.
template <int kT, int U, typename T>
__device__ __forceinline__ void load_tile_vecs(RawVec<T> (&raw)[U], const T* __restrict__ xr, uint32_t v0,
                                               uint32_t nv, uint32_t whole, int64_t L, bool aligned) {
  if (aligned && v0 + uint32_t(kT) * U <= whole) {
    const uint4* p = reinterpret_cast<const uint4*>(xr) + v0 + threadIdx.x;
#pragma unroll
    for (int u = 0; u < U; ++u) raw[u].raw = ldg16(p + u * kT);
    return;
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint32_t v = v0 + u * kT + threadIdx.x;
    if (v < nv) raw[u] = load_raw_vec<T>(xr, v, L, aligned);
  }
}

// The tile's test as bits (bit u * V + e: score e of the thread's vector u): pred(score, i)
// on each score inside the row, with no bound per score where the tile is whole (uniform).
template <int kT, int U, typename T, typename Pred>
__device__ __forceinline__ uint32_t tile_bits(const RawVec<T> (&cur)[U], uint32_t v0, uint32_t whole, int64_t L,
                                              Pred&& pred) {
  constexpr int V = 16 / sizeof(T);
  const uint32_t i0 = (v0 + threadIdx.x) * V;  // score (u, e) is i0 + u*kT*V + e
  uint32_t bits = 0;
  if (v0 + uint32_t(kT) * U <= whole) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int e = 0; e < V; ++e)
        bits |= static_cast<uint32_t>(pred(cur[u][e], i0 + u * kT * V + e)) << (u * V + e);
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const int64_t i = int64_t(v0 + u * kT + threadIdx.x) * V + e;
        if (i < L && pred(cur[u][e], static_cast<uint32_t>(i))) bits |= 1u << (u * V + e);
      }
  }
  return bits;
}

// Deterministic block-wide compaction over a row: tiles in row order, and inside a tile
// each thread's items at offsets from one block scan (no atomics: the order of the
// compacted items is a fixed function of the input). pred(score, i) selects (on the fp32
// score: a key per score would cost the pass its ALU-pipe budget); sink(pos, key, i)
// receives the selected items at consecutive positions. Returns the count.
// This is the row kernel's one full pass, so it is lean: each score is tested once, on its
// fp32 value (a bit per score), indices are 32-bit (rows are < 2^32 scores), only threads
// with a hit revisit their scores, and the next tile's loads are issued before a tile is
// tested, so that they are in flight across its scan's barriers (a CTA's loads would
// otherwise come in bursts, one tile at a time). One barrier per tile, the scan's
// (tile_exclusive_sum): tiles alternate between two warp-total arrays, and an array is
// written again only after the barrier of the scan in between, which every thread reaches
// after reading its prefix. kTwoTiles: two tiles in registers in turn (the candidate pass,
// whose loads then overlap better), else one and a copy (the fallback's output pass, where
// two made the kernel's registers spill in the fallback's select loop).
template <int kT, typename T, bool kTwoTiles, typename Pred, typename Sink>
__device__ uint32_t ordered_row_compact(const T* __restrict__ xr, int64_t L, bool aligned, uint32_t flip,
                                        uint32_t (&tot)[2][kT / 32], Pred&& pred, Sink&& sink) {
  constexpr int V = 16 / sizeof(T), U = row_unroll<T>();
  static_assert(U * V <= 32, "one bit per score of a thread's tile");
  // Vector indices in 32 bits (a row has < 2^32 scores, so < 2^30 vectors): the loop runs at
  // the kernel's register cap, and 64-bit counters take a register pair each.
  const uint32_t nv = static_cast<uint32_t>((L + V - 1) / V), whole = static_cast<uint32_t>(L / V);
  constexpr uint32_t step = uint32_t(kT) * U;
  const auto load_tile = [&](RawVec<T>(&raw)[U], uint32_t v0) { load_tile_vecs<kT>(raw, xr, v0, nv, whole, L, aligned); };
  uint32_t base = 0;
  int par = 0;  // the warp-total array of this tile
  const auto tile = [&](const RawVec<T>(&cur)[U], uint32_t v0) {
    const uint32_t i0 = (v0 + threadIdx.x) * V;  // score (u, e) is i0 + u*kT*V + e
    const uint32_t bits = tile_bits<kT>(cur, v0, whole, L, pred);
    uint32_t agg;
    uint32_t pos = tile_exclusive_sum<kT>(static_cast<uint32_t>(__popc(bits)), tot[par], agg);
    // Only the set bits: a test per score here cost the pass as much as the scores' own
    // compares (every warp has a thread with a hit). The rare hits re-read their score, an
    // L1 hit, since a register can only be picked by a constant index.
    pos += base;
    for (uint32_t b = bits; b != 0; b &= b - 1, ++pos) {
      const int k = __ffs(b) - 1;
      const uint32_t i = i0 + (k / V) * kT * V + k % V;
      sink(pos, float_key(to_float(xr[i])) ^ flip, i);
    }
    base += agg;
    par ^= 1;
  };
  RawVec<T> ta[U], tb[U];
  load_tile(ta, 0);
  if constexpr (kTwoTiles) {
    // Two register tiles in turn, each loaded while the other is tested: the copy below
    // waits at the loop's end for the loads just issued, so that only they are in flight
    // while it waits; here the next tile's are too.
    for (uint32_t v0 = 0; v0 < nv; v0 += 2 * step) {
      if (v0 + step < nv) load_tile(tb, v0 + step);
      tile(ta, v0);
      if (v0 + step >= nv) break;  // uniform
      if (v0 + 2 * step < nv) load_tile(ta, v0 + 2 * step);
      tile(tb, v0 + step);
    }
  } else {
    for (uint32_t v0 = 0; v0 < nv; v0 += step) {
      if (v0 + step < nv) load_tile(tb, v0 + step);
      tile(ta, v0);
#pragma unroll
      for (int u = 0; u < U; ++u) ta[u] = tb[u];
    }
  }
  __syncthreads();  // the caller may reuse the warp totals
  return base;
}

// The fixed-stride sample: groups of 8 contiguous scores (one 32 B sector) every 8 s
// scores, the first at a row-dependent offset (a multiple of 8 below 8 s). The row kernel's
// s and expected admitted count: row_sample_stride and sample_admit (tuning.cuh).
__device__ __forceinline__ int64_t sample_offset(int64_t r, int64_t s) {
  return static_cast<int64_t>(mix32(static_cast<uint32_t>(r) * 0x9E3779B9u + 0x7F4A7C15u) % static_cast<uint32_t>(s)) * 8;
}

}  // namespace
}  // namespace fastlapsum
