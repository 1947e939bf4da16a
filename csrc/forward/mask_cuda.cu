// CUDA mask writer: the soft (or log) LapSum mask from each row's fp64 threshold.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "../common/cuda_launch.cuh"
#include "../common/gpu_rows.cuh"
#include "../common/lapsum_math.h"
#include "../common/op_io.h"
#include "../ops.h"

namespace fastlapsum {
namespace {

template <typename scalar_t, bool kLog>
__global__ void lapsum_mask_kernel(const scalar_t* __restrict__ x, const double* __restrict__ b,
                                   const double* __restrict__ t, const double* __restrict__ edge,
                                   scalar_t* __restrict__ p, int64_t rows, int64_t n, double sign) {
  begin_dependent_grid();
  constexpr int V = vec_width<scalar_t>();
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const double br = sign * b[r], tr = t[r], inv_t = inv_temperature(tr), er = edge[r];
    scalar_t* pr = p + r * n;
    const bool aligned = is_aligned16(pr);
    stream_row<scalar_t>(x + r * n, nullptr, n, [&](const double(&xv)[V], const double(&)[V], int valid, int64_t i0) {
      double o[V];
#pragma unroll
      for (int q = 0; q < V; ++q) {
        const double s = sign * xv[q];
        o[q] = kLog ? lapsum_log_prob(s, br, tr, er) : mask_prob<scalar_t>(s, br, tr, inv_t, er);
      }
      store_vec<scalar_t, V>(pr, n, i0, aligned && valid == V, o);
    });
  }
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
  const dim3 grid = row_grid(rows, n, 16, 4096);
  const double sign = largest ? 1.0 : -1.0;
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "lapsum_mask_cuda", [&] {
    const auto kernel = log_mode ? lapsum_mask_kernel<scalar_t, true> : lapsum_mask_kernel<scalar_t, false>;
    launch_dependent(kernel, grid, kThreads, 0, stream, x.const_data_ptr<scalar_t>(), b.const_data_ptr<double>(),
                     t.const_data_ptr<double>(), edge.const_data_ptr<double>(), p.mutable_data_ptr<scalar_t>(), rows,
                     n, sign);
  });
  return p;
}

TORCH_LIBRARY_IMPL(fastlapsum, CUDA, m) { m.impl("lapsum_mask", &lapsum_mask_cuda); }

}  // namespace fastlapsum
