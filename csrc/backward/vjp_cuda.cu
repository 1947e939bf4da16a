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
  double inv_t;
  __device__ VjpSums operator()(VjpSums a, const VjpSums& b) const {
    a.merge(b, inv_t);
    return a;
  }
};

// e^{-x} for x >= 0 (+inf: 0) in fp32, one MUFU op (ex2.approx.ftz, ~2 ulp) of an argument
// prescaled in fp64.
__device__ __forceinline__ float exp2_neg(double x2) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(-static_cast<float>(x2)));
  return y;
}
constexpr double kLog2e = 1.4426950408889634;

// e^{-x} for folding a vector's sums into a thread's: a ratio of sums does not see the
// rounding of a factor they share.
struct ExpNegF32 {
  __device__ double operator()(double x) const { return static_cast<double>(exp2_neg(x * kLog2e)); }
};

// The elements of one fp32/fp16/bf16 row (fp64 rows use vjp_term): the distance d = s - b
// and its offsets from the row's reference in fp64 (in saturated rows the weighted scores
// sit many t from b, where an fp32 d would move a weight by |d|/t fp32 ulps), the
// weights' exponentials in fp32 (one MUFU op, ex2.approx.ftz) and the sums per vector in
// fp32. An infinite or NaN d (an infinite score or threshold) has a = +inf: no weight and
// no term, as in vjp_term.
struct VjpTermsF32 {
  float sign;
  double b, l2;  // l2 = log2(e)/t
  __device__ VjpTermsF32(double sign_d, double b_, double inv_t)
      : sign(static_cast<float>(sign_d)), b(b_), l2(fmin(inv_t * kLog2e, 1.7976931348623157e308)) {}
  // x: the element as stored (the row's sign not yet applied)
  __device__ __forceinline__ double dist(float x) const { return static_cast<double>(sign * x) - b; }
  __device__ __forceinline__ static double abs_dist(double d) { return is_finite(d) ? fabs(d) : INFINITY; }
  // e^{-x/t} for a distance x >= 0 (+inf: 0; l2 is capped so that x = 0 gives 1)
  __device__ __forceinline__ float exp_neg(double x) const { return exp2_neg(x * l2); }
};

// One vector's sums in fp32, relative to its own nearest element (m = its |d|, dref = its d).
template <int V>
__device__ __forceinline__ VjpSums vector_sums(const VjpTermsF32& term, const float (&xv)[V],
                                               const float (&gv)[V], int valid, bool log_mode) {
  // two passes over the vector's registers, d recomputed (an fp64 array of V would halve
  // the kernel's occupancy): its nearest element, then the sums relative to it
  double amin = INFINITY, dref = 0.0;
#pragma unroll
  for (int q = 0; q < V; ++q) {
    const double d = term.dist(xv[q]), a = q < valid ? VjpTermsF32::abs_dist(d) : INFINITY;
    if (a < amin) {
      amin = a;
      dref = d;
    }
  }
  VjpSums v;
  if (!(amin < INFINITY)) return v;
  float tw = 0.0f, G = 0.0f, twd = 0.0f, Gd = 0.0f, Ga = 0.0f, Gad = 0.0f;
#pragma unroll
  for (int q = 0; q < V; ++q) {
    const double d = term.dist(xv[q]), a = q < valid ? VjpTermsF32::abs_dist(d) : INFINITY;
    if (!(a < INFINITY)) continue;
    const float wh = 0.5f * term.exp_neg(a - amin), dd = static_cast<float>(d - dref);
    float gw = gv[q];
    if (log_mode) {
      if (d <= 0.0) {  // log p = u + log 1/2: an absolute term
        Ga += gv[q];
        Gad += gv[q] * dd;
        gw = 0.0f;
      } else {  // d log p / d u = tw / p
        gw = gv[q] / (1.0f - 0.5f * term.exp_neg(a));
      }
    }
    tw += wh;
    twd += wh * dd;
    G += gw * wh;
    Gd += gw * wh * dd;
  }
  v.m = amin;
  v.dref = dref;
  v.tw = tw; v.G = G; v.twd = twd; v.Gd = Gd; v.Ga = Ga; v.Gad = Gad;
  return v;
}

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
          if (q < valid) acc.add(vjp_term(sign * xv[q], br, inv_t, gv[q], log_mode), inv_t);
      });
    } else {  // fp32 terms, summed per vector in fp32, then in fp64
      const VjpTermsF32 term(sign, br, inv_t);
      stream_row<scalar_t, float>(x + r * n, gr, n, [&](const float(&xv)[V], const float(&gv)[V], int valid, int64_t) {
        acc.merge(vector_sums<V>(term, xv, gv, valid, log_mode), inv_t, ExpNegF32{});
      });
    }
    const VjpSums total = Reduce(tmp).Reduce(acc, SumOp{inv_t});
    if (threadIdx.x == 0) partial[r * gridDim.x + blockIdx.x] = total;
    __syncthreads();
  }
}

// Sum a row's partials in a fixed order (the same answer every run): thread j folds
// partials j, j + kThreads, ..., then one block reduction. All threads load, so the
// elementwise pass does not wait on one warp's chain of loads.
__device__ VjpSums fold_partials(const VjpSums* partial, int chunks, double inv_t) {
  using Reduce = cub::BlockReduce<VjpSums, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ VjpSums row_sum;
  VjpSums acc;
  for (int c = threadIdx.x; c < chunks; c += kThreads) acc.merge(partial[c], inv_t);
  const VjpSums total = Reduce(tmp).Reduce(acc, SumOp{inv_t});
  if (threadIdx.x == 0) row_sum = total;
  __syncthreads();
  const VjpSums s = row_sum;
  __syncthreads();
  return s;
}

// d L / d x for both VJPs: of the mask (grad given) or of the threshold (grad == nullptr,
// grad_b given: one value per row). Each element's weight is taken relative to the row's
// nearest score (wh = tw e^{m/t}), so it does not underflow where tw alone would. Bounded
// to 3 blocks per SM (80 registers, no spills on sm_90).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, 3) vjp_apply_kernel(const scalar_t* __restrict__ grad, const double* __restrict__ grad_b,
                                 const scalar_t* __restrict__ x, const double* __restrict__ b,
                                 const double* __restrict__ t, const VjpSums* __restrict__ partial,
                                 scalar_t* __restrict__ gx, double* __restrict__ gk, double* __restrict__ gt,
                                 int64_t rows, int64_t n, double sign, bool log_mode) {
  begin_dependent_grid();
  constexpr int V = vec_width<scalar_t>();
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const double br = sign * b[r], tr = t[r], inv_t = inv_temperature(tr);
    const VjpSums sums = fold_partials(partial + r * gridDim.x, gridDim.x, inv_t);
    const RowVjp v = grad != nullptr ? mask_vjp(sums, br, tr, log_mode)
                                     : threshold_vjp(sums, grad_b[r], br, tr, sign);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
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
        for (int q = 0; q < V; ++q) {
          const VjpTerm e = vjp_term(sign * xv[q], br, inv_t, 0.0, false);  // a and d only
          const double wh = 0.5 * exp(-(e.a - v.m) * inv_t);
          o[q] = sign * v.grad_score(wh, gv[q], e.d, e.a);
        }
        store_vec<scalar_t, V>(out, n, i0, aligned && valid == V, o);
      });
    } else {  // fp32 weights; the row's coefficients can exceed fp32, so they combine in fp64
      const VjpTermsF32 term(sign, br, inv_t);
      stream_row<scalar_t, float>(x + r * n, gr, n, [&](const float(&xv)[V], const float(&gv)[V], int valid, int64_t i0) {
        double o[V];
#pragma unroll
        for (int q = 0; q < V; ++q) {
          const double d = term.dist(xv[q]), a = VjpTermsF32::abs_dist(d);
          o[q] = sign * v.grad_score(0.5f * term.exp_neg(a - v.m), gv[q], d, a);
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
