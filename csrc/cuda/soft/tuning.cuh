// The tuning of the CUDA soft forward's on-chip regimes (short_rows_cuda.cu): where the
// warp-per-row kernel takes over from the CTA-per-row kernel, and its CTA shape.
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
  // Rows (warps) per CTA of the warp-per-row kernel: it uses no shared memory, so this only
  // sets the scheduling grain.
  static constexpr int kWarpRowsPerCta = 8;
  // The fewest lanes a row of the warp kernel takes (8, 16 or 32): rows of n <= 8 share a
  // warp four ways, n <= 16 two ways (one key a lane).
  static constexpr int kMinLanesPerRow = 8;
  // CTAs an SM that the warp kernel's registers are sized for (__launch_bounds__), by keys a
  // lane and key bytes: the most that ptxas fits without spills at kWarpRowsPerCta = 8
  // (4: 64 registers, 3: 80, 2: 128).
  static constexpr int warp_min_blocks(int items, int key_bytes) {
    return items <= 2 ? 4 : items <= (key_bytes == 8 ? 8 : 16) ? 3 : 2;
  }
};
using SoftTuning = SoftTuningSm90;

}  // namespace
}  // namespace fastlapsum
