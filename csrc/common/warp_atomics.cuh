// Shared-memory atomics aggregated over the converged lanes of a warp. Radix histograms of
// real scores are skewed (the top 11 bits of Gaussian scores fall in a handful of bins, and
// so do the candidates above a threshold): one atomic per lane would serialise on those
// bins. Safe in divergent code (the groups are the lanes that are active together).
#pragma once

#include <cooperative_groups.h>

namespace fastlapsum {

// hist[bin] += 1 for every calling lane, one atomic per group of lanes with the same bin.
__device__ __forceinline__ void hist_inc(unsigned* hist, unsigned bin) {
  namespace cg = cooperative_groups;
  const cg::coalesced_group same = cg::labeled_partition(cg::coalesced_threads(), bin);
  if (same.thread_rank() == 0) atomicAdd(&hist[bin], same.size());
}

// A distinct slot from the shared counter for every calling lane, one atomic per warp.
__device__ __forceinline__ unsigned slot_inc(unsigned* counter) {
  namespace cg = cooperative_groups;
  const cg::coalesced_group g = cg::coalesced_threads();
  unsigned first = 0;
  if (g.thread_rank() == 0) first = atomicAdd(counter, g.size());
  return g.shfl(first, 0) + g.thread_rank();
}

}  // namespace fastlapsum
