// The CUDA VJPs of rows held in registers: 8, 16 or 32 lanes of a warp a row (n <= 1024) or
// a CTA a row (n <= 8192). Each does reduce, coefficients and d L / d x in one launch for the whole
// batch, reading the row and its upstream gradient once (the streaming path reads them
// twice and gives a short row a block of mostly idle threads per launch).
#pragma once

#include <type_traits>

#include "../common/cuda_launch.cuh"
#include "../common/gpu_rows.cuh"
#include "../common/vjp_math.h"
#include "vjp_plan.h"
#include "vjp_terms_f32.cuh"

namespace fastlapsum {

// Row reductions of vjp_rows_kernel over kRowThreads threads (8, 16 or 32 lanes of a warp, or
// the CTA). Every thread of the row ends with the same bits: a butterfly across the row's
// lanes (nearer() is a total order and + commutes, so both partners of a pair compute the same
// value), then, for a CTA row, every thread reading the warps' slots in order. So every thread
// can compute the row's coefficients itself, with no broadcast.
template <int kRowThreads>
constexpr int kButterflyTop = (kRowThreads < 32 ? kRowThreads : 32) / 2;  // first xor distance
__device__ __forceinline__ Nearest shfl_xor(const Nearest& v, int m) {
  return Nearest{__shfl_xor_sync(0xffffffffu, v.a, m), __shfl_xor_sync(0xffffffffu, v.d, m)};
}
template <int kRowThreads>
__device__ __forceinline__ Nearest row_nearest(Nearest v, Nearest* slots) {
#pragma unroll
  for (int m = kButterflyTop<kRowThreads>; m > 0; m >>= 1) v = nearer(v, shfl_xor(v, m));
  if constexpr (kRowThreads > 32) {
    if ((threadIdx.x & 31) == 0) slots[threadIdx.x / 32] = v;
    __syncthreads();
    v = slots[0];
#pragma unroll
    for (int w = 1; w < kRowThreads / 32; ++w) v = nearer(v, slots[w]);
  }
  return v;
}

// S: SumsF32 or VjpSums (its sums; m and dref are the row's, the same in every thread)
template <typename S>
__device__ __forceinline__ void add_sums(S& a, const S& b) {
  a.tw += b.tw; a.G += b.G; a.twd += b.twd; a.Gd += b.Gd; a.Ga += b.Ga; a.Gad += b.Gad;
}
template <int kRowThreads, typename S>
__device__ __forceinline__ S row_sums(S s, S* slots) {
#pragma unroll
  for (int m = kButterflyTop<kRowThreads>; m > 0; m >>= 1) {
    S o = s;
    o.tw = __shfl_xor_sync(0xffffffffu, s.tw, m);
    o.G = __shfl_xor_sync(0xffffffffu, s.G, m);
    o.twd = __shfl_xor_sync(0xffffffffu, s.twd, m);
    o.Gd = __shfl_xor_sync(0xffffffffu, s.Gd, m);
    o.Ga = __shfl_xor_sync(0xffffffffu, s.Ga, m);
    o.Gad = __shfl_xor_sync(0xffffffffu, s.Gad, m);
    add_sums(s, o);
  }
  if constexpr (kRowThreads > 32) {
    if ((threadIdx.x & 31) == 0) slots[threadIdx.x / 32] = s;
    __syncthreads();
    s = slots[0];
#pragma unroll
    for (int w = 1; w < kRowThreads / 32; ++w) add_sums(s, slots[w]);
  }
  return s;
}

// Rows of at most kRowThreads * kItems scores, kRowThreads (8, 16 or 32 lanes of a warp, or
// the block) threads a row; element i of a row is item i / kRowThreads of thread i %
// kRowThreads (coalesced). Fewer lanes a row spread a row's scalar work (its coefficients, in
// fp64) over more scores. Two passes over the registers: the row's element nearest b, then every sum
// about it (plain adds, no rescaling), so the reductions are a minimum and six sums; the
// answer is the same every run.
template <typename scalar_t, int kItems, int kRowThreads>
__global__ void __launch_bounds__(kRowsBlockThreads) vjp_rows_kernel(
    const scalar_t* __restrict__ grad, const double* __restrict__ grad_b, const scalar_t* __restrict__ x,
    const double* __restrict__ b, const double* __restrict__ t, scalar_t* __restrict__ gx, double* __restrict__ gk,
    double* __restrict__ gt, int64_t rows, int64_t n, double sign, bool log_mode) {
  static_assert(kRowThreads == 8 || kRowThreads == 16 || kRowThreads == 32 || kRowThreads == kRowsBlockThreads,
                "8, 16 or 32 lanes, or the block, a row");
  begin_dependent_grid();
  using Val = compute_t<scalar_t>;
  using Sums = std::conditional_t<std::is_same<scalar_t, double>::value, VjpSums, SumsF32>;
  constexpr int kRowsPerBlock = kRowsBlockThreads / kRowThreads;
  constexpr int kSlots = kRowThreads <= 32 ? 1 : kRowThreads / 32;
  __shared__ Nearest near_slots[kSlots];
  __shared__ Sums sum_slots[kSlots];
  const int tid = threadIdx.x % kRowThreads;
  // The loop is uniform across the block: a group past the last row runs the row's
  // reductions with no scores (its warp's shuffles need every lane) and stores nothing.
  for (int64_t r0 = int64_t(blockIdx.x) * kRowsPerBlock; r0 < rows; r0 += int64_t(gridDim.x) * kRowsPerBlock) {
    const int64_t r_own = r0 + threadIdx.x / kRowThreads;
    const bool live = r_own < rows;
    const int64_t r = live ? r_own : rows - 1;
    const scalar_t* xr = x + r * n;
    const scalar_t* gr = grad == nullptr ? nullptr : grad + r * n;
    const double br = sign * b[r], tr = t[r], inv_t = inv_temperature(tr);
    Val xv[kItems], gv[kItems];
    bool ok[kItems];
#pragma unroll
    for (int q = 0; q < kItems; ++q) {
      const int64_t i = int64_t(q) * kRowThreads + tid;
      ok[q] = live && i < n;
      xv[q] = ok[q] ? static_cast<Val>(xr[i]) : Val(0);
      gv[q] = ok[q] && gr != nullptr ? static_cast<Val>(gr[i]) : Val(0);
    }
    VjpSums s;
    if constexpr (std::is_same<scalar_t, double>::value) {
      Nearest near;
#pragma unroll
      for (int q = 0; q < kItems; ++q) {
        const VjpTerm e = vjp_term(sign * xv[q], br, inv_t, 0.0, false);  // a and d only
        if (ok[q]) near = nearer(near, Nearest{e.a, e.d});
      }
      const Nearest ref = row_nearest<kRowThreads>(near, near_slots);
      VjpSums acc;  // about the row's nearest: add() never rescales
      if (ref.a < INFINITY) {
        acc.m = ref.a;
        acc.dref = ref.d;
      }
#pragma unroll
      for (int q = 0; q < kItems; ++q)
        if (ok[q]) acc.add(vjp_term(sign * xv[q], br, inv_t, gv[q], log_mode), inv_t);
      s = row_sums<kRowThreads>(acc, sum_slots);
    } else {
      const RowF32 row(sign, br, inv_t);
      Nearest ref;
      SumsF32 part;
      if (row.pairs) {
        ref = row_nearest<kRowThreads>(nearest_pairs<kItems>(row, xv, ok), near_slots);
        part = sums_about_pairs<kItems>(row, split(ref.d), xv, gv, ok, log_mode);
      } else {
        ref = row_nearest<kRowThreads>(nearest_f64d<kItems>(row, xv, ok), near_slots);
        part = sums_about_f64d<kItems>(row, ref, xv, gv, ok, log_mode);
      }
      s = row_sums<kRowThreads>(part, sum_slots).about(ref.a, ref.d);
    }
    // every thread: the same sums, so the same coefficients
    const RowVjp v = grad != nullptr ? mask_vjp(s, br, tr, log_mode) : threshold_vjp(s, grad_b[r], br, tr, sign);
    if (live && tid == 0) {
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
  if (plan.row_threads == 8) {
    launch(vjp_rows_kernel<scalar_t, 8, 8>);
  } else if (plan.row_threads == 16) {
    if (plan.items == 8) launch(vjp_rows_kernel<scalar_t, 8, 16>);
    else launch(vjp_rows_kernel<scalar_t, 16, 16>);
  } else if (plan.row_threads == 32) {
    if (plan.items == 16) launch(vjp_rows_kernel<scalar_t, 16, 32>);
    else launch(vjp_rows_kernel<scalar_t, kVjpMaxItems, 32>);
  } else {
    if (plan.items == 16) launch(vjp_rows_kernel<scalar_t, 16, kRowsBlockThreads>);
    else launch(vjp_rows_kernel<scalar_t, kVjpMaxItems, kRowsBlockThreads>);
  }
}

}  // namespace fastlapsum
