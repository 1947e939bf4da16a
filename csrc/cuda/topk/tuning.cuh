// The measured tuning of the CUDA top-k (topk_cuda.cu): the kernels' block sizes, unrolls and
// buffers, and the numbers of the host's dispatch between the per-row kernel and the grid path.
#pragma once

#include <cmath>
#include <cstdint>

#include "../../common/host_device.h"

namespace fastlapsum {
namespace {

// 512-thread row CTAs, two an SM: for fp32 rows the row pass streams best so; 16-bit rows
// (half the bytes, so a CTA's fixed phases weigh more) run a 256-thread build, four an SM.
constexpr int kBlock = 512;
constexpr int kBins = 2048;
constexpr int kUnroll = 2;     // grid kernels with staged compaction (tile <= kStageItems)
// streaming passes: 16-byte loads in flight per thread (64 B per thread either way; a
// 16-bit row at 4 would hold 32 floats per thread and spill)
constexpr int row_unroll_for(int64_t elem_bytes) { return elem_bytes >= 4 ? 4 : 2; }
template <typename T>
constexpr int row_unroll() { return row_unroll_for(sizeof(T)); }
constexpr int64_t kQuarterCap = 5632;  // 256-thread row CTAs' candidate buffer (four an SM)
constexpr int kStageItems = 8192;  // grid kernels: staged composites per CTA tile (64 KiB)
constexpr int64_t kHeadPrefetchBytes = 64 * 1024;  // row kernel: the row's first two tiles
constexpr int kSampleUnroll = 8;  // row kernel: independent sample loads in flight per thread

// The row kernel's sampled path needs a candidate buffer of 2.5x the budget (its threshold
// admits ~1.6-2x, the geometric centre: below): else the row takes the exact fallback.
FLS_HD bool sample_fits(double take, double cap) { return 2.5 * take <= cap; }

// The row kernel's sample (row_pass.cuh): groups of 8 scores every 8 s scores, s =
// clamp(max(take / kSampleTakePerStride, cap / kSampleCapPerStride), 1, kSampleMaxStride),
// the sparser of the budget's and the buffer's strides (small budgets on long rows: a sample
// as sparse as for K = 2048, since the sample is a phase of its own before the row's one
// pass). Its threshold admits A scores in expectation at sample rank A / s, and the admitted
// count spreads as Gamma(A/s) / (A/s) x A: a row whose count lands below take or above cap
// takes the exact fallback, which streams the row up to seven times (16-bit rows, whose
// k-th score has ~100 ties, need all six digits), and one such row is the batch's tail. So
// A = max(sqrt(take x cap), kSampleRank x s): the geometric centre of [take, cap], or ~cap /
// 2.5 for small budgets; and where A sits at the centre, s is dense enough for a rank of
// (kSampleTailSigmas / m)^2, m = ln(cap / take) / 2, so that either tail is <~1e-7 a row
// (1.75 x take at rank ~50 would leave ~1e-4 a row on either side).
constexpr int64_t kSampleTakePerStride = 27, kSampleCapPerStride = 118, kSampleMaxStride = 64;
constexpr double kSampleRank = 47.25, kSampleTailSigmas = 6.0;
FLS_HD double sample_admit(int64_t take, int64_t cap, int64_t s) {
  const double a = sqrt(static_cast<double>(take) * static_cast<double>(cap)), b = kSampleRank * static_cast<double>(s);
  return a > b ? a : b;
}
FLS_HD int64_t row_sample_stride(int64_t take, int64_t cap) {
  const int64_t a = take / kSampleTakePerStride, b = cap / kSampleCapPerStride;
  int64_t s = a > b ? a : b;
  s = s < 1 ? 1 : (s > kSampleMaxStride ? kSampleMaxStride : s);
  const double centre = sqrt(static_cast<double>(take) * static_cast<double>(cap));
  if (take > 0 && cap > take && kSampleRank * static_cast<double>(s) < centre) {
    const double m = 0.5 * log(static_cast<double>(cap) / static_cast<double>(take));
    const double rank = (kSampleTailSigmas / m) * (kSampleTailSigmas / m);
    const int64_t dense = static_cast<int64_t>(centre / rank);
    s = dense < s ? (dense < 1 ? 1 : dense) : s;
  }
  return s;
}
// A threshold bin whose samples project to more than kSampleTieSkip x the buffer (a score
// many tie at) is left out of the admission where the samples above it project to the
// budget: the buffer would overflow with it.
constexpr double kSampleTieSkip = 1.5;

// The host's plan (plan_topk.h), fitted to H200 timings of 1-64 rows x 64K-1M scores.
struct TopkTuningSm90 {
  // The grid path is a candidate for rows <= kGridMaxRows of n >= kGridMinN scores only.
  static constexpr int kGridMaxRows = 64;
  static constexpr int64_t kGridMinN = 65536;
  // Cost estimates (us): the grid path's launches plus kGridScoresPerUs scores a microsecond;
  // the per-row kernel's fixed phases plus a round trip per load in flight of its row.
  static constexpr double kGridFixedUs = 35.0, kGridScoresPerUs = 625000.0;
  static constexpr double kRowFixedUs = 17.0, kRowRoundTripUs = 0.8;
  // The per-row kernel's candidate buffer (8-byte entries): kRowCapPerK x the budget rounded
  // up to kRowCapRound, clamped to [kRowCapMin, kRowCapMax]; hard_mask's is kMaskRowCap. The
  // floor, 64 KiB (two CTAs an SM still fit), is for small budgets on long rows: their sample
  // is as sparse as for K = 2048 (kSampleCapPerStride) and fits the buffer, so that its second
  // histogram pass reads shared memory, not the row.
  static constexpr int64_t kRowCapPerK = 4, kRowCapRound = 256, kRowCapMin = 8192, kRowCapMax = 24576;
  static constexpr int64_t kMaskRowCap = 8192;
  // 16-bit rows take the 256-thread build (kQuarterCap) only for more than
  // kQuarterMinRowsPerSm rows an SM, i.e. where the 512-thread build needs a second wave:
  // with fewer, each SM runs as many 512-thread CTAs as 256-thread ones, and a row streams
  // at its CTA's loads in flight, which the 256-thread build halves.
  static constexpr int64_t kQuarterMinRowsPerSm = 2;
  // The grid path's candidate buffer per row: the budget + 1/8 (mask: n/4) + kGridCapSlack,
  // at most kGridCapTotal entries over all rows.
  static constexpr int64_t kGridCapSlack = 65536, kGridCapTotal = int64_t(1) << 27;
  // Tiny rows (warp_select.cuh): rows of n <= kWarpMaxN scores take the warp-row kernel, one
  // warp a row, kWarpRows rows a CTA, the row in registers (at most kWarpMaxItems keys a lane:
  // kWarpMaxN / 32 for every dtype). sorted=True sorts in the kernel for K <= kWarpSortMaxK
  // (a bitonic network over the warp, 1 or 2 composites a lane), above through at::sort.
  static constexpr int64_t kWarpMaxN = 2048;
  // Rows of 32+ keys a lane bisect over the keys above the bracket's lower end where they
  // fit kWarpCandPerLane a lane (~4-6 on random rows for take <= 64).
  static constexpr int kWarpRows = 4, kWarpMaxItems = 64, kWarpSortMaxK = 64, kWarpCandPerLane = 8;
  // Budgets of at most kWarpFilterMaxTake take the lanes'-maxima filter (warp_filter): its
  // bisection stops once at most take + kWarpFilterSlack maxima pass (~take + 2 scores pass
  // on random rows, ~4 ballots for take = 8 over 256 scores), and above 16 more than 32
  // scores pass it on most random rows.
  static constexpr int kWarpFilterMaxTake = 16, kWarpFilterSlack = 2;
  // Rows of n <= kThreadMaxN: a thread a row (ranks by pairwise compares), kThreadRowsPerCta
  // rows a CTA.
  static constexpr int kThreadMaxN = 32, kThreadRowsPerCta = 128;
};
using TopkTuning = TopkTuningSm90;

}  // namespace
}  // namespace fastlapsum
