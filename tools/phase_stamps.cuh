// Experiment aid (not part of the build): clock64 stamps of block (0, 0)'s thread 0 at a
// kernel's phase boundaries, printed (device printf) as cycles since stamp 0 at the kernel's
// end. To use: #include "../../tools/phase_stamps.cuh" in a kernel's .cu, put FLS_STAMP(i)
// after the barriers that end its phases (i < 24, stamp 0 first), FLS_STAMP_PRINT("name",
// count) at its end, and build with NVCC_APPEND_FLAGS=-DFASTLAPSUM_PHASE_STAMPS; run eager
// with FASTLAPSUM_DEPENDENT_LAUNCH=0. Without the flag the macros are empty. Session 22's
// stamps (experiments_session22_h200.txt) were taken this way; each .cu has its own array.
#pragma once
#ifdef FASTLAPSUM_PHASE_STAMPS
#include <cstdio>
static __device__ long long g_phase_stamps[24];
#define FLS_STAMP(i)                                                                   \
  do {                                                                                 \
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0) g_phase_stamps[i] = clock64(); \
  } while (0)
#define FLS_STAMP_PRINT(name, count)                                                   \
  do {                                                                                 \
    if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0) {                      \
      printf("STAMPS %s", name);                                                       \
      for (int i_ = 1; i_ < (count); ++i_) printf(" %lld", g_phase_stamps[i_] - g_phase_stamps[0]); \
      printf("\n");                                                                    \
      for (int i_ = 0; i_ < 24; ++i_) g_phase_stamps[i_] = 0;                           \
    }                                                                                  \
  } while (0)
#else
#define FLS_STAMP(i) \
  do {               \
  } while (0)
#define FLS_STAMP_PRINT(name, count) \
  do {                               \
  } while (0)
#endif
