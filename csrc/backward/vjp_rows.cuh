// The CUDA VJPs of rows held in registers: a warp per row (n <= 1024) or a CTA per row
// (n <= 8192). Each does reduce, coefficients and d L / d x in one launch for the whole
// batch, reading the row and its upstream gradient once (the streaming path reads them
// twice and gives a short row a block of mostly idle threads per launch).
#pragma once

#include <cub/block/block_reduce.cuh>

#include "../common/cuda_launch.cuh"
#include "../common/gpu_rows.cuh"
#include "../common/vjp_math.h"
#include "vjp_plan.h"
#include "vjp_terms_f32.cuh"

namespace fastlapsum {

// Elements per group of the fp32 reduction: the fp32 sums of a group are folded into the
// thread's fp64 ones at once.
constexpr int kGroup = 8;

struct VjpSumOp {
  double inv_t;
  __device__ VjpSums operator()(VjpSums a, const VjpSums& b) const {
    a.merge(b, inv_t);
    return a;
  }
};

__device__ __forceinline__ VjpSums shfl_down_sums(const VjpSums& s, int off) {
  VjpSums o;
  o.m = __shfl_down_sync(0xffffffffu, s.m, off);
  o.dref = __shfl_down_sync(0xffffffffu, s.dref, off);
  o.tw = __shfl_down_sync(0xffffffffu, s.tw, off);
  o.G = __shfl_down_sync(0xffffffffu, s.G, off);
  o.twd = __shfl_down_sync(0xffffffffu, s.twd, off);
  o.Gd = __shfl_down_sync(0xffffffffu, s.Gd, off);
  o.Ga = __shfl_down_sync(0xffffffffu, s.Ga, off);
  o.Gad = __shfl_down_sync(0xffffffffu, s.Gad, off);
  return o;
}
__device__ __forceinline__ RowVjp shfl_row(const RowVjp& v) {
  RowVjp o;
  o.grad_k = __shfl_sync(0xffffffffu, v.grad_k, 0);
  o.grad_t = __shfl_sync(0xffffffffu, v.grad_t, 0);
  o.K = __shfl_sync(0xffffffffu, v.K, 0);
  o.c = __shfl_sync(0xffffffffu, v.c, 0);
  o.E = __shfl_sync(0xffffffffu, v.E, 0);
  o.inv_t = __shfl_sync(0xffffffffu, v.inv_t, 0);
  o.m = __shfl_sync(0xffffffffu, v.m, 0);
  o.log_mode = __shfl_sync(0xffffffffu, v.log_mode, 0);
  o.nan = __shfl_sync(0xffffffffu, v.nan, 0);
  return o;
}

// Rows of at most kRowThreads * kItems scores, kRowThreads (32: a warp, or the block)
// threads a row; element i of a row is item i / kRowThreads of thread i % kRowThreads
// (coalesced). The row's sums reduce in a fixed order (a warp tree, then the warps in
// order), so the answer is the same every run.
template <typename scalar_t, int kItems, int kRowThreads>
__global__ void __launch_bounds__(kRowsBlockThreads) vjp_rows_kernel(
    const scalar_t* __restrict__ grad, const double* __restrict__ grad_b, const scalar_t* __restrict__ x,
    const double* __restrict__ b, const double* __restrict__ t, scalar_t* __restrict__ gx, double* __restrict__ gk,
    double* __restrict__ gt, int64_t rows, int64_t n, double sign, bool log_mode) {
  static_assert(kRowThreads == 32 || kRowThreads == kRowsBlockThreads, "a warp or the block per row");
  begin_dependent_grid();
  using Val = compute_t<scalar_t>;
  constexpr int G = kItems < kGroup ? kItems : kGroup;
  constexpr int kRowsPerBlock = kRowsBlockThreads / kRowThreads;
  constexpr int kWarps = kRowsBlockThreads / 32;
  __shared__ VjpSums warp_sums[kRowThreads == 32 ? 1 : kWarps];
  __shared__ RowVjp row_coef;
  const int lane = threadIdx.x & 31, tid = threadIdx.x % kRowThreads;
  for (int64_t r = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kRowThreads; r < rows;
       r += int64_t(gridDim.x) * kRowsPerBlock) {  // uniform across the block when kRowsPerBlock == 1
    const scalar_t* xr = x + r * n;
    const scalar_t* gr = grad == nullptr ? nullptr : grad + r * n;
    const double br = sign * b[r], tr = t[r], inv_t = inv_temperature(tr);
    Val xv[kItems], gv[kItems];
    bool ok[kItems];
#pragma unroll
    for (int q = 0; q < kItems; ++q) {
      const int64_t i = int64_t(q) * kRowThreads + tid;
      ok[q] = i < n;
      xv[q] = ok[q] ? static_cast<Val>(xr[i]) : Val(0);
      gv[q] = ok[q] && gr != nullptr ? static_cast<Val>(gr[i]) : Val(0);
    }
    VjpSums acc;
    if constexpr (std::is_same<scalar_t, double>::value) {
#pragma unroll
      for (int q = 0; q < kItems; ++q)
        if (ok[q]) acc.add(vjp_term(sign * xv[q], br, inv_t, gv[q], log_mode), inv_t);
    } else {
      const RowF32 row(sign, br, inv_t);
#pragma unroll
      for (int q0 = 0; q0 < kItems; q0 += G) {
        float xs[G], gs[G];
        bool oks[G];
        int valid = 0;  // a thread's valid items are a prefix
#pragma unroll
        for (int q = 0; q < G; ++q) {
          xs[q] = xv[q0 + q];
          gs[q] = gv[q0 + q];
          oks[q] = ok[q0 + q];
          valid += oks[q];
        }
        acc.merge(row_group_sums<G>(row, xs, gs, oks, valid, log_mode), inv_t, ExpNegF32{});
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {  // a fixed tree towards lane 0
      const VjpSums o = shfl_down_sums(acc, off);
      if (lane < off) acc.merge(o, inv_t);
    }
    RowVjp v{};
    if constexpr (kRowThreads == 32) {
      if (lane == 0) v = grad != nullptr ? mask_vjp(acc, br, tr, log_mode) : threshold_vjp(acc, grad_b[r], br, tr, sign);
      v = shfl_row(v);
    } else {
      if (lane == 0) warp_sums[threadIdx.x / 32] = acc;
      __syncthreads();
      if (threadIdx.x == 0) {
        VjpSums s = warp_sums[0];
        for (int w = 1; w < kWarps; ++w) s.merge(warp_sums[w], inv_t);
        row_coef = grad != nullptr ? mask_vjp(s, br, tr, log_mode) : threshold_vjp(s, grad_b[r], br, tr, sign);
      }
      __syncthreads();
      v = row_coef;
      __syncthreads();  // row_coef and warp_sums are rewritten by the next row
    }
    if (tid == 0) {
      gk[r] = v.grad_k;
      gt[r] = v.grad_t;
    }
    scalar_t* out = gx + r * n;
    if constexpr (std::is_same<scalar_t, double>::value) {
#pragma unroll
      for (int q = 0; q < kItems; ++q)
        if (ok[q]) out[int64_t(q) * kRowThreads + tid] = grad_f64(sign, br, inv_t, v, xv[q], gv[q]);
    } else {
      const RowF32 row(sign, br, inv_t);
      const RowCoefF32 cf(v);
#pragma unroll
      for (int q = 0; q < kItems; ++q)
        if (ok[q]) out[int64_t(q) * kRowThreads + tid] = static_cast<scalar_t>(grad_f32(row, cf, v, xv[q], gv[q], log_mode));
    }
  }
}

static_assert(kSoftLaunchSm90.vjp_warp_row_max <= 32 * kVjpMaxItems &&
                  kSoftLaunchSm90.vjp_cta_row_max <= kRowsBlockThreads * kVjpMaxItems,
              "vjp_rows_kernel holds at most kVjpMaxItems scores a thread");

// The plan's vjp_rows_kernel (plan.in_registers).
template <typename scalar_t>
void launch_vjp_rows(const VjpPlan& plan, const BackwardIO& w, const scalar_t* grad, const double* grad_b, double sign,
                     bool log_mode) {
  const int64_t rows = w.x.size(0), n = w.x.size(1);
  const auto launch = [&](auto kernel) {
    launch_dependent(kernel, plan.blocks, kRowsBlockThreads, 0, current_stream(), grad, grad_b,
                     w.x.const_data_ptr<scalar_t>(), w.b.const_data_ptr<double>(), w.t.const_data_ptr<double>(),
                     w.gx.mutable_data_ptr<scalar_t>(), w.gk.mutable_data_ptr<double>(),
                     w.gt.mutable_data_ptr<double>(), rows, n, sign, log_mode);
  };
  if (plan.row_threads == 32) {
    if (plan.items == 2) launch(vjp_rows_kernel<scalar_t, 2, 32>);
    else if (plan.items == 8) launch(vjp_rows_kernel<scalar_t, 8, 32>);
    else launch(vjp_rows_kernel<scalar_t, kVjpMaxItems, 32>);
  } else {
    if (plan.items == 16) launch(vjp_rows_kernel<scalar_t, 16, kRowsBlockThreads>);
    else launch(vjp_rows_kernel<scalar_t, kVjpMaxItems, kRowsBlockThreads>);
  }
}

}  // namespace fastlapsum
