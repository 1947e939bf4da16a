// The scan after a level (scan_row): folds the level's partials, checks the bracket's
// certificate on the first binned level, and finds the gap or the bin that holds the root. It
// runs in its own launch (scan_kernel) or in a level block of the row once all are done
// (level_kernel's fused instance, at the level block's kLevelThreads): the same fold either
// way, at two block sizes, so the two agree to rounding, not bit for bit.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "../../common/cuda_launch.cuh"
#include "bins.cuh"
#include "last_block.cuh"
#include "settled.cuh"

namespace fastlapsum {
namespace {

__device__ inline RowState fallback_state(RowState st, uint64_t min_key, uint64_t max_key) {
  st.status = kRefineRow;
  st.certify = kCertified;
  st.lo_key = min_key;
  st.hi_key = max_key;
  st.above0 = Tail{0.0, 0.0, INFINITY};
  st.below0 = Tail{0.0, 0.0, -INFINITY};
  st.path = kPathRadix;
  return st;
}

// A row's level partials, folded in a fixed order (the same whichever block folds them, for a
// block of kThreads); every thread gets the total.
template <int kThreads>
__device__ LevelPartial fold_partials(const LevelPartial* __restrict__ p, int chunks,
                                      typename cub::BlockReduce<LevelPartial, kThreads>::TempStorage& tmp,
                                      LevelPartial& s_total) {
  LevelPartial acc{0.0, 0.0, 0.0, 0, 0, 0, 0, 0};
  for (int c = threadIdx.x; c < chunks; c += kThreads) acc = LevelPartialSum{}(acc, load_cg(p + c));
  const LevelPartial total = cub::BlockReduce<LevelPartial, kThreads>(tmp).Reduce(acc, LevelPartialSum{});
  if (threadIdx.x == 0) s_total = total;
  __syncthreads();
  return s_total;
}

// The sums of a row's first pass: a row without an interior root (non-finite scores, k at an
// end) is settled (thread 0 writes its answer) and true returned; else the budget left for the
// finite scores is taken. The same decision in every thread.
__device__ inline bool settle_first_pass(RowState& st, const LevelPartial& total, double k, int64_t n, double sign,
                                         int64_t r, double* __restrict__ b_out, double* __restrict__ edge_out,
                                         int64_t* __restrict__ diag) {
  double b, edge, kf;
  if (!settle_row(k, st.t, static_cast<double>(n), static_cast<double>(total.nan), static_cast<double>(total.pinf),
                  static_cast<double>(total.ninf), &b, &edge, &kf)) {
    st.k = kf;
    return false;
  }
  if (threadIdx.x == 0) {
    b_out[r] = sign * b;
    edge_out[r] = edge;
    diag[3 * r] = kPathDirect;
    diag[3 * r + 1] = 0;
    diag[3 * r + 2] = 0;
  }
  st.status = kDone;
  return true;
}

// The scan's shared memory, for a block of kThreads.
template <int kThreads>
struct ScanStorage {
  union {
    typename cub::BlockReduce<LevelPartial, kThreads>::TempStorage fold;
    typename cub::BlockScan<Atom, kThreads, cub::BLOCK_SCAN_WARP_SCANS>::TempStorage scan;  // raking would need 40 KB
    typename cub::BlockScan<FlatBelow, kThreads, cub::BLOCK_SCAN_WARP_SCANS>::TempStorage below;
    typename cub::BlockScan<FlatAbove, kThreads, cub::BLOCK_SCAN_WARP_SCANS>::TempStorage above;
    typename cub::BlockReduce<int, kThreads>::TempStorage min;
  } tmp;
  union Groups {
    Atom atom[kThreads];
    FlatAbove flat[kThreads];
  };
  Groups group, above;
  LevelPartial total;
  double gap_lo, gap_hi, psi_top, psi_bottom;
  int inside, owner;
  // The owner's walk over its bins base .. base + bins - 1 (highest first): the bin that holds
  // the root, or the gap.
  template <typename Hit>
  __device__ void record(const Hit& hit, int base, int bins) {
    if (hit.inside >= 0) {
      inside = base + bins - 1 - static_cast<int>(hit.inside);
    } else {
      gap_lo = hit.lo;
      gap_hi = hit.above.ref;
    }
  }
};

// The scan of row r (still refining) over its bins h and its level's `chunks` partials;
// writes the row's next state and zeroes the bins for the next level. Every thread of the
// block calls it. The row's state: *read where the caller has read it after its wait
// (scan_kernel: for_each_row_cta's copy, one load of it), else state[r]. Not inlined, and the
// level kernel's scan reads the state here: its tile loop spills more with either the scan
// inlined or the state kept live across the loop.
template <typename scalar_t, int kThreads>
__device__ __noinline__ void scan_row(ScanStorage<kThreads>& sm, int64_t r, RowState* __restrict__ state,
                                      BinSums* __restrict__ h, const LevelPartial* __restrict__ partial, int chunks,
                                      const double* __restrict__ k_in, double* __restrict__ b_out,
                                      double* __restrict__ edge_out, int64_t* __restrict__ diag, int64_t n, double sign,
                                      const RowState* read = nullptr) {
  using KT = KeyTraits<scalar_t>;
  using Key = typename KT::Key;
  using AtomScan = cub::BlockScan<Atom, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  using BelowScan = cub::BlockScan<FlatBelow, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  using AboveScan = cub::BlockScan<FlatAbove, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  using MinIndex = cub::BlockReduce<int, kThreads>;
  constexpr int kBinsPer = kBins / kThreads;  // consecutive bins per thread
  RowState st = *(read != nullptr ? read : state + r);
  const LevelPartial total = fold_partials<kThreads>(partial, chunks, sm.tmp.fold, sm.total);
  const double t = st.t;
  const uint64_t lo = st.lo_key, hi = st.hi_key;
  bool finished = false;  // uniform: every thread decides the same
  if (st.certify != kCertified) {
    if (settle_first_pass(st, total, k_in[r], n, sign, r, b_out, edge_out, diag)) {
      finished = true;
    } else {
      st.middle = static_cast<int64_t>(total.middle);
      if (st.status == kRefineMiddle && total.overflow) {
        st = fallback_state(st, KT::min_key(), KT::max_key());
        finished = true;
      }
    }
  }
  if (!finished) {
    const double a_hi = KT::value(Key(hi)), a_lo = KT::value(Key(lo));
    Tail above{total.above_count, total.above_sum, a_hi}, below{0.0, total.below_sum, a_lo};
    if (st.status == kRefineMiddle && st.certify == kCertified) {  // add the scores outside the bracket
      if (st.above0.count > 0.0) {
        above.count += st.above0.count;
        above.sum += st.above0.sum * exp((a_hi - st.above0.ref) / t);
      }
      if (st.below0.sum > 0.0) below.sum += st.below0.sum * exp((st.below0.ref - a_lo) / t);
    }
    if (st.certify != kCertified) {
      st.above0 = above;
      st.below0 = below;
    }
    const int shift = bin_shift(lo, hi);
    const double inv_t = inv_temperature(t), k = st.k;
    // flat: the lower tail's sum must stay normal against a_hi (a sum below 1e-60, rare,
    // still decides Psi when k is that small)
    const FlatFrame f{a_lo, a_hi, inv_t};
    const bool flat_bins = flat_range(a_lo, a_hi, inv_t);
    if (flat_bins && !(below.sum > 0.0 && below.sum < 1e-60)) {  // uniform
      const double drop = exp((a_lo - a_hi) * inv_t);  // the tails' sums against the far end
      const FlatAtom none{0.0, 0.0, 0.0, INFINITY, -INFINITY};
      const double above_tail_u = above.sum * drop, below_tail_l = below.sum * drop;
      // The same scan as the atom path below, with sums in place of merges.
      const int j = static_cast<int>(threadIdx.x), base = kBinsPer * j;
      const auto edge_lo = [&](int bin) { return KT::value(Key(bin_keys(lo, hi, shift, bin).first)); };
      const auto edge_hi = [&](int bin) { return KT::value(Key(bin_keys(lo, hi, shift, bin).last)); };
      FlatAtom group = none;
      int top_bin = -1, bottom_bin = kBins;  // the group's highest / lowest nonempty bin
      for (int q = 0; q < kBinsPer; ++q) {
        const FlatAtom a = flat_bin<KT>(load_cg(h + base + q), lo, hi, shift, base + q);
        group = FlatMerge{}(group, a);
        if (a.count > 0.0) {
          top_bin = base + q;
          bottom_bin = bottom_bin < kBins ? bottom_bin : base + q;
        }
      }
      sm.group.flat[j] = FlatAbove{group.count, group.u, bottom_bin};
      FlatBelow below_g;
      FlatAbove above_r;
      BelowScan(sm.tmp.below).ExclusiveScan(FlatBelow{group.l, top_bin}, below_g, FlatBelow{below_tail_l, -1},
                                         FlatBelowMerge{});
      __syncthreads();  // s_group; tmp reused
      AboveScan(sm.tmp.above).ExclusiveScan(sm.group.flat[kThreads - 1 - j], above_r,
                                         FlatAbove{above.count, above_tail_u, kBins}, FlatAboveMerge{});
      sm.above.flat[kThreads - 1 - j] = above_r;
      if (j == kThreads - 1) sm.psi_top = f.psi(above.count, above_tail_u, below_g.l + group.l, a_hi);
      __syncthreads();  // s_above; tmp -> sm.tmp.min
      const FlatAbove above_g = sm.above.flat[j];
      const double above_lo = above_g.bottom < kBins ? edge_lo(above_g.bottom) : INFINITY;
      const bool holds = group.count > 0.0 &&
                         f.psi(above_g.count + group.count, above_g.u + group.u, below_g.l, group.lo) >= k;
      const int low = MinIndex(sm.tmp.min).Reduce(holds ? kThreads - 1 - j : kThreads, MinInt{});
      if (j == 0) {
        sm.owner = kThreads - 1 - low;  // -1: the root lies below every bin
        sm.inside = kBins;
        sm.gap_lo = below.ref;
        sm.gap_hi = fmin(fmin(above_lo, group.lo), a_hi);
        sm.psi_bottom = f.psi(above_g.count + group.count, above_g.u + group.u, below_tail_l, a_lo);
      }
      __syncthreads();
      if (j == sm.owner) {
        // atom_scan.h's walk over the group's bins, highest first (w = 0 is bin base + kBinsPer - 1).
        FlatAtom a[kBinsPer];
        double below_l[kBinsPer + 1];  // below_l[w]: the l sums of bin w and every score below it
        below_l[kBinsPer] = below_g.l;
#pragma unroll
        for (int w = kBinsPer - 1; w >= 0; --w) {
          const int bin = base + kBinsPer - 1 - w;
          a[w] = flat_bin<KT>(load_cg(h + bin), lo, hi, shift, bin);
          below_l[w] = below_l[w + 1] + a[w].l;
        }
        const GapHit<FlatTail> hit =
            walk_gaps(f, [&](int64_t w) { return a[w]; }, [&](int64_t w) { return below_l[w]; }, kBinsPer,
                      FlatTail{above_g.count, above_g.u, fmin(above_lo, a_hi)},
                      below_g.top >= 0 ? edge_hi(below_g.top) : below.ref, k);
        sm.record(hit, base, kBinsPer);
      }
      __syncthreads();
    } else {
      const AtomMerge merge{inv_t};
      const Atom none{0, 0, 0, 0, 0};
      const Atom above_atom = above.count > 0.0 ? Atom{above.ref, above.ref, above.count, above.sum, 0.0} : none;
      const Atom below_atom = below.sum > 0.0 ? Atom{below.ref, below.ref, 1.0, 0.0, below.sum} : none;
      // Thread j owns bins [kBinsPer j, kBinsPer (j + 1)) as one group atom; two block scans
      // give each group the atoms below it (after the lower tail) and above it (after the
      // upper tail). Psi decreases: the highest group whose lowest edge has Psi >= k holds
      // the root (inside one of its bins, or in the gap above one) and only its owner walks
      // its bins, so that most threads fold their bins once (exponentials are the cost).
      const int j = static_cast<int>(threadIdx.x), base = kBinsPer * j;
      Atom group = none;
      for (int q = 0; q < kBinsPer; ++q) group = merge(group, bin_atom<KT>(load_cg(h + base + q), lo, hi, shift, base + q, flat_bins, f));
      sm.group.atom[j] = group;
      Atom below_g, above_r;
      AtomScan(sm.tmp.scan).ExclusiveScan(group, below_g, below_atom, merge);
      __syncthreads();  // s_group; sm.tmp.scan reused
      AtomScan(sm.tmp.scan).ExclusiveScan(sm.group.atom[kThreads - 1 - j], above_r, above_atom, merge);
      sm.above.atom[kThreads - 1 - j] = above_r;  // the upper tail and the groups above that one
      if (j == kThreads - 1) {  // Psi at the range top: the upper tail above, everything else below
        const Atom sa = merge(below_g, group);
        sm.psi_top = psi_at_hi(above.count, above.sum, sa.count > 0.0 ? sa.L : 0.0, above.ref,
                              sa.count > 0.0 ? sa.hi : -INFINITY, t);
      }
      __syncthreads();  // s_above; sm.tmp.scan -> sm.tmp.min
      const Atom above_g = sm.above.atom[j];
      const Atom pa = merge(above_g, group);  // pa.lo is the group's lower edge; in thread 0, all atoms
      bool holds = false;  // Psi at the group's lower edge, its scores above that edge
      if (group.count > 0.0) {
        const bool lower = below_g.count > 0.0;
        holds = psi_at_hi(pa.count, pa.U, lower ? below_g.L : 0.0, pa.lo, lower ? below_g.hi : -INFINITY, t) >= k;
      }
      const int low = MinIndex(sm.tmp.min).Reduce(holds ? kThreads - 1 - j : kThreads, MinInt{});
      if (j == 0) {
        sm.owner = kThreads - 1 - low;  // -1: the root lies below every bin
        sm.inside = kBins;
        sm.gap_lo = below.ref;
        sm.gap_hi = pa.count > 0.0 ? pa.lo : above.ref;
        sm.psi_bottom = psi_at_lo(pa.count, pa.count > 0.0 ? pa.U : 0.0, below.sum, pa.count > 0.0 ? pa.lo : INFINITY,
                                 below.ref, t);
      }
      __syncthreads();
      if (j == sm.owner) {
        // atom_scan.h's find_gap over the group's bins, highest first, between the atoms above
        // and below the group.
        const auto bin_at = [&](int64_t w) {
          const int bin = base + kBinsPer - 1 - static_cast<int>(w);
          return bin_atom<KT>(load_cg(h + bin), lo, hi, shift, bin, flat_bins, f);
        };
        const bool upper = above_g.count > 0.0, lower = below_g.count > 0.0;
        double suffix_B[kBinsPer + 1];
        const GapHit<Tail> hit =
            find_gap(bin_at, kBinsPer, Tail{above_g.count, upper ? above_g.U : 0.0, upper ? above_g.lo : above.ref},
                     Tail{0.0, lower ? below_g.L : 0.0, lower ? below_g.hi : below.ref}, k, t, suffix_B);
        sm.record(hit, base, kBinsPer);
      }
      __syncthreads();
    }
    const double psi_top = sm.psi_top, psi_bottom = sm.psi_bottom;
    if (st.certify != kCertified && st.status == kRefineMiddle && !(psi_top <= k && psi_bottom >= k)) {
      st = fallback_state(st, KT::min_key(), KT::max_key());  // the sample missed: exact fallback
    } else if (sm.inside < kBins) {
      const BinKeys refine = bin_keys(lo, hi, shift, sm.inside);
      st.lo_key = refine.first;
      st.hi_key = refine.last;
    } else {
      st.gap_lo = sm.gap_lo;
      st.gap_hi = sm.gap_hi;
      st.status = st.status == kRefineMiddle ? kSolveMiddle : kSolveRow;
    }
    st.certify = kCertified;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < kBins; j += kThreads) h[j] = BinSums{0, 0.0, 0.0};
  if (threadIdx.x == 0) state[r] = st;
  __syncthreads();
}

template <typename scalar_t>
__global__ void __launch_bounds__(kScanThreads)
scan_kernel(RowState* __restrict__ state, BinSums* __restrict__ hist, const LevelPartial* __restrict__ partial,
            int chunks, const double* __restrict__ k_in, double* __restrict__ b_out, double* __restrict__ edge_out,
            int64_t* __restrict__ diag, int64_t rows, int64_t n, double sign, bool preread) {
  __shared__ ScanStorage<kScanThreads> sm;
  for_each_row_cta(state, rows, preread, past_refine, refining, [&](int64_t r, const RowState& st) {
    scan_row<scalar_t, kScanThreads>(sm, r, state, hist + r * kBins, partial + r * chunks, chunks, k_in, b_out,
                                     edge_out, diag, n, sign, &st);
  });
}

}  // namespace
}  // namespace fastlapsum
