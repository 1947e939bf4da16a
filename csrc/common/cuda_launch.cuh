// Launch helpers for the CUDA kernels: grid shapes bounded independently of the data.
#pragma once

// c10 headers only: ATen/cuda/CUDAContext.h would pull in cuSPARSE/cuBLAS headers that a
// minimal CUDA toolkit (CI) lacks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace fastlapsum {

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

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
