// CUDA closed-form VJPs (DESIGN §1.3): one reduction pass writing per-block partial
// sums, then one elementwise pass whose blocks first fold their row's partials in a
// fixed order (deterministic, no atomics, no host sync).
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>

#include <type_traits>

#include "../common/cuda_launch.cuh"
#include "../common/gpu_rows.cuh"
#include "../common/op_io.h"
#include "../common/vjp_math.h"
#include "../ops.h"

namespace fastlapsum {
namespace {

constexpr int64_t kMaxChunks = 2048;  // partial sums per row: enough blocks to fill the GPU

struct SumOp {
  __device__ VjpSums operator()(VjpSums a, const VjpSums& b) const {
    a.merge(b);
    return a;
  }
};

// The VJP terms of the elements of one fp32/fp16/bf16 row, in fp32 (fp64 rows use
// vjp_term): d = s - b with b split into two floats (s - b_hi is exact for the scores within
// a factor 2 of b, the ones that carry weight when |b| >> t), one MUFU exponential. An
// infinite or NaN d (an infinite score or threshold) gives zero terms, as in vjp_term.
struct VjpTermF {
  float tw, G, d;
};
struct VjpTermsF32 {
  float sign, b_hi, b_lo;
  ScaledExp<float> ex;
  __device__ VjpTermsF32(double sign_d, double b, double inv_t)
      : sign(static_cast<float>(sign_d)),
        b_hi(static_cast<float>(b)),
        b_lo(static_cast<float>(b - static_cast<double>(b_hi))),
        ex(inv_t) {}
  // x: the element as stored (the row's sign not yet applied), g: its upstream gradient
  __device__ __forceinline__ VjpTermF operator()(float x, float g, bool log_mode) const {
    const float d = (sign * x - b_hi) - b_lo;
    if (!(fabsf(d) <= 3.4028234663852886e38f)) return VjpTermF{0.0f, 0.0f, 0.0f};
    const float e = ex(fabsf(d)), tw = 0.5f * e;
    const float G = !log_mode ? g * tw : (d <= 0.0f ? g : g * e / (2.0f - e));
    return VjpTermF{tw, G, d};
  }
};

// the threshold VJP has no upstream tensor (grad == nullptr)
template <typename scalar_t>
__global__ void vjp_reduce_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ x,
                                  const double* __restrict__ b, const double* __restrict__ t,
                                  VjpSums* __restrict__ partial, int64_t rows, int64_t n,
                                  double sign, bool log_mode) {
  begin_dependent_grid();
  constexpr int V = vec_width<scalar_t>();
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
          if (q < valid) acc.add(vjp_term(sign * xv[q], br, inv_t, gv[q], log_mode, ExpF64{}));
      });
    } else {  // fp32 terms, summed per vector in fp32, then in fp64
      const VjpTermsF32 term(sign, br, inv_t);
      stream_row<scalar_t, float>(x + r * n, gr, n, [&](const float(&xv)[V], const float(&gv)[V], int valid, int64_t) {
        float tw = 0.0f, G = 0.0f, twd = 0.0f, Gd = 0.0f;
#pragma unroll
        for (int q = 0; q < V; ++q)
          if (q < valid) {
            const VjpTermF e = term(xv[q], gv[q], log_mode);
            tw += e.tw;
            G += e.G;
            twd += e.tw * e.d;
            Gd += e.G * e.d;
          }
        acc.merge(VjpSums{tw, G, twd, Gd});
      });
    }
    const VjpSums total = Reduce(tmp).Reduce(acc, SumOp());
    if (threadIdx.x == 0) partial[r * gridDim.x + blockIdx.x] = total;
    __syncthreads();
  }
}

// Sum a row's partials in a fixed order (the same answer every run): thread j folds
// partials j, j + kThreads, ..., then one block reduction. All threads load, so the
// elementwise pass does not wait on one warp's chain of loads.
__device__ VjpSums fold_partials(const VjpSums* partial, int chunks) {
  using Reduce = cub::BlockReduce<VjpSums, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ VjpSums row_sum;
  VjpSums acc;
  for (int c = threadIdx.x; c < chunks; c += kThreads) acc.merge(partial[c]);
  const VjpSums total = Reduce(tmp).Reduce(acc, SumOp());
  if (threadIdx.x == 0) row_sum = total;
  __syncthreads();
  const VjpSums s = row_sum;
  __syncthreads();
  return s;
}

// d L / d x for both VJPs: of the mask (grad given) or of the threshold (grad == nullptr,
// grad_b given: one value per row).
template <typename scalar_t>
__global__ void vjp_apply_kernel(const scalar_t* __restrict__ grad, const double* __restrict__ grad_b,
                                 const scalar_t* __restrict__ x, const double* __restrict__ b,
                                 const double* __restrict__ t, const VjpSums* __restrict__ partial,
                                 scalar_t* __restrict__ gx, double* __restrict__ gk, double* __restrict__ gt,
                                 int64_t rows, int64_t n, double sign, bool log_mode) {
  begin_dependent_grid();
  constexpr int V = vec_width<scalar_t>();
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const double br = sign * b[r], tr = t[r], inv_t = inv_temperature(tr);
    const VjpSums sums = fold_partials(partial + r * gridDim.x, gridDim.x);
    // either closed form as d L / d s = (G cg - tw cr) cs, with the row's grad_k, grad_t
    double cg, cr, cs, grad_k, grad_t;
    bool nan = false;
    if (grad != nullptr) {  // (G - tw <g', w>/W) / t
      const MaskVjp v = mask_vjp(sums, br, tr);
      cg = 1.0;
      cr = v.ratio;
      cs = inv_t;
      nan = v.nan;
      grad_k = v.grad_k;
      grad_t = v.grad_t;
    } else {  // scale tw
      const ThresholdVjp v = threshold_vjp(sums, grad_b[r], br, tr, sign);
      cg = 0.0;
      cr = -v.scale;
      cs = 1.0;
      grad_k = v.grad_k;
      grad_t = v.grad_t;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      gk[r] = grad_k;
      gt[r] = grad_t;
    }
    scalar_t* out = gx + r * n;
    const bool aligned = is_aligned16(out);
    const scalar_t* gr = grad == nullptr ? nullptr : grad + r * n;
    if constexpr (std::is_same<scalar_t, double>::value) {
      stream_row<scalar_t>(x + r * n, gr, n, [&](const double(&xv)[V], const double(&gv)[V], int valid, int64_t i0) {
        double o[V];
#pragma unroll
        for (int q = 0; q < V; ++q) {
          const VjpTerm e = vjp_term(sign * xv[q], br, inv_t, gv[q], log_mode, ExpF64{});
          o[q] = nan ? NAN : sign * ((e.G * cg - e.tw * cr) * cs);
        }
        store_vec<scalar_t, V>(out, n, i0, aligned && valid == V, o);
      });
    } else {  // fp32 terms; the row's coefficients can exceed fp32 (1/W), so they combine in fp64
      const VjpTermsF32 term(sign, br, inv_t);
      const double kg = sign * cg * cs, kr = sign * cr * cs;
      stream_row<scalar_t, float>(x + r * n, gr, n, [&](const float(&xv)[V], const float(&gv)[V], int valid, int64_t i0) {
        double o[V];
#pragma unroll
        for (int q = 0; q < V; ++q) {
          const VjpTermF e = term(xv[q], gv[q], log_mode);
          o[q] = nan ? NAN : static_cast<double>(e.G) * kg - static_cast<double>(e.tw) * kr;
        }
        store_vec<scalar_t, V>(out, n, i0, aligned && valid == V, o);
      });
    }
  }
}

// [rows, chunks] partial sums: a workspace from the caching allocator
at::Tensor partial_workspace(const at::Tensor& x, const dim3& grid) {
  return at::empty({x.size(0) * int64_t(grid.x) * int64_t(sizeof(VjpSums))}, x.options().dtype(at::kByte));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_topk_backward_cuda(
    const at::Tensor& grad_in, const at::Tensor& x_in, const at::Tensor& b_in,
    const at::Tensor& t_in, bool largest, bool log_mode) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  BackwardIO w = backward_io(x_in, b_in, t_in);
  TORCH_CHECK(grad_in.sizes() == w.x.sizes(), "fastlapsum: grad must have the shape of x");
  if (w.x.numel() == 0) return {w.gx, w.gk, w.gt};
  const dim3 grid = row_grid(w.x.size(0), w.x.size(1), 8, kMaxChunks);
  const at::Tensor ws = partial_workspace(w.x, grid);
  const at::Tensor g = grad_in.to(w.x.scalar_type()).contiguous();
  const int64_t rows = w.x.size(0), n = w.x.size(1);
  const double sign = largest ? 1.0 : -1.0;
  const cudaStream_t stream = current_stream();
  auto* partial = reinterpret_cast<VjpSums*>(ws.mutable_data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.x.scalar_type(), "soft_topk_backward_cuda", [&] {
    launch_dependent(vjp_reduce_kernel<scalar_t>, grid, kThreads, 0, stream,
        g.const_data_ptr<scalar_t>(), w.x.const_data_ptr<scalar_t>(), w.b.const_data_ptr<double>(),
        w.t.const_data_ptr<double>(), partial, rows, n, sign, log_mode);
    launch_dependent(vjp_apply_kernel<scalar_t>, grid, kThreads, 0, stream,
        g.const_data_ptr<scalar_t>(), nullptr, w.x.const_data_ptr<scalar_t>(), w.b.const_data_ptr<double>(),
        w.t.const_data_ptr<double>(), partial, w.gx.mutable_data_ptr<scalar_t>(),
        w.gk.mutable_data_ptr<double>(), w.gt.mutable_data_ptr<double>(), rows, n, sign, log_mode);
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
  const dim3 grid = row_grid(w.x.size(0), w.x.size(1), 8, kMaxChunks);
  const at::Tensor ws = partial_workspace(w.x, grid);
  const at::Tensor gb = grad_b_in.to(at::kDouble).contiguous();
  const int64_t rows = w.x.size(0), n = w.x.size(1);
  const double sign = largest ? 1.0 : -1.0;
  const cudaStream_t stream = current_stream();
  auto* partial = reinterpret_cast<VjpSums*>(ws.mutable_data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.x.scalar_type(), "threshold_backward_cuda", [&] {
    launch_dependent(vjp_reduce_kernel<scalar_t>, grid, kThreads, 0, stream,
        nullptr, w.x.const_data_ptr<scalar_t>(), w.b.const_data_ptr<double>(),
        w.t.const_data_ptr<double>(), partial, rows, n, sign, false);
    launch_dependent(vjp_apply_kernel<scalar_t>, grid, kThreads, 0, stream,
        nullptr, gb.const_data_ptr<double>(), w.x.const_data_ptr<scalar_t>(), w.b.const_data_ptr<double>(),
        w.t.const_data_ptr<double>(), partial, w.gx.mutable_data_ptr<scalar_t>(),
        w.gk.mutable_data_ptr<double>(), w.gt.mutable_data_ptr<double>(), rows, n, sign, false);
  });
  return {w.gx, w.gk, w.gt};
}

TORCH_LIBRARY_IMPL(fastlapsum, CUDA, m) {
  m.impl("soft_topk_backward", &soft_topk_backward_cuda);
  m.impl("lapsum_threshold_backward", &lapsum_threshold_backward_cuda);
}

}  // namespace fastlapsum
