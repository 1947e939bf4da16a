// CUDA mask writer: the soft (or log) LapSum mask from each row's fp64 threshold.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <type_traits>

#include "../../common/cuda_launch.cuh"
#include "../../common/gpu_rows.cuh"
#include "../../common/lapsum_math.h"
#include "../../common/op_io.h"
#include "../../ops.h"
#include "plan_soft.h"

namespace fastlapsum {
namespace {

// The soft mask of an fp32/fp16/bf16 row without fp64 arithmetic. The fp64 path converts
// every score and result (fp32 <-> fp64 conversions run at quarter rate on sm_90), which made
// the mask pass compute-bound next to its memory floor. Here u = (s - b)/t is a float-float
// (b and 1/t split into two floats each, s - b by two-sums, the product's error by an FMA),
// so u's error stays ~2^-48 relative, as good as fp64's for the exponential: p keeps ~2 ulp
// of relative accuracy deep in the tails, as lapsum_prob_f does (~32 FP32-pipe operations
// per score in place of six conversions). Rows whose threshold or temperature lies far
// outside fp32's range (or b infinite) keep the fp64 math.
struct MaskProbF32 {
  float sign, b_hi, b_lo, i_hi, i_lo;
  __device__ static bool usable(double b, double inv_t) {
    return fabs(b) <= 0x1p100 && inv_t >= 0x1p-60 && inv_t <= 0x1p60;
  }
  __device__ MaskProbF32(double sign_d, double b, double inv_t)
      : sign(static_cast<float>(sign_d)),
        b_hi(static_cast<float>(b)),
        b_lo(static_cast<float>(b - static_cast<double>(b_hi))),
        i_hi(static_cast<float>(inv_t)),
        i_lo(static_cast<float>(inv_t - static_cast<double>(i_hi))) {}
  // hi + lo == a + b exactly (Knuth's two-sum: no order between |a| and |b| needed)
  __device__ static __forceinline__ void two_sum(float a, float b, float& hi, float& lo) {
    hi = a + b;
    const float bb = hi - a;
    lo = (a - (hi - bb)) + (b - bb);
  }
  // x: the element as stored; +-inf give 1 / 0, NaN gives NaN
  __device__ __forceinline__ float operator()(float x) const {
    float d1, e1, d_hi, d_lo;
    two_sum(sign * x, -b_hi, d1, e1);  // s - b_hi, exactly (an infinite s: d1 infinite, e1 NaN)
    const float u1 = d1 * i_hi;        // u within a few ulp
    if (!(fabsf(u1) <= 100.0f)) return u1 > 0.0f ? 1.0f : (u1 < 0.0f ? 0.0f : u1);  // p < 2^-144, or NaN
    two_sum(d1, e1 - b_lo, d_hi, d_lo);  // s - b, renormalised (|e1 - b_lo| can exceed |d1|)
    const float u_hi = d_hi * i_hi;
    const float u_lo = fmaf(d_hi, i_hi, -u_hi) + fmaf(d_hi, i_lo, d_lo * i_hi);
    const bool below = u_hi <= 0.0f;
    const float a_hi = below ? u_hi : -u_hi, a_lo = below ? u_lo : -u_lo;  // -|u|
    const float e = expf(a_hi), e_u = fmaf(e, a_lo, e);                  // e^{a_hi} (1 + a_lo)
    return below ? 0.5f * e_u : 1.0f - 0.5f * e_u;
  }
};

// One row's mask in fp64 arithmetic: fp64 rows, the log mask, and the rows MaskProbF32
// cannot take.
template <typename scalar_t, bool kLog>
__device__ __forceinline__ void mask_row_f64(const scalar_t* __restrict__ xr, scalar_t* __restrict__ pr, int64_t n,
                                             double sign, double br, double tr, double er) {
  constexpr int V = vec_width<scalar_t>();
  const double inv_t = inv_temperature(tr);
  const bool aligned = is_aligned16(pr);
  stream_row<scalar_t>(xr, nullptr, n, [&](const double(&xv)[V], const double(&)[V], int valid, int64_t i0) {
    double o[V];
#pragma unroll
    for (int q = 0; q < V; ++q) {
      const double s = sign * xv[q];
      o[q] = kLog ? lapsum_log_prob(s, br, tr, er) : mask_prob<scalar_t>(s, br, tr, inv_t, er);
    }
    store_vec<scalar_t, V>(pr, n, i0, aligned && valid == V, o);
  });
}

template <typename scalar_t, bool kLog>
__global__ void lapsum_mask_kernel(const scalar_t* __restrict__ x, const double* __restrict__ b,
                                   const double* __restrict__ t, const double* __restrict__ edge,
                                   scalar_t* __restrict__ p, int64_t rows, int64_t n, double sign) {
  begin_dependent_grid();
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    mask_row_f64<scalar_t, kLog>(x + r * n, p + r * n, n, sign, sign * b[r], t[r], edge[r]);
}

// The soft mask of fp32/fp16/bf16 rows by MaskProbF32 (rows it cannot take: the fp64 math),
// 24 scores per thread in flight (96 bytes of fp32): four blocks per SM at 64 registers.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads, 4)
lapsum_mask_f32_kernel(const scalar_t* __restrict__ x, const double* __restrict__ b, const double* __restrict__ t,
                       const double* __restrict__ edge, scalar_t* __restrict__ p, int64_t rows, int64_t n,
                       double sign) {
  begin_dependent_grid();
  constexpr int V = vec_width<scalar_t>();
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const double br = sign * b[r], inv_t = inv_temperature(t[r]);
    scalar_t* pr = p + r * n;
    if (!MaskProbF32::usable(br, inv_t)) {  // uniform across the block
      mask_row_f64<scalar_t, false>(x + r * n, pr, n, sign, br, t[r], edge[r]);
      continue;
    }
    const MaskProbF32 prob(sign, br, inv_t);
    const bool aligned = is_aligned16(pr);
    stream_row<scalar_t, float, 24 / V>(x + r * n, nullptr, n, [&](const float(&xv)[V], const float(&)[V], int valid, int64_t i0) {
      float o[V];
#pragma unroll
      for (int q = 0; q < V; ++q) o[q] = prob(xv[q]);
      store_vec<scalar_t, V>(pr, n, i0, aligned && valid == V, o);
    });
  }
}

// The kernel for a dtype and mode: fp32/fp16/bf16 soft masks take the fp32 kernel.
template <typename scalar_t>
auto mask_kernel(bool log_mode) {
  if constexpr (std::is_same<scalar_t, double>::value)
    return log_mode ? lapsum_mask_kernel<scalar_t, true> : lapsum_mask_kernel<scalar_t, false>;
  else
    return log_mode ? lapsum_mask_kernel<scalar_t, true> : lapsum_mask_f32_kernel<scalar_t>;
}

}  // namespace

at::Tensor lapsum_mask_cuda(const at::Tensor& x_in, const at::Tensor& b_in, const at::Tensor& t_in,
                            const at::Tensor& edge_in, bool largest, bool log_mode) {
  check_rows(x_in, {{&b_in, kBadB}, {&t_in, kBadT}, {&edge_in, kBadEdge}});
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), b = b_in.contiguous(), t = t_in.contiguous(),
                   edge = edge_in.contiguous();
  at::Tensor p = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  if (x.numel() == 0) return p;
  const double sign = largest ? 1.0 : -1.0;
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "lapsum_mask_cuda", [&] {
    const auto kernel = mask_kernel<scalar_t>(log_mode);
    const dim3 grid = plan_mask_cuda(rows, n, soft_launch_tuning(compute_capability()));
    launch_dependent(kernel, grid, kThreads, 0, stream, x.const_data_ptr<scalar_t>(), b.const_data_ptr<double>(),
                     t.const_data_ptr<double>(), edge.const_data_ptr<double>(), p.mutable_data_ptr<scalar_t>(), rows,
                     n, sign);
  });
  return p;
}

TORCH_LIBRARY_IMPL(fastlapsum, CUDA, m) { m.impl("lapsum_mask", &lapsum_mask_cuda); }

}  // namespace fastlapsum
