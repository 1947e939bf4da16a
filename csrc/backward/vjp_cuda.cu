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
#include "vjp_rows.cuh"
#include "vjp_terms_f32.cuh"
#include "../ops.h"

namespace fastlapsum {
namespace {

// Elements per group of the streaming reduction: the fp32 sums of a group are folded into
// the thread's fp64 ones at once.
constexpr int kGroup = 8;

// The sums of a block's threads as one VjpSums (valid in thread 0; the caller syncs before
// the next call). The block's nearest element is reduced first (nearer() is a total order),
// each thread's sums are rebased onto it (one exp a thread), and what is left is plain fp64
// sums: a tree of merges would take two exps a step.
struct Sums6 {
  double tw, G, twd, Gd, Ga, Gad;
};
struct NearerOp {
  __device__ Nearest operator()(const Nearest& x, const Nearest& y) const { return nearer(x, y); }
};
struct Sums6Op {
  __device__ Sums6 operator()(const Sums6& x, const Sums6& y) const {
    return Sums6{x.tw + y.tw, x.G + y.G, x.twd + y.twd, x.Gd + y.Gd, x.Ga + y.Ga, x.Gad + y.Gad};
  }
};
__device__ __noinline__ VjpSums block_sums(VjpSums acc, double inv_t) {
  using NearReduce = cub::BlockReduce<Nearest, kThreads>;
  using SumReduce = cub::BlockReduce<Sums6, kThreads>;
  __shared__ union {
    typename NearReduce::TempStorage near;
    typename SumReduce::TempStorage sum;
  } tmp;
  __shared__ Nearest ref;
  const Nearest n = NearReduce(tmp.near).Reduce(acc.m < INFINITY ? Nearest{acc.m, acc.dref} : Nearest{}, NearerOp{});
  if (threadIdx.x == 0) ref = n;
  __syncthreads();
  const Nearest r = ref;
  if (acc.m < INFINITY) acc.rebase(r.a, r.d, exp(-(acc.m - r.a) * inv_t));
  const Sums6 t = SumReduce(tmp.sum).Reduce(Sums6{acc.tw, acc.G, acc.twd, acc.Gd, acc.Ga, acc.Gad}, Sums6Op{});
  VjpSums v;
  if (r.a < INFINITY) {
    v.m = r.a;
    v.dref = r.d;
    v.tw = t.tw; v.G = t.G; v.twd = t.twd; v.Gd = t.Gd; v.Ga = t.Ga; v.Gad = t.Gad;
  }
  return v;
}

// the threshold VJP has no upstream tensor (grad == nullptr)
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, 3) vjp_reduce_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ x,
                                  const double* __restrict__ b, const double* __restrict__ t,
                                  VjpSums* __restrict__ partial, int64_t rows, int64_t n,
                                  double sign, bool log_mode) {
  begin_dependent_grid();
  constexpr int V = vec_width<scalar_t>();
  constexpr int U = kGroup / V;  // vectors per group (stream tile)
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
      // Groups of kGroup scores (tiles of U vectors) for the usual row, whose float-pair sums
      // gain from longer groups; a vector at a time for a row of fp64 distances (row_group_sums).
      // A thread folds its groups with fp32 factors (ExpNegF32) into fp64 sums.
      const RowF32 row(sign, br, inv_t);
      // log_mode as a constant of the group body (no per-element branch on it)
      const auto stream = [&](auto lm) {
        constexpr bool kLog = decltype(lm)::value;
        if (row.pairs) {
          stream_row_tiles<scalar_t, float, U>(x + r * n, gr, n, [&](const float(&xv)[U][V], const float(&gv)[U][V],
                                                                     const int(&valid)[U], int64_t) {
            float xs[kGroup], gs[kGroup];
            bool ok[kGroup];  // a prefix: a tile's vectors run along the row
#pragma unroll
            for (int u = 0; u < U; ++u) {
#pragma unroll
              for (int q = 0; q < V; ++q) {
                xs[u * V + q] = xv[u][q];
                gs[u * V + q] = gv[u][q];
                ok[u * V + q] = q < valid[u];
              }
            }
            acc.merge(row_group_sums<kGroup>(row, xs, gs, ok, kLog), inv_t, ExpNegF32{});
          });
        } else {
          stream_row<scalar_t, float>(x + r * n, gr, n, [&](const float(&xv)[V], const float(&gv)[V], int valid, int64_t) {
            bool ok[V];
#pragma unroll
            for (int q = 0; q < V; ++q) ok[q] = q < valid;
            acc.merge(row_group_sums<V>(row, xv, gv, ok, kLog), inv_t, ExpNegF32{});
          });
        }
      };
      if (log_mode) stream(std::true_type{});
      else stream(std::false_type{});
    }
    const VjpSums total = block_sums(acc, inv_t);
    if (threadIdx.x == 0) partial[r * gridDim.x + blockIdx.x] = total;
    __syncthreads();
  }
}

// A row's partials summed in a fixed order (the same answer every run) into its VJP
// coefficients, by the whole block; every thread gets them. grad_b: the threshold's VJP
// (mask false).
__device__ RowVjp fold_row(const VjpSums* __restrict__ partial, int chunks, const double* __restrict__ grad_b,
                           int64_t r, double br, double tr, double sign, bool mask, bool log_mode) {
  __shared__ RowVjp row;
  const double inv_t = inv_temperature(tr);
  VjpSums acc;
  for (int c = threadIdx.x; c < chunks; c += kThreads) acc.merge(partial[c], inv_t);
  const VjpSums s = block_sums(acc, inv_t);
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

// The launches of both VJPs by plan_vjp (vjp_plan.h): rows in registers, one launch of
// vjp_rows_kernel (vjp_rows.cuh); else reduce (partial sums per block), finalize (a row's
// coefficients, once, for rows of many blocks), apply (d L / d x). grad == nullptr: the
// threshold's VJP (grad_b given).
template <typename scalar_t>
void launch_vjp(const BackwardIO& w, const scalar_t* grad, const double* grad_b, bool largest, bool log_mode) {
  const double sign = largest ? 1.0 : -1.0;
  const int64_t rows = w.x.size(0), n = w.x.size(1);
  const VjpPlan plan = plan_vjp(rows, n, sm_count(), soft_launch_tuning(compute_capability()));
  if (plan.in_registers) return launch_vjp_rows<scalar_t>(plan, w, grad, grad_b, sign, log_mode);
  const dim3 grid = plan.grid;
  const bool finalize = plan.finalize;
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
  if (finalize)
    launch_dependent(vjp_finalize_kernel, plan.row_blocks, kThreads, 0, stream, partial, static_cast<int>(grid.x), grad_b,
                     bp, tp, coef, gk, gt, rows, sign, grad != nullptr, log_mode);
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
