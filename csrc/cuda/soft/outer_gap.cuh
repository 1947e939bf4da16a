// The outer gap of DESIGN §1.1.1 on chip: before a short row's sort, the row's extreme finite
// score on the side that can hold the root (outer_gap_side) and the sum of the terms
// e^{-|s - m|/t} on that side (fp64 exponentials, summed in GapSum's fixed point: the same
// bits in every lane and for every order of the row); where the closed form holds
// (outer_gap_root) the row needs no sort and no scan. A lane group's version for
// warp_rows_kernel, a CTA's for short_rows_kernel (short_rows_cuda.cu).
#pragma once

#include "../../common/lapsum_math.h"
#include "sorted_solve.cuh"
#include "warp_scan.cuh"

namespace fastlapsum {

// A key oriented to the gap's side, so that the extreme finite score has the largest
// oriented key; 0 for a key that does not enter: +-inf, and the padding key 0 (below every
// score's key; ~key is never 0 for a finite key).
template <typename Key, typename SK>
__device__ __forceinline__ Key gap_key(Key key, bool top) {
  const bool finite = key > SK::key(-INFINITY) && key < SK::key(INFINITY);
  return finite ? (top ? key : static_cast<Key>(~key)) : Key(0);
}

// A thread's part of the gap's sum over its keys: e^{side (s - m)/t} for the entering ones.
template <typename Key, typename SK, int kItems>
__device__ __forceinline__ GapSum gap_sum_part(const Key (&keys)[kItems], bool top, double m, const GapExp& e) {
  GapSum S{0, 0};
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const double d = SK::value(keys[q]) - m;
    S.add(e(gap_key<Key, SK>(keys[q], top) != 0 ? (top ? d : -d) : -INFINITY));
  }
  return S;
}

// Butterfly over kLanes lanes of a group (kLanes = 32: the warp): every lane ends with the
// same sum. The sums' whole parts are at most a short row's length (32 bits).
template <int kLanes>
__device__ __forceinline__ GapSum group_sum(GapSum S) {
#pragma unroll
  for (int d = kLanes / 2; d > 0; d >>= 1)
    S.merge(LaneGroup<kLanes>::exchange(static_cast<uint32_t>(S.whole), d), LaneGroup<kLanes>::exchange(S.frac, d));
  return S;
}

// The root in the outer gap of a row held by a lane group, or NaN where it lies among the
// scores (the sort decides). score(q): the lane's q-th signed score (NaN past the row);
// key_min / key_max: the lane's finite keys' extremes (KeyStats); nf: the finite scores, kf:
// their budget (settle_row). The whole group calls; the answer is the group's.
template <typename SK, int kItems, int kLanes, typename Key, typename Score>
__device__ __forceinline__ double outer_gap_group(const Score& score, Key key_min, Key key_max, double kf, double nf,
                                                  double t) {
  const double side = outer_gap_side(kf, nf);
  const bool top = side > 0.0;
  // a lane without finite scores: 0
  const Key best = LaneGroup<kLanes>::max(top ? key_max : static_cast<Key>(~key_min));
  const double m = SK::value(top ? best : static_cast<Key>(~best));
  const GapExp e(t);
  GapSum S{0, 0};
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const double s = score(q);
    S.add(e(is_finite(s) ? side * (s - m) : -INFINITY));
  }
  S = group_sum<kLanes>(S);
  return outer_gap_root_on(side, side * m, S.value(), kf, nf, t);
}

// The same for a row held by the CTA (kItems keys a thread, positions past the row holding
// the padding key 0), the finite scores' extremes from the census. st: shared memory that
// nothing else uses. The whole block calls.
struct GapSumStorage {
  uint64_t frac[kWarps];
  uint32_t whole[kWarps];
};

template <typename Key, typename SK, int kItems>
__device__ __forceinline__ double outer_gap_block(GapSumStorage& st, const Key (&keys)[kItems], Key key_min,
                                                  Key key_max, double kf, double nf, double t) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const double side = outer_gap_side(kf, nf);
  const bool top = side > 0.0;
  const double m = SK::value(top ? key_max : key_min);
  const GapSum S = group_sum<32>(gap_sum_part<Key, SK, kItems>(keys, top, m, GapExp(t)));
  if (lane == 0) {
    st.frac[warp] = S.frac;
    st.whole[warp] = static_cast<uint32_t>(S.whole);
  }
  __syncthreads();
  const bool mine = lane < kWarps;
  const GapSum total = group_sum<32>(GapSum{mine ? st.whole[lane] : 0u, mine ? st.frac[lane] : 0ull});
  return outer_gap_root_on(side, side * m, total.value(), kf, nf, t);
}

}  // namespace fastlapsum
