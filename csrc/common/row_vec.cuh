// 16-byte vector access to a row, for every CUDA kernel (soft threshold, mask, VJP, top-k):
// the one aligned 16-byte load (ldg16), the one raw vector type (uint4, typed as RawVec),
// and the scalar fallback for a row's unaligned start or ragged tail (load_raw, load_vec).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace fastlapsum {

// Elements per 16-byte vector load.
template <typename scalar_t>
constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(scalar_t));
}

// The type a per-element pass classifies and exponentiates in: fp64 for fp64 rows, fp32
// otherwise (every fp16/bf16/fp32 score is exact in fp32, and fp32 saves the fp32<->fp64
// conversions, quarter rate on sm_90, that fp64 arithmetic per score needs).
template <typename scalar_t>
using compute_t = std::conditional_t<std::is_same<scalar_t, double>::value, double, float>;

// The 16 bytes at p (16-byte aligned), through the read-only cache.
template <typename T>
__device__ __forceinline__ uint4 ldg16(const T* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// Element q of a raw vector of scalar_t.
template <typename scalar_t>
__device__ __forceinline__ scalar_t raw_elem(const uint4& raw, int q) {
  scalar_t s[vec_width<scalar_t>()];
  memcpy(s, &raw, 16);
  return s[q];
}

// True when a row pointer allows 16-byte vector access.
template <typename T>
__device__ __forceinline__ bool is_aligned16(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// One 16-byte vector of a row kept raw (4 registers) until its elements are used, so a
// thread can hold several loads in flight without the registers of their converted values.
template <typename scalar_t>
struct RawVec {
  static constexpr int V = vec_width<scalar_t>();
  uint4 raw;
  __device__ __forceinline__ compute_t<scalar_t> operator[](int q) const {
    return static_cast<compute_t<scalar_t>>(raw_elem<scalar_t>(raw, q));
  }
};

// Elements [i0, i0 + V) of a row by scalar loads (any alignment), raw; those at or past n
// read as `past_end`.
template <typename scalar_t>
__device__ __forceinline__ RawVec<scalar_t> load_raw_scalar(const scalar_t* __restrict__ row, int64_t n, int64_t i0,
                                                            scalar_t past_end) {
  constexpr int V = RawVec<scalar_t>::V;
  RawVec<scalar_t> r;
  scalar_t s[V];
#pragma unroll
  for (int q = 0; q < V; ++q) s[q] = i0 + q < n ? row[i0 + q] : past_end;
  memcpy(&r.raw, s, 16);
  return r;
}

// Elements [i0, i0 + V) of a row, raw; those at or past n read as `past_end`.
template <typename scalar_t>
__device__ __forceinline__ RawVec<scalar_t> load_raw(const scalar_t* __restrict__ row, int64_t n, int64_t i0,
                                                     bool aligned, scalar_t past_end) {
  if (aligned && i0 + RawVec<scalar_t>::V <= n) return {ldg16(row + i0)};
  return load_raw_scalar(row, n, i0, past_end);
}

// Loads elements [i0, i0 + V) of a row (those below n) as Val (double, or the compute type),
// with one 16-byte load when the row is aligned and the vector is whole. Returns how many
// are valid.
template <typename scalar_t, int V, typename Val>
__device__ __forceinline__ int load_vec(const scalar_t* __restrict__ row, int64_t n, int64_t i0,
                                        bool aligned, Val (&v)[V]) {
  if (aligned && i0 + V <= n) {
    const uint4 raw = ldg16(row + i0);
#pragma unroll
    for (int q = 0; q < V; ++q) v[q] = static_cast<Val>(raw_elem<scalar_t>(raw, q));
    return V;
  }
  int valid = 0;
#pragma unroll
  for (int q = 0; q < V; ++q)
    if (i0 + q < n) {
      v[q] = static_cast<Val>(row[i0 + q]);
      ++valid;
    }
  return valid;
}

// Stores elements [i0, i0 + V) of a row (those below n), with one 16-byte store when the
// row is aligned and the vector is whole.
template <typename scalar_t, int V, typename Val>
__device__ __forceinline__ void store_vec(scalar_t* __restrict__ row, int64_t n, int64_t i0, bool aligned,
                                          const Val (&v)[V]) {
  if (aligned && i0 + V <= n) {
    union {
      uint4 raw;
      scalar_t s[V];
    } u;
#pragma unroll
    for (int q = 0; q < V; ++q) u.s[q] = static_cast<scalar_t>(v[q]);
    *reinterpret_cast<uint4*>(row + i0) = u.raw;
    return;
  }
#pragma unroll
  for (int q = 0; q < V; ++q)
    if (i0 + q < n) row[i0 + q] = static_cast<scalar_t>(v[q]);
}

}  // namespace fastlapsum
