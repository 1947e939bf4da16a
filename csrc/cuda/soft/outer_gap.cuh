// The outer gap of DESIGN §1.1.1 on chip: before a short row's sort, the row's extreme finite
// score on the side that can hold the root (outer_gap_side) and the sum of the terms
// e^{-|s - m|/t} on that side (GapTerm: fp32 exponentials for 16/32-bit rows, fp64 for fp64
// rows; summed in GapSum's fixed point: the same bits in every lane and for every order of
// the row); where the closed form holds
// (outer_gap_root) the row needs no sort and no scan. A lane group's version for
// warp_rows_kernel, a CTA's for short_rows_kernel (short_rows_cuda.cu).
#pragma once

#include <type_traits>

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

// Butterfly over kLanes lanes of a group (kLanes = 32: the warp): every lane ends with the
// same sum. The sums' whole parts are at most a short row's length (32 bits).
template <int kLanes>
__device__ __forceinline__ GapSum group_sum(GapSum S) {
#pragma unroll
  for (int d = kLanes / 2; d > 0; d >>= 1)
    S.merge(LaneGroup<kLanes>::exchange(static_cast<uint32_t>(S.whole), d), LaneGroup<kLanes>::exchange(S.frac, d));
  return S;
}

// A gap term e^{d/t} (d <= 0) added to a GapSum. fp64 rows: GapExp's exponential, to
// 2^-64. 16/32-bit rows: d and d log2(e)/t in fp32 and exp2f (<= 2 ulp), each term's relative
// error a few 1e-7 -- the mask's own precision -- at a tenth of the fp64 exponential's cost;
// the term, exact in fp32, enters the fixed point truncated to 2^-64 as an fp64 term does, so
// the sum stays independent of order. For t outside [2^-100, 2^100] fp32 could lose the
// differences (d or log2(e)/t overflows): those rows skip the gap and sort.
struct GapTermF64 {
  GapExp e;
  __device__ explicit GapTermF64(double t) : e(t) {}
  __device__ static bool holds(double) { return true; }
  __device__ void add(GapSum& S, double d) const { S.add(e(d)); }
};
struct GapTermF32 {
  float c;  // log2(e) / t
  __device__ explicit GapTermF32(double t) : c(static_cast<float>(1.4426950408889634 / t)) {}
  __device__ static bool holds(double t) { return t >= 0x1p-100 && t <= 0x1p100; }
  __device__ void add(GapSum& S, float d) const {
    const float e = exp2f(d * c);  // 1 exactly at d = 0
    if (e >= 1.0f) S.whole += 1;
    else S.merge(0, __float2ull_rz(e * 0x1p64f));  // exact scaling, then the fp64 term's truncation
  }
};
template <typename Score>
using GapTerm = std::conditional_t<sizeof(Score) == 4, GapTermF32, GapTermF64>;

// The root in the outer gap of a row held by a lane group, or NaN where it lies among the
// scores (the sort decides). score(q): the lane's q-th signed score as SK::Score (NaN past
// the row); key_min / key_max: the lane's finite keys' extremes (KeyStats); nf: the finite
// scores, kf: their budget (settle_row). The whole group calls; the answer is the group's.
template <typename SK, int kItems, int kLanes, typename Key, typename ScoreAt>
__device__ __forceinline__ double outer_gap_group(const ScoreAt& score, Key key_min, Key key_max, double kf,
                                                  double nf, double t) {
  using Score = typename SK::Score;
  using Term = GapTerm<Score>;
  if (!Term::holds(t)) return NAN;
  const double side = outer_gap_side(kf, nf);
  const bool top = side > 0.0;
  // a lane without finite scores: 0
  const Key best = LaneGroup<kLanes>::max(top ? key_max : static_cast<Key>(~key_min));
  const Score ms = SK::score(top ? best : static_cast<Key>(~best));
  const double m = ms;
  const Term term(t);
  GapSum S{0, 0};
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const Score s = score(q);
    term.add(S, is_finite(s) ? (top ? s - ms : ms - s) : -Score(INFINITY));  // <= 0; a term 0
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
  using Score = typename SK::Score;
  using Term = GapTerm<Score>;
  if (!Term::holds(t)) return NAN;  // uniform: t is the row's
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const double side = outer_gap_side(kf, nf);
  const bool top = side > 0.0;
  const Score ms = SK::score(top ? key_max : key_min);
  const double m = ms;
  const Term term(t);
  GapSum part{0, 0};
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const Score s = SK::score(keys[q]);
    term.add(part, gap_key<Key, SK>(keys[q], top) != 0 ? (top ? s - ms : ms - s) : -Score(INFINITY));
  }
  const GapSum S = group_sum<32>(part);
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
