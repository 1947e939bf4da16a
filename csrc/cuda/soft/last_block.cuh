// "Last block done" (the CUDA threadFenceReduction pattern): the blocks of a row each add
// their share to global memory and arrive at the row's counter; the block that arrives last
// sees every share and runs the row's next phase (a level's scan, the sides' solve) in the same
// launch. No block waits for another, so the grid need not be resident at once.
#pragma once

#include <cstring>

namespace fastlapsum {
namespace {

// True in every thread of the block that arrives last of `target` at *counter. Every thread's
// writes before the call (stores or atomics) are visible to that block's loads after it
// (cooperative groups' grid barrier makes the same arrival: a barrier, then one thread's fence
// and atomic). The last block puts the counter back to 0 for the next launch that counts on it:
// every block of this one has arrived, and that launch waits for this one to finish.
__device__ inline bool last_arrival(unsigned* counter, unsigned target, int& s_last) {
  __syncthreads();  // every thread's writes before thread 0's fence
  if (threadIdx.x == 0) {
    __threadfence();  // this block's writes before its arrival
    const bool last = atomicAdd(counter, 1u) == target - 1;
    if (last) {
      atomicExch(counter, 0u);
      __threadfence();  // the other blocks' writes (ordered before their arrivals) before this block's reads
    }
    s_last = last;
  }
  __syncthreads();
  return s_last != 0;
}

// The same in two steps, for a kernel that runs the next phase after its row loop (a call
// inside the level kernel's row loop makes its tile loop spill): arrive() after the block's
// writes for the row, and later, after all its arrivals, claim() in every thread: true in the
// one block that claims the row once all `target` blocks have arrived (then the counter is 0
// again). The last block to arrive claims it, unless a block of the row that finished earlier
// comes to its claim after that arrival and takes it first.
__device__ inline void arrive(unsigned* counter) {
  __syncthreads();  // every thread's writes before thread 0's fence
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
  }
}
__device__ inline bool claim(unsigned* counter, unsigned target, int& s_claim) {
  __syncthreads();  // s_claim's last readers are done
  if (threadIdx.x == 0) {
    const bool claimed = atomicCAS(counter, target, 0u) == target;
    if (claimed) __threadfence();  // as last_arrival's
    s_claim = claimed;
  }
  __syncthreads();
  return s_claim != 0;
}

// A load of a value other blocks of this launch wrote, from L2: never the read-only path that
// const __restrict__ may select (not coherent within a launch), nor a stale L1 line.
template <typename T>
__device__ __forceinline__ T load_cg(const T* p) {
  static_assert(sizeof(T) % 8 == 0 && alignof(T) >= 8, "8-byte words");
  unsigned long long w[sizeof(T) / 8];
#pragma unroll
  for (int i = 0; i < int(sizeof(T) / 8); ++i) w[i] = __ldcg(reinterpret_cast<const unsigned long long*>(p) + i);
  T v;
  memcpy(&v, w, sizeof(T));
  return v;
}

}  // namespace
}  // namespace fastlapsum
