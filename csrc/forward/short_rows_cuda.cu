// Short rows on chip: one CTA per row runs the whole sort solver of DESIGN §1.1 and,
// for the forward op, writes the mask in the same kernel (one read, one write).
//
// The row is sorted descending in shared memory (CUB block radix sort on the order-
// preserving keys); the §1.1 prefix sums A and suffix sums B are block-wide scans of
// (reference, rescaled sum) pairs, whose combine rule is associative; every gap then
// evaluates Psi at its lower end in parallel, the first gap where Psi >= k holds the
// root, and its owner solves it in closed form. Deterministic: fixed arrangement and
// fixed scan trees.
#include <ATen/Dispatch.h>

#include <cfloat>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "../common/cuda_launch.cuh"
#include "../common/gpu_rows.cuh"
#include "gpu_keys.cuh"
#include "threshold_cuda.h"

namespace fastlapsum {
namespace {

constexpr int kShortThreads = 512;

// sum_i e^{(ref - s_i)/t} (prefix: ref = the lowest score so far) or e^{(s_i - ref)/t}
// (suffix: ref = the highest); sum == 0 marks "no score".
struct RefSum {
  double ref, sum;
};

// Combines a run with the run that follows it in scan order, both rescaled to the later
// run's reference. `down`: scores descend along the scan (prefix), else ascend (suffix).
template <bool kDown>
struct RefSumOp {
  double inv_t;
  __device__ RefSum operator()(const RefSum& a, const RefSum& b) const {
    if (b.sum == 0.0) return a;
    if (a.sum == 0.0) return b;
    const double d = kDown ? (b.ref - a.ref) : (a.ref - b.ref);  // <= 0
    return RefSum{b.ref, a.sum * exp(d * inv_t) + b.sum};
  }
};

template <typename scalar_t, int kItems>
__global__ void __launch_bounds__(kShortThreads)
short_rows_kernel(const scalar_t* __restrict__ x, const double* __restrict__ k_in, const double* __restrict__ t_in,
                  double* __restrict__ b_out, double* __restrict__ edge_out, int64_t* __restrict__ diag,
                  scalar_t* __restrict__ p_out, bool log_mode, int64_t n, double sign) {
  using KT = KeyTraits<scalar_t>;
  using Key = typename KT::Key;
  constexpr int kN = kShortThreads * kItems;
  using Sort = cub::BlockRadixSort<Key, kShortThreads, kItems>;
  using Scan = cub::BlockScan<RefSum, kShortThreads>;
  using Count = cub::BlockReduce<int, kShortThreads>;
  using MinPos = cub::BlockReduce<int, kShortThreads>;
  __shared__ union {
    typename Sort::TempStorage sort;
    double vals[kN];  // sorted scores, then the suffix sums
  } sm;
  __shared__ typename Scan::TempStorage scan;
  __shared__ typename Count::TempStorage count;
  __shared__ int s_counts[3];
  __shared__ double s_b, s_last;
  __shared__ double s_warp_ref[kShortThreads / 32], s_warp_sum[kShortThreads / 32];
  __shared__ int s_pos;

  const int64_t r = blockIdx.x;
  const int tid = threadIdx.x;
  const scalar_t* row = x + r * n;
  const double k = k_in[r], t = t_in[r];

  // Striped loads (coalesced); the scores stay in registers for the mask.
  double s[kItems];
  Key keys[kItems];
  int nan = 0, pinf = 0, ninf = 0;
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const int64_t i = q * kShortThreads + tid;
    s[q] = i < n ? sign * static_cast<double>(row[i]) : 0.0;
    keys[q] = i < n ? KT::key(s[q]) : Key(0);  // padding sorts below every score
    if (i < n) {
      nan += s[q] != s[q];
      pinf += s[q] == INFINITY;
      ninf += s[q] == -INFINITY;
    }
  }
  const int c0 = Count(count).Sum(nan);
  __syncthreads();
  const int c1 = Count(count).Sum(pinf);
  __syncthreads();
  const int c2 = Count(count).Sum(ninf);
  if (tid == 0) { s_counts[0] = c0; s_counts[1] = c1; s_counts[2] = c2; }
  __syncthreads();
  const int n_pinf = s_counts[1], n_ninf = s_counts[2];
  double b, edge, kf;
  const bool settled = settle_row(k, t, static_cast<double>(n), s_counts[0], n_pinf, n_ninf, &b, &edge, &kf);

  if (!settled) {  // uniform across the block
    const double inv_t = inv_temperature(t);
    Sort(sm.sort).SortDescending(keys);  // blocked: thread tid holds positions tid*kItems + q
    __syncthreads();
    const int first = n_pinf, end = static_cast<int>(n) - n_ninf;  // finite positions [first, end)
    double v[kItems];
#pragma unroll
    for (int q = 0; q < kItems; ++q) {
      const int j = tid * kItems + q;
      v[q] = KT::value(keys[q]);
      sm.vals[j] = v[q];
      if (j == end - 1) s_last = v[q];
    }
    __syncthreads();
    // Prefix P_j = sum_{first <= i <= j} e^{(s_j - s_i)/t}, in this thread's positions.
    RefSum pre[kItems];
#pragma unroll
    for (int q = 0; q < kItems; ++q) {
      const int j = tid * kItems + q;
      pre[q] = (j >= first && j < end) ? RefSum{v[q], 1.0} : RefSum{0.0, 0.0};
    }
    RefSum pre_total;
    Scan(scan).InclusiveScan(pre, pre, RefSumOp<true>{inv_t}, pre_total);
    __syncthreads();
    // Suffix Q_j = sum_{j <= i < end} e^{(s_i - s_j)/t}: the same scan over the reversed order,
    // read from shared memory and written back there (by position) for the owners.
    RefSum suf[kItems];
#pragma unroll
    for (int q = 0; q < kItems; ++q) {
      const int j = kN - 1 - (tid * kItems + q);
      suf[q] = (j >= first && j < end) ? RefSum{sm.vals[j], 1.0} : RefSum{0.0, 0.0};
    }
    __syncthreads();
    Scan(scan).InclusiveScan(suf, suf, RefSumOp<false>{inv_t});
#pragma unroll
    for (int q = 0; q < kItems; ++q) sm.vals[kN - 1 - (tid * kItems + q)] = suf[q].sum;
    __syncthreads();
    // Gap j lies between s_{j-1} (above) and s_j (below), for j in [first, end]; Psi at its
    // lower end s_j is  C - 1/2 e^{(s_j - s_{j-1})/t} A + 1/2 B  with C = j - first,
    // A = P_{j-1} and B = Q_j. Each position j < end tests its own gap.
    int found = kN + 1;
    // P_{tid*kItems - 1} lives in the previous thread: a shuffle, or shared memory across warps.
    const int lane = tid & 31, warp = tid >> 5;
    double up_ref = __shfl_up_sync(0xffffffffu, pre[kItems - 1].ref, 1);
    double up_sum = __shfl_up_sync(0xffffffffu, pre[kItems - 1].sum, 1);
    if (lane == 31) { s_warp_ref[warp] = pre[kItems - 1].ref; s_warp_sum[warp] = pre[kItems - 1].sum; }
    __syncthreads();
    if (lane == 0) {
      up_ref = warp > 0 ? s_warp_ref[warp - 1] : 0.0;
      up_sum = warp > 0 ? s_warp_sum[warp - 1] : 0.0;
    }
    double prev_ref = up_ref, prev_sum = up_sum;  // P_{j-1}
#pragma unroll
    for (int q = 0; q < kItems; ++q) {
      const int j = tid * kItems + q;
      if (j >= first && j < end && found > kN) {
        const double C = static_cast<double>(j - first);
        const double A = j > first ? prev_sum : 0.0;
        const double hi = j > first ? prev_ref : INFINITY;
        const double B = sm.vals[j];
        if (psi_at_lo(C, A, B, hi, v[q], t) >= kf) found = j;
      }
      prev_ref = pre[q].ref;
      prev_sum = pre[q].sum;
    }
    const int jstar_local = MinPos(count).Reduce(found, MinInt{});
    if (tid == 0) s_pos = jstar_local < kN + 1 ? jstar_local : end;  // none: the gap below all
    __syncthreads();
    const int jstar = s_pos;
    // The owner of position jstar - 1 holds A and hi; the lower end is s_jstar (or -inf).
    if (jstar == end && tid == 0) {
      // below every finite score: A = the whole prefix, hi = the lowest finite score
      s_b = solve_interval(static_cast<double>(end - first), pre_total.sum, 0.0, s_last, -INFINITY, kf, t);
    }
#pragma unroll
    for (int q = 0; q < kItems; ++q) {
      const int j = tid * kItems + q;
      if (j == jstar && jstar < end) {
        const double C = static_cast<double>(j - first);
        const double A = j > first ? (q > 0 ? pre[q - 1].sum : up_sum) : 0.0;
        const double hi = j > first ? (q > 0 ? pre[q - 1].ref : up_ref) : INFINITY;
        s_b = solve_interval(C, A, sm.vals[j], hi, v[q], kf, t);
      }
    }
    __syncthreads();
    b = s_b;
  }
  if (tid == 0) {
    b_out[r] = sign * b;
    edge_out[r] = edge;
    diag[3 * r] = settled ? kPathDirect : kPathSort;
    diag[3 * r + 1] = settled ? 0 : n - n_pinf - n_ninf;
    diag[3 * r + 2] = 0;
  }
  if (p_out == nullptr) return;
  scalar_t* prow = p_out + r * n;
  const double inv_t = inv_temperature(t);
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const int64_t i = q * kShortThreads + tid;
    if (i >= n) continue;
    prow[i] = static_cast<scalar_t>(log_mode ? lapsum_log_prob(s[q], b, t, edge) : mask_prob<scalar_t>(s[q], b, t, inv_t, edge));
  }
}

}  // namespace

void solve_short_rows_cuda(const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest,
                           at::Tensor& b, at::Tensor& edge, at::Tensor& diag, at::Tensor* p,
                           bool log_mode) {
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n <= kShortRowMax, "fastlapsum: internal: row too long for the on-chip solver");
  if (rows == 0) return;
  const double sign = largest ? 1.0 : -1.0;
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "solve_short_rows_cuda", [&] {
    scalar_t* pp = p != nullptr ? p->mutable_data_ptr<scalar_t>() : nullptr;
    const auto launch = [&](auto kernel) {
      kernel<<<static_cast<unsigned>(rows), kShortThreads, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), k.const_data_ptr<double>(), t.const_data_ptr<double>(),
          b.mutable_data_ptr<double>(), edge.mutable_data_ptr<double>(), diag.mutable_data_ptr<int64_t>(), pp,
          log_mode, n, sign);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (n <= kShortThreads * 2) launch(short_rows_kernel<scalar_t, 2>);
    else launch(short_rows_kernel<scalar_t, 8>);
  });
}

}  // namespace fastlapsum
