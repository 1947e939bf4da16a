// The long-row threshold solver's shared layout (threshold_cuda.cu): its tuning constants,
// the row state that carries a row from one launch to the next, and the per-block partial
// sums with their fixed-order merges.
#pragma once

#include <cstdint>

#include "../../common/atom_scan.h"
#include "tuning.cuh"

namespace fastlapsum {
namespace {

constexpr int kBins = 2048;
constexpr int kDigitBits = 11;
constexpr int kLevelThreads = 512;
// 16-byte vectors per thread per tile of the row pass, their loads issued together and kept
// raw until used (converted to fp64 up front they would take ~126 registers: one block per SM).
constexpr int kLevelUnroll = 4;
// The scan and the solve in launches of their own (threshold_cuda.cu); fused into the launch
// before, they run at its block's size, kLevelThreads.
constexpr int kScanThreads = SoftTuning::kSeparateFoldThreads;
constexpr int kProposeThreads = 256;
constexpr int kSampleKeys = 8;  // sample keys per propose thread, kept in registers
// Propose stops at a bucket with at most this many sample keys: a smaller bound often costs a
// third digit's round trip (a few us at 1e6) to save a few middle scores (a bucket of two
// digits holds ~15 scores of a Gaussian 1e6 row at k = n/16).
constexpr unsigned kStopKeys = 8;
constexpr int64_t kFirstHistWords = kBins + 32;  // per row: the first digit's counts, the barrier counter
constexpr int kSolveThreads = SoftTuning::kSeparateFoldThreads;  // see kScanThreads
constexpr int64_t kMaxChunks = 1024;  // blocks per row in the row-wide passes
constexpr int64_t kSideBlocks = 128;  // blocks per row of the sides pass
constexpr int kMaxSidesSlices = (kMaxChunks + kSideBlocks - 1) / kSideBlocks;  // middle slices per sides block
constexpr unsigned kMiddleBlocks = 256;  // blocks per row of a level over the middle set
// The on-chip solve of a gathered middle set (sorted_middle_kernel) holds up to
// kSortedMaxItems = 16 scores a thread (8192 in all): a Gaussian row of 2^21 gathers ~4.8K
// scores (k = n/16, t = 1), one of 1e6 ~2.6K, one of 1e5 ~640 (bracket_rule.h's sample of
// 4 n^(2/3)); SoftLaunchTuning::sorted_middle_max_n sets the rows that try it.
constexpr int kSortedMaxItems = 16;

// Scores per tile of the level pass over a row of elem_bytes scores (one block scan per tile
// when gathering), and radix digits of kDigitBits over keys of `bits` bits.
__host__ __device__ constexpr int64_t level_tile_for(int elem_bytes) {
  return int64_t(kLevelThreads) * (16 / elem_bytes) * kLevelUnroll;
}
__host__ __device__ constexpr int digits_for(int bits) { return (bits + kDigitBits - 1) / kDigitBits; }

enum RowStatus : int { kRefineMiddle = 0, kRefineRow = 1, kSolveMiddle = 2, kSolveRow = 3, kDone = 4 };
// Certification still ahead of a row (kCertifyRow) or done. A bracketed row's first level
// (level 0) only gathers its middle set, so that the rare middle scores keep the row pass's
// loop lean, and no scan follows it; level 1 bins that set. The scan after a row's first
// binning level checks the certificate (or settles the row: non-finite scores, k at an end).
enum Certify : int { kCertified = 0, kCertifyRow = 1 };

struct RowState {
  int status;
  int certify;              // Certify
  uint64_t lo_key, hi_key;  // key range being refined, inclusive
  double k, t;              // budget left for the finite scores (after the first scan), temperature
  Tail above0, below0;      // scores outside the bracket: carried into the middle-buffer levels
  double gap_lo, gap_hi;    // the final gap: no score lies strictly inside
  int64_t middle, path, attempts;
};

struct LevelPartial {  // one block's share of a level
  double above_count, above_sum, below_sum;
  unsigned long long middle, nan, pinf, ninf;
  int overflow;
};

struct LevelPartialSum {
  __device__ LevelPartial operator()(LevelPartial a, const LevelPartial& b) const {
    a.above_count += b.above_count;
    a.above_sum += b.above_sum;
    a.below_sum += b.below_sum;
    a.middle += b.middle;
    a.nan += b.nan;
    a.pinf += b.pinf;
    a.ninf += b.ninf;
    a.overflow |= b.overflow;
    return a;
  }
};

struct BinSums {
  unsigned long long count;
  double U, L;  // against the bin's lower / upper key edge
};

// Scores at or above the gap and at or below it, as atoms: sums against the nearest
// score on each side (online rescaling), because the closed form needs the two sides'
// masses relative to each other even when both are tiny against the gap's ends.
struct GapSides {
  Atom above, below;
};

// The same sums in a flat frame (sides_kernel): against the gap's ends, with the nearest
// score on each side.
struct FlatSides {
  double above_count, above_u, above_min, below_count, below_l, below_max;
};
struct FlatSidesSum {
  __device__ FlatSides operator()(const FlatSides& a, const FlatSides& b) const {
    return FlatSides{a.above_count + b.above_count, a.above_u + b.above_u, fmin(a.above_min, b.above_min),
                     a.below_count + b.below_count, a.below_l + b.below_l, fmax(a.below_max, b.below_max)};
  }
};

// One sides block's share of a row: flat sums, or atoms (see flat_sides).
union SidesPartial {
  GapSides atoms;
  FlatSides flat;
};

struct GapMerge {
  double inv_t;
  __device__ GapSides operator()(GapSides a, const GapSides& b) const {
    atom_merge(a.above, b.above, inv_t);
    atom_merge(a.below, b.below, inv_t);
    return a;
  }
};

struct AtomMerge {
  double inv_t;
  __device__ Atom operator()(Atom a, const Atom& b) const {
    atom_merge(a, b, inv_t);
    return a;
  }
};

// The scan's bins and tails against the two ends of the key range [a_lo, a_hi]:
// u = sum e^{(a_lo - s)/t}, l = sum e^{(s - a_hi)/t}, and the lowest / highest nonempty bin
// edge. When the range spans at most kFlatSpan temperatures these stay in fp64's normal
// range, so merges are plain sums and the scan's dependent chains hold no exponentials
// (merging atoms costs two per step). Wider ranges (the fallback's whole-row level, tiny t)
// take the atom scan.
constexpr double kFlatSpan = 512.0;
struct FlatAtom {
  double count, u, l, lo, hi;
};
struct FlatMerge {
  __device__ FlatAtom operator()(const FlatAtom& a, const FlatAtom& b) const {
    return FlatAtom{a.count + b.count, a.u + b.u, a.l + b.l, fmin(a.lo, b.lo), fmax(a.hi, b.hi)};
  }
};
// What the flat scans carry past a group: below it, the l sum and the highest nonempty bin;
// above it, the count, the u sum and the lowest nonempty bin (-1 / kBins: none). The edges
// follow from bin indices, so the scans move two or three words, not five with min/max.
struct FlatBelow {
  double l;
  int top;
};
struct FlatAbove {
  double count, u;
  int bottom;
};
struct FlatBelowMerge {
  __device__ FlatBelow operator()(const FlatBelow& a, const FlatBelow& b) const {
    return FlatBelow{a.l + b.l, a.top > b.top ? a.top : b.top};
  }
};
struct FlatAboveMerge {
  __device__ FlatAbove operator()(const FlatAbove& a, const FlatAbove& b) const {
    return FlatAbove{a.count + b.count, a.u + b.u, a.bottom < b.bottom ? a.bottom : b.bottom};
  }
};
// The sums above a gap in the flat frame: count, u, and the gap's upper end.
struct FlatTail {
  double count, u, ref;
};
struct FlatFrame {
  double a_lo, a_hi, inv_t;
  // Psi at g in [a_lo, a_hi]: C scores above g with sum u, the scores below with sum l.
  __device__ double psi(double C, double u, double l, double g) const {
    return C - 0.5 * u * exp((g - a_lo) * inv_t) + 0.5 * l * exp((a_hi - g) * inv_t);
  }
  // The curve of walk_gaps (atom_scan.h): B is the l sum below the gap.
  using Above = FlatTail;
  __device__ void add(FlatTail& s, const FlatAtom& a) const {
    s.count += a.count;
    s.u += a.u;
    s.ref = a.lo;
  }
  __device__ double psi_lo(const FlatTail& s, double B, double lo) const { return psi(s.count, s.u, B, lo); }
  __device__ double psi_hi(const FlatTail& s, double B, double) const { return psi(s.count, s.u, B, s.ref); }
};

}  // namespace
}  // namespace fastlapsum
