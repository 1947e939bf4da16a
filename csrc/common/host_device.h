// FLS_HD: a function compiled for host and device (inline on the host-only build).
#pragma once

#if defined(__CUDACC__)
#define FLS_HD __host__ __device__ __forceinline__
#else
#define FLS_HD inline
#endif
