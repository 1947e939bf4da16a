// The launch plan of the CUDA VJPs (vjp_cuda.cu): rows held in registers (vjp_rows.cuh, one
// launch) or streamed (reduce, finalize, apply), and their grids, decided from the shape and
// the device's SoftLaunchTuning. plan_vjp is its only author; the launchers take the plan.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../common/cuda_launch.cuh"
#include "../cuda/soft/tuning.cuh"

namespace fastlapsum {

constexpr int kRowsBlockThreads = 256;  // CTA of vjp_rows_kernel (a warp a row or the CTA a row)
constexpr int kVjpMaxItems = 32;        // scores a thread of vjp_rows_kernel, at most

struct VjpPlan {
  bool in_registers;   // vjp_rows_kernel
  int row_threads;     //   8, 16 or 32 (lanes of a warp a row) or kRowsBlockThreads (the CTA a row)
  int items;           //   scores a thread
  unsigned blocks;     //   its grid
  dim3 grid;           // streaming: reduce and apply, [blocks a row, rows]
  bool finalize;       //   a launch folds each row's partials once (else every apply block does)
  unsigned row_blocks; //   the finalize grid
};

inline VjpPlan plan_vjp(int64_t rows, int64_t n, int sm_count, const SoftLaunchTuning& tu) {
  VjpPlan p{};
  // Rows in registers: a warp a row, else the CTA a row, with the fewest items a thread that
  // hold the row (padding costs registers and idle lanes).
  p.in_registers = n <= tu.vjp_cta_row_max;
  if (p.in_registers) {
    const bool warp = n <= tu.vjp_warp_row_max;
    // A warp's rows: 8 to 32 scores a lane, in as few lanes as that allows (a row's
    // coefficients are scalar fp64 work that its lanes all repeat).
    if (warp) {
      p.row_threads = n <= 64 ? 8 : n <= 256 ? 16 : 32;
      p.items = n <= 128 ? 8 : n <= 512 ? 16 : 32;
    } else {
      p.row_threads = kRowsBlockThreads;
      p.items = n <= int64_t(kRowsBlockThreads) * 16 ? 16 : 32;
    }
    const int64_t per_block = kRowsBlockThreads / p.row_threads;
    p.blocks = static_cast<unsigned>(std::min<int64_t>((rows + per_block - 1) / per_block, 1 << 20));
    return p;
  }
  // Streaming: the fewest blocks a row (most scores a thread, up to the cap) that still give
  // the grid vjp_blocks_per_sm blocks an SM; short or few rows keep vjp_scores_per_thread.
  const int64_t fill = std::max<int64_t>(int64_t(sm_count) * tu.vjp_blocks_per_sm, 1);
  const int64_t row_blocks = (fill + rows - 1) / std::max<int64_t>(rows, 1);
  const int64_t few = row_grid(rows, n, tu.vjp_max_scores_per_thread, tu.vjp_max_blocks).x;
  const int64_t many = row_grid(rows, n, tu.vjp_scores_per_thread, tu.vjp_max_blocks).x;
  p.grid = row_grid(rows, n, tu.vjp_scores_per_thread, tu.vjp_max_blocks);
  p.grid.x = static_cast<unsigned>(std::min(many, std::max(few, row_blocks)));
  p.finalize = p.grid.x > tu.vjp_fold_in_apply_max;
  p.row_blocks = static_cast<unsigned>(rows < 65535 ? rows : 65535);
  return p;
}

}  // namespace fastlapsum
