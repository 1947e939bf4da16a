// CUDA closed-form VJPs (DESIGN §1.3, docs/GRADIENTS.md): one reduction pass writing
// per-block partial sums, one block per row folding them in a fixed order into the row's
// coefficients (deterministic, no atomics, no host sync), then one elementwise pass.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>

#include <algorithm>
#include <type_traits>

#include "../common/cuda_launch.cuh"
#include "../common/gpu_rows.cuh"
#include "../common/op_io.h"
#include "../common/vjp_math.h"
#include "vjp_terms_f32.cuh"
#include "../ops.h"

namespace fastlapsum {
namespace {

constexpr int64_t kMaxChunks = 2048;  // partial sums per row: enough blocks to fill the GPU

struct SumOp {
  double inv_t;
  __device__ VjpSums operator()(VjpSums a, const VjpSums& b) const {
    a.merge(b, inv_t);
    return a;
  }
};

// Elements per group of the fp32 reduction: the fp32 sums of a group are folded into the
// thread's fp64 ones at once (two 16-byte vectors of fp32, one of fp16/bf16).
constexpr int kGroup = 8;

// the threshold VJP has no upstream tensor (grad == nullptr)
template <typename scalar_t>
__global__ void vjp_reduce_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ x,
                                  const double* __restrict__ b, const double* __restrict__ t,
                                  VjpSums* __restrict__ partial, int64_t rows, int64_t n,
                                  double sign, bool log_mode) {
  begin_dependent_grid();
  constexpr int V = vec_width<scalar_t>();
  constexpr int U = kGroup / V;  // vectors per group (stream tile)
  using Reduce = cub::BlockReduce<VjpSums, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const double br = sign * b[r], inv_t = inv_temperature(t[r]);
    VjpSums acc;
    const scalar_t* gr = grad == nullptr ? nullptr : grad + r * n;
    if constexpr (std::is_same<scalar_t, double>::value) {
      stream_row<scalar_t>(x + r * n, gr, n, [&](const double(&xv)[V], const double(&gv)[V], int valid, int64_t) {
#pragma unroll
        for (int q = 0; q < V; ++q)  // constant indices: xv, gv stay in registers
          if (q < valid) acc.add(vjp_term(sign * xv[q], br, inv_t, gv[q], log_mode), inv_t);
      });
    } else {
      const RowF32 row(sign, br, inv_t);
      if (row.pairs) {  // the usual row: float-pair distances, fp32 sums per group, fp64 across groups
        stream_row_tiles<scalar_t, float, U>(x + r * n, gr, n, [&](const float(&xv)[U][V], const float(&gv)[U][V],
                                                                   const int(&valid)[U], int64_t) {
          float xs[kGroup], gs[kGroup];
          bool ok[kGroup];
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int q = 0; q < V; ++q) {
              xs[u * V + q] = xv[u][q];
              gs[u * V + q] = gv[u][q];
              ok[u * V + q] = q < valid[u];
            }
          acc.merge(group_sums<kGroup>(row, xs, gs, ok, log_mode), inv_t, ExpNegF32{});
        });
      } else {
        stream_row<scalar_t, float>(x + r * n, gr, n, [&](const float(&xv)[V], const float(&gv)[V], int valid, int64_t) {
          acc.merge(vector_sums_f64d<V>(row, xv, gv, valid, log_mode), inv_t, ExpNegF32{});
        });
      }
    }
    const VjpSums total = Reduce(tmp).Reduce(acc, SumOp{inv_t});
    if (threadIdx.x == 0) partial[r * gridDim.x + blockIdx.x] = total;
    __syncthreads();
  }
}

// A row's partials summed in a fixed order (the same answer every run) into its VJP
// coefficients, by the whole block; every thread gets them. grad_b: the threshold's VJP
// (mask false).
__device__ RowVjp fold_row(const VjpSums* __restrict__ partial, int chunks, const double* __restrict__ grad_b,
                           int64_t r, double br, double tr, double sign, bool mask, bool log_mode) {
  using Reduce = cub::BlockReduce<VjpSums, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ RowVjp row;
  const double inv_t = inv_temperature(tr);
  VjpSums acc;
  for (int c = threadIdx.x; c < chunks; c += kThreads) acc.merge(partial[c], inv_t);
  const VjpSums s = Reduce(tmp).Reduce(acc, SumOp{inv_t});
  if (threadIdx.x == 0) row = mask ? mask_vjp(s, br, tr, log_mode) : threshold_vjp(s, grad_b[r], br, tr, sign);
  __syncthreads();
  const RowVjp v = row;
  __syncthreads();
  return v;
}

// One block per row folds its partials once, so that the elementwise pass reads the
// coefficients instead of each of its blocks folding them (rows of many blocks).
__global__ void __launch_bounds__(kThreads) vjp_finalize_kernel(const VjpSums* __restrict__ partial, int chunks,
                                                                const double* __restrict__ grad_b,
                                                                const double* __restrict__ b, const double* __restrict__ t,
                                                                RowVjp* __restrict__ coef, double* __restrict__ gk,
                                                                double* __restrict__ gt, int64_t rows, double sign,
                                                                bool mask, bool log_mode) {
  begin_dependent_grid();
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const RowVjp v = fold_row(partial + r * chunks, chunks, grad_b, r, sign * b[r], t[r], sign, mask, log_mode);
    if (threadIdx.x == 0) {
      coef[r] = v;
      gk[r] = v.grad_k;
      gt[r] = v.grad_t;
    }
  }
}

// d L / d x for both VJPs: of the mask (grad given) or of the threshold (grad == nullptr:
// its coefficients carry grad_b). Each element's weight is taken relative to the row's
// nearest score (wh = tw e^{m/t}), so it does not underflow where tw alone would.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, 3) vjp_apply_kernel(const scalar_t* __restrict__ grad,
                                 const scalar_t* __restrict__ x, const double* __restrict__ b,
                                 const double* __restrict__ t, const RowVjp* __restrict__ coef,
                                 const VjpSums* __restrict__ partial, const double* __restrict__ grad_b,
                                 double* __restrict__ gk, double* __restrict__ gt,
                                 scalar_t* __restrict__ gx, int64_t rows, int64_t n, double sign, bool log_mode) {
  begin_dependent_grid();
  constexpr int V = vec_width<scalar_t>();
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const double br = sign * b[r], inv_t = inv_temperature(t[r]);
    // coef == nullptr: few partials a row, each block folds them (one launch fewer)
    const RowVjp v = coef != nullptr ? coef[r]
                                     : fold_row(partial + r * gridDim.x, gridDim.x, grad_b, r, br, t[r], sign,
                                                grad != nullptr, log_mode);
    if (coef == nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
      gk[r] = v.grad_k;
      gt[r] = v.grad_t;
    }
    scalar_t* out = gx + r * n;
    const bool aligned = is_aligned16(out);
    const scalar_t* gr = grad == nullptr ? nullptr : grad + r * n;
    if constexpr (std::is_same<scalar_t, double>::value) {
      stream_row<scalar_t>(x + r * n, gr, n, [&](const double(&xv)[V], const double(&gv)[V], int valid, int64_t i0) {
        double o[V];
#pragma unroll
        for (int q = 0; q < V; ++q) o[q] = grad_f64(sign, br, inv_t, v, xv[q], gv[q]);
        store_vec<scalar_t, V>(out, n, i0, aligned && valid == V, o);
      });
    } else {
      const RowF32 row(sign, br, inv_t);
      const RowCoefF32 cf(v);
      stream_row<scalar_t, float>(x + r * n, gr, n, [&](const float(&xv)[V], const float(&gv)[V], int valid, int64_t i0) {
        float o[V];
#pragma unroll
        for (int q = 0; q < V; ++q) o[q] = grad_f32(row, cf, v, xv[q], gv[q], log_mode);
        store_vec<scalar_t, V>(out, n, i0, aligned && valid == V, o);
      });
    }
  }
}

// Short rows (n <= 32 * kItems), one warp per row: the row in registers, its sums reduced
// across the warp in a fixed order, its coefficients from lane 0, d L / d x written from
// the registers. One launch for the whole batch (the three-launch path gives such a row a
// block of mostly idle threads per launch).
constexpr int kWarpRowsThreads = 256;
constexpr int kWarpRowsMaxItems = 32;  // rows up to 1024 scores

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

template <typename scalar_t, int kItems>
__global__ void __launch_bounds__(kWarpRowsThreads) vjp_warp_rows_kernel(
    const scalar_t* __restrict__ grad, const double* __restrict__ grad_b, const scalar_t* __restrict__ x,
    const double* __restrict__ b, const double* __restrict__ t, scalar_t* __restrict__ gx, double* __restrict__ gk,
    double* __restrict__ gt, int64_t rows, int64_t n, double sign, bool log_mode) {
  begin_dependent_grid();
  using Val = compute_t<scalar_t>;
  constexpr int G = kItems < kGroup ? kItems : kGroup;
  constexpr int kWarps = kWarpRowsThreads / 32;
  const int lane = threadIdx.x & 31;
  for (int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32; r < rows; r += int64_t(gridDim.x) * kWarps) {
    const scalar_t* xr = x + r * n;
    const scalar_t* gr = grad == nullptr ? nullptr : grad + r * n;
    const double br = sign * b[r], tr = t[r], inv_t = inv_temperature(tr);
    Val xv[kItems], gv[kItems];
    bool ok[kItems];
#pragma unroll
    for (int q = 0; q < kItems; ++q) {  // item q of lane l: element 32 q + l (coalesced)
      const int64_t i = int64_t(q) * 32 + lane;
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
        int valid = 0;  // a lane's valid items are a prefix
#pragma unroll
        for (int q = 0; q < G; ++q) {
          xs[q] = xv[q0 + q];
          gs[q] = gv[q0 + q];
          oks[q] = ok[q0 + q];
          valid += oks[q];
        }
        acc.merge(row.pairs ? group_sums<G>(row, xs, gs, oks, log_mode) : vector_sums_f64d<G>(row, xs, gs, valid, log_mode),
                  inv_t, ExpNegF32{});
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {  // a fixed tree towards lane 0
      const VjpSums o = shfl_down_sums(acc, off);
      if (lane < off) acc.merge(o, inv_t);
    }
    RowVjp v{};
    if (lane == 0) {
      v = grad != nullptr ? mask_vjp(acc, br, tr, log_mode) : threshold_vjp(acc, grad_b[r], br, tr, sign);
      gk[r] = v.grad_k;
      gt[r] = v.grad_t;
    }
    v = shfl_row(v);
    scalar_t* out = gx + r * n;
    if constexpr (std::is_same<scalar_t, double>::value) {
#pragma unroll
      for (int q = 0; q < kItems; ++q)
        if (ok[q]) out[int64_t(q) * 32 + lane] = grad_f64(sign, br, inv_t, v, xv[q], gv[q]);
    } else {
      const RowF32 row(sign, br, inv_t);
      const RowCoefF32 cf(v);
#pragma unroll
      for (int q = 0; q < kItems; ++q)
        if (ok[q]) out[int64_t(q) * 32 + lane] = static_cast<scalar_t>(grad_f32(row, cf, v, xv[q], gv[q], log_mode));
    }
  }
}

// The warp-per-row kernel for rows of at most 32 * kWarpRowsMaxItems scores: the fewest
// items per lane that hold the row (padding costs registers and idle lanes).
template <typename scalar_t>
bool launch_warp_rows(const BackwardIO& w, const scalar_t* grad, const double* grad_b, double sign, bool log_mode) {
  const int64_t rows = w.x.size(0), n = w.x.size(1);
  if (n > 32 * kWarpRowsMaxItems) return false;
  constexpr int64_t kWarps = kWarpRowsThreads / 32;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((rows + kWarps - 1) / kWarps, 1 << 20));
  const auto launch = [&](auto kernel) {
    launch_dependent(kernel, blocks, kWarpRowsThreads, 0, current_stream(), grad, grad_b,
                     w.x.const_data_ptr<scalar_t>(), w.b.const_data_ptr<double>(), w.t.const_data_ptr<double>(),
                     w.gx.mutable_data_ptr<scalar_t>(), w.gk.mutable_data_ptr<double>(),
                     w.gt.mutable_data_ptr<double>(), rows, n, sign, log_mode);
  };
  if (n <= 64) launch(vjp_warp_rows_kernel<scalar_t, 2>);
  else if (n <= 256) launch(vjp_warp_rows_kernel<scalar_t, 8>);
  else launch(vjp_warp_rows_kernel<scalar_t, kWarpRowsMaxItems>);
  return true;
}

// Partials a row up to which each block of the elementwise pass folds them itself (cheaper
// than a launch); above, one block per row does it once.
constexpr int64_t kFoldInApplyMaxChunks = 16;

// The launches of both VJPs: reduce (partial sums per block), finalize (a row's coefficients,
// once, for rows of many blocks), apply (d L / d x); rows of at most 1024 scores: one warp
// per row, one launch. grad == nullptr: the threshold's VJP (grad_b given).
template <typename scalar_t>
void launch_vjp(const BackwardIO& w, const scalar_t* grad, const double* grad_b, bool largest, bool log_mode) {
  const double sign = largest ? 1.0 : -1.0;
  if (launch_warp_rows<scalar_t>(w, grad, grad_b, sign, log_mode)) return;
  const int64_t rows = w.x.size(0), n = w.x.size(1);
  const dim3 grid = row_grid(rows, n, 8, kMaxChunks);
  const bool finalize = grid.x > kFoldInApplyMaxChunks;
  const int64_t partial_bytes = rows * int64_t(grid.x) * int64_t(sizeof(VjpSums));
  const at::Tensor ws = at::empty({partial_bytes + (finalize ? rows * int64_t(sizeof(RowVjp)) : 0)},
                                  w.x.options().dtype(at::kByte));
  auto* partial = reinterpret_cast<VjpSums*>(ws.mutable_data_ptr());
  auto* coef = finalize ? reinterpret_cast<RowVjp*>(static_cast<uint8_t*>(ws.mutable_data_ptr()) + partial_bytes)
                        : nullptr;
  const cudaStream_t stream = current_stream();
  const scalar_t* xp = w.x.const_data_ptr<scalar_t>();
  const double* bp = w.b.const_data_ptr<double>();
  const double* tp = w.t.const_data_ptr<double>();
  double* gk = w.gk.mutable_data_ptr<double>();
  double* gt = w.gt.mutable_data_ptr<double>();
  launch_dependent(vjp_reduce_kernel<scalar_t>, grid, kThreads, 0, stream, grad, xp, bp, tp, partial, rows, n, sign,
                   log_mode);
  if (finalize) {
    const unsigned row_blocks = static_cast<unsigned>(rows < 65535 ? rows : 65535);
    launch_dependent(vjp_finalize_kernel, row_blocks, kThreads, 0, stream, partial, static_cast<int>(grid.x), grad_b,
                     bp, tp, coef, gk, gt, rows, sign, grad != nullptr, log_mode);
  }
  launch_dependent(vjp_apply_kernel<scalar_t>, grid, kThreads, 0, stream, grad, xp, bp, tp, coef, partial, grad_b, gk,
                   gt, w.gx.mutable_data_ptr<scalar_t>(), rows, n, sign, log_mode);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_topk_backward_cuda(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& b_in,
    const at::Tensor& t_in, bool largest, bool log_mode) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  BackwardIO w = backward_io(x_in, b_in, t_in);
  TORCH_CHECK(grad_in.sizes() == w.x.sizes(), "fastlapsum: grad must have the shape of x");
  if (w.x.numel() == 0) return {w.gx, w.gk, w.gt};
  const at::Tensor g = grad_in.to(w.x.scalar_type()).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.x.scalar_type(), "soft_topk_backward_cuda", [&] {
    launch_vjp<scalar_t>(w, g.const_data_ptr<scalar_t>(), nullptr, largest, log_mode);
  });
  return {w.gx, w.gk, w.gt};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_threshold_backward_cuda(
    const at::Tensor& grad_b_in, const at::Tensor& x_in, const at::Tensor& b_in,
    const at::Tensor& t_in, bool largest) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  BackwardIO w = backward_io(x_in, b_in, t_in);
  TORCH_CHECK(grad_b_in.numel() == w.x.size(0), "fastlapsum: grad_b needs one value per row");
  if (w.x.numel() == 0) return {w.gx, w.gk, w.gt};
  const at::Tensor gb = grad_b_in.to(at::kDouble).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.x.scalar_type(), "threshold_backward_cuda", [&] {
    launch_vjp<scalar_t>(w, nullptr, gb.const_data_ptr<double>(), largest, false);
  });
  return {w.gx, w.gk, w.gt};
}

TORCH_LIBRARY_IMPL(fastlapsum, CUDA, m) {
  m.impl("soft_topk_backward", &soft_topk_backward_cuda);
  m.impl("lapsum_threshold_backward", &lapsum_threshold_backward_cuda);
}

}  // namespace fastlapsum
