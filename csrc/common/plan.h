// The solver plan of the threshold ops, the same on every device (docs/DESIGN.md §7):
// method "auto" sorts rows of at most kAutoSortMaxN scores (the closed-form scan after a
// sort, §1.1) and brackets longer ones (§1.2). The crossover is measured on the CPU
// (benchmarks/bench_auto_crossover.py: the bracket wins by ~2x from 4096 scores on, the
// sort below 2048) and is where the CUDA on-chip solver's row fits one CTA. It is decided on
// the row length alone, so that the host knows it without reading the row.
#pragma once

#include <cstdint>

#include "lapsum_math.h"

namespace fastlapsum {

constexpr int64_t kAutoSortMaxN = 4096;

// true: the sort solver; false: the bracket (method "sort" on a longer CUDA row runs the
// exact radix bracket, the GPU's sort of a row that does not fit on chip).
inline bool plan_sorts(int64_t n, int64_t method) {
  return method == kMethodSort || (method == kMethodAuto && n <= kAutoSortMaxN);
}

}  // namespace fastlapsum
