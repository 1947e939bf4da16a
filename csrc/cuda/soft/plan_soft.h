// The launch plan of the CUDA soft forward, threshold and mask (docs/DESIGN.md §7): the regime
// of a call and every grid its launchers use, decided from the shape, dtype, method and device
// (SM count; compute capability -> SoftLaunchTuning). plan_soft_cuda (threshold_cuda.cu) and
// plan_mask_cuda are the plans; the launchers take them and decide nothing more.
#pragma once

#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "../../common/bracket_rule.h"
#include "../../common/cuda_launch.cuh"
#include "../../common/plan.h"
#include "params.cuh"
#include "tuning.cuh"

namespace fastlapsum {

// Rows that the plan sorts are solved on chip (short_rows_cuda.cu), a CTA of kShortThreads
// (sorted_solve.cuh's block) per row unless a warp holds the row.
constexpr int64_t kShortRowMax = kAutoSortMaxNCuda;
constexpr int kShortThreads = 512;

// The CUDA regime of rows of n scores: rows the plan sorts run on chip, a warp per row where
// the row fits a warp's registers (SoftTuning), else a CTA per row; the others the certified
// bracket, or for method "sort" on rows too long for the chip the exact radix bracket alone.
inline SoftRegime soft_regime_cuda(int64_t n, at::ScalarType dtype, int64_t method) {
  if (!plan_sorts(n, method, kAutoSortMaxNCuda)) return kSoftLongRows;
  if (n > kShortRowMax) return kSoftRadixRows;
  return n <= SoftTuning::warp_row_max(dtype == at::kDouble) ? kSoftWarpRows : kSoftCtaRows;
}
inline bool on_chip(SoftRegime regime) { return regime == kSoftWarpRows || regime == kSoftCtaRows; }

// The launch sequence of a long-row call (threshold_cuda.cu).
struct LongRowsPlan {
  bool sort;               // the radix bracket alone (no sample, no middle set)
  int64_t tile;            // scores a level tile
  int64_t chunks;          // level blocks a row (grid.x of the level passes)
  int64_t cap;             // middle-set slice of a level block (0: none)
  int64_t side_blocks;     // blocks a row of the sides pass
  unsigned row_blocks;     // grid.y of the row-wide passes, blocks of the per-row ones (rows loop)
  bool self_propose;       // the gathering level proposes for itself: no propose launch
  int64_t propose_blocks;  // propose's grid: blocks a row, rows at once (when launched)
  int64_t propose_rows;
  int propose_min_blocks;  // propose's instance: the CTAs an SM its registers are sized for
  int levels;              // level launches
  bool sorted_middle;      // the gathered middle set is solved on chip after level 0
  bool preread;            // see rows_settled_early
  bool fused_tail;         // each scan and the solve run in a block of the launch before theirs
                           // (last_block.cuh): no scan or solve launches
};

// A call's plan: the regime and, on chip, the kernel instance and grid; else the long rows'.
struct SoftPlan {
  SoftRegime regime;
  int lanes;        // warp rows: lanes a row (8, 16 or 32)
  int items;        // warp rows: keys a lane; CTA rows: keys a thread
  int64_t blocks;   // on chip: CTAs
  int threads;      // on chip: threads a CTA
  LongRowsPlan long_rows;
};

// On chip: the warp kernel with the fewest lanes, then the fewest keys a lane (a power of two:
// the bitonic network), that hold the row; the CTA kernel with the fewest keys a thread
// (padding costs every sort pass).
inline void plan_on_chip(SoftPlan& p, int64_t rows, int64_t n, bool fp64, const SoftLaunchTuning& tu) {
  if (p.regime == kSoftWarpRows) {
    p.lanes = SoftTuning::kMinLanesPerRow;
    while (p.lanes < 32 && n > p.lanes) p.lanes *= 2;
    p.items = 1;
    if (p.lanes == 32)
      while (p.items < 32 && 32 * p.items < SoftTuning::warp_row_max(fp64) && n > 32 * p.items) p.items *= 2;
    const int warps = std::min(p.items <= 16 ? tu.warp_rows_cta_warps : tu.warp_rows_cta_warps_long,
                               SoftTuning::kWarpRowsMaxWarps);
    const int64_t per_cta = int64_t(warps) * (32 / p.lanes);
    p.blocks = (rows + per_cta - 1) / per_cta;
    p.threads = warps * 32;
  } else {
    p.lanes = 0;
    p.items = n <= kShortThreads * 2 ? 2 : n <= kShortThreads * 4 ? 4 : 8;
    p.blocks = rows;
    p.threads = kShortThreads;
  }
}

// Long rows: propose_wave(min_blocks) gives the blocks of propose's instance for min_blocks
// resident on the whole GPU (asked only when a propose launch is planned).
template <typename ProposeWave>
LongRowsPlan plan_long_rows(int64_t rows, int64_t n, at::ScalarType dtype, bool sort, int sms,
                            const SoftLaunchTuning& tu, const ProposeWave& propose_wave) {
  LongRowsPlan p{};
  const bool fp64 = dtype == at::kDouble;
  p.sort = sort;
  // Blocks per row: a few tiles each, at most kMaxChunks; the grid covers rows by looping.
  p.tile = level_tile_for(static_cast<int>(c10::elementSize(dtype)));
  const int64_t tiles = (n + p.tile - 1) / p.tile;
  // Several tiles per block, so that a gathering block's next tile loads while it classifies
  // one; one when a row's tiles fit a block per SM (all in flight at once, and the sorted
  // middle set reads the slices cheaply).
  const int64_t tiles_per_block = tiles <= sms ? 1 : tu.level_block_vectors / kLevelUnroll;
  int64_t chunks = (tiles + tiles_per_block - 1) / tiles_per_block;
  // At most one wave of level blocks over the rows: a block streams its tiles in a grid-stride
  // loop, so more blocks only add waves, partials for the scan to fold, and a wave of
  // launches to each level that a finished row skips.
  const int64_t wave = std::max<int64_t>(1, tu.level_blocks_per_sm * static_cast<int64_t>(sms) / rows);
  chunks = std::max<int64_t>(1, std::min({chunks, kMaxChunks, wave}));
  p.chunks = chunks;
  const int64_t per_block = (tiles + chunks - 1) / chunks * p.tile;
  // Middle slice per block: a multiple of the widest first bracket's expected share (q = 1/2).
  p.cap = 0;
  if (!sort) {
    const double m = static_cast<double>(sample_geometry(n, 0).count);
    const double share = (2.0 * (kBracketZ * std::sqrt(0.25 * m) + 2.0) + 2.0) / m;
    p.cap = static_cast<int64_t>(tu.middle_slice_factor * share * static_cast<double>(per_block)) + tu.middle_slice_slack;
    p.cap = p.cap > per_block ? per_block : p.cap;
  }
  p.side_blocks = chunks < kSideBlocks ? chunks : kSideBlocks;
  p.row_blocks = static_cast<unsigned>(rows < 65535 ? rows : 65535);
  // Rows of one tile a gathering block, one row a block row: the gathering pass proposes for
  // itself (propose_from_tile), one launch and the sample's scattered loads fewer. Its blocks
  // are all resident (one wave), as its row barriers need.
  p.self_propose = !sort && tiles_per_block == 1 && chunks == tiles && rows <= 65535;
  p.propose_blocks = p.propose_rows = 0;
  if (!p.self_propose) {
    // Enough blocks per row to hold the largest sample (offset 0) in registers; rows beyond
    // one wave of blocks loop, so that a row's blocks are all resident.
    const int64_t per_propose = int64_t(kProposeThreads) * kSampleKeys;
    p.propose_blocks = sort ? 1 : (sample_geometry(n, 0).count + per_propose - 1) / per_propose;
    // The instance without the register cap where every row's blocks fit one wave of it (a
    // single long row): the cap buys CTAs an SM that such a grid does not fill. Else the capped
    // one, for the rows in flight.
    const int64_t one_wave = propose_wave(SoftTuning::kProposeMinBlocksOneWave);
    const bool fits = rows * p.propose_blocks <= one_wave;
    p.propose_min_blocks = fits ? SoftTuning::kProposeMinBlocksOneWave : SoftTuning::kProposeMinBlocks;
    const int64_t propose_all = fits ? one_wave : propose_wave(p.propose_min_blocks);
    p.propose_rows = std::max<int64_t>(1, std::min<int64_t>(p.row_blocks, propose_all / p.propose_blocks));
  }
  // The first level certifies (a bracketed row: two levels, gather then bin); a row sent to
  // the fallback then needs a level per digit.
  p.levels = 2 + digits_for(fp64 ? 64 : 32);
  p.sorted_middle = !sort && !fp64 && n <= tu.sorted_middle_max_n;  // fp64 rows (64-bit keys) bin
  p.preread = !p.sorted_middle;
  // Fused, each level's scan and the solve cost no launch (several us of host time each in
  // eager mode), but the fused level kernel's tile loop spills more (the scan's call after
  // it). Up to fused_max_n the levels after the first read a small middle set, or nothing
  // once the sorted middle set has solved the row; longer rows' levels stream a large middle
  // set (or the whole row, method "sort"), where the spills cost more than the launches
  // (H200, 10^8 scores: 473 us fused, 452 us separate).
  p.fused_tail = n <= tu.fused_max_n;
  return p;
}

// The mask pass (mask_cuda.cu): [blocks a row, rows], up to mask_max_blocks a row (more than
// one wave of grid-stride blocks streams faster than one).
inline dim3 plan_mask_cuda(int64_t rows, int64_t n, const SoftLaunchTuning& tu) {
  return row_grid(rows, n, tu.mask_scores_per_thread, tu.mask_max_blocks);
}

}  // namespace fastlapsum
