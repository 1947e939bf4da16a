// Rows already settled: the status predicates with which a dependent launch skips the rows
// it has nothing left to do for (what that rests on is spelled out below).
#pragma once

#include "../../common/cuda_launch.cuh"
#include "params.cuh"

namespace fastlapsum {
namespace {

// After propose the kernels are dependent launches (cuda_launch.cuh): each one's blocks are
// resident while the one before it runs, and wait for it to finish. A row settled early (the
// sorted middle kernel solves most rows up to 2^21; a certified row needs no more digits)
// leaves up to ten of them with nothing to do but read its state after the wait and exit. So
// those kernels read the row's status before the wait as well: a status only moves forward
// (refine -> solve -> done), so a settled status read early is final, and the block exits as
// soon as the wait returns instead of after one more round trip to L2. Only where the sorted
// middle kernel is not launched (`preread`): it pays for rows beyond 2^21, but after the
// sorted kernel it costs more than it saves. (Exiting before the wait is slower: the next
// kernel's blocks are then only launched when these exit; it would also break completion's
// transitivity through the waits.)
// What this rests on, for whoever changes these kernels:
// - no write moves a status back (solve or done -> refine, done -> anything);
// - each kernel does nothing for a row that its predicate below calls settled (the check after
//   its wait `continue`s before any write), so returning early skips nothing;
// - a dependent launch's blocks are resident only after every block of the launch before it
//   has passed its wait, so the launch two back has completed and its state is in L2, which
//   __ldcg reads: the first pre-read must come two launches after the rows' states are
//   written (propose, or level 0 proposing for itself: then level 1 does not pre-read), so
//   that no earlier call's stale state is ever seen.
__device__ inline bool past_refine(int status) { return status != kRefineMiddle && status != kRefineRow; }
__device__ inline bool is_done(int status) { return status == kDone; }

// True in every thread when each row of this block (first, first + stride, ...) is settled;
// read past L1 (a line left by an earlier kernel could be stale).
__device__ inline bool rows_settled_early(const RowState* state, int64_t first, int64_t stride, int64_t rows,
                                          bool (*settled)(int)) {
  bool all = true;
  if (threadIdx.x == 0)
    for (int64_t r = first; r < rows && all; r += stride) all = settled(__ldcg(&state[r].status));
  return __syncthreads_and(all) != 0;
}

// A launch of a CTA a row (rows blockIdx.x, + gridDim.x, ...): body(r, st) in every thread for
// each row whose status `wants`, st the row's state read once after the wait; with preread, a
// block whose rows are all `settled` before the wait ends at it.
template <typename Body>
__device__ inline void for_each_row_cta(const RowState* state, int64_t rows, bool preread, bool (*settled)(int),
                                        bool (*wants)(int), Body body) {
  const bool skip = preread && rows_settled_early(state, blockIdx.x, gridDim.x, rows, settled);
  begin_dependent_grid();
  if (skip) return;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const RowState st = state[r];
    if (wants(st.status)) body(r, st);  // uniform
  }
}
__device__ inline bool refining(int status) { return !past_refine(status); }
__device__ inline bool solving(int status) { return status == kSolveMiddle || status == kSolveRow; }

}  // namespace
}  // namespace fastlapsum
