// The sort solver of DESIGN §1.1 for one short row per lane group (a warp, or 8 or 16 lanes
// for the tiniest rows; short_rows_cuda.cu): the row's keys in registers (kItems a lane,
// blocked: group lane l holds positions l * kItems + q), a bitonic sort across registers and
// lanes, and the closed-form scan of solve_sorted (sorted_solve.cuh) with the group in place
// of the CTA: the same per-run map folds, tests and walk of the owning run, the lanes' scan
// being one group scan. No shared memory, no barriers. Deterministic (fixed network, fixed
// scan trees).
#pragma once

#include "sorted_solve.cuh"

namespace fastlapsum {

// Sorts the group's kLanes * kItems keys descending into the blocked arrangement (any
// arrangement in). A bitonic network: compare-exchanges of positions p and p ^ stride, the
// lower position taking the larger key where p's bit `size` is clear (every stage's last
// merge, size = kLanes * kItems, sorts all descending); strides below kItems stay in a
// lane's registers, larger ones pair lane l with lane l ^ (stride / kItems) through a
// shuffle. The whole group calls.
template <typename Key, int kItems, int kLanes = 32>
__device__ __forceinline__ void warp_sort_descending(Key (&keys)[kItems]) {
  static_assert(kItems >= 1 && kItems <= 32 && (kItems & (kItems - 1)) == 0, "a power of two keys a lane");
  using G = LaneGroup<kLanes>;
  constexpr int kN = kLanes * kItems;
  const int lane = G::lane();
#pragma unroll
  for (int size = 2; size <= kN; size <<= 1) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      if (stride >= kItems) {
        // p & size is lane & (size / kItems) here (size > stride >= kItems).
        const int m = stride / kItems;
        const bool descending = (lane & (size / kItems)) == 0;
        const bool keep_max = descending == ((lane & m) == 0);
#pragma unroll
        for (int q = 0; q < kItems; ++q) {
          const Key other = G::exchange(keys[q], m);
          keys[q] = keep_max ? (other > keys[q] ? other : keys[q]) : (other < keys[q] ? other : keys[q]);
        }
      } else {
#pragma unroll
        for (int q = 0; q < kItems; ++q) {
          if (q & stride) continue;
          const int u = q | stride;
          // p & size: the register index's bit while size < kItems, else the lane's.
          const bool descending = size < kItems ? (q & size) == 0 : (lane & (size / kItems)) == 0;
          const Key hi = keys[q] > keys[u] ? keys[q] : keys[u], lo = keys[q] > keys[u] ? keys[u] : keys[q];
          keys[q] = descending ? hi : lo;
          keys[u] = descending ? lo : hi;
        }
      }
    }
  }
}

// solve_sorted for a whole row (no tails) held by one lane group: the finite sorted scores
// at positions [first, end) of the blocked arrangement, first < end. Returns b in every lane
// of the group. Each lane's kItems positions are one run (fold_maps); one group scan gives
// what enters each run (A'_{j0 - 1} from below, R past it from above); the last lane whose
// test before its run fails owns the root's gap, and its run is walked a lane each
// (gap_in_run). The whole group calls.
template <typename Key, typename SK, int kItems, int kLanes = 32>
__device__ __forceinline__ double solve_sorted_warp(const Key (&keys)[kItems], int first, int end, double kf,
                                                    double t) {
  static_assert(kItems <= kLanes, "the owner's keys are walked a lane each");
  using G = LaneGroup<kLanes>;
  const int lane = G::lane(), j0 = lane * kItems;
  const GapExp e(t);
  // s_{j0 - 1}; lane 0's is never used (position 0 is never inside (first, end)).
  const double v_before = G::up(SK::value(keys[kItems - 1]), 1);
  double fa, fc, rc;
  fold_maps<Key, SK, kItems>(keys, v_before, j0, first, end, e, &fa, &fc, &rc);
  double x, y;  // A'_{j0 - 1} and R_{j0 + kItems}; a whole row starts both scans at 0
  warp_enter_maps<kLanes>(fa, fc, rc, 0.0, 0.0, &x, &y);
  const bool pass = run_passes(j0, first, end, 0.0, x, fa, rc, y, kf);
  const int owner = G::max(pass ? -1 : lane);  // >= 0: lane 0 fails
  // The owner's keys, a lane each.
  Key run = 0;
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const Key kq = G::from(keys[q], owner);
    if (lane == q) run = kq;
  }
  Gap gap;
  double C;
  const int lead = gap_in_run<Key, SK, kLanes>(run, owner * kItems, kItems, G::from(x, owner), G::from(y, owner),
                                               G::from(v_before, owner), first, end, kf,
                                               SortedTails{0.0, 0.0, 0.0, 0.0, 0.0}, e, &gap, &C);
  // The lead's candidate to every lane (one uniform path through solve_interval).
  const auto from_lead = [&](double v) { return G::from(v, lead); };
  return solve_interval(from_lead(C), from_lead(gap.A), from_lead(gap.B), from_lead(gap.hi), from_lead(gap.lo), kf, t);
}

}  // namespace fastlapsum
