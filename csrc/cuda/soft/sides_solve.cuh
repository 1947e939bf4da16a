// The last two phases: the sums on each side of the root's final gap (sides_kernel) and
// their fold into the root (solve_row: in its own launch, solve_kernel, or in the sides
// kernel's last block of the row when kSolve).
#pragma once

#include "../../common/cuda_launch.cuh"
#include "bins.cuh"
#include "last_block.cuh"
#include "settled.cuh"

namespace fastlapsum {
namespace {

// A gathered middle set whose bracket spans at most kFlatSpan temperatures: every term
// against the gap's ends is normal, so the sides are plain sums (one exponential per score)
// and the nearest scores, summed in a fixed order; the solve rescales them once.
__device__ inline bool flat_sides(const RowState& st, double inv_t) {
  return st.status == kSolveMiddle && is_finite(st.gap_lo) && is_finite(st.gap_hi) &&
         (st.above0.ref - st.below0.ref) * inv_t <= kFlatSpan;
}

// A block's reduction scratch (a value per warp): the sides' and the solve's.
template <int kThreads>
union SidesScratch {
  GapSides atoms[kThreads / 32];
  FlatSides flat[kThreads / 32];
};

// The solve of row r (its gap found): its `parts` sides partials folded in a fixed order,
// rescaled to the nearest scores and solved; writes b, edge, diag and the state (done). Every
// thread of the block calls it. The row's state as scan_row's: *read, else state[r].
template <int kThreads>
__device__ __noinline__ void solve_row(SidesScratch<kThreads>& scratch, int64_t r, RowState* __restrict__ state,
                                       const SidesPartial* __restrict__ partial, int parts, double* __restrict__ b_out,
                                       double* __restrict__ edge_out, int64_t* __restrict__ diag, double sign,
                                       const RowState* read = nullptr) {
  RowState st = *(read != nullptr ? read : state + r);
  const Atom none{0, 0, 0, 0, 0};
  const double inv_t = inv_temperature(st.t);
  GapSides g{none, none};
  if (flat_sides(st, inv_t)) {  // uniform
    FlatSides acc{0.0, 0.0, INFINITY, 0.0, 0.0, -INFINITY};
    for (int c = threadIdx.x; c < parts; c += kThreads) acc = FlatSidesSum{}(acc, load_cg(partial + c).flat);
    const FlatSides f = tree_reduce<kThreads>(acc, FlatSidesSum{}, scratch.flat);
    // e^{(gap_hi - s)/t} = e^{(gap_hi - min)/t} e^{(min - s)/t}: the nearest score's term is 1
    if (f.above_count > 0.0)
      g.above = Atom{f.above_min, f.above_min, f.above_count, f.above_u * exp((f.above_min - st.gap_hi) * inv_t), 0.0};
    if (f.below_count > 0.0)
      g.below = Atom{f.below_max, f.below_max, f.below_count, 0.0, f.below_l * exp((st.gap_lo - f.below_max) * inv_t)};
  } else {
    const GapMerge merge{inv_t};
    GapSides acc{none, none};
    for (int c = threadIdx.x; c < parts; c += kThreads) acc = merge(acc, load_cg(partial + c).atoms);
    g = tree_reduce<kThreads>(acc, merge, scratch.atoms);
  }
  if (threadIdx.x == 0) {
    if (st.status == kSolveMiddle) {  // the scores outside the bracket
      if (st.above0.count > 0.0)
        atom_merge(g.above, Atom{st.above0.ref, st.above0.ref, st.above0.count, st.above0.sum, 0.0}, inv_t);
      if (st.below0.sum > 0.0) atom_merge(g.below, Atom{st.below0.ref, st.below0.ref, 1.0, 0.0, st.below0.sum}, inv_t);
    }
    const double hi = g.above.count > 0.0 ? g.above.lo : INFINITY;
    const double lo = g.below.count > 0.0 ? g.below.hi : -INFINITY;
    b_out[r] = sign * solve_interval(g.above.count, g.above.U, g.below.L, hi, lo, st.k, st.t);
    edge_out[r] = 1.0;
    diag[3 * r] = st.path;
    diag[3 * r + 1] = st.middle;
    diag[3 * r + 2] = st.attempts;
    st.status = kDone;
    state[r] = st;
  }
  __syncthreads();
}

// Grid: [sides blocks, rows]; block j covers the middle slices (or row tiles) j, j + gridDim.x, ...
// Fewer blocks than the level passes: for atom rows (not flat_sides) the merges of the block
// reductions cost exps. kSolve: the row's last block to finish solves it (last_block.cuh;
// `arrivals`, a counter a row, zero before and after).
template <typename scalar_t, bool kSolve>
__global__ void __launch_bounds__(kLevelThreads)
sides_kernel(const scalar_t* __restrict__ x, RowState* __restrict__ state, const double* __restrict__ middle,
             const unsigned* __restrict__ slice_count, int64_t cap, int chunks, SidesPartial* __restrict__ partial,
             unsigned* __restrict__ arrivals, double* __restrict__ b_out, double* __restrict__ edge_out,
             int64_t* __restrict__ diag, int64_t rows, int64_t n, double sign, bool preread) {
  const bool settled = preread && rows_settled_early(state, blockIdx.y, gridDim.y, rows, is_done);
  begin_dependent_grid();
  if (settled) return;
  constexpr int V = vec_width<scalar_t>();
  __shared__ SidesScratch<kLevelThreads> scratch;
  __shared__ unsigned s_count[kMaxSidesSlices];
  __shared__ int s_last;
  const Atom none{0, 0, 0, 0, 0};
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const RowState st = state[r];
    if (st.status != kSolveMiddle && st.status != kSolveRow) continue;  // uniform
    const double inv_t = inv_temperature(st.t);
    const bool flat = flat_sides(st, inv_t);  // uniform
    GapSides acc{none, none};
    FlatSides fa{0.0, 0.0, INFINITY, 0.0, 0.0, -INFINITY};
    const auto add = [&](double s) {
      if (!is_finite(s)) return;
      if (flat) {
        if (s >= st.gap_hi) {
          fa.above_count += 1.0;
          fa.above_u += exp((st.gap_hi - s) * inv_t);
          fa.above_min = fmin(fa.above_min, s);
        } else if (s <= st.gap_lo) {
          fa.below_count += 1.0;
          fa.below_l += exp((s - st.gap_lo) * inv_t);
          fa.below_max = fmax(fa.below_max, s);
        }
      } else if (s >= st.gap_hi) {
        atom_add(acc.above, s, inv_t);
      } else if (s <= st.gap_lo) {
        atom_add(acc.below, s, inv_t);
      }
    };
    if (st.status == kSolveRow) {
      const scalar_t* xr = x + r * n;
      const bool aligned = is_aligned16(xr);
      const int64_t tile = int64_t(kLevelThreads) * V;
      for (int64_t tl = blockIdx.x; tl * tile < n; tl += gridDim.x) {
        double v[V];
        const int valid = load_vec<scalar_t, V>(xr, n, tl * tile + int64_t(threadIdx.x) * V, aligned, v);
        for (int q = 0; q < valid; ++q) add(sign * v[q]);
      }
    } else {
      // The block's slices as one flat range (their counts first), several loads in
      // flight per thread: slice by slice, each small slice would cost a round trip.
      const int slices = (chunks - static_cast<int>(blockIdx.x) + gridDim.x - 1) / gridDim.x;  // <= kMaxSidesSlices
      if (threadIdx.x < slices) s_count[threadIdx.x] = slice_count[r * chunks + blockIdx.x + threadIdx.x * gridDim.x];
      __syncthreads();
      unsigned total_count = 0;
      for (int q = 0; q < slices; ++q) total_count += s_count[q];
      constexpr int kBatch = 4;
      for (unsigned j0 = threadIdx.x; j0 < total_count; j0 += kBatch * blockDim.x) {
        double v[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          unsigned j = j0 + b * blockDim.x;
          if (j >= total_count) continue;
          int q = 0;
          while (j >= s_count[q]) j -= s_count[q++];
          v[b] = middle[(r * chunks + blockIdx.x + int64_t(q) * gridDim.x) * cap + j];
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          if (j0 + b * blockDim.x < total_count) add(v[b]);
      }
    }
    if (flat) {
      const FlatSides f = tree_reduce<kLevelThreads>(fa, FlatSidesSum{}, scratch.flat);
      if (threadIdx.x == 0) partial[r * gridDim.x + blockIdx.x].flat = f;
    } else {
      const GapSides total = tree_reduce<kLevelThreads>(acc, GapMerge{inv_t}, scratch.atoms);
      if (threadIdx.x == 0) partial[r * gridDim.x + blockIdx.x].atoms = total;
    }
    if constexpr (kSolve) {  // every block of the row gets here (the status test above is the row's)
      if (last_arrival(arrivals + r, gridDim.x, s_last))
        solve_row<kLevelThreads>(scratch, r, state, partial + r * gridDim.x, gridDim.x, b_out, edge_out, diag, sign);
    } else {
      __syncthreads();
    }
  }
}

__global__ void __launch_bounds__(kSolveThreads)
solve_kernel(RowState* __restrict__ state, const SidesPartial* __restrict__ partial, int parts,
             double* __restrict__ b_out, double* __restrict__ edge_out, int64_t* __restrict__ diag, int64_t rows,
             double sign, bool preread) {
  __shared__ SidesScratch<kSolveThreads> scratch;
  for_each_row_cta(state, rows, preread, is_done, solving, [&](int64_t r, const RowState& st) {
    solve_row<kSolveThreads>(scratch, r, state, partial + r * parts, parts, b_out, edge_out, diag, sign, &st);
  });
}

}  // namespace
}  // namespace fastlapsum
