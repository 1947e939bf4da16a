// The solver plan of the threshold ops (docs/DESIGN.md §7): method "auto" sorts rows of at
// most a device's kAutoSortMaxN* scores (the closed-form scan after a sort, §1.1) and brackets
// longer ones (§1.2), the same algorithm family on every device, decided on the row length
// alone so that the host knows it without reading the row. The crossovers differ because
// the sorts differ: a CUDA CTA sorts up to 4096 scores on chip in one launch, against the
// bracket's chain. The CPU's stays where its std::sort lost to the scalar bracket (1536), so
// that both devices sort every row up to 1536 scores and report the same paths, which the
// CUDA-against-CPU tests compare; the vectorized CPU bracket is now 2.5-3.3x faster than the
// sort on batches of 256-1024 scores (benchmarks/results/auto_crossover_cpu.txt).
//
// The regimes below name how a call is mapped onto its device. Each device's dispatch
// computes its regime with one function (soft: soft_regime_cpu here, soft_regime_cuda in
// cuda/soft/plan_soft.h; topk: plan_topk in cuda/topk/plan_topk.h (TopkPlan)), which the regime
// ops (soft_regime, topk_regime) also return, so that the diagnostics cannot drift from the
// dispatch. Codes index the name tables, which the extension exports to Python.
#pragma once

#include <cstdint>

#include "lapsum_math.h"

namespace fastlapsum {

constexpr int64_t kAutoSortMaxNCpu = 1536;
constexpr int64_t kAutoSortMaxNCuda = 4096;

// true: the sort solver; false: the bracket (method "sort" on a longer CUDA row runs the
// exact radix bracket, the GPU's sort of a row that does not fit on chip).
inline bool plan_sorts(int64_t n, int64_t method, int64_t auto_sort_max_n) {
  return method == kMethodSort || (method == kMethodAuto && n <= auto_sort_max_n);
}

// lapsum_threshold / soft_topk / log_soft_topk.
enum SoftRegime : int64_t {
  kSoftCpuSort = 0,     // CPU, the sort solver per row
  kSoftCpuBracket = 1,  // CPU, the certified bracket per row
  kSoftWarpRows = 2,    // CUDA, sorted on chip, a warp (or part of one) per row
  kSoftCtaRows = 3,     // CUDA, sorted on chip, a CTA per row
  kSoftLongRows = 4,    // CUDA, the certified bracket's launch sequence
  kSoftRadixRows = 5,   // CUDA, method "sort" on a row too long for the chip: the radix bracket alone
};
constexpr const char* kSoftRegimeNames[] = {"cpu-sort", "cpu-bracket", "warp-rows",
                                            "cta-rows", "long-rows",   "radix-rows"};

inline SoftRegime soft_regime_cpu(int64_t n, int64_t method) {
  return plan_sorts(n, method, kAutoSortMaxNCpu) ? kSoftCpuSort : kSoftCpuBracket;
}

// fastlapsum.topk and the straight-through hard mask.
enum TopkRegime : int64_t {
  kTopkThreadRows = 0,  // CUDA, a thread per row
  kTopkWarpRows = 1,    // CUDA, a warp per row
  kTopkRowCta = 2,      // CUDA, a CTA per row
  kTopkGrid = 3,        // CUDA, several CTAs per row (few long rows)
  kTopkSort = 4,        // CUDA, a stable sort of order keys (float64, and int32/int64 rows)
  kTopkCpu = 5,         // CPU, std::nth_element per row
};
constexpr const char* kTopkRegimeNames[] = {"thread-rows", "warp-rows", "row-cta", "grid", "sort", "cpu"};

}  // namespace fastlapsum
