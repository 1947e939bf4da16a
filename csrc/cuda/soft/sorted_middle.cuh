// The sorted middle set (sorted_middle_kernel): one CTA per row sorts a gathered middle
// set that fits it and solves the row with the on-chip sort solver (sorted_solve.cuh).
#pragma once

#include "bin_scan.cuh"
#include "sorted_solve.cuh"

namespace fastlapsum {
namespace {

// Loads a gathered middle set of m <= kSortedThreads * kItems scores (striped: position
// q * kSortedThreads + tid, from slice `map[position]`), sorts it and solves the row with the
// tails. Every thread gets b.
template <typename scalar_t, int kItems, typename Key = typename SortKey<scalar_t>::Key>
__device__ __forceinline__ double solve_middle_set(SortStorage<Key, kItems>& sort,
                                                   SolveStorage& solve, CensusStorage<Key>& census,
                                                   double (&last_v)[kWarps], const uint16_t* map,
                                                   const unsigned* s_start, const double* __restrict__ middle,
                                                   int64_t cap, unsigned m, const RowState& st,
                                                   const SortedTails& tails) {
  using SK = SortKey<scalar_t>;
  Key keys[kItems];
  KeyStats<Key> stats;
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const unsigned i = q * kSortedThreads + threadIdx.x;
    if (i >= m) continue;
    const unsigned c = map[i];
    keys[q] = SK::key(middle[c * cap + (i - s_start[c])]);
    stats.add(keys[q]);
  }
  // take_census's barrier ends the map's use: the sort's storage may alias it.
  sort_descending<Key, SK, kItems>(sort, keys, m, take_census(census, 0, 0, 0, stats));
  return solve_sorted<Key, SK, kItems>(solve, last_v, keys, 0, static_cast<int>(m), st.k, st.t, tails);
}

// A bracketed row whose gathered middle set fits one CTA (up to kSortedMaxItems scores a
// thread), straight after the gathering pass: the set is sorted on chip and solved with the
// scores outside the bracket as its tails (sorted_solve.cuh); the root certifies the bracket
// when it lies inside it (Psi(a_hi) <= k <= Psi(a_lo)), else the row goes to the exact
// fallback. The row is then done and the binning levels skip it: they replace a chain of ~10
// launches (bin, scan, bin, scan, sides, solve) by one. A larger set is left to them. The
// sort takes the fewest items a thread that hold the set (padding costs every sort pass).
// fp32, fp16 and bf16 rows (32-bit keys).
template <typename scalar_t>
__global__ void __launch_bounds__(kSortedThreads, 1)
sorted_middle_kernel(RowState* __restrict__ state, const LevelPartial* __restrict__ partial, int chunks,
                     const double* __restrict__ middle, const unsigned* __restrict__ slice_count, int64_t cap,
                     const double* __restrict__ k_in, double* __restrict__ b_out, double* __restrict__ edge_out,
                     int64_t* __restrict__ diag, int64_t rows, int64_t n, double sign) {
  begin_dependent_grid();
  using KT = KeyTraits<scalar_t>;
  using Key = typename SortKey<scalar_t>::Key;
  static_assert(sizeof(Key) == 4 && 32 * kSortedMaxItems < 1024, "32-bit keys; take_census packs 10 bits a warp");
  constexpr unsigned kCapacity = kSortedThreads * kSortedMaxItems;
  static_assert(kMaxChunks <= 65536, "slice numbers are 16-bit");
  constexpr int kSlices = (kMaxChunks + kSortedThreads - 1) / kSortedThreads;  // slice counts per thread
  using Offsets = cub::BlockScan<unsigned, kSortedThreads>;
  __shared__ union {
    typename cub::BlockReduce<LevelPartial, kSortedThreads>::TempStorage fold;
    typename Offsets::TempStorage offsets;
    uint16_t map[kCapacity];  // each position's slice: after the offsets, before the sort
    SortStorage<Key, kSortedMaxItems / 4> sort4;
    SortStorage<Key, kSortedMaxItems / 2> sort8;
    SortStorage<Key, kSortedMaxItems> sort16;
    SolveStorage solve;  // after the sort
  } sm;
  __shared__ CensusStorage<Key> census;
  __shared__ double last_v[kWarps];
  __shared__ LevelPartial s_total;
  __shared__ unsigned s_start[kMaxChunks];  // each slice's first position in the set
  const int tid = threadIdx.x;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    // The state, the partials and the slices' sizes in one round trip: level 0 wrote them for
    // every row of a bracketed launch, so they are read before the state says whether to.
    RowState st = state[r];
    const double k = k_in[r];
    unsigned count[kSlices], start[kSlices], m;
#pragma unroll
    for (int q = 0; q < kSlices; ++q) {
      const int c = tid * kSlices + q;
      count[q] = c < chunks ? slice_count[r * chunks + c] : 0u;
    }
    const LevelPartial total = fold_partials<kSortedThreads>(partial + r * chunks, chunks, sm.fold, s_total);
    if (st.status != kRefineMiddle || st.certify != kCertifyRow) continue;  // uniform
    // Where each slice's scores go in the set (fold_partials ended with a barrier).
    Offsets(sm.offsets).ExclusiveSum(count, start, m);
#pragma unroll
    for (int q = 0; q < kSlices; ++q)
      if (tid * kSlices + q < chunks) s_start[tid * kSlices + q] = start[q];
    __syncthreads();
    // Every decision below is the same in every thread.
    if (settle_first_pass(st, total, k, n, sign, r, b_out, edge_out, diag)) {
      // settled
    } else if (total.overflow) {
      st = fallback_state(st, KT::min_key(), KT::max_key());
    } else if (m > kCapacity) {
      continue;  // the binning levels take the row
    } else {
      const double a_hi = KT::value(static_cast<typename KT::Key>(st.hi_key));
      const double a_lo = KT::value(static_cast<typename KT::Key>(st.lo_key));
      const SortedTails tails{total.above_count, total.above_sum, a_hi, total.below_sum, a_lo};
      double b;
      if (m == 0) {
        b = solve_interval(tails.above_count, tails.above_sum, tails.below_sum, tails.above_count > 0.0 ? a_hi : INFINITY,
                           tails.below_sum > 0.0 ? a_lo : -INFINITY, st.k, st.t);
      } else {
        // Each position's slice, a warp per slice (the offsets' storage is free after the barrier above).
        for (int c = tid / 32; c < chunks; c += kWarps) {
          const unsigned e = c + 1 < chunks ? s_start[c + 1] : m;
          for (unsigned i = s_start[c] + tid % 32; i < e; i += 32) sm.map[i] = static_cast<uint16_t>(c);
        }
        __syncthreads();
        const double* mr = middle + r * chunks * cap;
        if (m <= kCapacity / 4)
          b = solve_middle_set<scalar_t, kSortedMaxItems / 4>(sm.sort4, sm.solve, census, last_v, sm.map,
                                                              s_start, mr, cap, m, st, tails);
        else if (m <= kCapacity / 2)
          b = solve_middle_set<scalar_t, kSortedMaxItems / 2>(sm.sort8, sm.solve, census, last_v, sm.map,
                                                              s_start, mr, cap, m, st, tails);
        else
          b = solve_middle_set<scalar_t, kSortedMaxItems>(sm.sort16, sm.solve, census, last_v, sm.map, s_start,
                                                          mr, cap, m, st, tails);
      }
      if (b >= a_lo && b <= a_hi) {  // certified (a NaN fails too)
        if (tid == 0) {
          b_out[r] = sign * b;
          edge_out[r] = 1.0;
          diag[3 * r] = st.path;
          diag[3 * r + 1] = m;
          diag[3 * r + 2] = st.attempts;
        }
        st.status = kDone;
      } else {
        st = fallback_state(st, KT::min_key(), KT::max_key());
      }
    }
    if (tid == 0) state[r] = st;
    __syncthreads();
  }
}

// The sorted middle-set kernel for scalar_t's rows, or none: fp64 rows (64-bit keys) take the
// binning levels. (A function template, so that the fp64 kernel is never named.)
template <typename scalar_t>
constexpr auto sorted_middle_for() -> decltype(&sorted_middle_kernel<float>) {
  if constexpr (sizeof(scalar_t) > 4) return nullptr;
  else return &sorted_middle_kernel<scalar_t>;
}

}  // namespace
}  // namespace fastlapsum
