// Short rows on chip: the whole sort solver of DESIGN §1.1 and, for the forward op, the
// mask in the same kernel (one read of the row to solve, one re-read from L1/L2 and one
// write for the mask). Tiny rows (kSoftWarpRows) run a warp per row, the row in registers
// (warp_rows.cuh); the others a CTA per row (sorted_solve.cuh).
//
// In the CTA kernel, one census of the row (non-finite counts, which key bits vary, the
// finite keys' range) settles the rows without an interior root, sizes the bucket pass and
// bounds the radix sort to the varying bits. The warp kernel needs only the non-finite counts.
// Both first try the outer gap (§1.1.1, outer_gap.cuh): a row whose root lies beyond its max
// (or min), the common case of a small budget, skips the sort and the scan.
#include <ATen/Dispatch.h>

#include <cstdint>
#include <type_traits>

#include "../../common/cuda_launch.cuh"
#include "../../common/gpu_rows.cuh"
#include "outer_gap.cuh"
#include "sorted_solve.cuh"
#include "threshold_cuda.h"
#include "tuning.cuh"
#include "warp_rows.cuh"

namespace fastlapsum {
namespace {

static_assert(kShortThreads == kSortedThreads, "the CTA regime (plan_soft.h) runs sorted_solve's block");

// Position i of a row of n >= 1 scores, or its last one past the end.
__device__ __forceinline__ unsigned clamp_index(int i, int n) { return static_cast<unsigned>(i < n ? i : n - 1); }

// The row's mask (or log mask) from its threshold, re-reading the scores (from L1/L2), item
// q of thread tid (of kStride) at q * kStride + tid (n: a short row's, int): all loads
// first, then branch-free per-element math, so the loads and exponentials overlap. Below
// fp64 the mask stays in fp32 from the exponential to the store (lapsum_prob_f).
template <typename scalar_t, int kItems, int kStride>
__device__ __forceinline__ void write_mask(const scalar_t* __restrict__ row, scalar_t* __restrict__ prow, int n,
                                           double sign, double b, double t, double edge, bool log_mode, int tid) {
  // Unconditional loads of clamped positions (past the row: its last score, unused): the
  // compiler otherwise rebuilds each predicated load's address from the row index. An empty
  // row has no position to clamp to.
  if (n == 0) return;
  double s[kItems];
#pragma unroll
  for (int q = 0; q < kItems; ++q) s[q] = sign * static_cast<double>(row[clamp_index(q * kStride + tid, n)]);
  const auto store = [&](int q, auto p) {
    const int i = q * kStride + tid;
    if (i < n) prow[clamp_index(i, n)] = static_cast<scalar_t>(p);
  };
  if (log_mode) {
#pragma unroll
    for (int q = 0; q < kItems; ++q) store(q, lapsum_log_prob(s[q], b, t, edge));
    return;
  }
  const double inv_t = inv_temperature(t);
  const auto mask = [&] {
#pragma unroll
    for (int q = 0; q < kItems; ++q) {
      if constexpr (std::is_same<scalar_t, double>::value) store(q, lapsum_prob(s[q], b, t, edge));
      else store(q, lapsum_prob_f(s[q], b, inv_t, edge));
    }
  };
  // The same call on both sides: this side lets the compiler drop the per-score tests of an
  // infinite b (the row's, uniform).
  if (b == INFINITY || b == -INFINITY) mask();
  else mask();
}

// A row's threshold, edge and diagnostics: `sorted`, the finite scores the sort ordered (0
// where it did not run) tells the sort path from the outer gap.
__device__ __forceinline__ void write_row_result(double* b_out, double* edge_out, int64_t* diag, int64_t r,
                                                 double sign, double b, double edge, bool settled, int sorted) {
  b_out[r] = sign * b;
  edge_out[r] = edge;
  diag[3 * r] = settled ? kPathDirect : sorted > 0 ? kPathSort : kPathOuterGap;
  diag[3 * r + 1] = sorted;
  diag[3 * r + 2] = 0;
}

template <typename scalar_t, int kItems>
__global__ void __launch_bounds__(kShortThreads, 1)
short_rows_kernel(const scalar_t* __restrict__ x, const double* __restrict__ k_in, const double* __restrict__ t_in,
                  double* __restrict__ b_out, double* __restrict__ edge_out, int64_t* __restrict__ diag,
                  scalar_t* __restrict__ p_out, bool log_mode, int64_t n, double sign) {
  begin_dependent_grid();
  using SK = SortKey<scalar_t>;
  using Key = typename SK::Key;
  __shared__ union {
    SortStorage<Key, kItems> sort;
    SolveStorage solve;  // after the sort
  } sm;
  __shared__ CensusStorage<Key> census;
  __shared__ double last_v[kWarps];
  __shared__ GapSumStorage gap_part;
  static_assert(32 * kItems < 1024, "take_census packs a warp's counts in 10 bits");

  const int64_t r = blockIdx.x;
  const int tid = threadIdx.x;
  const scalar_t* row = x + r * n;
  const double k = k_in[r], t = t_in[r];

  // Striped loads (coalesced); only the keys stay (the mask re-reads the row from L2).
  Key keys[kItems];
  NonFiniteCount count;
  KeyStats<Key> stats;
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const int64_t i = q * kShortThreads + tid;
    keys[q] = 0;  // below every score's key (outer_gap_block skips it)
    if (i < n) {
      const double s = sign * static_cast<double>(row[i]);
      keys[q] = SK::key(s);
      count.add(s);
      stats.add(keys[q], is_finite(s));
    }
  }
  const Census<Key> c = take_census(census, count.nan, count.pinf, count.ninf, stats);
  double b, edge, kf;
  const bool settled = settle_row(k, t, static_cast<double>(n), c.nan, c.pinf, c.ninf, &b, &edge, &kf);

  int sorted = 0;
  if (!settled) {  // uniform across the block, as is the gap's test
    const int first = c.pinf, end = static_cast<int>(n) - c.ninf;  // finite positions [first, end) once sorted
    b = outer_gap_block<Key, SK, kItems>(gap_part, keys, c.key_min, c.key_max, kf, end - first, t);
    if (b != b) {
      sorted = end - first;
      sort_descending<Key, SK, kItems>(sm.sort, keys, n, c);  // positions [0, n) hold the row
      b = solve_sorted<Key, SK, kItems>(sm.solve, last_v, keys, first, end, kf, t, SortedTails{});
    }
  }
  if (tid == 0) write_row_result(b_out, edge_out, diag, r, sign, b, edge, settled, sorted);
  if (p_out == nullptr) return;
  write_mask<scalar_t, kItems, kShortThreads>(row, p_out + r * n, static_cast<int>(n), sign, b, t, edge, log_mode,
                                              tid);
}

// One row per group of kLanes lanes (a warp, or 8 / 16 lanes for rows of at most that many
// scores), the plan's warps per CTA, n <= kLanes * kItems: striped loads (coalesced); the
// census (non-finite counts, each lane's finite extremes); the outer gap, re-reading the row
// (from L1), so that no keys are live while it runs; where it fails, the keys padded with
// 0 (below every score's key, so the padding sorts last) from a third read, the sort and
// solve of warp_rows.cuh; the mask re-reading the row. A group past the last row leaves at
// once (whole groups only: the shuffles below need all of the group's lanes; the groups of
// a warp shuffle under their own masks, so they may part ways).
template <typename scalar_t, int kItems, int kLanes>
__global__ void __launch_bounds__(SoftTuning::kWarpRowsMaxWarps * 32,
                                  SoftTuning::warp_min_blocks(kItems, sizeof(typename SortKey<scalar_t>::Key)))
warp_rows_kernel(const scalar_t* __restrict__ x, const double* __restrict__ k_in, const double* __restrict__ t_in,
                 double* __restrict__ b_out, double* __restrict__ edge_out, int64_t* __restrict__ diag,
                 scalar_t* __restrict__ p_out, bool log_mode, int64_t rows, int64_t n, double sign) {
  begin_dependent_grid();
  using SK = SortKey<scalar_t>;
  using Key = typename SK::Key;
  using G = LaneGroup<kLanes>;
  const int lane = G::lane();
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kLanes) + threadIdx.x / kLanes;
  if (r >= rows) return;
  const scalar_t* row = x + r * n;
  const double k = k_in[r], t = t_in[r];

  const int nn = static_cast<int>(n);  // at most warp_row_max
  // Scores in SK::Score (fp32 for 16/32-bit rows: exact, and no fp64 conversion per score).
  using Score = typename SK::Score;
  const Score sgn = static_cast<Score>(sign);
  const auto score = [&](int q) {  // position q * kLanes + lane, NaN past the row
    const int i = q * kLanes + lane;
    const Score s = sgn * static_cast<Score>(row[clamp_index(i, nn)]);
    return i < nn ? s : Score(NAN);
  };
  NonFiniteCount count;
  KeyStats<Key> ext;  // min/max of the lane's finite keys
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const int i = q * kLanes + lane;
    if (i < nn) {  // a load of its own: sharing score(q)'s would keep every score live to the sort
      const Score s = sgn * static_cast<Score>(row[i]);
      count.add(s);
      ext.add(SK::key(s), is_finite(s));
    }
  }
  const int nan = G::sum(count.nan), pinf = G::sum(count.pinf), ninf = G::sum(count.ninf);
  double b, edge, kf;
  const bool settled = settle_row(k, t, static_cast<double>(n), nan, pinf, ninf, &b, &edge, &kf);
  int sorted = 0;
  if (!settled) {  // uniform across the group, as is the gap's test
    b = outer_gap_group<SK, kItems, kLanes>(score, ext.min, ext.max, kf, nn - pinf - ninf, t);
    if (b != b) {
      sorted = nn - pinf - ninf;
      Key keys[kItems];
#pragma unroll
      for (int q = 0; q < kItems; ++q) {
        const Score s = score(q);
        keys[q] = s == s ? SK::key(s) : Key(0);
      }
      warp_sort_descending<Key, kItems, kLanes>(keys);  // positions [0, n) hold the row, padding after
      b = solve_sorted_warp<Key, SK, kItems, kLanes>(keys, pinf, nn - ninf, kf, t);
    }
  }
  if (lane == 0) write_row_result(b_out, edge_out, diag, r, sign, b, edge, settled, sorted);
  if (p_out == nullptr) return;
  write_mask<scalar_t, kItems, kLanes>(row, p_out + r * n, nn, sign, b, t, edge, log_mode, lane);
}

// The warp regime (soft_regime_cuda, plan_soft.h) holds rows of at most warp_row_max.
static_assert(SoftTuning::warp_row_max(false) <= 32 * 32 && SoftTuning::warp_row_max(true) <= 32 * 32,
              "warp_rows walks a lane's keys a lane each: at most 32 keys a lane");

// The warp kernel of the plan's lanes and keys a lane (plan_on_chip); only kernels up to the
// dtype's warp_row_max are built.
template <typename scalar_t, int kItems, int kLanes, typename Launch>
void launch_warp_rows(const SoftPlan& plan, const Launch& launch) {
  if constexpr (kLanes < 32) {
    if (plan.lanes > kLanes) return launch_warp_rows<scalar_t, kItems, 2 * kLanes>(plan, launch);
  } else if constexpr (kItems < 32 && 32 * kItems < SoftTuning::warp_row_max(std::is_same<scalar_t, double>::value)) {
    if (plan.items > kItems) return launch_warp_rows<scalar_t, 2 * kItems, kLanes>(plan, launch);
  }
  TORCH_CHECK(plan.lanes == kLanes && plan.items == kItems, "fastlapsum: internal: no warp-row kernel for the plan");
  launch(warp_rows_kernel<scalar_t, kItems, kLanes>);
}

}  // namespace

void solve_short_rows_cuda(const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest,
                           const SoftPlan& plan, at::Tensor& b, at::Tensor& edge, at::Tensor& diag, at::Tensor* p,
                           bool log_mode) {
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(on_chip(plan.regime) && plan.regime == soft_regime_cuda(n, x.scalar_type(), kMethodSort),
              "fastlapsum: internal: not a regime of the on-chip solver");
  if (rows == 0) return;
  const double sign = largest ? 1.0 : -1.0;
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "solve_short_rows_cuda", [&] {
    scalar_t* pp = p != nullptr ? p->mutable_data_ptr<scalar_t>() : nullptr;
    const auto launch = [&](auto kernel) {
      launch_dependent(kernel, static_cast<unsigned>(plan.blocks), plan.threads, 0, stream,
          x.const_data_ptr<scalar_t>(), k.const_data_ptr<double>(), t.const_data_ptr<double>(),
          b.mutable_data_ptr<double>(), edge.mutable_data_ptr<double>(), diag.mutable_data_ptr<int64_t>(), pp,
          log_mode, n, sign);
    };
    if (plan.regime == kSoftWarpRows) {
      const auto warp_launch = [&](auto kernel) {
        launch_dependent(kernel, static_cast<unsigned>(plan.blocks), plan.threads, 0, stream,
            x.const_data_ptr<scalar_t>(), k.const_data_ptr<double>(), t.const_data_ptr<double>(),
            b.mutable_data_ptr<double>(), edge.mutable_data_ptr<double>(), diag.mutable_data_ptr<int64_t>(), pp,
            log_mode, rows, n, sign);
      };
      launch_warp_rows<scalar_t, 1, SoftTuning::kMinLanesPerRow>(plan, warp_launch);
      return;
    }
    if (plan.items == 2) launch(short_rows_kernel<scalar_t, 2>);
    else if (plan.items == 4) launch(short_rows_kernel<scalar_t, 4>);
    else launch(short_rows_kernel<scalar_t, 8>);
  });
}

}  // namespace fastlapsum
