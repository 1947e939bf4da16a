// fastlapsum.topk and the straight-through hard mask on CUDA: exact sample-guided
// radix selection (docs/DESIGN.md §2; the selector of "Sample-Guided Exact Top-K Selection
// for Long-Context Sparse Attention", HPC-Ops Top-K, §4-5).
//
// Order: every score gets a 32-bit order-preserving key (float_key of its fp32 image,
// complemented for largest=false; NaN ranks above +inf), and every element the unique
// 64-bit composite  c = key << 32 | ~index,  so "larger c" means "better, and among tied
// scores the smaller index". Selecting the top `take` composites is then a radix select
// with no ties; the answer is the same index set as the CPU op (select_cpu.h).
//
// Exact radix select (block_select / grid passes): digits of c at 11+11+10 (the key)
// then 11+11+10 (the index) bits, each pass histograms the elements that match the
// prefix found so far and picks the bin holding the remaining rank; it stops as soon as
// that bin's count equals the rank still needed (usually after the key digits). The
// result is (prefix, ks): an element is selected iff (c >> ks) >= (prefix >> ks), which
// holds for exactly `take` elements.
//
// Paths (chosen on the host by plan_topk in plan_topk.h, from static shapes only; everything
// data-dependent is decided on the device, so no host sync, fixed launch sequence,
// graph-capturable):
//
// 0. Tiny rows, n <= 2048 (topk_regime_for; MoE routers): the warp-row kernel
//    (warp_select_kernel, warp_select.cuh), one warp a row, four rows a CTA, the row's keys
//    in registers, a bisection for the take-th key by warp reductions, the output in index
//    order by warp scans; sorted=True with K <= 64 is sorted in the same kernel (one launch).
//    Rows of n <= 32: a thread a row (thread_select_kernel, ranks by pairwise compares,
//    output sorted). hard_mask too.
// 1. Per-row kernel (row_select_kernel, one 512-thread CTA per row, two an SM; for 16-bit
//    scores with 2.5*K <= 5632 in batches of more than two rows an SM, 256 threads, four an
//    SM), used unless path 0 or the grid path
//    below is chosen. Per row: L = valid length (lengths read on the device,
//    clamped to [0, n]), take = min(K, L).
//    - take == 0 or take == L: write all valid indices directly (+ -1 padding).
//    - L <= cap (cap = smem candidate capacity): load the whole row into shared memory
//      (keys + indices) once and select there (direct exact path for short rows).
//    - else if 2.5*take <= cap: sampled path (the sample's first loads go out with the
//      length's, the row's head is prefetched into L2). Fixed-stride view: groups of 8 contiguous
//      scores (one 32 B sector) every 8*s scores, s = clamp(max(take/27, cap/118), 1, 64),
//      with a row-dependent offset, denser where the threshold's rank must be higher (tuning.cuh:
//      row_sample_stride); two 11-bit histogram passes over the sample give a 22-bit key
//      threshold T at sample rank ceil(a*S/L), a = max(sqrt(take*cap), 47.25*s) (the count it
//      admits: the geometric centre of [take, cap], at a rank where either tail is <~1e-7 a
//      row; small budgets admit ~cap/2.5 from a sparser sample, as the sample is a phase of
//      its own; a bin of ties that would overflow the buffer is skipped where the samples
//      above it project to take). One fused full-row pass
//      (16-byte vector loads) appends every score with key >= T to the smem buffer and
//      builds the first-digit histogram of the admitted keys. If take <= count <= cap
//      the exact select runs over the smem candidates only.
//    - otherwise (underfill, overflow, or take too large for the buffer): exact
//      fallback, radix select streaming the row from global memory (<= 6 passes + 1).
//    Candidate buffer and outputs are compacted by block scans per tile (no atomics; a
//    tile's scores in thread order, each thread's strided over the tile, so not index
//    order), so the unsorted output order is deterministic (run to run); then -1 / -inf
//    (+inf for smallest) padding.
//    cap = clamp(round_up(4*K, 256), 8192, 24576) entries of (key, index) = 8 B each
//    (64 KiB for K <= 2048) in dynamic shared memory, at most 5632 for the 256-thread CTAs;
//    hard_mask plans with K = its k_max (a bound on every row's k_r, from a number k), or
//    with cap = 8192 when no bound is known.
// 2. Grid path (g_* kernels), for few long rows (rows <= 64 and n >= 2^16, where its cost
//    estimate beats the per-row kernel's, and hard_mask without k_max: topk_use_grid_path): every row
//    gets `bpr` CTAs (blockIdx.x; the rows share one full wave of resident CTAs, where
//    4 per SM made collect 1.33 waves) so a single row of 10^8 scores uses the whole GPU.
//    Fixed sequence of launches: init, sample histogram a, scan, sample histogram b,
//    scan (-> threshold T at sample rank r_e + 5 sqrt(r_e) + 16, r_e = take*S/L, s = 64),
//    collect (grid-wide count + warp-slotted, block-staged compaction of the composites
//    >= T into a bounded per-row global buffer of cap_g = min(n, K + K/8 + 65536) entries,
//    plus the first-digit histogram), decide (candidates valid iff take <= count <= cap_g, else
//    fallback to the full row), 6 x (histogram pass, scan) of the radix select over the
//    candidates (or the row), output. Passes after the select is decided exit at once.
//    This also plays the role of KV-split (several CTAs per row for few long rows),
//    with kernel boundaries instead of a last-arriver counter. Its launches cost ~35 us, so
//    up to 64 rows of up to ~128K scores (fp32) run faster on the per-row kernel. The
//    selected SET is deterministic, but the unsorted output ORDER of this path is not
//    (tiles reserve output ranges with a global atomic); sorted=True is deterministic
//    everywhere.
// sorted=True (but path 0 with K <= 64): the kernels also write the composite (as an
// order-preserving int64), and the K outputs of each row are then permuted by one at::sort
// of it (descending: best first, ties by smaller index, padding last).
// fp64 scores: a simple exact path composed of ATen ops (stable sort of int64 keys).
// Row pitch: any x with stride(1) == 1 is used in place (16-byte vector loads when a
// row's start is 16-byte aligned, scalar loads otherwise).
// hard_mask_cuda: the same selectors with a per-row take = k_r (a whole NaN row where
// k_r is not an integer in [0, n] or the row's threshold b_r is NaN: row_budget), the
// output pass writing the 0/1 mask of the row.
//
// Files, all compiled in this translation unit: warp_select.cuh (path 0), row_select.cuh
// (path 1), grid_select.cuh (path 2), radix_select.cuh, row_pass.cuh and params.cuh (shared),
// tuning.cuh (the measured constants), plan_topk.h (the plan: regime and launch numbers). This
// file: the launchers, which follow the plan, and the fp64 path.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "../../common/cuda_launch.cuh"
#include "../../common/lapsum_math.h"
#include "../../common/plan.h"
#include "../../common/tile_scan.cuh"
#include "../../ops.h"
#include "tuning.cuh"
#include "plan_topk.h"
#include "params.cuh"
#include "row_select.cuh"
#include "grid_select.cuh"
#include "warp_select.cuh"

namespace fastlapsum {
namespace {

// The dtypes of the CUDA selectors (integer rows are routed by fastlapsum/functional.py).
bool selector_dtype(at::ScalarType d) {
  return d == at::kDouble || d == at::kFloat || d == at::kHalf || d == at::kBFloat16;
}

// The grid path's collect CTAs resident on one SM (the kernel opted in to its staging buffer).
template <typename T, bool kMask>
int64_t grid_ctas_per_sm(int dev) {
  set_max_dynamic_smem(g_collect<T, kMask>, kStageItems * 8, dev);
  return resident_blocks(g_collect<T, kMask>, kBlock, kStageItems * 8, dev);
}
template <typename T>
int64_t grid_ctas_per_sm(bool mask, int dev) {
  return mask ? grid_ctas_per_sm<T, true>(dev) : grid_ctas_per_sm<T, false>(dev);
}

// The plan on this device: the grid path's wave is its collect CTAs resident on every SM (the
// caller holds the device's guard).
TopkPlan plan_topk_cuda(int64_t rows, int64_t n, int64_t K, at::ScalarType dtype, bool mask, bool sorted) {
  const auto grid_wave = [&] {
    const int dev = c10::cuda::current_device();
    const int64_t per_sm = dtype == at::kHalf       ? grid_ctas_per_sm<at::Half>(mask, dev)
                           : dtype == at::kBFloat16 ? grid_ctas_per_sm<at::BFloat16>(mask, dev)
                                                    : grid_ctas_per_sm<float>(mask, dev);
    return per_sm * sm_count();
  };
  return plan_topk(rows, n, K, dtype, mask, sorted, sm_count(), grid_wave);
}

// A thread a row (ranks by pairwise compares): the instance of the plan's row capacity.
template <typename T, bool kMask>
void launch_thread_rows(Params P, int64_t rows, const TopkPlan& plan) {
  P.rows = rows;
  const auto go = [&](auto kernel) {
    launch_dependent(kernel, static_cast<unsigned>(plan.blocks), plan.threads, 0, current_stream(), P);
  };
  if (plan.instance == 8) return go(thread_select_kernel<T, kMask, 8>);
  if (plan.instance == 16) return go(thread_select_kernel<T, kMask, 16>);
  TORCH_CHECK(plan.instance == TopkTuning::kThreadMaxN, "fastlapsum.topk: internal: no thread-row instance");
  go(thread_select_kernel<T, kMask, TopkTuning::kThreadMaxN>);
}

// The warp-row kernel: the instance of the plan's chunks of 32 vectors a lane.
template <typename T, bool kMask>
void launch_warp_rows(Params P, int64_t rows, const TopkPlan& plan) {
  constexpr int kMaxC = TopkTuning::kWarpMaxItems / (16 / sizeof(T));
  P.rows = rows;
  const auto go = [&](auto kernel) {
    launch_dependent(kernel, static_cast<unsigned>(plan.blocks), plan.threads, 0, current_stream(), P);
  };
  if (plan.instance == 1) return go(warp_select_kernel<T, kMask, 1>);
  if (plan.instance == 2) return go(warp_select_kernel<T, kMask, 2>);
  if (plan.instance == 4) return go(warp_select_kernel<T, kMask, 4>);
  if constexpr (kMaxC > 8) {
    if (plan.instance == 8) return go(warp_select_kernel<T, kMask, 8>);
  }
  TORCH_CHECK(plan.instance == kMaxC, "fastlapsum.topk: internal: no warp-row instance");
  go(warp_select_kernel<T, kMask, kMaxC>);
}

// The grid path's fixed sequence of launches over its workspace.
template <typename T, bool kMask>
void launch_grid(Params P, int64_t rows, const at::Tensor& x, const TopkPlan& plan) {
  const cudaStream_t stream = current_stream();
  set_max_dynamic_smem(g_collect<T, kMask>, plan.smem, x.get_device());
  set_max_dynamic_smem(g_output<T, kMask>, plan.smem, x.get_device());
  P.bpr = plan.blocks;
  P.cap_g = plan.cap;
  at::Tensor ws = at::empty({plan.ws_bytes}, x.options().dtype(at::kByte));
  uint8_t* w = ws.mutable_data_ptr<uint8_t>();
  P.st = reinterpret_cast<GState*>(w);
  P.ghist = reinterpret_cast<uint32_t*>(w + plan.ws_state_bytes);
  P.cand = reinterpret_cast<uint64_t*>(w + plan.ws_state_bytes + plan.ws_hist_bytes);
  const dim3 grid(static_cast<unsigned>(plan.blocks), static_cast<unsigned>(rows));
  const int threads = plan.threads;
  launch_dependent(g_init<T, kMask>, rows, threads, 0, stream, P);
  for (int stage = kSampleA; stage <= kSampleB; ++stage) {
    launch_dependent(g_hist<T, kMask>, grid, threads, 0, stream, P, stage);
    launch_dependent(g_scan<kMask>, rows, threads, 0, stream, P, stage);
  }
  launch_dependent(g_collect<T, kMask>, grid, threads, plan.smem, stream, P);
  launch_dependent(g_decide, rows, threads, 0, stream, P);
  for (int p = 0; p < 6; ++p) {
    launch_dependent(g_hist<T, kMask>, grid, threads, 0, stream, P, kRadix0 + p);
    launch_dependent(g_scan<kMask>, rows, threads, 0, stream, P, kRadix0 + p);
  }
  launch_dependent(g_output<T, kMask>, grid, threads, plan.smem, stream, P);
}

// A CTA a row: the plan's build (512 threads, or 256 for 16-bit scores) and candidate buffer.
template <typename T, bool kMask>
void launch_row_cta(Params P, int64_t rows, const at::Tensor& x, const TopkPlan& plan) {
  P.cap = static_cast<int>(plan.cap);
  const auto go = [&](auto kernel) {
    set_max_dynamic_smem(kernel, plan.smem, x.get_device());
    launch_dependent(kernel, static_cast<unsigned>(rows), plan.threads, plan.smem, current_stream(), P);
  };
  if constexpr (!kMask && sizeof(T) == 2) {
    if (plan.threads == kBlock / 2) return go(row_select_kernel<T, kMask, kBlock / 2>);
  }
  TORCH_CHECK(plan.threads == kBlock, "fastlapsum.topk: internal: no row-CTA build");
  go(row_select_kernel<T, kMask, kBlock>);
}

// Scores as a [rows, n] view with unit inner stride (row pitch kept).
at::Tensor rows_view(const at::Tensor& x) {
  if (x.size(1) <= 1 || x.stride(1) == 1) {
    if (x.size(0) <= 1 || x.stride(0) >= x.size(1)) return x;
  }
  return x.contiguous();
}

template <typename T, bool kMask>
void launch(Params P, int64_t rows, const at::Tensor& x, const TopkPlan& plan) {
  TORCH_CHECK(plan.launch && plan.K == P.K, "fastlapsum.topk: internal: a plan of another call");
  if (plan.regime == kTopkThreadRows) return launch_thread_rows<T, kMask>(P, rows, plan);
  if (plan.regime == kTopkWarpRows) return launch_warp_rows<T, kMask>(P, rows, plan);
  if (plan.regime == kTopkGrid) return launch_grid<T, kMask>(P, rows, x, plan);
  launch_row_cta<T, kMask>(P, rows, x, plan);
}

// fp64: exact, composed of ATen ops. Signed int64 keys with the order of the doubles
// (NaN highest), complemented for smallest; invalid positions get the lowest key (they
// also have the largest indices, so a stable sort keeps them behind every valid score).
at::Tensor fp64_keys(const at::Tensor& x, bool largest) {
  const at::Tensor b = (x + 0.0).view(at::kLong);  // -0 -> +0
  at::Tensor key = at::where(b.ge(0), b, at::bitwise_xor(b, std::numeric_limits<int64_t>::max()));
  key = at::where(x.isnan(), at::full_like(key, std::numeric_limits<int64_t>::max()), key);
  if (!largest) key = at::bitwise_not(key);
  return key;
}

std::tuple<at::Tensor, at::Tensor> topk_fp64(const at::Tensor& x, int64_t k, bool largest,
                                             const std::optional<at::Tensor>& lengths) {
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor key = fp64_keys(x, largest);
  at::Tensor pad_mask;
  if (lengths.has_value()) {
    const at::Tensor len = lengths->to(at::kLong).clamp(0, n).view({rows, 1});
    const at::Tensor invalid = at::arange(n, x.options().dtype(at::kLong)).view({1, n}).ge(len);
    key = key.masked_fill(invalid, std::numeric_limits<int64_t>::min());
    pad_mask = at::arange(k, x.options().dtype(at::kLong)).view({1, k}).ge(len);
  }
  const at::Tensor order = std::get<1>(key.sort(/*stable=*/true, /*dim=*/1, /*descending=*/true));
  at::Tensor idx = order.narrow(1, 0, k).contiguous();
  at::Tensor values = x.gather(1, idx);
  if (pad_mask.defined()) {
    idx = idx.masked_fill(pad_mask, -1);
    values = values.masked_fill(pad_mask, largest ? -INFINITY : INFINITY);
  }
  return {values, idx};
}

at::Tensor hard_mask_fp64(const at::Tensor& x, const at::Tensor& k, const at::Tensor& b, bool largest) {
  const int64_t n = x.size(1);
  const at::Tensor order = std::get<1>(fp64_keys(x, largest).sort(true, 1, true));
  const at::Tensor ar = at::arange(n, x.options().dtype(at::kLong)).expand_as(order);
  const at::Tensor rank = at::empty_like(order).scatter_(1, order, ar);
  const at::Tensor kr = k.round();
  const at::Tensor keep = rank.lt(kr.view({-1, 1}));
  at::Tensor ok = k.eq(kr).logical_and(k.ge(0)).logical_and(k.le(static_cast<double>(n)));
  if (b.defined()) ok = ok.logical_and(b.isnan().logical_not());
  const at::Tensor p = keep.to(x.scalar_type());
  return at::where(ok.view({-1, 1}), p, at::full_like(p, NAN));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> topk_cuda(const at::Tensor& x_in, int64_t k, bool largest, bool sorted,
                                             const std::optional<at::Tensor>& lengths) {
  TORCH_CHECK(x_in.dim() == 2, "fastlapsum.topk: expected x of shape [rows, n]");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t rows = x_in.size(0), n = x_in.size(1);
  TORCH_CHECK(k >= 0 && k <= n, "fastlapsum.topk: k must be in [0, n]");
  TORCH_CHECK(n < 4294967295LL, "fastlapsum.topk: rows longer than 2^32 - 2 are not supported on CUDA");
  at::Tensor len;
  if (lengths.has_value()) {
    TORCH_CHECK(lengths->device() == x_in.device(), "fastlapsum.topk: lengths must be on the device of x");
    TORCH_CHECK(lengths->numel() == rows, "fastlapsum.topk: lengths needs one value per row");
    len = lengths->to(at::kLong).contiguous();
  }
  TORCH_CHECK(selector_dtype(x_in.scalar_type()), "fastlapsum.topk: expected a floating-point x");
  const TopkPlan plan = plan_topk_cuda(rows, n, k, x_in.scalar_type(), false, sorted);
  if (plan.regime == kTopkSort)
    return topk_fp64(x_in.contiguous(), k, largest, len.defined() ? std::optional<at::Tensor>(len) : std::nullopt);
  const at::Tensor x = rows_view(x_in);
  at::Tensor values = at::empty({rows, k}, x.options());
  at::Tensor indices = at::empty({rows, k}, x.options().dtype(at::kLong));
  if (!plan.launch) return {values, indices};
  const bool want_comp = plan.sort_after;
  at::Tensor comp = want_comp ? at::empty({rows, k}, x.options().dtype(at::kLong)) : at::Tensor();
  Params P{};
  P.pitch = rows > 1 ? x.stride(0) : n;
  P.n = n;
  P.K = k;
  P.lengths = len.defined() ? len.const_data_ptr<int64_t>() : nullptr;
  P.flip = direction_flip<uint32_t>(largest);
  P.out_idx = indices.mutable_data_ptr<int64_t>();
  P.out_comp = want_comp ? comp.mutable_data_ptr<int64_t>() : nullptr;
  P.warp_sort = plan.sort_in_kernel ? 1 : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fastlapsum_topk_cuda", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      P.x = x.const_data_ptr<scalar_t>();
      P.out_val = values.mutable_data_ptr<scalar_t>();
      launch<scalar_t, false>(P, rows, x, plan);
    }
  });
  if (want_comp) {
    const at::Tensor perm = std::get<1>(comp.sort(/*dim=*/1, /*descending=*/true));
    values = values.gather(1, perm);
    indices = indices.gather(1, perm);
  }
  return {values, indices};
}

at::Tensor hard_mask_cuda(const at::Tensor& x_in, const at::Tensor& k, const at::Tensor& b, bool largest,
                          int64_t k_max) {
  // Inputs as threshold_io leaves them (checked there; the caller holds x's device guard).
  const int64_t rows = x_in.size(0), n = x_in.size(1);
  TORCH_CHECK(n < 4294967295LL, "fastlapsum.hard_mask: rows longer than 2^32 - 2 are not supported on CUDA");
  TORCH_CHECK(selector_dtype(x_in.scalar_type()), "fastlapsum.hard_mask: expected a floating-point x");
  const TopkPlan plan = plan_topk_cuda(rows, n, k_max, x_in.scalar_type(), true, false);
  if (plan.regime == kTopkSort) return hard_mask_fp64(x_in.contiguous(), k, b, largest);
  const at::Tensor x = rows_view(x_in);
  at::Tensor mask = at::empty({rows, n}, x.options());
  if (!plan.launch) return mask;
  Params P{};
  P.pitch = rows > 1 ? x.stride(0) : n;
  P.n = n;
  P.K = plan.K;  // the plan's bound (-1: none); each row's take is its k_r (row_budget)
  P.kvec = k.const_data_ptr<double>();
  P.nan_rows = b.defined() ? b.const_data_ptr<double>() : nullptr;
  P.flip = direction_flip<uint32_t>(largest);
  P.out_mask = nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fastlapsum_hard_mask_cuda", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      P.x = x.const_data_ptr<scalar_t>();
      P.out_mask = mask.mutable_data_ptr<scalar_t>();
      launch<scalar_t, true>(P, rows, x, plan);
    }
  });
  return mask;
}

namespace {

int64_t topk_regime_cuda(const at::Tensor& x, int64_t k, bool hard_mask) {
  TORCH_CHECK(x.dim() == 2, "fastlapsum.topk_regime: expected x of shape [rows, n]");
  TORCH_CHECK(k >= (hard_mask ? -1 : 0) && k <= x.size(1), "fastlapsum.topk: k must be in [0, n]",
              hard_mask ? " (or -1: no bound on the mask's budgets)" : "");
  TORCH_CHECK(selector_dtype(x.scalar_type()), "fastlapsum.topk: expected a floating-point x");
  const c10::cuda::CUDAGuard guard(x.device());  // the grid path's plan asks the device
  return plan_topk_cuda(x.size(0), x.size(1), k, x.scalar_type(), hard_mask, false).regime;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastlapsum, CUDA, m) {
  m.impl("topk", &topk_cuda);
  m.impl("topk_regime", &topk_regime_cuda);
}

}  // namespace fastlapsum

