// The tuning of the CUDA soft ops (soft forward, threshold, mask, VJP), per architecture, as
// CUB keeps its tuning policies: SoftTuningSm90 shapes the on-chip kernels at compile time;
// SoftLaunchTuning holds the numbers the host plans launches with (plan_soft.h), chosen at run
// time by the device's compute capability (soft_launch_tuning). Only sm_90 (H200) is measured;
// other GPUs take its numbers.
#pragma once

#include <cstdint>

namespace fastlapsum {
namespace {

struct SoftTuningSm90 {
  // Rows of n <= kWarpRowMax scores (kWarpRowMaxF64 for fp64, whose keys take two registers
  // each) run a warp (or a share of one) per row, the row in registers (n / 32 rounded up to
  // a power of two scores a lane); longer rows a CTA per row.
  static constexpr int64_t kWarpRowMax = 1024;
  static constexpr int64_t kWarpRowMaxF64 = 512;  // 32 fp64 keys a lane spill at 128 registers
  static constexpr int64_t warp_row_max(bool fp64) { return fp64 ? kWarpRowMaxF64 : kWarpRowMax; }
  // The most warps a CTA of the warp-per-row kernel has (its __launch_bounds__; the plan
  // launches SoftLaunchTuning::warp_rows_cta_warps <= this).
  static constexpr int kWarpRowsMaxWarps = 8;
  // The fewest lanes a row of the warp kernel takes (8, 16 or 32): rows of n <= 8 share a
  // warp four ways, n <= 16 two ways (one key a lane).
  static constexpr int kMinLanesPerRow = 8;
  // CTAs an SM that the warp kernel's registers are sized for (__launch_bounds__), by keys a
  // lane and key bytes, at kWarpRowsMaxWarps = 8 (4: 64 registers, 3: 80, 2: 128). The kernel
  // is latency-bound, so 32-bit rows of up to 8 keys a lane take 64 registers: their spills
  // (up to ~150 bytes) sit in the sort, which few router rows reach (the outer gap).
  static constexpr int warp_min_blocks(int items, int key_bytes) {
    return items <= 2 || (key_bytes == 4 && items <= 8) ? 4 : items <= (key_bytes == 8 ? 8 : 16) ? 3 : 2;
  }
  // CTAs an SM that propose_kernel's registers are sized for (__launch_bounds__), one instance
  // each. Rows beyond one wave of propose blocks loop, each row's select trading histograms
  // through global memory: on batched long rows (2048 x 131072) the rows in flight bound it,
  // so those take kProposeMinBlocks (80 registers, a few spilled). A grid that fits one wave
  // of kProposeMinBlocksOneWave (a single long row: a few dozen blocks) gains nothing from the
  // cap and takes that instance (181 registers, no spills).
  static constexpr int kProposeMinBlocks = 3;
  static constexpr int kProposeMinBlocksOneWave = 1;
  // Threads of the scan and the solve where they run in launches of their own (rows over
  // SoftLaunchTuning::fused_max_n); fused into a level or sides block they fold at that
  // block's size. At 512 the separate chain was 2-6 % slower on single rows of 5e6-1e8.
  static constexpr int kSeparateFoldThreads = 256;
};
using SoftTuning = SoftTuningSm90;

}  // namespace

// The host's launch numbers (plan_soft.h). Every field is read by one plan function only.
struct SoftLaunchTuning {
  // Long rows (the bracket's launch sequence, threshold_cuda.cu).
  int level_blocks_per_sm;        // level blocks in flight over all rows: this many per SM (one wave)
  int level_block_vectors;        // 16-byte vectors a thread of a level block streams when a row
                                  // has more tiles than the GPU has SMs (else one tile a block)
  double middle_slice_factor;     // a level block's middle slice: this many times the widest first
  int64_t middle_slice_slack;     //   bracket's expected share of its scores, plus this many
  int64_t sorted_middle_max_n;    // rows up to this long solve their gathered middle set on chip
  int64_t fused_max_n;            // rows up to this long fuse each scan and the solve into the
                                  // launch before (longer rows: the fused level's tile loop spills)
  // The mask pass (mask_cuda.cu): blocks a row, scores a thread before a row takes more blocks.
  int64_t mask_scores_per_thread, mask_max_blocks;
  // The streaming VJP (vjp_cuda.cu): vjp_scores_per_thread scores a thread, raised up to
  // vjp_max_scores_per_thread while the grid keeps vjp_blocks_per_sm blocks an SM (a block's
  // row setup and its reduction of fp64 sums cost as much as hundreds of scores), at most
  // vjp_max_blocks a row; rows of at most vjp_fold_in_apply_max blocks are folded by every
  // apply block, longer ones by a finalize launch.
  int64_t vjp_scores_per_thread, vjp_max_scores_per_thread, vjp_blocks_per_sm, vjp_max_blocks,
      vjp_fold_in_apply_max;
  // The register VJP (vjp_rows.cuh): a warp a row up to vjp_warp_row_max scores, a CTA a row up
  // to vjp_cta_row_max; longer rows stream.
  int64_t vjp_warp_row_max, vjp_cta_row_max;
  // Warps a CTA of the forward's warp-per-row kernel (<= SoftTuning::kWarpRowsMaxWarps), for
  // rows of at most 16 keys a lane and for longer ones. Its rows differ in cost (the outer gap
  // or a sort) and a CTA frees its slot only when its slowest row is done, so short rows take
  // small CTAs; rows of 32 keys a lane (128 registers) run best in full ones.
  int warp_rows_cta_warps, warp_rows_cta_warps_long;
};

inline constexpr SoftLaunchTuning kSoftLaunchSm90 = {
    /*level_blocks_per_sm=*/2,
    /*level_block_vectors=*/8,
    /*middle_slice_factor=*/4.0,
    /*middle_slice_slack=*/1024,
    /*sorted_middle_max_n=*/int64_t(1) << 21,
    /*fused_max_n=*/int64_t(1) << 21,
    /*mask_scores_per_thread=*/16,
    /*mask_max_blocks=*/4096,
    /*vjp_scores_per_thread=*/8,
    /*vjp_max_scores_per_thread=*/64,
    /*vjp_blocks_per_sm=*/12,
    /*vjp_max_blocks=*/2048,
    /*vjp_fold_in_apply_max=*/16,
    /*vjp_warp_row_max=*/1024,
    /*vjp_cta_row_max=*/8192,
    /*warp_rows_cta_warps=*/4,
    /*warp_rows_cta_warps_long=*/8,
};

// The launch numbers for a device of compute capability major.minor (e.g. 9.0 -> 90).
inline const SoftLaunchTuning& soft_launch_tuning(int cc) {
  (void)cc;  // sm_90 is the only table; unmeasured GPUs take its numbers
  return kSoftLaunchSm90;
}

}  // namespace fastlapsum
