// Order-preserving keys of the scores on the GPU, by score type: 32-bit for fp32, fp16
// and bf16 (their values are floats), 64-bit for fp64. Shared by the threshold kernels.
// (The per-element arithmetic and the row streaming are in ../common/gpu_rows.cuh.)
#pragma once

#include <cfloat>
#include <cstdint>

#include "../../common/order_keys.h"

namespace fastlapsum {

template <typename scalar_t>
struct KeyTraits {
  using Key = uint32_t;
  static constexpr int kBits = 32;
  __device__ static Key key(double s) { return float_key(static_cast<float>(s)); }
  // The key of the smallest and largest finite score.
  __device__ static Key min_key() { return float_key(-FLT_MAX); }
  __device__ static Key max_key() { return float_key(FLT_MAX); }
  __device__ static double value(Key k) { return static_cast<double>(key_to_float(k)); }
};

template <>
struct KeyTraits<double> {
  using Key = uint64_t;
  static constexpr int kBits = 64;
  __device__ static Key key(double s) { return double_key(s); }
  __device__ static Key min_key() { return double_key(-DBL_MAX); }
  __device__ static Key max_key() { return double_key(DBL_MAX); }
  __device__ static double value(Key k) { return key_to_double(k); }
};

// min for block reductions of positions (cub::Min is gone from recent CUB).
struct MinInt {
  __device__ int operator()(int a, int b) const { return a < b ? a : b; }
};

}  // namespace fastlapsum
