// The launch plan of the CUDA hard top-k and the straight-through hard mask (docs/DESIGN.md §2):
// the regime of a call and every number its launchers use (kernel instance, grid, block,
// candidate buffers, shared memory, the grid path's workspace), decided from the shape, the
// budget (hard_mask: its bound k_max), dtype, the sorted flag and the device's resident CTAs of
// the grid path. Host arithmetic only, no CUDA: plan_topk_cuda (topk_cuda.cu) asks the device
// and the launchers take the plan and decide nothing more; the CPU build exports plan_topk
// with the device's numbers as arguments (the _topk_cuda_plan op), so that tests check it
// anywhere. The measured numbers are in tuning.cuh.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#include "../../common/plan.h"
#include "tuning.cuh"

namespace fastlapsum {
namespace {

// The grid path's per-row state (grid_select.cuh), here so that the plan sizes its workspace.
struct GState {
  uint64_t prefix;
  int64_t L, take;
  int32_t ks;        // -1 until the select is decided
  uint32_t need;
  uint32_t trivial;  // 1: take == 0 or take == L; 2: NaN row (mask)
  uint32_t sampled;
  int64_t off, G, S;
  uint32_t rstar, d1, rem, thr;
  unsigned long long cand_cnt, out_cnt;
  uint32_t use_cand;
};

struct TopkPlan {
  TopkRegime regime;
  int64_t K;               // topk: k; hard_mask: the bound k_max, or -1 (none)
  bool launch;             // false: nothing to launch (no rows, or an empty output)
  bool sort_in_kernel;     // sorted=True written sorted by the thread/warp-row kernel
  bool sort_after;         // sorted=True by one at::sort of the kernels' composites
  // thread rows: the kernel's row capacity (8, 16 or kThreadMaxN scores); warp rows: chunks of
  // 32 vectors a lane (1, 2, 4, 8 or kWarpMaxItems / vector width); row CTA: threads (the
  // 512-thread build, or the 256-thread one of 16-bit scores, four an SM).
  int instance;
  int threads;             // a CTA
  int64_t blocks;          // grid.x (grid path: bpr, CTAs a row; grid.y is the rows)
  int64_t cap;             // row CTA: candidate buffer, entries; grid path: per row (cap_g)
  int smem;                // dynamic shared memory bytes (row CTA; grid path: collect and output)
  int64_t ws_state_bytes;  // grid path's workspace: [states | histograms | candidates]
  int64_t ws_hist_bytes;
  int64_t ws_bytes;
};

// The per-row kernel's candidate buffer (entries) for budget K (hard_mask: its k_max, -1 when
// unknown).
inline int64_t topk_row_cap(bool mask, int64_t K) {
  using Tu = TopkTuning;
  const int64_t cap = mask && K < 0 ? Tu::kMaskRowCap
                                    : ((Tu::kRowCapPerK * K + Tu::kRowCapRound - 1) / Tu::kRowCapRound) * Tu::kRowCapRound;
  return std::max<int64_t>(Tu::kRowCapMin, std::min<int64_t>(cap, Tu::kRowCapMax));
}

// Whether a call could run the per-row kernel's 256-thread build (four CTAs an SM; a buffer of
// at most kQuarterCap): topk on 16-bit scores (the only instantiations of that build) whose
// sampled path fits that buffer.
inline bool topk_quarter_fits(int64_t elem_bytes, bool mask, int64_t K) {
  return !mask && elem_bytes == 2 && sample_fits(static_cast<double>(K), static_cast<double>(kQuarterCap));
}

// Whether it does: in batches of more rows than the 512-thread build runs in one wave
// (kQuarterMinRowsPerSm an SM: with fewer, a row streams at its CTA's loads in flight, which
// the 256-thread build halves).
inline bool topk_quarter_build(int64_t elem_bytes, bool mask, int64_t K, int64_t rows, int64_t sms) {
  return topk_quarter_fits(elem_bytes, mask, K) && rows > TopkTuning::kQuarterMinRowsPerSm * sms;
}

// Few long rows (rows <= 64, n >= 2^16): the grid path or the per-row kernel, whichever a
// cost estimate fitted to H200 timings (TopkTuningSm90, fp32 and fp16) puts lower. The grid
// path: its launches plus a rate of scores a microsecond. The per-row kernel: its fixed
// phases plus one CTA streaming its row at the rate its loads in flight allow (a round trip
// each; its few CTAs leave DRAM idle, so each streams at that rate).
// A budget too large for the per-row kernel's sampled path (it would stream the row up to
// seven times) keeps the grid path; so does hard_mask without a bound on its budgets (a row
// of any k may come).
inline bool topk_use_grid_path(int64_t rows, int64_t n, int64_t K, int64_t elem_bytes, bool mask) {
  using Tu = TopkTuning;
  if (rows > Tu::kGridMaxRows || n < Tu::kGridMinN) return false;
  if ((mask && K < 0) || !sample_fits(static_cast<double>(K), static_cast<double>(topk_row_cap(mask, K)))) return true;
  // The row kernel's rate as fitted: 16-bit scores with the 256-thread build's loads in flight.
  // Rows this few run the 512-thread build (topk_quarter_build), which streams faster, so the
  // estimate errs only towards the grid path, where it was measured to win.
  const double threads = topk_quarter_fits(elem_bytes, mask, K) ? kBlock / 2 : kBlock;
  const double in_flight = threads * row_unroll_for(elem_bytes) * 16.0;  // bytes
  const double row_us = Tu::kRowFixedUs + Tu::kRowRoundTripUs * static_cast<double>(n) * elem_bytes / in_flight;
  const double grid_us = Tu::kGridFixedUs + static_cast<double>(rows) * static_cast<double>(n) / Tu::kGridScoresPerUs;
  return grid_us < row_us;
}

// The regime. float64: the ATen sort path. Tiny rows (MoE routers): a thread a row for
// n <= kThreadMaxN, else the warp-row kernel up to kWarpMaxN, whatever the row count and budget
// (a CTA of 256-512 threads on a row of at most 2048 scores idles most of them, and its
// select's barriers and 2048-bin histograms cost more than a warp's register search); then the
// grid path where topk_use_grid_path picks it; else a CTA a row.
inline TopkRegime topk_regime_for(int64_t rows, int64_t n, int64_t K, at::ScalarType dtype, bool mask) {
  if (dtype == at::kDouble) return kTopkSort;
  if (n <= TopkTuning::kThreadMaxN) return kTopkThreadRows;
  if (n <= TopkTuning::kWarpMaxN) return kTopkWarpRows;
  return topk_use_grid_path(rows, n, K, c10::elementSize(dtype), mask) ? kTopkGrid : kTopkRowCta;
}

// The plan of a [rows, n] call: topk (K = k, sorted) or hard_mask (mask, K = its k_max or -1)
// on a device of sms SMs. grid_wave() gives the grid path's collect CTAs resident on the whole GPU (asked only when that
// path launches).
template <typename GridWave>
TopkPlan plan_topk(int64_t rows, int64_t n, int64_t K, at::ScalarType dtype, bool mask, bool sorted, int64_t sms,
                   const GridWave& grid_wave) {
  using Tu = TopkTuning;
  TORCH_CHECK(dtype == at::kDouble || dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "fastlapsum.topk: expected a floating-point x");
  TopkPlan p{};
  if (mask && (K < 0 || K > n)) K = -1;  // a bound beyond the row bounds nothing
  p.K = K;
  p.regime = topk_regime_for(rows, n, K, dtype, mask);
  p.launch = p.regime != kTopkSort && rows > 0 && n > 0 && (mask || K > 0);
  if (!p.launch) return p;
  const bool small = p.regime == kTopkThreadRows || p.regime == kTopkWarpRows;
  // Tiny rows with a small budget sort in the kernel: one launch.
  p.sort_in_kernel = !mask && sorted && K > 1 && small && K <= Tu::kWarpSortMaxK;
  p.sort_after = !mask && sorted && K > 1 && !p.sort_in_kernel;
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t V = 16 / elem;  // scores a 16-byte vector
  constexpr int64_t kMaxGrid = 2147483647LL;
  if (p.regime == kTopkThreadRows) {
    p.instance = n <= 8 ? 8 : n <= 16 ? 16 : Tu::kThreadMaxN;
    p.threads = Tu::kThreadRowsPerCta;
    p.blocks = (rows + p.threads - 1) / p.threads;
    TORCH_CHECK(p.blocks <= kMaxGrid, "fastlapsum.topk: shape out of range of the thread-row kernel");
  } else if (p.regime == kTopkWarpRows) {
    // The warp kernel instantiated for 1, 2, 4, ... chunks of 32 vectors a lane: the smallest
    // that covers the row.
    const int64_t max_chunks = Tu::kWarpMaxItems / V;
    const int64_t chunks = (n + 32 * V - 1) / (32 * V);
    p.instance = chunks <= 1 ? 1 : chunks <= 2 ? 2 : chunks <= 4 ? 4 : (max_chunks > 8 && chunks <= 8) ? 8 : int(max_chunks);
    p.threads = Tu::kWarpRows * 32;
    p.blocks = (rows + Tu::kWarpRows - 1) / Tu::kWarpRows;
    TORCH_CHECK(chunks <= max_chunks && p.blocks <= kMaxGrid, "fastlapsum.topk: shape out of range of the warp-row kernel");
  } else if (p.regime == kTopkGrid) {
    // Every row gets bpr CTAs, the rows sharing one full wave of resident collect CTAs, each
    // CTA at least a tile of kBlock * kUnroll vectors.
    p.threads = kBlock;
    p.smem = kStageItems * 8;
    const int64_t wave = grid_wave();
    const int64_t max_bpr = std::max<int64_t>(1, (n / V + int64_t(kBlock) * kUnroll - 1) / (int64_t(kBlock) * kUnroll));
    p.blocks = std::min<int64_t>(max_bpr, std::max<int64_t>(1, wave / rows));
    const int64_t cap_want = mask && K < 0 ? n / 4 + Tu::kGridCapSlack  // any budget may come
                                           : K + K / 8 + Tu::kGridCapSlack;
    p.cap = std::max<int64_t>(1, std::min<int64_t>({n, cap_want, Tu::kGridCapTotal / rows}));
    p.ws_state_bytes = ((rows * int64_t(sizeof(GState)) + 255) / 256) * 256;
    p.ws_hist_bytes = rows * kBins * 4;
    p.ws_bytes = p.ws_state_bytes + p.ws_hist_bytes + rows * p.cap * 8;
  } else {
    // A CTA a row. 16-bit scores: 256-thread CTAs, four an SM (a candidate buffer of at most
    // kQuarterCap, so that four fit), where the sampled path still fits that buffer and the
    // rows fill more than a wave of 512-thread CTAs. A 16-bit
    // row is half the bytes of an fp32 one, so its fixed phases (length, sample, select,
    // output) are a larger share of its time, and four CTAs an SM overlap them with streaming
    // better than two (most at N = 128K, little by 512K); fp32 rows are slower so.
    TORCH_CHECK(rows <= kMaxGrid, "fastlapsum.topk: too many rows for the CUDA kernel");
    const int64_t cap = topk_row_cap(mask, K);
    const bool quarter = topk_quarter_build(elem, mask, K, rows, sms);
    p.threads = quarter ? kBlock / 2 : kBlock;
    p.instance = p.threads;
    p.cap = quarter ? std::min(cap, kQuarterCap) : cap;
    p.smem = static_cast<int>(p.cap * 8);
    p.blocks = rows;
  }
  return p;
}

}  // namespace
}  // namespace fastlapsum
