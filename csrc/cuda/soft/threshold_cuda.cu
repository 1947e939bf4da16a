// CUDA threshold solver for rows of any length: the certified sample bracket of DESIGN
// §1.2, with the radix bracket over the whole row as its exact fallback, in one fixed
// launch sequence (no host sync; a row that is done skips the remaining launches).
//
//  propose  a few blocks per row: the noised systematic sample of bracket_rule.h (its keys
//           in registers) and two order statistics of it (radix select, the blocks trading
//           each digit's histogram through global memory) -> the bracket's key range.
//  level    a grid over each row. Scores above / below the row's key range go to the two
//           tails (fp64 sums against the range ends, reduced per block in a fixed order);
//           scores inside go to up to 2048 range atoms ("bins"). A bracketed row's first
//           level only gathers those into the row's middle buffer (one bounded slice per
//           block, in a deterministic order); every later level of it reads only that.
//  sorted   rows up to 2^21 scores, after the gathering level: one CTA per row sorts a middle
//           set that fits it and solves the row (the short-row solver's sort and scan, with
//           the tails), certifying the bracket, so that the launches after it skip the row.
//  scan     one CTA per row, after every level but a gathering one: folds the tails; on the
//           first binned level checks the certificate Psi(a_R) <= k <= Psi(a_L) (a failure,
//           or a middle set too big for its slices, sends the row to the radix fallback
//           over the whole row); then the closed-form
//           scan over the bins, in parallel: the root lies in a gap (solve it) or strictly
//           inside one bin, whose key range the next level refines.
//  sides    sums of the scores on each side of the final gap (against the gap's ends when
//           the bracket is at most kFlatSpan temperatures wide, else as atoms against the
//           nearest score), with fixed-order reductions; solve: one CTA per row folds them,
//           rescales to the nearest scores and solves.
// Bins are summed with float atomics: they only locate the root. Every number the root is
// computed from is reduced in a fixed order, so the answer is the same on every run.
//
// Each phase's kernel is in its own header, compiled in this translation unit: propose.cuh,
// gather_pass.cuh (level), sorted_middle.cuh, bin_scan.cuh (scan), sides_solve.cuh (sides,
// solve); shared by them: params.cuh, bins.cuh, settled.cuh. This file: the launch sequence.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <limits>
#include <type_traits>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "../../common/atom_scan.h"
#include "../../common/bracket_rule.h"
#include "../../common/cuda_launch.cuh"
#include "../../common/gpu_rows.cuh"
#include "../../common/op_io.h"
#include "../../common/tile_scan.cuh"
#include "../../ops.h"
#include "gpu_keys.cuh"
#include "sorted_solve.cuh"
#include "threshold_cuda.h"
#include "params.cuh"
#include "bins.cuh"
#include "settled.cuh"
#include "propose.cuh"
#include "gather_pass.cuh"
#include "bin_scan.cuh"
#include "sorted_middle.cuh"
#include "sides_solve.cuh"

namespace fastlapsum {

void solve_long_rows_cuda(const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest,
                          bool sort, at::Tensor& b, at::Tensor& edge, at::Tensor& diag) {
  const int64_t rows = x.size(0), n = x.size(1);
  if (rows == 0 || n == 0) return;
  const double sign = largest ? 1.0 : -1.0;
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "solve_long_rows_cuda", [&] {
    // Blocks per row: a few tiles each, at most kMaxChunks; the grid covers rows by looping.
    const int64_t tile = level_tile<scalar_t>();
    const int64_t tiles = (n + tile - 1) / tile;
    // Two tiles per block (~16K fp32 scores), so that a gathering block's next tile loads
    // while it classifies one; one when a row's tiles fit a block per SM (rows up to ~1M
    // fp32 scores: all in flight at once, and the sorted middle set reads the slices cheaply).
    const int64_t tiles_per_block = tiles <= sm_count() ? 1 : 8 / kLevelUnroll;
    int64_t chunks = (tiles + tiles_per_block - 1) / tiles_per_block;
    // At most one wave of level blocks (two per SM) over the rows: a block streams its tiles
    // in a grid-stride loop, so more blocks only add waves, partials for the scan to fold,
    // and a wave of launches to each level that a finished row skips.
    const int64_t wave = std::max<int64_t>(1, 2 * static_cast<int64_t>(sm_count()) / rows);
    chunks = std::max<int64_t>(1, std::min({chunks, kMaxChunks, wave}));
    const int64_t per_block = (tiles + chunks - 1) / chunks * tile;
    // Middle slice per block: 4x the widest first bracket's expected share (q = 1/2).
    int64_t cap = 0;
    if (!sort) {
      const double m = static_cast<double>(sample_geometry(n, 0).count);
      const double share = (2.0 * (kBracketZ * std::sqrt(0.25 * m) + 2.0) + 2.0) / m;
      cap = static_cast<int64_t>(4.0 * share * static_cast<double>(per_block)) + 1024;
      cap = cap > per_block ? per_block : cap;
    }
    const auto bytes = [&](int64_t count) { return at::empty({count}, x.options().dtype(at::kByte)); };
    constexpr int kDigits = digits_for(KeyTraits<scalar_t>::kBits);
    // One zeroed buffer (one fill): the bins, then propose's first-digit counts and barrier counters.
    // The fill is an ordinary launch before propose (or the gathering pass that proposes for
    // itself): level 0 relies on it (it reads x before its wait, see level_kernel).
    const int64_t hist_bytes = rows * kBins * int64_t(sizeof(BinSums));
    at::Tensor zeroed = at::zeros({hist_bytes + (sort ? 0 : rows * kFirstHistWords * 4)}, x.options().dtype(at::kByte));
    at::Tensor later_hist = bytes(sort ? 1 : rows * (kDigits - 1) * 2 * kBins * 4);
    at::Tensor state = bytes(rows * int64_t(sizeof(RowState)));
    at::Tensor partial = bytes(rows * chunks * int64_t(sizeof(LevelPartial)));
    const int64_t side_blocks = chunks < kSideBlocks ? chunks : kSideBlocks;
    at::Tensor sides = bytes(rows * side_blocks * int64_t(sizeof(SidesPartial)));
    at::Tensor counts = bytes(rows * chunks * int64_t(sizeof(unsigned)) + 1);
    at::Tensor middle = at::empty({sort ? 1 : rows * chunks * cap}, x.options().dtype(at::kDouble));
    uint8_t* zp = zeroed.mutable_data_ptr<uint8_t>();
    auto* st = reinterpret_cast<RowState*>(state.mutable_data_ptr());
    auto* hs = reinterpret_cast<BinSums*>(zp);
    auto* lp = reinterpret_cast<LevelPartial*>(partial.mutable_data_ptr());
    auto* sp = reinterpret_cast<SidesPartial*>(sides.mutable_data_ptr());
    auto* cp = reinterpret_cast<unsigned*>(counts.mutable_data_ptr());
    double* mp = middle.mutable_data_ptr<double>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const unsigned row_blocks = static_cast<unsigned>(rows < 65535 ? rows : 65535);
    const dim3 grid(static_cast<unsigned>(chunks), row_blocks);
    // Rows of one tile a gathering block (up to ~1M fp32 scores), one row a block row: the
    // gathering pass proposes for itself (propose_from_tile), one launch and the sample's
    // scattered loads fewer. Its blocks are all resident (one wave), as its row barriers need.
    const bool self_propose = !sort && tiles_per_block == 1 && chunks == tiles && rows <= 65535;
    auto* first_hist = reinterpret_cast<unsigned*>(zp + hist_bytes);
    auto* later = reinterpret_cast<unsigned*>(later_hist.mutable_data_ptr());
    if (!self_propose) {
      // Propose: enough blocks per row to hold the largest sample (offset 0) in registers;
      // rows beyond one wave of blocks loop, so that a row's blocks are all resident.
      const int64_t per_block = int64_t(kProposeThreads) * kSampleKeys;
      const int64_t blocks = sort ? 1 : (sample_geometry(n, 0).count + per_block - 1) / per_block;
      const int64_t wave = int64_t(resident_blocks(propose_kernel<scalar_t>, kProposeThreads, 0, x.get_device())) * sm_count();
      const int64_t ys = std::max<int64_t>(1, std::min<int64_t>(row_blocks, wave / blocks));
      launch_dependent(propose_kernel<scalar_t>, dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(ys)),
                       kProposeThreads, 0, stream, xp, k.const_data_ptr<double>(), t.const_data_ptr<double>(), st,
                       first_hist, later, rows, n, sign, sort);
    }
    // The first level certifies (a bracketed row: two levels, gather then bin); a row sent to
    // the fallback then needs a level per digit.
    const int levels = 2 + kDigits;
    double* bp = b.mutable_data_ptr<double>();
    double* ep = edge.mutable_data_ptr<double>();
    int64_t* dp = diag.mutable_data_ptr<int64_t>();
    constexpr auto sorted_middle = sorted_middle_for<scalar_t>();
    const bool use_sorted = !sort && sorted_middle != nullptr && n <= kSortedMiddleMaxN;
    const bool preread = !use_sorted;  // see rows_settled_early
    for (int level = 0; level < levels; ++level) {
      launch_dependent(level_kernel<scalar_t>, grid, kLevelThreads, 0, stream, xp, st, mp, cp, cap, hs, lp,
                       k.const_data_ptr<double>(), t.const_data_ptr<double>(), first_hist, later, rows, n, sign, level,
                       preread && !(self_propose && level == 1), self_propose && level == 0);
      if (level == 0 && !sort) {  // gathered only: level 1 bins the set, unless it is solved on chip here
        if (use_sorted)  // (never for fp64, whose sorted_middle is null)
          launch_dependent(sorted_middle, row_blocks, kSortedThreads, 0, stream, st, lp, static_cast<int>(chunks), mp,
                           cp, cap, k.const_data_ptr<double>(), bp, ep, dp, rows, n, sign);
        continue;
      }
      launch_dependent(scan_kernel<scalar_t>, row_blocks, kScanThreads, 0, stream, st, hs, lp,
                       static_cast<int>(chunks), k.const_data_ptr<double>(), bp, ep, dp, rows, n, sign, preread);
    }
    launch_dependent(sides_kernel<scalar_t>, dim3(static_cast<unsigned>(side_blocks), row_blocks), kLevelThreads, 0,
                     stream, xp, st, mp, cp, cap, static_cast<int>(chunks), sp, rows, n, sign, preread);
    launch_dependent(solve_kernel, row_blocks, kSolveThreads, 0, stream, st, sp, static_cast<int>(side_blocks), bp, ep,
                     dp, rows, sign, preread);
  });
}

void solve_rows_cuda(ThresholdIO& io, bool largest, int64_t method) {
  if (io.x.size(0) == 0) return;
  const SoftRegime regime = soft_regime_cuda(io.x.size(1), io.x.scalar_type(), method);
  if (on_chip(regime))
    solve_short_rows_cuda(io.x, io.k, io.t, largest, regime, io.b, io.edge, io.diag, nullptr, false);
  else
    solve_long_rows_cuda(io.x, io.k, io.t, largest, regime == kSoftRadixRows, io.b, io.edge, io.diag);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_threshold_cuda(const at::Tensor& x_in,
                                                                     const at::Tensor& k_in,
                                                                     const at::Tensor& t_in,
                                                                     bool largest, int64_t method) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  ThresholdIO io = threshold_io(x_in, k_in, t_in, method);
  solve_rows_cuda(io, largest, method);
  return {io.b, io.edge, io.diag};
}

namespace {

int64_t soft_regime_cuda_op(const at::Tensor& x, int64_t method) {
  TORCH_CHECK(x.dim() == 2, "fastlapsum.soft_regime: expected x of shape [rows, n]");
  TORCH_CHECK(method >= kMethodAuto && method <= kMethodBracket,
              "fastlapsum: method must be 0 (auto), 1 (sort) or 2 (bracket)");
  return soft_regime_cuda(x.size(1), x.scalar_type(), method);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastlapsum, CUDA, m) {
  m.impl("lapsum_threshold", &lapsum_threshold_cuda);
  m.impl("soft_regime", &soft_regime_cuda_op);
}

}  // namespace fastlapsum

