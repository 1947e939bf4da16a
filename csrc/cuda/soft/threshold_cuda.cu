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
//  scan     one CTA per row (or one of the level's blocks of it), after every level but a
//           gathering one: folds the tails; on the first binned level checks the certificate
//           Psi(a_R) <= k <= Psi(a_L) (a failure, or a middle set too big for its slices,
//           sends the row to the radix fallback over the whole row); then the closed-form
//           scan over the bins, in parallel: the root lies in a gap (solve it) or strictly
//           inside one bin, whose key range the next level refines.
//  sides    sums of the scores on each side of the final gap (against the gap's ends when
//           the bracket is at most kFlatSpan temperatures wide, else as atoms against the
//           nearest score), with fixed-order reductions; solve: one CTA per row (or the
//           sides' last block of it) folds them, rescales to the nearest scores and solves.
// Bins are summed with float atomics: they only locate the root. Every number the root is
// computed from is reduced in a fixed order, so the answer is the same on every run.
//
// The fused tail (LongRowsPlan::fused_tail: rows up to fused_max_n): each scan runs in a block of the
// level before it once all of the row's blocks are done, and the solve in the sides' last
// block of the row (last_block.cuh), so the sequence is fill, [propose], level 0, [sorted], levels 1.., sides:
// 2 + levels (+ propose, + sorted) launches instead of a scan after each binning level and a
// solve more. The same fold either way, at the level block's 512 threads fused and at
// SoftTuning::kSeparateFoldThreads on its own: the two agree to rounding, not bit for bit (a
// shape's plan always takes the same one, so each call is reproducible).
//
// Each phase's kernel is in its own header, compiled in this translation unit: propose.cuh,
// gather_pass.cuh (level), sorted_middle.cuh, bin_scan.cuh (scan), sides_solve.cuh (sides,
// solve); shared by them: params.cuh, bins.cuh, settled.cuh, last_block.cuh. This file:
// plan_soft_cuda (the plan of every soft launch, arithmetic in plan_soft.h) and the launch
// sequence.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cstdlib>
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
namespace {

// propose_kernel's instance for a plan's propose_min_blocks.
template <typename scalar_t>
auto propose_instance(int min_blocks) {
  TORCH_CHECK(min_blocks == SoftTuning::kProposeMinBlocks || min_blocks == SoftTuning::kProposeMinBlocksOneWave,
              "fastlapsum: internal: no propose instance for ", min_blocks, " CTAs an SM");
  return min_blocks == SoftTuning::kProposeMinBlocks ? propose_kernel<scalar_t, SoftTuning::kProposeMinBlocks>
                                                     : propose_kernel<scalar_t, SoftTuning::kProposeMinBlocksOneWave>;
}

}  // namespace

SoftPlan plan_soft_cuda(int64_t rows, int64_t n, at::ScalarType dtype, int64_t method) {
  SoftPlan plan{};
  plan.regime = soft_regime_cuda(n, dtype, method);
  if (rows == 0 || n == 0) return plan;  // nothing to launch
  if (on_chip(plan.regime)) {
    plan_on_chip(plan, rows, n, dtype == at::kDouble, soft_launch_tuning(compute_capability()));
    return plan;
  }
  const auto propose_wave = [&](int min_blocks) {
    int64_t wave = 0;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "plan_soft_cuda", [&] {
      wave = int64_t(resident_blocks(propose_instance<scalar_t>(min_blocks), kProposeThreads, 0,
                                     c10::cuda::current_device())) *
             sm_count();
    });
    return wave;
  };
  plan.long_rows = plan_long_rows(rows, n, dtype, plan.regime == kSoftRadixRows, sm_count(),
                                  soft_launch_tuning(compute_capability()), propose_wave);
  // A benchmarking knob (docs/PERFORMANCE.md): FASTLAPSUM_FUSED_TAIL=0 launches each scan and the
  // solve on their own, =1 fuses them. Read at every call (a getenv, well under a us), so that
  // one process can time both sequences.
  const char* fused = std::getenv("FASTLAPSUM_FUSED_TAIL");
  if (fused != nullptr && (fused[0] == '0' || fused[0] == '1') && fused[1] == '\0')
    plan.long_rows.fused_tail = fused[0] == '1';
  return plan;
}

void solve_long_rows_cuda(const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest,
                          const LongRowsPlan& plan, at::Tensor& b, at::Tensor& edge, at::Tensor& diag) {
  const int64_t rows = x.size(0), n = x.size(1);
  if (rows == 0 || n == 0) return;
  const double sign = largest ? 1.0 : -1.0;
  const cudaStream_t stream = current_stream();
  const bool sort = plan.sort;
  const int64_t chunks = plan.chunks, cap = plan.cap, side_blocks = plan.side_blocks;
  const unsigned row_blocks = plan.row_blocks;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "solve_long_rows_cuda", [&] {
    TORCH_CHECK(plan.tile == level_tile<scalar_t>() && plan.levels == 2 + digits_for(KeyTraits<scalar_t>::kBits),
                "fastlapsum: internal: a long-row plan of another dtype");
    constexpr int kDigits = digits_for(KeyTraits<scalar_t>::kBits);
    // The workspaces, carved from one allocation (an allocator call costs ~1-2 us of host time
    // in eager mode), each part 256-byte aligned. The first part is zeroed (one memset): the
    // bins, propose's first-digit counts and barrier counters, then the fused tail's arrival
    // counters (a row's, put back to zero by the block that runs the row). The memset is an
    // ordinary stream operation before propose (or the gathering pass that proposes for
    // itself): level 0 relies on it (it reads x before its wait, see level_kernel).
    const int64_t hist_bytes = rows * kBins * int64_t(sizeof(BinSums));
    const int64_t first_bytes = sort ? 0 : rows * kFirstHistWords * 4;
    const bool fused = plan.fused_tail;
    enum Part { kZeroed, kLater, kState, kPartial, kSides, kCounts, kMiddle, kParts };
    const int64_t part_bytes[kParts] = {
        hist_bytes + first_bytes + (fused ? rows * 4 : 0), sort ? 1 : rows * (kDigits - 1) * 2 * kBins * 4,
        rows * int64_t(sizeof(RowState)), rows * chunks * int64_t(sizeof(LevelPartial)),
        rows * side_blocks * int64_t(sizeof(SidesPartial)), rows * chunks * int64_t(sizeof(unsigned)) + 1,
        (sort ? 1 : rows * chunks * cap) * int64_t(sizeof(double))};
    int64_t offset[kParts + 1] = {0};
    for (int i = 0; i < kParts; ++i) offset[i + 1] = offset[i] + (part_bytes[i] + 255) / 256 * 256;
    at::Tensor work = at::empty({offset[kParts]}, x.options().dtype(at::kByte));
    uint8_t* wp = work.mutable_data_ptr<uint8_t>();
    uint8_t* zp = wp + offset[kZeroed];
    C10_CUDA_CHECK(cudaMemsetAsync(zp, 0, part_bytes[kZeroed], stream));
    auto* st = reinterpret_cast<RowState*>(wp + offset[kState]);
    auto* hs = reinterpret_cast<BinSums*>(zp);
    auto* lp = reinterpret_cast<LevelPartial*>(wp + offset[kPartial]);
    auto* sp = reinterpret_cast<SidesPartial*>(wp + offset[kSides]);
    auto* cp = reinterpret_cast<unsigned*>(wp + offset[kCounts]);
    double* mp = reinterpret_cast<double*>(wp + offset[kMiddle]);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const dim3 grid(static_cast<unsigned>(chunks), row_blocks);
    const bool self_propose = plan.self_propose;
    auto* first_hist = reinterpret_cast<unsigned*>(zp + hist_bytes);
    auto* arrivals = fused ? reinterpret_cast<unsigned*>(zp + hist_bytes + first_bytes) : nullptr;
    auto* later = reinterpret_cast<unsigned*>(wp + offset[kLater]);
    if (!self_propose)
      launch_dependent(propose_instance<scalar_t>(plan.propose_min_blocks),
                       dim3(static_cast<unsigned>(plan.propose_blocks), static_cast<unsigned>(plan.propose_rows)),
                       kProposeThreads, 0, stream, xp, k.const_data_ptr<double>(), t.const_data_ptr<double>(), st,
                       first_hist, later, rows, n, sign, sort);
    double* bp = b.mutable_data_ptr<double>();
    double* ep = edge.mutable_data_ptr<double>();
    int64_t* dp = diag.mutable_data_ptr<int64_t>();
    constexpr auto sorted_middle = sorted_middle_for<scalar_t>();
    TORCH_CHECK(!plan.sorted_middle || sorted_middle != nullptr, "fastlapsum: internal: no sorted middle-set kernel");
    const bool preread = plan.preread;
    for (int level = 0; level < plan.levels; ++level) {
      const bool gathering = level == 0 && !sort;  // no scan follows it
      // fused: a level block of each row scans it once the row's blocks are done, no scan launch
      launch_dependent(fused && !gathering ? level_kernel<scalar_t, true> : level_kernel<scalar_t, false>, grid,
                       kLevelThreads, 0, stream, xp, st, mp, cp, cap, hs, lp, k.const_data_ptr<double>(),
                       t.const_data_ptr<double>(), first_hist, later, arrivals, bp, ep, dp, rows, n, sign, level,
                       preread && !(self_propose && level == 1), self_propose && level == 0);
      if (gathering) {  // gathered only: level 1 bins the set, unless it is solved on chip here
        if (plan.sorted_middle)
          launch_dependent(sorted_middle, row_blocks, kSortedThreads, 0, stream, st, lp, static_cast<int>(chunks), mp,
                           cp, cap, k.const_data_ptr<double>(), bp, ep, dp, rows, n, sign);
        continue;
      }
      if (!fused)
        launch_dependent(scan_kernel<scalar_t>, row_blocks, kScanThreads, 0, stream, st, hs, lp,
                         static_cast<int>(chunks), k.const_data_ptr<double>(), bp, ep, dp, rows, n, sign, preread);
    }
    // fused: the sides' last block of each row solves it, no solve launch
    launch_dependent(fused ? sides_kernel<scalar_t, true> : sides_kernel<scalar_t, false>,
                     dim3(static_cast<unsigned>(side_blocks), row_blocks), kLevelThreads, 0, stream, xp, st, mp, cp,
                     cap, static_cast<int>(chunks), sp, arrivals, bp, ep, dp, rows, n, sign, preread);
    if (!fused)
      launch_dependent(solve_kernel, row_blocks, kSolveThreads, 0, stream, st, sp, static_cast<int>(side_blocks), bp,
                       ep, dp, rows, sign, preread);
  });
}

void solve_rows_cuda(ThresholdIO& io, bool largest, const SoftPlan& plan) {
  if (io.x.size(0) == 0) return;
  if (on_chip(plan.regime))
    solve_short_rows_cuda(io.x, io.k, io.t, largest, plan, io.b, io.edge, io.diag, nullptr, false);
  else
    solve_long_rows_cuda(io.x, io.k, io.t, largest, plan.long_rows, io.b, io.edge, io.diag);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_threshold_cuda(const at::Tensor& x_in,
                                                                     const at::Tensor& k_in,
                                                                     const at::Tensor& t_in,
                                                                     bool largest, int64_t method) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  ThresholdIO io = threshold_io(x_in, k_in, t_in, method);
  solve_rows_cuda(io, largest, plan_soft_cuda(io.x.size(0), io.x.size(1), io.x.scalar_type(), method));
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

