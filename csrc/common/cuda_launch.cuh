// Launch helpers for the CUDA kernels: grid shapes bounded independently of the data.
#pragma once

// c10 headers only: ATen/cuda/CUDAContext.h would pull in cuSPARSE/cuBLAS headers that a
// minimal CUDA toolkit (CI) lacks.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

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

// Compute capability of the current device as major * 10 + minor (9.0 -> 90), looked up once
// per device.
inline int compute_capability() {
  static int cached[256] = {};
  const int dev = c10::cuda::current_device();
  if (cached[dev] == 0) {
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    cached[dev] = major * 10 + minor;
  }
  return cached[dev];
}

// Facts about a kernel on a device, looked up once (under one lock) and remembered, so that
// later calls (e.g. under graph capture) make no CUDA API call other than launches. Keyed
// by (kernel, device, threads, smem bytes); threads = 0 holds the dynamic shared memory the
// kernel is opted in to. 0 until set.
inline std::mutex& kernel_facts_mutex() {
  static std::mutex mu;
  return mu;
}
inline int& kernel_fact(const void* kernel, int dev, int threads, int smem) {
  static std::map<std::tuple<const void*, int, int, int>, int> facts;
  return facts[{kernel, dev, threads, smem}];
}

// Opts a kernel in to `bytes` of dynamic shared memory.
template <typename Kernel>
void set_max_dynamic_smem(Kernel kernel, int bytes, int dev) {
  const std::lock_guard<std::mutex> lock(kernel_facts_mutex());
  int& have = kernel_fact(reinterpret_cast<const void*>(kernel), dev, 0, 0);
  if (bytes <= have) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  have = bytes;
}

// CTAs of `kernel` (`threads` threads, `smem` dynamic bytes) resident per SM: a kernel that
// streams in grid-stride loops can size its grid to one full wave.
template <typename Kernel>
int resident_blocks(Kernel kernel, int threads, int smem, int dev) {
  const std::lock_guard<std::mutex> lock(kernel_facts_mutex());
  int& have = kernel_fact(reinterpret_cast<const void*>(kernel), dev, threads, smem);
  if (have == 0) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&have, kernel, threads, smem));
    have = have < 1 ? 1 : have;
  }
  return have;
}

// Programmatic dependent launch (Hopper and later). A kernel launched by launch_dependent may
// be scheduled while the kernel before it in the stream is still running, so its blocks are
// resident when that one ends instead of a launch later; in a chain of short kernels (the
// solver's ~13 launches) that latency is most of the gap between them. Such a kernel must
// start with begin_dependent_grid(): it waits until the previous grid has finished and its
// writes are visible (a no-op when the launch was not dependent), then lets the next one
// be scheduled. Every kernel waits for its predecessor, so completion stays transitive.
__device__ __forceinline__ void begin_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether kernels go out as dependent launches: on devices of compute capability 9.0 or
// later, unless FASTLAPSUM_DEPENDENT_LAUNCH=0 (for per-kernel profiles: a dependent kernel's
// measured time includes its wait for the one before it).
inline bool dependent_launch_enabled() {
  static const bool disabled = [] {
    const char* v = std::getenv("FASTLAPSUM_DEPENDENT_LAUNCH");
    return v != nullptr && std::string(v) == "0";
  }();
  static int cached[256] = {};  // 0: unknown, 1: no, 2: yes
  const int dev = c10::cuda::current_device();
  if (cached[dev] == 0) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    cached[dev] = major >= 9 && !disabled ? 2 : 1;
  }
  return cached[dev] == 2;
}

// kernel<<<grid, block, smem, stream>>>(args...) as a dependent launch (see above); the
// kernel must begin with begin_dependent_grid().
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                      Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = dependent_launch_enabled() ? 1 : 0;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
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
