// The kernels' parameters (one struct for both paths) and the per-row budget, padding and
// output writes they share.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "plan_topk.h"  // GState
#include "radix_select.cuh"

namespace fastlapsum {
namespace {

struct Params {
  const void* x;
  int64_t rows, pitch, n, K;
  const int64_t* lengths;  // topk: valid prefix per row (may be null)
  const double* kvec;      // mask: budget per row
  const double* nan_rows;  // mask: a NaN row where nan_rows[r] is NaN (may be null)
  uint32_t flip;           // 0 (largest) or ~0 (smallest)
  int cap;                 // per-row kernel: smem candidate capacity
  int warp_sort;           // warp-row kernel: sorted output in the kernel (out_comp null)
  void* out_val;           // [rows, K]
  int64_t* out_idx;        // [rows, K]
  int64_t* out_comp;       // [rows, K] or null
  void* out_mask;          // [rows, n]
  // grid path
  struct GState* st;
  uint32_t* ghist;   // [rows, kBins]
  uint64_t* cand;    // [rows, cap_g]
  int64_t cap_g;
  int64_t bpr;       // CTAs per row
};

// Per-row budget: returns false (and the row is a NaN row, mask_row_fill) for an invalid
// mask budget or a row whose nan_rows entry is NaN (the straight-through mask's rule).
template <bool kMask>
__device__ __forceinline__ bool row_budget(const Params& P, int64_t r, int64_t& L, int64_t& take) {
  L = P.n;
  if (!kMask && P.lengths != nullptr) {
    const int64_t l = P.lengths[r];
    L = l < 0 ? 0 : (l > P.n ? P.n : l);
  }
  if (kMask) {
    const double kv = P.kvec[r];
    if (!(kv == rint(kv) && kv >= 0.0 && kv <= static_cast<double>(P.n))) return false;
    if (P.nan_rows != nullptr && isnan(P.nan_rows[r])) return false;
    take = static_cast<int64_t>(kv);
  } else {
    take = P.K < L ? P.K : L;
  }
  return true;
}

// A mask row of one value (NaN for a row row_budget rejects, 0 or 1 for take 0 or n),
// entries tid, tid + nthreads, ...
template <typename T>
__device__ __forceinline__ void mask_row_fill(const Params& P, int64_t r, float value, int64_t tid, int64_t nthreads) {
  T* mrow = static_cast<T*>(P.out_mask) + r * P.n;
  const T v = static_cast<T>(value);
  for (int64_t i = tid; i < P.n; i += nthreads) mrow[i] = v;
}

template <typename T>
__device__ __forceinline__ void pad_row(const Params& P, int64_t r, int64_t take, int64_t tid, int64_t nthreads) {
  T* ov = static_cast<T*>(P.out_val) + r * P.K;
  int64_t* oi = P.out_idx + r * P.K;
  const T pad = static_cast<T>(P.flip ? INFINITY : -INFINITY);
  for (int64_t j = take + tid; j < P.K; j += nthreads) {
    oi[j] = -1;
    ov[j] = pad;
    if (P.out_comp != nullptr) P.out_comp[r * P.K + j] = std::numeric_limits<int64_t>::min();
  }
}

template <typename T>
__device__ __forceinline__ void emit(const Params& P, int64_t r, uint64_t pos, uint64_t c) {
  const uint32_t key = static_cast<uint32_t>(c >> 32);
  const uint32_t idx = ~static_cast<uint32_t>(c);
  P.out_idx[r * P.K + pos] = idx;
  static_cast<T*>(P.out_val)[r * P.K + pos] = from_key<T>(key, P.flip);
  if (P.out_comp != nullptr) P.out_comp[r * P.K + pos] = comp_signed(c);
}

}  // namespace
}  // namespace fastlapsum
