// Launch helpers for the CUDA kernels: grid shapes bounded independently of the data.
#pragma once

// c10 headers only: ATen/cuda/CUDAContext.h would pull in cuSPARSE/cuBLAS headers that a
// minimal CUDA toolkit (CI) lacks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace fastlapsum {

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Streaming multiprocessors of the current device, looked up once per device (so that later
// calls, e.g. under graph capture, make no CUDA API call but launches).
inline int sm_count() {
  static int cached[256] = {};
  const int dev = c10::cuda::current_device();
  if (cached[dev] == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&cached[dev], cudaDevAttrMultiProcessorCount, dev));
  return cached[dev];
}

constexpr int kThreads = 256;

// A [chunks, rows] grid for row-wise work: chunks enough to cover a row with `per_thread`
// elements per thread (at most max_chunks), rows capped by the grid limit (kernels loop).
inline dim3 row_grid(int64_t rows, int64_t n, int64_t per_thread, int64_t max_chunks) {
  const int64_t per_block = kThreads * per_thread;
  int64_t chunks = (n + per_block - 1) / per_block;
  chunks = chunks < 1 ? 1 : (chunks > max_chunks ? max_chunks : chunks);
  const int64_t y = rows < 1 ? 1 : (rows > 65535 ? 65535 : rows);
  return dim3(static_cast<unsigned>(chunks), static_cast<unsigned>(y));
}

}  // namespace fastlapsum
