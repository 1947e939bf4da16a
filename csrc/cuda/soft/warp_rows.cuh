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
// arrangement in). A bitonic network in its flip form, so that no compare-exchange depends
// on a direction: each merge of size `size` first compares positions p and p ^ (size - 1)
// (the second half mirrored), then p and p ^ stride for stride = size / 4, ..., 1; the lower
// position always takes the larger key. Pairs inside a lane (partner distance < kItems) are
// a max and a min of two registers; pairs across lanes pair lane l with lane l ^ m through
// a shuffle, the lower lane keeping the max (a mirrored pair also mirrors the register:
// q with kItems - 1 - q). The whole group calls.
template <typename Key, int kItems, int kLanes = 32>
__device__ __forceinline__ void warp_sort_descending(Key (&keys)[kItems]) {
  static_assert(kItems >= 1 && kItems <= 32 && (kItems & (kItems - 1)) == 0, "a power of two keys a lane");
  using G = LaneGroup<kLanes>;
  constexpr int kN = kLanes * kItems;
  const int lane = G::lane();
  const auto in_lane = [&](int q, int u) {  // q < u
    const Key hi = keys[q] > keys[u] ? keys[q] : keys[u], lo = keys[q] > keys[u] ? keys[u] : keys[q];
    keys[q] = hi;
    keys[u] = lo;
  };
  const auto keep = [](bool keep_max, Key mine, Key other) {  // a lane's side of a pair across lanes
    return keep_max ? (other > mine ? other : mine) : (other < mine ? other : mine);
  };
#pragma unroll
  for (int size = 2; size <= kN; size <<= 1) {
    if (size <= kItems) {
#pragma unroll
      for (int q = 0; q < kItems; ++q)
        if ((q & (size / 2)) == 0) in_lane(q, q ^ (size - 1));
    } else {
      const int m = size / kItems - 1;  // the mirrored lane
      const bool keep_max = (lane & (size / kItems / 2)) == 0;
      // Registers q and kItems - 1 - q swap partners: both shuffled before either changes.
#pragma unroll
      for (int q = 0; q < (kItems + 1) / 2; ++q) {
        const int u = kItems - 1 - q;
        const Key for_q = G::exchange(keys[u], m), for_u = G::exchange(keys[q], m);
        keys[q] = keep(keep_max, keys[q], for_q);
        if (u != q) keys[u] = keep(keep_max, keys[u], for_u);
      }
    }
#pragma unroll
    for (int stride = size / 4; stride > 0; stride >>= 1) {
      if (stride >= kItems) {
        const int m = stride / kItems;
        const bool keep_max = (lane & m) == 0;
#pragma unroll
        for (int q = 0; q < kItems; ++q) {
          keys[q] = keep(keep_max, keys[q], G::exchange(keys[q], m));
        }
      } else {
#pragma unroll
        for (int q = 0; q < kItems; ++q)
          if ((q & stride) == 0) in_lane(q, q | stride);
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
  const int lead = gap_in_run<Key, SK, kLanes, kItems>(run, owner * kItems, kItems, G::from(x, owner),
                                                       G::from(y, owner), G::from(v_before, owner), first, end, kf,
                                                       SortedTails{0.0, 0.0, 0.0, 0.0, 0.0}, e, &gap, &C);
  // The lead's candidate to every lane (one uniform path through solve_interval).
  const auto from_lead = [&](double v) { return G::from(v, lead); };
  return solve_interval(from_lead(C), from_lead(gap.A), from_lead(gap.B), from_lead(gap.hi), from_lead(gap.lo), kf, t);
}

}  // namespace fastlapsum
