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
// Paths (chosen on the host by topk_regime_for, from static shapes only; everything
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
//    scores with 2.5*K <= 5632, 256 threads, four an SM), used unless path 0 or the grid path
//    below is chosen. Per row: L = valid length (lengths read on the device,
//    clamped to [0, n]), take = min(K, L).
//    - take == 0 or take == L: write all valid indices directly (+ -1 padding).
//    - L <= cap (cap = smem candidate capacity): load the whole row into shared memory
//      (keys + indices) once and select there (direct exact path for short rows).
//    - else if 2.5*take <= cap: sampled path (the sample's first loads go out with the
//      length's, the row's head is prefetched into L2). Fixed-stride view: groups of 8 contiguous
//      scores (one 32 B sector) every 8*s scores, s = clamp(max(take/27, cap/118), 1, 64),
//      with a row-dependent offset; two 11-bit histogram passes over the sample give a 22-bit
//      key threshold T at sample rank ceil(a*S/L), a = max(1.75*take, 47.25*s) (the count
//      it admits: sample rank ~47; small budgets admit ~cap/2.5 from a sparser sample, as
//      the sample is a phase of its own; a bin of ties that would overflow the buffer is
//      skipped where the samples above it project to take). One fused full-row pass
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
//    estimate beats the per-row kernel's, and hard_mask without k_max: use_grid_path): every row
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
// tuning.cuh (the measured constants). This file: the host's dispatch and the fp64 path.
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
#include "params.cuh"
#include "row_select.cuh"
#include "grid_select.cuh"
#include "warp_select.cuh"

namespace fastlapsum {
namespace {

// The per-row kernel's candidate buffer (entries) for budget K (hard_mask: its k_max, -1 when
// unknown), and whether it runs as the 256-thread build (four CTAs an SM; a buffer of at most
// kQuarterCap): topk on 16-bit scores (the only instantiations of that build) whose sampled
// path fits that buffer.
int64_t row_cap(bool mask, int64_t K) {
  using Tu = TopkTuning;
  const int64_t cap = mask && K < 0 ? Tu::kMaskRowCap
                                    : ((Tu::kRowCapPerK * K + Tu::kRowCapRound - 1) / Tu::kRowCapRound) * Tu::kRowCapRound;
  return std::max<int64_t>(Tu::kRowCapMin, std::min<int64_t>(cap, Tu::kRowCapMax));
}
template <typename T, bool kMask>
constexpr bool kHasQuarterBuild = !kMask && sizeof(T) == 2;
template <typename T, bool kMask>
bool quarter_build(int64_t K) { return kHasQuarterBuild<T, kMask> && sample_fits(K, kQuarterCap); }

// Few long rows (rows <= 64, n >= 2^16): the grid path or the per-row kernel, whichever a
// cost estimate fitted to H200 timings (TopkTuningSm90, fp32 and fp16) puts lower. The grid
// path: its launches plus a rate of scores a microsecond. The per-row kernel: its fixed
// phases plus one CTA streaming its row at the rate its loads in flight allow (a round trip
// each; its few CTAs leave DRAM idle, so each streams at that rate).
// A budget too large for the per-row kernel's sampled path (it would stream the row up to
// seven times) keeps the grid path; so does hard_mask without a bound on its budgets (a row
// of any k may come).
template <typename T, bool kMask>
bool use_grid_path(int64_t rows, int64_t n, int64_t K) {
  using Tu = TopkTuning;
  if (rows > Tu::kGridMaxRows || n < Tu::kGridMinN) return false;
  if ((kMask && K < 0) || !sample_fits(K, row_cap(kMask, K))) return true;
  const double threads = quarter_build<T, kMask>(K) ? kBlock / 2 : kBlock;
  const double in_flight = threads * row_unroll<T>() * 16.0;  // bytes
  const double row_us = Tu::kRowFixedUs + Tu::kRowRoundTripUs * static_cast<double>(n) * sizeof(T) / in_flight;
  const double grid_us = Tu::kGridFixedUs + static_cast<double>(rows) * static_cast<double>(n) / Tu::kGridScoresPerUs;
  return grid_us < row_us;
}

// The mapping of a [rows, n] call with budget K (the mask: its k_max or -1), decided here only: the
// dispatch below and the topk_regime op both call it. Tiny rows (MoE routers): a thread a row
// for n <= kThreadMaxN, else the warp-row kernel up to kWarpMaxN, whatever the row count and
// budget (a CTA of 256-512 threads on a row of at most 2048 scores idles most of them, and
// its select's barriers and 2048-bin histograms cost more than a warp's register search);
// then the grid path where use_grid_path picks it; else a CTA a row.
template <typename T, bool kMask>
TopkRegime topk_regime_for(int64_t rows, int64_t n, int64_t K) {
  if (n <= TopkTuning::kThreadMaxN) return kTopkThreadRows;
  if (n <= TopkTuning::kWarpMaxN) return kTopkWarpRows;
  return use_grid_path<T, kMask>(rows, n, K) ? kTopkGrid : kTopkRowCta;
}

// The dtypes of the CUDA selectors (integer rows are routed by fastlapsum/functional.py).
bool selector_dtype(at::ScalarType d) {
  return d == at::kDouble || d == at::kFloat || d == at::kHalf || d == at::kBFloat16;
}

// The regime for a selector_dtype (float64: the ATen sort path).
TopkRegime topk_regime(int64_t rows, int64_t n, int64_t K, at::ScalarType dtype, bool mask) {
  if (dtype == at::kDouble) return kTopkSort;
  TopkRegime regime = kTopkRowCta;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "fastlapsum_topk_regime", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>)
      regime = mask ? topk_regime_for<scalar_t, true>(rows, n, K) : topk_regime_for<scalar_t, false>(rows, n, K);
  });
  return regime;
}

// A thread a row (ranks by pairwise compares), rows of at most kThreadMaxN scores.
template <typename T, bool kMask>
void launch_thread_rows(Params P, int64_t rows) {
  constexpr int kT = TopkTuning::kThreadRowsPerCta;
  TORCH_CHECK(P.n <= TopkTuning::kThreadMaxN && (rows + kT - 1) / kT <= 2147483647LL,
              "fastlapsum.topk: shape out of range of the thread-row kernel");
  P.rows = rows;
  const auto go = [&](auto kernel) {
    launch_dependent(kernel, static_cast<unsigned>((rows + kT - 1) / kT), kT, 0, current_stream(), P);
  };
  if (P.n <= 8) return go(thread_select_kernel<T, kMask, 8>);
  if (P.n <= 16) return go(thread_select_kernel<T, kMask, 16>);
  go(thread_select_kernel<T, kMask, TopkTuning::kThreadMaxN>);
}

// The warp-row kernel, instantiated for kC = 1, 2, 4, ... chunks of 32 vectors a lane: the
// smallest that covers the row.
template <typename T, bool kMask>
void launch_warp_rows(Params P, int64_t rows) {
  constexpr int V = 16 / sizeof(T), kMaxC = TopkTuning::kWarpMaxItems / V, kRows = TopkTuning::kWarpRows;
  const int64_t chunks = (P.n + 32 * V - 1) / (32 * V);
  TORCH_CHECK(chunks <= kMaxC && (rows + kRows - 1) / kRows <= 2147483647LL,
              "fastlapsum.topk: shape out of range of the warp-row kernel");
  P.rows = rows;
  const auto go = [&](auto kernel) {
    launch_dependent(kernel, static_cast<unsigned>((rows + kRows - 1) / kRows), kRows * 32, 0, current_stream(), P);
  };
  if (chunks <= 1) return go(warp_select_kernel<T, kMask, 1>);
  if (chunks <= 2) return go(warp_select_kernel<T, kMask, 2>);
  if (chunks <= 4) return go(warp_select_kernel<T, kMask, 4>);
  if constexpr (kMaxC > 8) {
    if (chunks <= 8) return go(warp_select_kernel<T, kMask, 8>);
  }
  go(warp_select_kernel<T, kMask, kMaxC>);
}

// Scores as a [rows, n] view with unit inner stride (row pitch kept).
at::Tensor rows_view(const at::Tensor& x) {
  if (x.size(1) <= 1 || x.stride(1) == 1) {
    if (x.size(0) <= 1 || x.stride(0) >= x.size(1)) return x;
  }
  return x.contiguous();
}

template <typename T, bool kMask>
void launch(Params P, int64_t rows, const at::Tensor& x, TopkRegime regime) {
  const cudaStream_t stream = current_stream();
  if (rows == 0) return;
  TORCH_CHECK((regime == topk_regime_for<T, kMask>(rows, P.n, P.K)), "fastlapsum.topk: internal: regime mismatch");
  if (regime == kTopkThreadRows) return launch_thread_rows<T, kMask>(P, rows);
  if (regime == kTopkWarpRows) return launch_warp_rows<T, kMask>(P, rows);
  if (regime == kTopkGrid) {
    const int sms = sm_count();  // x's device: the caller holds its guard
    const int stage_bytes = kStageItems * 8;
    set_max_dynamic_smem(g_collect<T, kMask>, stage_bytes, x.get_device());
    set_max_dynamic_smem(g_output<T, kMask>, stage_bytes, x.get_device());
    const int64_t wave = static_cast<int64_t>(resident_blocks(g_collect<T, kMask>, kBlock, stage_bytes, x.get_device())) * sms;
    constexpr int V = 16 / sizeof(T);
    const int64_t max_bpr = std::max<int64_t>(1, (P.n / V + int64_t(kBlock) * kUnroll - 1) / (int64_t(kBlock) * kUnroll));
    P.bpr = std::min<int64_t>(max_bpr, std::max<int64_t>(1, wave / rows));
    const int64_t cap_want = kMask && P.K < 0 ? P.n / 4 + TopkTuning::kGridCapSlack  // any budget may come
                                              : P.K + P.K / 8 + TopkTuning::kGridCapSlack;
    P.cap_g = std::max<int64_t>(1, std::min<int64_t>({P.n, cap_want, TopkTuning::kGridCapTotal / rows}));
    const int64_t st_bytes = ((rows * int64_t(sizeof(GState)) + 255) / 256) * 256;
    const int64_t h_bytes = rows * kBins * 4;
    at::Tensor ws = at::empty({st_bytes + h_bytes + rows * P.cap_g * 8}, x.options().dtype(at::kByte));
    uint8_t* w = ws.mutable_data_ptr<uint8_t>();
    P.st = reinterpret_cast<GState*>(w);
    P.ghist = reinterpret_cast<uint32_t*>(w + st_bytes);
    P.cand = reinterpret_cast<uint64_t*>(w + st_bytes + h_bytes);
    const dim3 grid(static_cast<unsigned>(P.bpr), static_cast<unsigned>(rows));
    launch_dependent(g_init<T, kMask>, rows, kBlock, 0, stream, P);
    for (int stage = kSampleA; stage <= kSampleB; ++stage) {
      launch_dependent(g_hist<T, kMask>, grid, kBlock, 0, stream, P, stage);
      launch_dependent(g_scan<kMask>, rows, kBlock, 0, stream, P, stage);
    }
    launch_dependent(g_collect<T, kMask>, grid, kBlock, stage_bytes, stream, P);
    launch_dependent(g_decide, rows, kBlock, 0, stream, P);
    for (int p = 0; p < 6; ++p) {
      launch_dependent(g_hist<T, kMask>, grid, kBlock, 0, stream, P, kRadix0 + p);
      launch_dependent(g_scan<kMask>, rows, kBlock, 0, stream, P, kRadix0 + p);
    }
    launch_dependent(g_output<T, kMask>, grid, kBlock, stage_bytes, stream, P);
    return;
  }
  const int64_t cap = row_cap(kMask, P.K);
  TORCH_CHECK(rows <= 2147483647LL, "fastlapsum.topk: too many rows for the CUDA kernel");
  const auto launch_rows = [&](auto kernel, int threads, int64_t buffer) {
    P.cap = static_cast<int>(buffer);
    const int smem = static_cast<int>(buffer * 8);
    set_max_dynamic_smem(kernel, smem, x.get_device());
    launch_dependent(kernel, static_cast<unsigned>(rows), threads, smem, stream, P);
  };
  // 16-bit scores: 256-thread CTAs, four an SM (a candidate buffer of at most kQuarterCap, so
  // that four fit), where the sampled path still fits that buffer. A 16-bit row is half the
  // bytes of an fp32 one, so its fixed phases (length, sample, select, output) are a larger
  // share of its time, and four CTAs an SM overlap them with streaming better than two
  // (most at N = 128K, little by 512K); fp32 rows are slower so.
  if constexpr (kHasQuarterBuild<T, kMask>) {
    if (quarter_build<T, kMask>(P.K)) {
      launch_rows(row_select_kernel<T, kMask, kBlock / 2>, kBlock / 2, std::min(cap, kQuarterCap));
      return;
    }
  }
  launch_rows(row_select_kernel<T, kMask, kBlock>, kBlock, cap);
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
  const TopkRegime regime = topk_regime(rows, n, k, x_in.scalar_type(), false);
  if (regime == kTopkSort) {
    auto res = topk_fp64(x_in.contiguous(), k, largest, len.defined() ? std::optional<at::Tensor>(len) : std::nullopt);
    return res;
  }
  const at::Tensor x = rows_view(x_in);
  at::Tensor values = at::empty({rows, k}, x.options());
  at::Tensor indices = at::empty({rows, k}, x.options().dtype(at::kLong));
  if (rows == 0 || k == 0) return {values, indices};
  // Tiny rows with a small budget sort in the kernel: one launch.
  const bool sort_in_kernel = sorted && k > 1 && (regime == kTopkThreadRows || regime == kTopkWarpRows) &&
                              k <= TopkTuning::kWarpSortMaxK;
  const bool want_comp = sorted && k > 1 && !sort_in_kernel;
  at::Tensor comp = want_comp ? at::empty({rows, k}, x.options().dtype(at::kLong)) : at::Tensor();
  Params P{};
  P.pitch = rows > 1 ? x.stride(0) : n;
  P.n = n;
  P.K = k;
  P.lengths = len.defined() ? len.const_data_ptr<int64_t>() : nullptr;
  P.flip = largest ? 0u : 0xFFFFFFFFu;
  P.out_idx = indices.mutable_data_ptr<int64_t>();
  P.out_comp = want_comp ? comp.mutable_data_ptr<int64_t>() : nullptr;
  P.warp_sort = sort_in_kernel ? 1 : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fastlapsum_topk_cuda", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      P.x = x.const_data_ptr<scalar_t>();
      P.out_val = values.mutable_data_ptr<scalar_t>();
      launch<scalar_t, false>(P, rows, x, regime);
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
  k_max = k_max < 0 || k_max > n ? -1 : k_max;  // a bound beyond the row bounds nothing
  const TopkRegime regime = topk_regime(rows, n, k_max, x_in.scalar_type(), true);
  if (regime == kTopkSort) return hard_mask_fp64(x_in.contiguous(), k, b, largest);
  const at::Tensor x = rows_view(x_in);
  at::Tensor mask = at::empty({rows, n}, x.options());
  if (mask.numel() == 0) return mask;
  Params P{};
  P.pitch = rows > 1 ? x.stride(0) : n;
  P.n = n;
  P.K = k_max;  // the plan's bound; each row's take is its k_r (row_budget)
  P.kvec = k.const_data_ptr<double>();
  P.nan_rows = b.defined() ? b.const_data_ptr<double>() : nullptr;
  P.flip = largest ? 0u : 0xFFFFFFFFu;
  P.out_mask = nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fastlapsum_hard_mask_cuda", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      P.x = x.const_data_ptr<scalar_t>();
      P.out_mask = mask.mutable_data_ptr<scalar_t>();
      launch<scalar_t, true>(P, rows, x, regime);
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
  return topk_regime(x.size(0), x.size(1), k, x.scalar_type(), hard_mask);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastlapsum, CUDA, m) {
  m.impl("topk", &topk_cuda);
  m.impl("topk_regime", &topk_regime_cuda);
}

}  // namespace fastlapsum

