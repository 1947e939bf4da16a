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
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <limits>
#include <type_traits>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "../common/atom_scan.h"
#include "../common/bracket_rule.h"
#include "../common/cuda_launch.cuh"
#include "../common/gpu_rows.cuh"
#include "../common/op_io.h"
#include "../common/tile_scan.cuh"
#include "../ops.h"
#include "gpu_keys.cuh"
#include "sorted_solve.cuh"
#include "threshold_cuda.h"

namespace fastlapsum {
namespace {

constexpr int kBins = 2048;
constexpr int kDigitBits = 11;
constexpr int kLevelThreads = 512;
// 16-byte vectors per thread per tile of the row pass, their loads issued together and kept
// raw until used (converted to fp64 up front they would take ~126 registers: one block per SM).
constexpr int kLevelUnroll = 4;
constexpr int kScanThreads = 256;  // 512 (4 bins per thread) is no faster
constexpr int kScanBins = kBins / kScanThreads;  // consecutive bins per scan thread
constexpr int kProposeThreads = 256;
constexpr int kSampleKeys = 8;  // sample keys per propose thread, kept in registers
// Propose stops at a bucket with at most this many sample keys: a smaller bound often costs a
// third digit's round trip (a few us at 1e6) to save a few middle scores (a bucket of two
// digits holds ~15 scores of a Gaussian 1e6 row at k = n/16).
constexpr unsigned kStopKeys = 8;
constexpr int64_t kFirstHistWords = kBins + 32;  // per row: the first digit's counts, the barrier counter
constexpr int kSolveThreads = 256;
constexpr int64_t kMaxChunks = 1024;  // blocks per row in the row-wide passes
constexpr int64_t kSideBlocks = 128;  // blocks per row of the sides pass
constexpr int kMaxSidesSlices = (kMaxChunks + kSideBlocks - 1) / kSideBlocks;  // middle slices per sides block
constexpr unsigned kMiddleBlocks = 256;  // blocks per row of a level over the middle set
// Rows up to this length try to solve their middle set on chip (sorted_middle_kernel), up to
// kSortedMaxItems = 16 scores a thread (8192 in all): a Gaussian row of 2^21 gathers ~4.8K
// scores (k = n/16, t = 1), one of 1e6 ~2.6K, one of 1e5 ~640 (bracket_rule.h's sample of
// 4 n^(2/3)).
constexpr int64_t kSortedMiddleMaxN = int64_t(1) << 21;
constexpr int kSortedMaxItems = 16;

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
struct FlatFrame {
  double a_lo, a_hi, inv_t;
  // Psi at g in [a_lo, a_hi]: C scores above g with sum u, the scores below with sum l.
  __device__ double psi(double C, double u, double l, double g) const {
    return C - 0.5 * u * exp((g - a_lo) * inv_t) + 0.5 * l * exp((a_hi - g) * inv_t);
  }
};


// Block-wide reduction in a fixed order with a short chain of dependent merges: a shuffle
// tree in each warp, then one over the warps' results (cub::BlockReduce merges those one
// after another: 15 in a row at 512 threads, each several fp64 exponentials for atoms).
// The result is valid in thread 0; scratch holds a value per warp.
template <int kThreads, typename T, typename Op>
__device__ T tree_reduce(T v, Op op, T* scratch) {
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int d = 16; d > 0; d /= 2) {
    const T other = cub::ShuffleDown<32>(v, d, 31, 0xffffffffu);
    if (lane + d < 32) v = op(v, other);
  }
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = scratch[lane < kWarps ? lane : 0];
    for (int d = kWarps / 2; d > 0; d /= 2) {
      const T other = cub::ShuffleDown<32>(v, d, 31, 0xffffffffu);
      if (lane + d < kWarps) v = op(v, other);
    }
  }
  return v;
}

// Scores per tile of the level pass over a row (one block scan per tile when gathering).
template <typename scalar_t>
__host__ __device__ constexpr int64_t level_tile() {
  return int64_t(kLevelThreads) * vec_width<scalar_t>() * kLevelUnroll;
}

__host__ __device__ constexpr int digits_for(int bits) { return (bits + kDigitBits - 1) / kDigitBits; }

// Bins of a key range: width 2^shift keys, at most kBins of them.
__device__ inline int bin_shift(uint64_t lo, uint64_t hi) {
  int shift = 0;
  while (((hi - lo) >> shift) >= static_cast<uint64_t>(kBins)) ++shift;
  return shift;
}

// Keys [first, last] of bin `bin` of the range [lo, hi]: 2^shift keys, the last bin cut at hi.
struct BinKeys {
  uint64_t first, last;
};
__device__ inline BinKeys bin_keys(uint64_t lo, uint64_t hi, int shift, int bin) {
  const uint64_t first = lo + (static_cast<uint64_t>(bin) << shift);
  const uint64_t last_full = first + ((uint64_t(1) << shift) - 1);
  return BinKeys{first, last_full > hi || last_full < first ? hi : last_full};
}

// A level's bins over a range that spans at most kFlatSpan temperatures hold their sums
// against the range's ends (BinSums::U against a_lo, L against a_hi: each block converts its
// edge-relative sums once when it adds them), so the scan's flat path reads them as they are.
__device__ inline bool flat_range(double a_lo, double a_hi, double inv_t) { return (a_hi - a_lo) * inv_t <= kFlatSpan; }

template <typename KT>
__device__ inline FlatAtom flat_bin(const BinSums& h, uint64_t lo, uint64_t hi, int shift, int bin) {
  if (h.count == 0) return FlatAtom{0.0, 0.0, 0.0, INFINITY, -INFINITY};
  using Key = typename KT::Key;
  const BinKeys b = bin_keys(lo, hi, shift, bin);
  return FlatAtom{static_cast<double>(h.count), h.U, h.L, KT::value(Key(b.first)), KT::value(Key(b.last))};
}

// A bin as an atom (sums against its own edges); `flat` bins are converted back.
template <typename KT>
__device__ inline Atom bin_atom(const BinSums& h, uint64_t lo, uint64_t hi, int shift, int bin, bool flat,
                                const FlatFrame& f) {
  if (h.count == 0) return Atom{0, 0, 0, 0, 0};
  using Key = typename KT::Key;
  const BinKeys b = bin_keys(lo, hi, shift, bin);
  const double e_lo = KT::value(Key(b.first)), e_hi = KT::value(Key(b.last));
  if (!flat) return Atom{e_lo, e_hi, static_cast<double>(h.count), h.U, h.L};
  return Atom{e_lo, e_hi, static_cast<double>(h.count), h.U * exp((e_lo - f.a_lo) * f.inv_t),
              h.L * exp((f.a_hi - e_hi) * f.inv_t)};
}

// Adds one score's terms to a shared-memory bin. Float atomics on shared memory are CAS loops
// on sm_90; with kAggregate the lanes of a warp that hit the same bin (ties, a narrow
// cluster) add theirs together first: one atomic per bin per warp, not one per lane spinning
// on one word. (No warp match before Volta: plain atomics there.)
template <bool kAggregate>
__device__ inline void bin_add(unsigned* count, double* U, double* L, int bin, double u, double l) {
  unsigned lanes = 1;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
  if constexpr (kAggregate) {
    const unsigned lane = threadIdx.x % 32;
    const unsigned peers = __match_any_sync(__activemask(), bin);
    lanes = __popc(peers);
    if (peers != (1u << lane)) {  // the lowest lane gathers the others' terms, in lane order
      const double own_u = u, own_l = l;
      for (unsigned rest = peers & (peers - 1); rest != 0; rest &= rest - 1) {
        const int src = __ffs(rest) - 1;
        const double ou = __shfl_sync(peers, own_u, src), ol = __shfl_sync(peers, own_l, src);
        u += ou;
        l += ol;
      }
      if (lane != static_cast<unsigned>(__ffs(peers) - 1)) return;
    }
  }
#endif
  atomicAdd(&count[bin], lanes);
  atomicAdd(&U[bin], u);
  atomicAdd(&L[bin], l);
}

// ---- rows already settled -------------------------------------------------------------------

// After propose the kernels are dependent launches (cuda_launch.cuh): each one's blocks are
// resident while the one before it runs, and wait for it to finish. A row settled early (the
// sorted middle kernel solves most rows up to 2^21; a certified row needs no more digits)
// leaves up to ten of them with nothing to do but read its state after the wait and exit. So
// those kernels read the row's status before the wait as well: a status only moves forward
// (refine -> solve -> done), so a settled status read early is final, and the block exits as
// soon as the wait returns instead of after one more round trip to L2. Only where the sorted
// middle kernel is not launched (`preread`): it pays for rows beyond 2^21, but after the
// sorted kernel it costs more than it saves. (Exiting before the wait is slower: the next
// kernel's blocks are then only launched when these exit; it would also break completion's
// transitivity through the waits.)
// What this rests on, for whoever changes these kernels:
// - no write moves a status back (solve or done -> refine, done -> anything);
// - each kernel does nothing for a row that its predicate below calls settled (the check after
//   its wait `continue`s before any write), so returning early skips nothing;
// - a dependent launch's blocks are resident only after every block of the launch before it
//   has passed its wait, so the launch two back has completed and its state is in L2, which
//   __ldcg reads: the first pre-read must come two launches after the rows' states are
//   written (propose, or level 0 proposing for itself: then level 1 does not pre-read), so
//   that no earlier call's stale state is ever seen.
__device__ inline bool past_refine(int status) { return status != kRefineMiddle && status != kRefineRow; }
__device__ inline bool is_done(int status) { return status == kDone; }

// True in every thread when each row of this block (first, first + stride, ...) is settled;
// read past L1 (a line left by an earlier kernel could be stale).
__device__ inline bool rows_settled_early(const RowState* state, int64_t first, int64_t stride, int64_t rows,
                                          bool (*settled)(int)) {
  bool all = true;
  if (threadIdx.x == 0)
    for (int64_t r = first; r < rows && all; r += stride) all = settled(__ldcg(&state[r].status));
  return __syncthreads_and(all) != 0;
}

// ---- propose -------------------------------------------------------------------------------

// Waits until the row's counter has `target` arrivals: the blocks of one row trade their
// histograms through global memory. They are all resident (the grid is at most one wave and
// every block of it arrives), so the wait ends.
__device__ inline void row_barrier(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's histogram adds (after the bar.sync above) before the arrival
    atomicAdd(counter, 1u);
    unsigned seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < target);
  }
  __syncthreads();
}

// A row's state before its first pass.
template <typename KT>
__device__ inline RowState initial_state(double k, double t, bool sort) {
  RowState st{};
  st.status = sort ? kRefineRow : kRefineMiddle;
  st.certify = kCertifyRow;
  st.lo_key = KT::min_key();
  st.hi_key = KT::max_key();
  st.k = k;
  st.t = t;
  st.above0 = Tail{0.0, 0.0, INFINITY};
  st.below0 = Tail{0.0, 0.0, -INFINITY};
  st.path = sort ? kPathRadix : kPathBracket;
  st.attempts = sort ? 0 : 1;
  return st;
}

// The radix select of the bracket's two order statistics over a row's noised sample, shared
// by propose_kernel and the gathering pass that proposes for itself (level_kernel): the blocks
// of a row add each digit's counts (of their sample keys under either end's prefix so far) to
// the row's global histogram, and after a row barrier every block reads the whole histogram
// and takes the same next digit. rank < 0 or >= m leaves that end open.
struct SampleSelect {
  int64_t rank[2];       // each end's rank left inside its bucket
  uint64_t prefix[2];    // each end's key prefix so far
  unsigned in_bucket[2];  // sample keys in each end's bucket so far
};

// The key of sample point i (score v) with its Laplace noise: the same bits wherever it is
// computed (propose_kernel, propose_from_tile), so the rounding is spelled out (sign * v is
// exact; one rounding for t * noise, one for the sum).
template <typename KT>
__device__ inline typename KT::Key sample_key(double v, double t, double sign, int64_t i) {
  return KT::key(__fma_rn(sign, v, __dmul_rn(t, static_cast<double>(laplace_noise_f(static_cast<uint32_t>(i))))));
}

// bits of the digit that follows the first `done` bits of a key
template <typename KT>
__device__ constexpr int digit_bits(int done) {
  return KT::kBits - done < kDigitBits ? KT::kBits - done : kDigitBits;
}

// Takes one digit: this thread's kBins / kThreads bins of both ends' counts straight from L2
// (16-byte loads, all in flight together: the digit's one round trip), scanned, and each
// end's bucket chosen. `shared`: both ends count in one histogram (the first digit), else
// src holds [end][bin].
template <int kThreads>
__device__ inline void take_digit(const unsigned* src, bool shared, int bits,
                                  typename cub::BlockScan<unsigned, kThreads>::TempStorage& scan, SampleSelect& sel) {
  constexpr int kPer = kBins / kThreads;  // bins per thread
  static_assert(kPer % 4 == 0, "16-byte loads");
  uint4 raw[2][kPer / 4];
#pragma unroll
  for (int target = 0; target < 2; ++target)
#pragma unroll
    for (int v = 0; v < kPer / 4; ++v)
      raw[target][v] = __ldcg(reinterpret_cast<const uint4*>(src + (shared ? 0 : target * kBins) + kPer * threadIdx.x) + v);
#pragma unroll
  for (int target = 0; target < 2; ++target) {
    unsigned c[kPer], e[kPer];
    memcpy(c, raw[target], sizeof(c));
    cub::BlockScan<unsigned, kThreads>(scan).ExclusiveSum(c, e);
    const int64_t rank = sel.rank[target];
    __syncthreads();
#pragma unroll
    for (int q = 0; q < kPer; ++q)
      if (rank >= e[q] && rank < static_cast<int64_t>(e[q]) + c[q]) {
        sel.rank[target] = rank - e[q];
        sel.prefix[target] = (sel.prefix[target] << bits) | static_cast<uint64_t>(kPer * threadIdx.x + q);
        sel.in_bucket[target] = c[q];
      }
    __syncthreads();
  }
}

// After `level` + 1 digits: all of them, or two digits or more and each end's bucket holding
// at most kStopKeys sample keys (the bucket's outer edge is as good an end as the key: it adds
// at most kStopKeys sample spacings to the bracket, and a digit's round trips are saved).
template <typename KT>
__device__ inline bool select_done(int level, const SampleSelect& sel) {
  return level + 1 == digits_for(KT::kBits) ||
         (level >= 1 && sel.in_bucket[0] <= kStopKeys && sel.in_bucket[1] <= kStopKeys);
}

// Calls add(end, digit) for each end whose prefix (the first `done` bits) the key lies under,
// with the key's next digit; ends whose rank fell outside the sample are skipped.
template <typename KT, typename Add>
__device__ inline void next_digit_of(typename KT::Key key, int done, int64_t count, const SampleSelect& sel, Add add) {
  using Key = typename KT::Key;  // in the key's width: 64-bit shifts cost fp32 rows twice
  const int next_bits = digit_bits<KT>(done);
  const int digit = static_cast<int>((key >> (KT::kBits - done - next_bits)) & ((Key(1) << next_bits) - 1));
  const Key top = key >> (KT::kBits - done);  // done >= kDigitBits here
#pragma unroll
  for (int end = 0; end < 2; ++end)
    if (sel.rank[end] >= 0 && sel.rank[end] < count && top == static_cast<Key>(sel.prefix[end])) add(end, digit);
}

// The bracket's key range once the select stopped after `done` bits: keys, or buckets that
// hold few sample keys (a bucket of the second digit is 2^-13 of the value wide, which can be
// far wider than the bracket when |score| >> t).
template <typename KT>
__device__ inline void set_bracket(const SampleSelect& sel, int done, int64_t il, int64_t iu, int64_t count,
                                   RowState& st) {
  const int rest = KT::kBits - done;  // bits below the buckets' prefix (0: keys)
  const uint64_t below = rest == 0 ? 0 : (uint64_t(1) << rest) - 1;
  const uint64_t lo = il >= 0 && il < count ? sel.prefix[0] << rest : 0;
  const uint64_t hi = iu >= 0 && iu < count ? (sel.prefix[1] << rest) | below : ~uint64_t(0);
  const uint64_t kmin = KT::min_key(), kmax = KT::max_key();
  st.lo_key = lo < kmin ? kmin : (lo > kmax ? kmax : lo);
  st.hi_key = hi < kmin ? kmin : (hi > kmax ? kmax : hi);
  if (st.hi_key < st.lo_key) st.hi_key = st.lo_key;
}

// Where a row's sample select starts, for propose_kernel and propose_from_tile: the sample,
// the bracket's two ranks in it, the row's histograms (the first digit's and the barrier
// counter come zeroed with the workspace; the later digits' are zeroed here by the row's
// gridDim.x blocks, before their first barrier) and, from thread 0, sel at the two ranks.
struct RowSelectStart {
  SampleGeometry g;
  int64_t il, iu;
  unsigned *first, *counter, *later;
};
template <typename KT>
__device__ inline RowSelectStart start_row_select(int64_t r, int64_t n, double k, unsigned* first_hist,
                                                  unsigned* later_hist, SampleSelect& sel) {
  constexpr int kDigits = digits_for(KT::kBits);
  const double nn = static_cast<double>(n);
  RowSelectStart s;
  s.g = sample_geometry(n, r);
  bracket_indices(s.g.count, nn, (k >= 0.0 && k <= nn) ? k : 0.5 * nn, 0, &s.il, &s.iu);
  s.first = first_hist + r * kFirstHistWords;  // kBins counts, then the barrier counter
  s.counter = s.first + kBins;
  s.later = later_hist + r * (kDigits - 1) * 2 * kBins;  // [digit - 1][end][bin]
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < (kDigits - 1) * 2 * kBins;
       j += int64_t(gridDim.x) * blockDim.x)
    s.later[j] = 0;
  if (threadIdx.x == 0) sel = SampleSelect{{s.il, s.iu}, {0, 0}, {0, 0}};  // an open end's bucket count stays 0
  return s;
}

// Adds this block's `words` counts (shared memory) to the row's histogram, then waits at the
// row barrier (its `phase`-th) until every block of the row has.
__device__ inline void publish_counts(const unsigned* block, unsigned* row, int words, const RowSelectStart& rs,
                                      unsigned& phase) {
  __syncthreads();
  for (int j = threadIdx.x; j < words; j += blockDim.x)
    if (block[j] != 0) atomicAdd(&row[j], block[j]);
  row_barrier(rs.counter, gridDim.x * ++phase);
}

// The select's digits once the first digit's counts are in: every block takes each digit
// alike; unless the select is then done, count_next(dst, done) adds this block's counts of the
// next digit ([end][bin] at dst) and waits at the row barrier. Returns the bits taken.
template <typename KT, int kThreads, typename CountNext>
__device__ inline int select_digits(const RowSelectStart& rs, typename cub::BlockScan<unsigned, kThreads>::TempStorage& scan,
                                    SampleSelect& sel, CountNext&& count_next) {
  int done = 0;
  for (int level = 0; level < digits_for(KT::kBits); ++level) {
    const int bits = digit_bits<KT>(done);
    take_digit<kThreads>(level == 0 ? rs.first : rs.later + (level - 1) * 2 * kBins, level == 0, bits, scan, sel);
    done += bits;
    if (select_done<KT>(level, sel)) break;  // the same decision in every block
    count_next(rs.later + level * 2 * kBins, done);
  }
  return done;
}

// The noised systematic sample of a row and two order statistics of it -> the bracket's key
// range, in one launch: a few blocks per row each keep kSampleKeys keys per thread in
// registers and count each digit in shared memory before adding it to the row's histogram.
// The first digit's histogram and the barrier counter come zeroed; the later ones are zeroed
// here before the first barrier.
template <typename scalar_t>
__global__ void __launch_bounds__(kProposeThreads)
propose_kernel(const scalar_t* __restrict__ x, const double* __restrict__ k_in, const double* __restrict__ t_in,
               RowState* __restrict__ state, unsigned* __restrict__ first_hist, unsigned* __restrict__ later_hist,
               int64_t rows, int64_t n, double sign, bool sort) {
  begin_dependent_grid();
  using KT = KeyTraits<scalar_t>;
  using Key = typename KT::Key;
  using Scan = cub::BlockScan<unsigned, kProposeThreads>;
  __shared__ unsigned hist[2][kBins];
  __shared__ typename Scan::TempStorage scan;
  __shared__ SampleSelect sel;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const double k = k_in[r], t = t_in[r];
    RowState st = initial_state<KT>(k, t, sort);
    if (!sort) {
      const RowSelectStart rs = start_row_select<KT>(r, n, k, first_hist, later_hist, sel);
      const SampleGeometry& g = rs.g;
      for (int j = threadIdx.x; j < kBins; j += blockDim.x) hist[0][j] = 0;
      __syncthreads();
      // This block's share of the sample: each gather is its own memory transaction, so all
      // of a thread's loads are issued before any is used.
      const auto sample_index = [&](int q) { return (int64_t(blockIdx.x) * kSampleKeys + q) * blockDim.x + threadIdx.x; };
      Key keys[kSampleKeys];
      {
        double v[kSampleKeys];
#pragma unroll
        for (int q = 0; q < kSampleKeys; ++q) {
          const int64_t i = sample_index(q);
          v[q] = i < g.count ? static_cast<double>(x[r * n + g.offset + i * g.stride]) : 0.0;
        }
#pragma unroll
        for (int q = 0; q < kSampleKeys; ++q) {
          const int64_t i = sample_index(q);
          keys[q] = sample_key<KT>(v[q], t, sign, i);
          if (i < g.count) atomicAdd(&hist[0][static_cast<int>(static_cast<uint64_t>(keys[q]) >> (KT::kBits - kDigitBits))], 1u);
        }
      }
      unsigned phase = 0;
      publish_counts(&hist[0][0], rs.first, kBins, rs, phase);
      const int done = select_digits<KT, kProposeThreads>(rs, scan, sel, [&](unsigned* dst, int done) {
        // The next digit of this block's keys under each end's prefix.
        for (int j = threadIdx.x; j < 2 * kBins; j += blockDim.x) hist[j / kBins][j % kBins] = 0;
        __syncthreads();
#pragma unroll
        for (int q = 0; q < kSampleKeys; ++q)
          if (sample_index(q) < g.count)
            next_digit_of<KT>(keys[q], done, g.count, sel, [&](int end, int digit) { atomicAdd(&hist[end][digit], 1u); });
        publish_counts(&hist[0][0], dst, 2 * kBins, rs, phase);
      });
      set_bracket<KT>(sel, done, rs.il, rs.iu, g.count, st);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) state[r] = st;
    __syncthreads();
  }
}

// The bracket of row r from the sample points in this block's parked tile, for a gathering
// pass that proposes for itself (rows of one tile a block, see solve_long_rows_cuda): the
// blocks of a row hold the whole sample between them (point i sits at offset + i * stride), so
// with propose_kernel's noise and select the bracket is propose's, bit for bit. The first
// digit's counts go through block_hist (shared memory that does not overlap the tile); the
// later digits' few keys straight to the row's histogram. Saves propose's launch and its
// scattered sample loads. Every thread returns the row's state.
template <typename scalar_t>
__device__ RowState propose_from_tile(const scalar_t* tile, unsigned* block_hist, int64_t r, int64_t n, double sign,
                                      double k, double t, unsigned* first_hist, unsigned* later_hist,
                                      typename cub::BlockScan<unsigned, kLevelThreads>::TempStorage& scan,
                                      SampleSelect& sel) {
  using KT = KeyTraits<scalar_t>;
  RowState st = initial_state<KT>(k, t, false);
  const RowSelectStart rs = start_row_select<KT>(r, n, k, first_hist, later_hist, sel);
  const SampleGeometry& g = rs.g;
  // This tile's points: i in [i0, i1), positions [start, end) of the row.
  const int64_t start = int64_t(blockIdx.x) * level_tile<scalar_t>();
  const int64_t end = start + level_tile<scalar_t>() < n ? start + level_tile<scalar_t>() : n;
  const auto first_point = [&](int64_t pos) { return pos <= g.offset ? 0 : (pos - g.offset + g.stride - 1) / g.stride; };
  const int64_t i0 = first_point(start), i1 = first_point(end) < g.count ? first_point(end) : g.count;
  const auto key_of = [&](int64_t i) {
    return sample_key<KT>(static_cast<double>(tile[g.offset + i * g.stride - start]), t, sign, i);
  };
  // The first digit's counts through this block's histogram: the row's keys crowd a few dozen
  // of its bins, so one global add per point would queue the whole row's sample on them.
  for (int j = threadIdx.x; j < kBins; j += blockDim.x) block_hist[j] = 0;
  __syncthreads();
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x)
    atomicAdd(&block_hist[static_cast<int>(static_cast<uint64_t>(key_of(i)) >> (KT::kBits - kDigitBits))], 1u);
  unsigned phase = 0;
  publish_counts(block_hist, rs.first, kBins, rs, phase);  // its barrier also publishes sel
  // the later digits' keys are few (those under an end's bucket): straight to the row's counts
  const int done = select_digits<KT, kLevelThreads>(rs, scan, sel, [&](unsigned* dst, int done) {
    for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x)
      next_digit_of<KT>(key_of(i), done, g.count, sel, [&](int e, int digit) { atomicAdd(&dst[e * kBins + digit], 1u); });
    row_barrier(rs.counter, gridDim.x * ++phase);
  });
  set_bracket<KT>(sel, done, rs.il, rs.iu, g.count, st);
  return st;
}

// ---- level --------------------------------------------------------------------------------

template <typename scalar_t>
__global__ void __launch_bounds__(kLevelThreads, 2)
level_kernel(const scalar_t* __restrict__ x, RowState* __restrict__ state, double* __restrict__ middle,
             unsigned* __restrict__ slice_count, int64_t cap, BinSums* __restrict__ hist,
             LevelPartial* __restrict__ partial, const double* __restrict__ k_in, const double* __restrict__ t_in,
             unsigned* __restrict__ first_hist, unsigned* __restrict__ later_hist, int64_t rows, int64_t n,
             double sign, int level, bool preread, bool propose) {
  using KT = KeyTraits<scalar_t>;
  using Key = typename KT::Key;
  using F = compute_t<scalar_t>;
  constexpr int V = vec_width<scalar_t>();
  constexpr int U = kLevelUnroll;
  using Reduce = cub::BlockReduce<LevelPartial, kLevelThreads>;
  __shared__ union {
    typename Reduce::TempStorage red;
    typename cub::BlockScan<unsigned, kLevelThreads>::TempStorage scan;  // propose_from_tile, before any reduce
  } tmp;
  __shared__ SampleSelect sel;
  __shared__ uint32_t tile_tot[2][kLevelThreads / 32];  // tiles alternate (see run_tiles)
  // The bins, or (level 0, before the wait) this block's first tile: a gathering row has no bins.
  __shared__ union {
    struct {
      double U[kBins], L[kBins];
      unsigned count[kBins];
    } bins;
    uint4 tile[kLevelUnroll * kLevelThreads];
  } sb;
  unsigned* const s_count = sb.bins.count;  // also propose_from_tile's histogram, beside the parked tile
  static_assert(sizeof(double) * 2 * kBins >= sizeof(sb.tile), "the counts lie past the parked tile");
  double* const s_U = sb.bins.U;
  double* const s_L = sb.bins.L;
  // Level 0 reads every row from x, which no kernel of the solver writes and which was complete
  // before its first kernel (the workspace fill, an ordinary launch) began. So this block's
  // first tile of its first row is loaded before the wait for propose and parked in shared
  // memory: a dependent launch starts while propose runs, and the tile's DRAM round trip
  // overlaps it instead of following it (a gathering block of a row up to ~1M fp32 scores has
  // just that one tile). Parked, not held: registers held across the row loop spill.
  const scalar_t past_end = static_cast<scalar_t>(sign > 0.0 ? -INFINITY : INFINITY);  // -inf, signed
  // This thread's vectors of tile tl of row xr, raw (scores past the row's end read as past_end).
  const auto load_tile = [&](RawVec<scalar_t>(&vec)[U], const scalar_t* xr, bool aligned, int64_t tl) {
#pragma unroll
    for (int u = 0; u < U; ++u)
      vec[u] = load_raw<scalar_t>(xr, n, tl * level_tile<scalar_t>() + (int64_t(u) * kLevelThreads + threadIdx.x) * V,
                                  aligned, past_end);
  };
  const bool early = level == 0 && blockIdx.y < rows && int64_t(blockIdx.x) * level_tile<scalar_t>() < n;
  if (early) {
    const scalar_t* xr = x + int64_t(blockIdx.y) * n;
    RawVec<scalar_t> v[U];
    load_tile(v, xr, is_aligned16(xr), blockIdx.x);
#pragma unroll
    for (int u = 0; u < U; ++u) sb.tile[u * kLevelThreads + threadIdx.x] = v[u].raw;
    __syncthreads();  // every thread's tile is parked before any thread zeroes the bins over it
  }
  const bool settled = preread && level > 0 && rows_settled_early(state, blockIdx.y, gridDim.y, rows, past_refine);
  begin_dependent_grid();
  if (settled) return;
  // propose: level 0 of rows of one tile a block, one row a block row (see solve_long_rows_cuda)
  RowState proposed;
  if (propose) {
    const int64_t r = blockIdx.y;
    proposed = propose_from_tile<scalar_t>(reinterpret_cast<const scalar_t*>(sb.tile), s_count, r, n, sign, k_in[r],
                                           t_in[r], first_hist, later_hist, tmp.scan, sel);
    if (blockIdx.x == 0 && threadIdx.x == 0) state[r] = proposed;
  }
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const RowState st = propose ? proposed : state[r];
    if (st.status != kRefineMiddle && st.status != kRefineRow) continue;  // uniform across the block
    const bool gather = st.status == kRefineMiddle && level == 0;  // no bins
    // binning the gathered set for certification: it adds to the gathering pass's sums
    const bool bin_first = st.status == kRefineMiddle && st.certify == kCertifyRow && level > 0;
    const bool from_row = st.status == kRefineRow || gather;
    const int64_t slice_id = r * gridDim.x + blockIdx.x;
    // The middle set is small: a wave of blocks reads it (a block's fixed cost, zeroing and
    // flushing 2048 bins, is most of a pass over it). The others add nothing to the sums.
    const unsigned readers = gridDim.x < kMiddleBlocks ? gridDim.x : kMiddleBlocks;
    if (!from_row && blockIdx.x >= readers) {
      if (threadIdx.x == 0 && !bin_first) partial[slice_id] = LevelPartial{};
      continue;
    }
    if (!gather)
      for (int j = threadIdx.x; j < kBins; j += blockDim.x) { s_count[j] = 0; s_U[j] = 0.0; s_L[j] = 0.0; }
    __syncthreads();
    const uint64_t lo = st.lo_key, hi = st.hi_key;
    const int shift = bin_shift(lo, hi);
    const double a_hi = KT::value(Key(hi)), a_lo = KT::value(Key(lo)), inv_t = inv_temperature(st.t);
    LevelPartial acc{0.0, 0.0, 0.0, 0, 0, 0, 0, 0};
    // Classifies one (signed) score; true when it lies in the key range.
    // aggregate_tag: a whole row's binning pass (the fallback's levels) adds a warp's ties to
    // a bin together, else they spin on one bin's CAS loop; a middle-set pass does not (few
    // scores per block, where the warp match costs more than it saves).
    const auto consider = [&](double s, auto aggregate_tag) -> bool {
      // Most scores lie outside the range: decided by value, without computing a key. The
      // strict comparisons agree with the keys' (keys are monotone and each range end's
      // value has that end's key; the one exception, the key below +0's, decodes to -0,
      // and s > -0 still means s is above it). Ends, NaN and signed zeros go on by key.
      if (s > a_hi) {
        if (s == INFINITY) acc.pinf += 1;
        else {
          acc.above_count += 1.0;
          acc.above_sum += exp_term<scalar_t>((a_hi - s) * inv_t);
        }
        return false;
      }
      if (s < a_lo) {
        if (s == -INFINITY) acc.ninf += 1;
        else acc.below_sum += exp_term<scalar_t>((s - a_lo) * inv_t);
        return false;
      }
      if (!is_finite(s)) {
        acc.nan += s != s;
        acc.pinf += s == INFINITY;
        acc.ninf += s == -INFINITY;
        return false;
      }
      const uint64_t key = KT::key(s);
      if (key > hi) {
        acc.above_count += 1.0;
        acc.above_sum += exp_term<scalar_t>((a_hi - s) * inv_t);
        return false;
      }
      if (key < lo) {
        acc.below_sum += exp_term<scalar_t>((s - a_lo) * inv_t);
        return false;
      }
      const int bin = static_cast<int>((key - lo) >> shift);
      const BinKeys edges = bin_keys(lo, hi, shift, bin);
      bin_add<decltype(aggregate_tag)::value>(s_count, s_U, s_L, bin,
                                              exp_term<scalar_t>((KT::value(Key(edges.first)) - s) * inv_t),
                                              exp_term<scalar_t>((s - KT::value(Key(edges.last))) * inv_t));
      acc.middle += 1;
      return true;
    };
    if (from_row) {
      // Classification in the compute type (fp32 for fp32/fp16/bf16 rows): the range ends
      // are key values, so exact in it, and the comparisons agree with consider()'s. Both
      // tails take the same branch-free path (one exponential, its sum picked by 0/1
      // factors), summed per tile in it and flushed to the fp64 sums. A gathering pass issues the next
      // tile's loads before it classifies a tile, so they are in flight across its barriers.
      const F hi_c = static_cast<F>(a_hi), lo_c = static_cast<F>(a_lo), sign_c = static_cast<F>(sign);
      const ScaledExp<F> tail_exp(inv_t);
      const scalar_t* xr = x + r * n;
      const bool aligned = is_aligned16(xr);
      const int64_t tile = level_tile<scalar_t>();
      const int64_t tiles = (n + tile - 1) / tile;
      double* slice = middle + slice_id * cap;
      int64_t used = 0;  // gathered so far by the block (the same in every thread)
      unsigned above_n = 0, pinf_n = 0, ninf_n = 0, nan_n = 0;
      static_assert(U * V <= 32, "one bit per score of a thread's tile");
      // One tile: the tails, and a bit per score inside the range (a gathering pass gathers
      // those, a binning pass bins them with consider()). The loop keeps to the FMA pipe
      // (compares, selects and bit logic run at half rate on sm_90): sides are 0/1 factors,
      // counts and bits are float sums. Scores past the row's end are loaded as -inf (they
      // add nothing). A non-finite score poisons a sum (s * 0), and such a tile is looked at
      // again to count its non-finite scores exactly and keep them out of the gather (a NaN
      // makes the tails NaN too; its row is settled as a NaN row at certification).
      const auto classify = [&](const RawVec<scalar_t>(&vec)[U], int64_t tl, auto gather_tag, auto far_tag) -> unsigned {
        constexpr bool kGather = decltype(gather_tag)::value;
        const auto side = [](F by) {  // 1 on that side of the range (by > 0), else 0
          if constexpr (decltype(far_tag)::value) return positive_indicator_far(by);
          else return positive_indicator(by);
        };
        constexpr F kMax = std::numeric_limits<F>::max(), kInf = std::numeric_limits<F>::infinity();
        const auto index = [&](int u, int q) { return tl * tile + (int64_t(u) * kLevelThreads + threadIdx.x) * V + q; };
        F above_part = 0, below_part = 0, above_cnt = 0, poison = 0;
        F above_lo = 0, above_hi = 0, below_lo = 0, below_hi = 0;  // gather: a bit per score per side
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int q = 0; q < V; ++q) {
            const int bit = u * V + q;
            const F v = vec[u][q];
            // s = sign v is exact, so each difference is one rounding of s - end: its sign is exact.
            // Gathering: two subtractions take their range end straight from a uniform register
            // (two FMAs with sign and end each need a move; the binning loop keeps them, as
            // its registers are tighter).
            F above_by, below_by;  // > 0: that side
            if constexpr (kGather) {
              const F s = v * sign_c;
              above_by = s - hi_c;
              below_by = lo_c - s;
            } else {
              above_by = fma(v, sign_c, -hi_c);
              below_by = fma(v, -sign_c, lo_c);
            }
            const F out = fmax(above_by, below_by);  // <= 0: inside the range
            const F e = tail_exp(fabs(out));         // e^{-|out|/t}: 0 for +-inf
            const F is_above = side(above_by), is_below = side(below_by);
            above_part = fma(is_above, e, above_part);
            below_part = fma(is_below, e, below_part);
            poison = fma(v, F(0), poison);  // NaN once a score is +-inf or NaN
            if (kGather) {  // the sides' bits (exact: at most 16 distinct powers of two per sum); the
                            // count above is their popcount, the gathered ones are neither side's
              const F place = F(1 << (bit % 16));
              F& ab = bit < 16 ? above_lo : above_hi;
              F& bb = bit < 16 ? below_lo : below_hi;
              ab = fma(is_above, place, ab);
              bb = fma(is_below, place, bb);
            } else {
              above_cnt += is_above;
              if (!(out > F(0)) && index(u, q) < n) consider(static_cast<double>(v * sign_c), std::true_type{});
            }
          }
        acc.above_sum += static_cast<double>(above_part);
        acc.below_sum += static_cast<double>(below_part);
        unsigned in_bits = 0;
        if (kGather) {
          constexpr unsigned kTileBits = U * V == 32 ? ~0u : (1u << (U * V)) - 1u;
          const unsigned above_bits = static_cast<unsigned>(above_lo) | (static_cast<unsigned>(above_hi) << 16);
          const unsigned below_bits = static_cast<unsigned>(below_lo) | (static_cast<unsigned>(below_hi) << 16);
          above_n += __popc(above_bits);
          in_bits = ~(above_bits | below_bits) & kTileBits;
        } else {
          above_n += static_cast<unsigned>(above_cnt);
        }
        if (poison != F(0)) {
#pragma unroll
          for (int u = 0; u < U; ++u)
#pragma unroll
            for (int q = 0; q < V; ++q) {
              const F s = vec[u][q] * sign_c;
              if (fabs(s) <= kMax) continue;
              in_bits &= ~(1u << (u * V + q));
              if (index(u, q) >= n) continue;
              if (s > hi_c) {  // +inf
                --above_n;
                ++pinf_n;
              } else if (s < lo_c) {
                ++ninf_n;
              } else if (kGather) {  // consider() counted these in a binning pass
                nan_n += s != s;
                pinf_n += s == kInf;
                ninf_n += s == -kInf;
              }
            }
        }
        return in_bits;
      };
      // Both kinds of pass, each its own compact loop.
      const auto run_tiles = [&](auto gather_tag, auto far_tag) {
        constexpr bool kGather = decltype(gather_tag)::value;
        RawVec<scalar_t> vec[U];
        int par = 0;  // the warp-total array of this tile
        if (kGather && blockIdx.x < tiles) {
          if (early && r == blockIdx.y) {  // this thread's own parked vectors: no barrier needed
#pragma unroll
            for (int u = 0; u < U; ++u) vec[u].raw = sb.tile[u * kLevelThreads + threadIdx.x];
          } else {
            load_tile(vec, xr, aligned, blockIdx.x);
          }
        }
        for (int64_t tl = blockIdx.x; tl < tiles; tl += gridDim.x) {
          RawVec<scalar_t> next[U];  // a gathering pass prefetches (a binning one has no registers to spare)
          if (!kGather) load_tile(vec, xr, aligned, tl);
          else if (tl + gridDim.x < tiles) load_tile(next, xr, aligned, tl + gridDim.x);
          const unsigned in_bits = classify(vec, tl, gather_tag, far_tag);
          if (kGather) {
            // One block scan per tile keeps the buffer's order deterministic. Its barrier is
            // the tile's only one: a warp-total array is written again only after the barrier
            // of the scan in between, which every thread reaches after reading its offset.
            uint32_t total;
            uint32_t offset = tile_exclusive_sum<kLevelThreads>(__popc(in_bits), tile_tot[par], total);
            par ^= 1;
            // The rare gathered scores are read again (cache hits), so that the tile's
            // registers are free across the scan for the next tile's loads.
            for (unsigned bits = in_bits; bits != 0; bits &= bits - 1, ++offset) {
              const int b = __ffs(bits) - 1, u = b / V, q = b % V;
              if (used + offset < cap)
                slice[used + offset] = sign * static_cast<double>(xr[tl * tile + (int64_t(u) * kLevelThreads + threadIdx.x) * V + q]);
            }
            used += total;
          }
          if (kGather)
#pragma unroll
            for (int u = 0; u < U; ++u) vec[u] = next[u];
        }
      };
      // Range ends away from zero (uniform): the gathering loop's side tests take one multiply.
      const bool far = fabs(hi_c) >= F(kFarEnd) && fabs(lo_c) >= F(kFarEnd);
      if (gather && far) run_tiles(std::true_type{}, std::true_type{});
      else if (gather) run_tiles(std::true_type{}, std::false_type{});
      else run_tiles(std::false_type{}, std::false_type{});
      __syncthreads();  // tile_tot is free again
      acc.above_count += static_cast<double>(above_n);
      acc.pinf += pinf_n;
      acc.ninf += ninf_n;
      acc.nan += nan_n;
      if (gather) {
        if (threadIdx.x == 0) slice_count[slice_id] = static_cast<unsigned>(used < cap ? used : cap);
        acc.overflow = used > cap;
      }
    } else {
      // The gathered middle set. Binning it first (certification) also drops the scores that
      // lie outside the range by key (a signed zero at an end): they are summed in the tails
      // here, and later passes over the set must not see them again.
      for (int64_t c = blockIdx.x; c < gridDim.x; c += readers) {
        const unsigned count = slice_count[r * gridDim.x + c];
        double* slice = middle + (r * gridDim.x + c) * cap;
        for (unsigned j = threadIdx.x; j < count; j += blockDim.x)
          if (!consider(slice[j], std::false_type{}) && bin_first) slice[j] = -INFINITY;  // skipped by every later pass
      }
    }
    const LevelPartial total = Reduce(tmp.red).Reduce(acc, LevelPartialSum{});
    if (threadIdx.x == 0)  // binning the gathered set adds to its row pass's sums
      partial[slice_id] = bin_first ? LevelPartialSum{}(partial[slice_id], total) : total;
    __syncthreads();
    if (gather) continue;  // no bins
    BinSums* h = hist + r * kBins;
    const bool flat = flat_range(a_lo, a_hi, inv_t);
    for (int j = threadIdx.x; j < kBins; j += blockDim.x) {
      if (s_count[j] == 0) continue;
      double U = s_U[j], L = s_L[j];
      if (flat) {  // against the range's ends (see flat_range)
        const BinKeys e = bin_keys(lo, hi, shift, j);
        U *= exp((a_lo - KT::value(Key(e.first))) * inv_t);
        L *= exp((KT::value(Key(e.last)) - a_hi) * inv_t);
      }
      atomicAdd(&h[j].count, static_cast<unsigned long long>(s_count[j]));
      atomicAdd(&h[j].U, U);
      atomicAdd(&h[j].L, L);
    }
    __syncthreads();
  }
}

// ---- scan ---------------------------------------------------------------------------------

__device__ inline RowState fallback_state(RowState st, uint64_t min_key, uint64_t max_key) {
  st.status = kRefineRow;
  st.certify = kCertified;
  st.lo_key = min_key;
  st.hi_key = max_key;
  st.above0 = Tail{0.0, 0.0, INFINITY};
  st.below0 = Tail{0.0, 0.0, -INFINITY};
  st.path = kPathRadix;
  return st;
}

// A row's level partials, folded in a fixed order; every thread gets the total.
template <int kThreads>
__device__ LevelPartial fold_partials(const LevelPartial* __restrict__ p, int chunks,
                                      typename cub::BlockReduce<LevelPartial, kThreads>::TempStorage& tmp,
                                      LevelPartial& s_total) {
  LevelPartial acc{0.0, 0.0, 0.0, 0, 0, 0, 0, 0};
  for (int c = threadIdx.x; c < chunks; c += kThreads) acc = LevelPartialSum{}(acc, p[c]);
  const LevelPartial total = cub::BlockReduce<LevelPartial, kThreads>(tmp).Reduce(acc, LevelPartialSum{});
  if (threadIdx.x == 0) s_total = total;
  __syncthreads();
  return s_total;
}

// The sums of a row's first pass: a row without an interior root (non-finite scores, k at an
// end) is settled (thread 0 writes its answer) and true returned; else the budget left for the
// finite scores is taken. The same decision in every thread.
__device__ inline bool settle_first_pass(RowState& st, const LevelPartial& total, double k, int64_t n, double sign,
                                         int64_t r, double* __restrict__ b_out, double* __restrict__ edge_out,
                                         int64_t* __restrict__ diag) {
  double b, edge, kf;
  if (!settle_row(k, st.t, static_cast<double>(n), static_cast<double>(total.nan), static_cast<double>(total.pinf),
                  static_cast<double>(total.ninf), &b, &edge, &kf)) {
    st.k = kf;
    return false;
  }
  if (threadIdx.x == 0) {
    b_out[r] = sign * b;
    edge_out[r] = edge;
    diag[3 * r] = kPathDirect;
    diag[3 * r + 1] = 0;
    diag[3 * r + 2] = 0;
  }
  st.status = kDone;
  return true;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kScanThreads)
scan_kernel(RowState* __restrict__ state, BinSums* __restrict__ hist, const LevelPartial* __restrict__ partial,
            int chunks, const double* __restrict__ k_in, double* __restrict__ b_out, double* __restrict__ edge_out,
            int64_t* __restrict__ diag, int64_t rows, int64_t n, double sign, bool preread) {
  const bool settled = preread && rows_settled_early(state, blockIdx.x, gridDim.x, rows, past_refine);
  begin_dependent_grid();
  if (settled) return;
  using KT = KeyTraits<scalar_t>;
  using Key = typename KT::Key;
  using Fold = cub::BlockReduce<LevelPartial, kScanThreads>;
  using AtomScan = cub::BlockScan<Atom, kScanThreads, cub::BLOCK_SCAN_WARP_SCANS>;  // raking would need 40 KB
  using BelowScan = cub::BlockScan<FlatBelow, kScanThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  using AboveScan = cub::BlockScan<FlatAbove, kScanThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  using MinIndex = cub::BlockReduce<int, kScanThreads>;
  __shared__ union {
    typename Fold::TempStorage fold;
    typename AtomScan::TempStorage scan;
    typename BelowScan::TempStorage below;
    typename AboveScan::TempStorage above;
    typename MinIndex::TempStorage min;
  } tmp;
  __shared__ union {
    Atom atom[kScanThreads];
    FlatAbove flat[kScanThreads];
  } s_group, s_above;
  __shared__ LevelPartial s_total;
  __shared__ double s_gap_lo, s_gap_hi, s_psi_top, s_psi_bottom;
  __shared__ int s_inside, s_owner;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    RowState st = state[r];
    if (st.status != kRefineMiddle && st.status != kRefineRow) continue;  // uniform
    BinSums* h = hist + r * kBins;
    const LevelPartial total = fold_partials<kScanThreads>(partial + r * chunks, chunks, tmp.fold, s_total);
    const double t = st.t;
    const uint64_t lo = st.lo_key, hi = st.hi_key;
    bool finished = false;  // uniform: every thread decides the same
    if (st.certify != kCertified) {
      if (settle_first_pass(st, total, k_in[r], n, sign, r, b_out, edge_out, diag)) {
        finished = true;
      } else {
        st.middle = static_cast<int64_t>(total.middle);
        if (st.status == kRefineMiddle && total.overflow) {
          st = fallback_state(st, KT::min_key(), KT::max_key());
          finished = true;
        }
      }
    }
    if (!finished) {
      const double a_hi = KT::value(Key(hi)), a_lo = KT::value(Key(lo));
      Tail above{total.above_count, total.above_sum, a_hi}, below{0.0, total.below_sum, a_lo};
      if (st.status == kRefineMiddle && st.certify == kCertified) {  // add the scores outside the bracket
        if (st.above0.count > 0.0) {
          above.count += st.above0.count;
          above.sum += st.above0.sum * exp((a_hi - st.above0.ref) / t);
        }
        if (st.below0.sum > 0.0) below.sum += st.below0.sum * exp((st.below0.ref - a_lo) / t);
      }
      if (st.certify != kCertified) {
        st.above0 = above;
        st.below0 = below;
      }
      const int shift = bin_shift(lo, hi);
      const double inv_t = inv_temperature(t), k = st.k;
      // flat: the lower tail's sum must stay normal against a_hi (a sum below 1e-60, rare,
      // still decides Psi when k is that small)
      const FlatFrame f{a_lo, a_hi, inv_t};
      const bool flat_bins = flat_range(a_lo, a_hi, inv_t);
      if (flat_bins && !(below.sum > 0.0 && below.sum < 1e-60)) {  // uniform
        const double drop = exp((a_lo - a_hi) * inv_t);  // the tails' sums against the far end
        const FlatAtom none{0.0, 0.0, 0.0, INFINITY, -INFINITY};
        const double above_tail_u = above.sum * drop, below_tail_l = below.sum * drop;
        // The same scan as the atom path below, with sums in place of merges.
        const int j = static_cast<int>(threadIdx.x), base = kScanBins * j;
        const auto edge_lo = [&](int bin) { return KT::value(Key(bin_keys(lo, hi, shift, bin).first)); };
        const auto edge_hi = [&](int bin) { return KT::value(Key(bin_keys(lo, hi, shift, bin).last)); };
        FlatAtom group = none;
        int top_bin = -1, bottom_bin = kBins;  // the group's highest / lowest nonempty bin
        for (int q = 0; q < kScanBins; ++q) {
          const FlatAtom a = flat_bin<KT>(h[base + q], lo, hi, shift, base + q);
          group = FlatMerge{}(group, a);
          if (a.count > 0.0) {
            top_bin = base + q;
            bottom_bin = bottom_bin < kBins ? bottom_bin : base + q;
          }
        }
        s_group.flat[j] = FlatAbove{group.count, group.u, bottom_bin};
        FlatBelow below_g;
        FlatAbove above_r;
        BelowScan(tmp.below).ExclusiveScan(FlatBelow{group.l, top_bin}, below_g, FlatBelow{below_tail_l, -1},
                                           FlatBelowMerge{});
        __syncthreads();  // s_group; tmp reused
        AboveScan(tmp.above).ExclusiveScan(s_group.flat[kScanThreads - 1 - j], above_r,
                                           FlatAbove{above.count, above_tail_u, kBins}, FlatAboveMerge{});
        s_above.flat[kScanThreads - 1 - j] = above_r;
        if (j == kScanThreads - 1) s_psi_top = f.psi(above.count, above_tail_u, below_g.l + group.l, a_hi);
        __syncthreads();  // s_above; tmp -> tmp.min
        const FlatAbove above_g = s_above.flat[j];
        const double above_lo = above_g.bottom < kBins ? edge_lo(above_g.bottom) : INFINITY;
        const bool holds = group.count > 0.0 &&
                           f.psi(above_g.count + group.count, above_g.u + group.u, below_g.l, group.lo) >= k;
        const int low = MinIndex(tmp.min).Reduce(holds ? kScanThreads - 1 - j : kScanThreads, MinInt{});
        if (j == 0) {
          s_owner = kScanThreads - 1 - low;  // -1: the root lies below every bin
          s_inside = kBins;
          s_gap_lo = below.ref;
          s_gap_hi = fmin(fmin(above_lo, group.lo), a_hi);
          s_psi_bottom = f.psi(above_g.count + group.count, above_g.u + group.u, below_tail_l, a_lo);
        }
        __syncthreads();
        if (j == s_owner) {
          // The owner's walk, descending, every bin's two tests computed (their exponentials
          // overlap) and the first bin that passes one taken: Psi >= k at its upper edge puts
          // the root in the gap above it, Psi > k at its lower edge (bin counted above) inside it.
          FlatAtom a[kScanBins];
          double below_l[kScanBins];  // the sums below each bin, lower tail included
          double run_l = below_g.l;
#pragma unroll
          for (int q = 0; q < kScanBins; ++q) {
            a[q] = flat_bin<KT>(h[base + q], lo, hi, shift, base + q);
            below_l[q] = run_l;
            run_l += a[q].l;
          }
          double C = above_g.count, u = above_g.u, top = above_lo;  // the atoms above bin q
          int hit = -1;
          bool gap_hit = false;
          double hit_lo = 0.0, hit_hi = 0.0;  // the gap above the hit bin
#pragma unroll
          for (int q = kScanBins - 1; q >= 0; --q) {
            if (a[q].count == 0.0) continue;
            const bool gap = f.psi(C, u, a[q].l + below_l[q], a[q].hi) >= k;
            const bool inside = a[q].lo < a[q].hi && f.psi(C + a[q].count, u + a[q].u, below_l[q], a[q].lo) > k;
            if (hit < 0 && (gap || inside)) {
              hit = q;
              gap_hit = gap;
              hit_lo = a[q].hi;
              hit_hi = fmin(top, a_hi);
            }
            C += a[q].count;
            u += a[q].u;
            top = fmin(top, a[q].lo);
          }
          s_gap_lo = below_g.top >= 0 ? edge_hi(below_g.top) : below.ref;
          s_gap_hi = group.lo;
          if (hit >= 0 && gap_hit) {
            s_gap_lo = hit_lo;
            s_gap_hi = hit_hi;
          } else if (hit >= 0) {
            s_inside = base + hit;
          }
        }
        __syncthreads();
      } else {
        const AtomMerge merge{inv_t};
        const Atom none{0, 0, 0, 0, 0};
        const Atom above_atom = above.count > 0.0 ? Atom{above.ref, above.ref, above.count, above.sum, 0.0} : none;
        const Atom below_atom = below.sum > 0.0 ? Atom{below.ref, below.ref, 1.0, 0.0, below.sum} : none;
        // Thread j owns bins [kScanBins j, kScanBins (j + 1)) as one group atom; two block scans
        // give each group the atoms below it (after the lower tail) and above it (after the
        // upper tail). Psi decreases: the highest group whose lowest edge has Psi >= k holds
        // the root (inside one of its bins, or in the gap above one) and only its owner walks
        // its bins, so that most threads fold their bins once (exponentials are the cost).
        const int j = static_cast<int>(threadIdx.x), base = kScanBins * j;
        Atom group = none;
        for (int q = 0; q < kScanBins; ++q) group = merge(group, bin_atom<KT>(h[base + q], lo, hi, shift, base + q, flat_bins, f));
        s_group.atom[j] = group;
        Atom below_g, above_r;
        AtomScan(tmp.scan).ExclusiveScan(group, below_g, below_atom, merge);
        __syncthreads();  // s_group; tmp.scan reused
        AtomScan(tmp.scan).ExclusiveScan(s_group.atom[kScanThreads - 1 - j], above_r, above_atom, merge);
        s_above.atom[kScanThreads - 1 - j] = above_r;  // the upper tail and the groups above that one
        if (j == kScanThreads - 1) {  // Psi at the range top: the upper tail above, everything else below
          const Atom sa = merge(below_g, group);
          s_psi_top = psi_at_hi(above.count, above.sum, sa.count > 0.0 ? sa.L : 0.0, above.ref,
                                sa.count > 0.0 ? sa.hi : -INFINITY, t);
        }
        __syncthreads();  // s_above; tmp.scan -> tmp.min
        const Atom above_g = s_above.atom[j];
        const Atom pa = merge(above_g, group);  // pa.lo is the group's lower edge; in thread 0, all atoms
        bool holds = false;  // Psi at the group's lower edge, its scores above that edge
        if (group.count > 0.0) {
          const bool lower = below_g.count > 0.0;
          holds = psi_at_hi(pa.count, pa.U, lower ? below_g.L : 0.0, pa.lo, lower ? below_g.hi : -INFINITY, t) >= k;
        }
        const int low = MinIndex(tmp.min).Reduce(holds ? kScanThreads - 1 - j : kScanThreads, MinInt{});
        if (j == 0) {
          s_owner = kScanThreads - 1 - low;  // -1: the root lies below every bin
          s_inside = kBins;
          s_gap_lo = below.ref;
          s_gap_hi = pa.count > 0.0 ? pa.lo : above.ref;
          s_psi_bottom = psi_at_lo(pa.count, pa.count > 0.0 ? pa.U : 0.0, below.sum, pa.count > 0.0 ? pa.lo : INFINITY,
                                   below.ref, t);
        }
        __syncthreads();
        if (j == s_owner) {
          // The walk of scan_atoms over the group's bins, descending: the first bin whose upper
          // edge has Psi >= k has the root in the gap above it; a bin with Psi < k at its upper
          // and > k at its lower edge holds it. Neither (Psi = k at the group's lower edge, to
          // rounding): the gap below the group.
          double suf_hi[kScanBins], suf_L[kScanBins];  // the atoms below each bin, lower tail included
          Atom run = below_g;
          for (int q = 0; q < kScanBins; ++q) {
            suf_hi[q] = run.count > 0.0 ? run.hi : -INFINITY;
            suf_L[q] = run.count > 0.0 ? run.L : 0.0;
            run = merge(run, bin_atom<KT>(h[base + q], lo, hi, shift, base + q, flat_bins, f));
          }
          double gap_lo = below_g.count > 0.0 ? below_g.hi : below.ref, gap_hi = group.lo;
          run = above_g;
          for (int q = kScanBins - 1; q >= 0; --q) {
            const int bin = base + q;
            const Atom a = bin_atom<KT>(h[bin], lo, hi, shift, bin, flat_bins, f);
            const Atom p = run;
            run = merge(run, a);
            if (a.count == 0.0) continue;
            const double C = p.count, A = p.count > 0.0 ? p.U : 0.0, top = p.count > 0.0 ? p.lo : INFINITY;
            const double sL = suf_L[q], sH = suf_hi[q];
            const double L_incl = a.L + (sL > 0.0 ? sL * exp((sH - a.hi) / t) : 0.0);
            if (psi_at_lo(C, A, L_incl, top, a.hi, t) >= k) {
              gap_lo = a.hi;
              gap_hi = p.count > 0.0 ? p.lo : above.ref;
              break;
            }
            if (a.lo < a.hi) {
              const double U_incl = a.U + (A > 0.0 ? A * exp((a.lo - top) / t) : 0.0);
              if (psi_at_hi(C + a.count, U_incl, sL, a.lo, sL > 0.0 ? sH : -INFINITY, t) > k) {
                s_inside = bin;
                break;
              }
            }
          }
          s_gap_lo = gap_lo;
          s_gap_hi = gap_hi;
        }
        __syncthreads();
      }
      const double psi_top = s_psi_top, psi_bottom = s_psi_bottom;
      if (st.certify != kCertified && st.status == kRefineMiddle && !(psi_top <= k && psi_bottom >= k)) {
        st = fallback_state(st, KT::min_key(), KT::max_key());  // the sample missed: exact fallback
      } else if (s_inside < kBins) {
        const BinKeys refine = bin_keys(lo, hi, shift, s_inside);
        st.lo_key = refine.first;
        st.hi_key = refine.last;
      } else {
        st.gap_lo = s_gap_lo;
        st.gap_hi = s_gap_hi;
        st.status = st.status == kRefineMiddle ? kSolveMiddle : kSolveRow;
      }
      st.certify = kCertified;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < kBins; j += blockDim.x) h[j] = BinSums{0, 0.0, 0.0};
    if (threadIdx.x == 0) state[r] = st;
    __syncthreads();
  }
}

// ---- sorted middle set --------------------------------------------------------------------

// Loads a gathered middle set of m <= kSortedThreads * kItems scores (striped: position
// q * kSortedThreads + tid, from slice `map[position]`), sorts it and solves the row with the
// tails. Every thread gets b.
template <typename scalar_t, int kItems, typename Key = typename SortKey<scalar_t>::Key>
__device__ __forceinline__ double solve_middle_set(SortStorage<Key, kItems>& sort,
                                                   SolveStorage& solve, CensusStorage<Key>& census,
                                                   double (&last_v)[kWarps], const uint16_t* map,
                                                   const unsigned* s_start, const double* __restrict__ middle,
                                                   int64_t cap, unsigned m, const RowState& st,
                                                   const SortedTails& tails) {
  using SK = SortKey<scalar_t>;
  Key keys[kItems];
  KeyStats<Key> stats;
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const unsigned i = q * kSortedThreads + threadIdx.x;
    if (i >= m) continue;
    const unsigned c = map[i];
    keys[q] = SK::key(middle[c * cap + (i - s_start[c])]);
    stats.add(keys[q]);
  }
  // take_census's barrier ends the map's use: the sort's storage may alias it.
  sort_descending<Key, SK, kItems>(sort, keys, m, take_census(census, 0, 0, 0, stats));
  return solve_sorted<Key, SK, kItems>(solve, last_v, keys, 0, static_cast<int>(m), st.k, st.t, tails);
}

// A bracketed row whose gathered middle set fits one CTA (up to kSortedMaxItems scores a
// thread), straight after the gathering pass: the set is sorted on chip and solved with the
// scores outside the bracket as its tails (sorted_solve.cuh); the root certifies the bracket
// when it lies inside it (Psi(a_hi) <= k <= Psi(a_lo)), else the row goes to the exact
// fallback. The row is then done and the binning levels skip it: they replace a chain of ~10
// launches (bin, scan, bin, scan, sides, solve) by one. A larger set is left to them. The
// sort takes the fewest items a thread that hold the set (padding costs every sort pass).
// fp32, fp16 and bf16 rows (32-bit keys).
template <typename scalar_t>
__global__ void __launch_bounds__(kSortedThreads, 1)
sorted_middle_kernel(RowState* __restrict__ state, const LevelPartial* __restrict__ partial, int chunks,
                     const double* __restrict__ middle, const unsigned* __restrict__ slice_count, int64_t cap,
                     const double* __restrict__ k_in, double* __restrict__ b_out, double* __restrict__ edge_out,
                     int64_t* __restrict__ diag, int64_t rows, int64_t n, double sign) {
  begin_dependent_grid();
  using KT = KeyTraits<scalar_t>;
  using Key = typename SortKey<scalar_t>::Key;
  static_assert(sizeof(Key) == 4 && 32 * kSortedMaxItems < 1024, "32-bit keys; take_census packs 10 bits a warp");
  constexpr unsigned kCapacity = kSortedThreads * kSortedMaxItems;
  static_assert(kMaxChunks <= 65536, "slice numbers are 16-bit");
  constexpr int kSlices = (kMaxChunks + kSortedThreads - 1) / kSortedThreads;  // slice counts per thread
  using Offsets = cub::BlockScan<unsigned, kSortedThreads>;
  __shared__ union {
    typename cub::BlockReduce<LevelPartial, kSortedThreads>::TempStorage fold;
    typename Offsets::TempStorage offsets;
    uint16_t map[kCapacity];  // each position's slice: after the offsets, before the sort
    SortStorage<Key, kSortedMaxItems / 4> sort4;
    SortStorage<Key, kSortedMaxItems / 2> sort8;
    SortStorage<Key, kSortedMaxItems> sort16;
    SolveStorage solve;  // after the sort
  } sm;
  __shared__ CensusStorage<Key> census;
  __shared__ double last_v[kWarps];
  __shared__ LevelPartial s_total;
  __shared__ unsigned s_start[kMaxChunks];  // each slice's first position in the set
  const int tid = threadIdx.x;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    // The state, the partials and the slices' sizes in one round trip: level 0 wrote them for
    // every row of a bracketed launch, so they are read before the state says whether to.
    RowState st = state[r];
    const double k = k_in[r];
    unsigned count[kSlices], start[kSlices], m;
#pragma unroll
    for (int q = 0; q < kSlices; ++q) {
      const int c = tid * kSlices + q;
      count[q] = c < chunks ? slice_count[r * chunks + c] : 0u;
    }
    const LevelPartial total = fold_partials<kSortedThreads>(partial + r * chunks, chunks, sm.fold, s_total);
    if (st.status != kRefineMiddle || st.certify != kCertifyRow) continue;  // uniform
    // Where each slice's scores go in the set (fold_partials ended with a barrier).
    Offsets(sm.offsets).ExclusiveSum(count, start, m);
#pragma unroll
    for (int q = 0; q < kSlices; ++q)
      if (tid * kSlices + q < chunks) s_start[tid * kSlices + q] = start[q];
    __syncthreads();
    // Every decision below is the same in every thread.
    if (settle_first_pass(st, total, k, n, sign, r, b_out, edge_out, diag)) {
      // settled
    } else if (total.overflow) {
      st = fallback_state(st, KT::min_key(), KT::max_key());
    } else if (m > kCapacity) {
      continue;  // the binning levels take the row
    } else {
      const double a_hi = KT::value(static_cast<typename KT::Key>(st.hi_key));
      const double a_lo = KT::value(static_cast<typename KT::Key>(st.lo_key));
      const SortedTails tails{total.above_count, total.above_sum, a_hi, total.below_sum, a_lo};
      double b;
      if (m == 0) {
        b = solve_interval(tails.above_count, tails.above_sum, tails.below_sum, tails.above_count > 0.0 ? a_hi : INFINITY,
                           tails.below_sum > 0.0 ? a_lo : -INFINITY, st.k, st.t);
      } else {
        // Each position's slice, a warp per slice (the offsets' storage is free after the barrier above).
        for (int c = tid / 32; c < chunks; c += kWarps) {
          const unsigned e = c + 1 < chunks ? s_start[c + 1] : m;
          for (unsigned i = s_start[c] + tid % 32; i < e; i += 32) sm.map[i] = static_cast<uint16_t>(c);
        }
        __syncthreads();
        const double* mr = middle + r * chunks * cap;
        if (m <= kCapacity / 4)
          b = solve_middle_set<scalar_t, kSortedMaxItems / 4>(sm.sort4, sm.solve, census, last_v, sm.map,
                                                              s_start, mr, cap, m, st, tails);
        else if (m <= kCapacity / 2)
          b = solve_middle_set<scalar_t, kSortedMaxItems / 2>(sm.sort8, sm.solve, census, last_v, sm.map,
                                                              s_start, mr, cap, m, st, tails);
        else
          b = solve_middle_set<scalar_t, kSortedMaxItems>(sm.sort16, sm.solve, census, last_v, sm.map, s_start,
                                                          mr, cap, m, st, tails);
      }
      if (b >= a_lo && b <= a_hi) {  // certified (a NaN fails too)
        if (tid == 0) {
          b_out[r] = sign * b;
          edge_out[r] = 1.0;
          diag[3 * r] = st.path;
          diag[3 * r + 1] = m;
          diag[3 * r + 2] = st.attempts;
        }
        st.status = kDone;
      } else {
        st = fallback_state(st, KT::min_key(), KT::max_key());
      }
    }
    if (tid == 0) state[r] = st;
    __syncthreads();
  }
}

// The sorted middle-set kernel for scalar_t's rows, or none: fp64 rows (64-bit keys) take the
// binning levels. (A function template, so that the fp64 kernel is never named.)
template <typename scalar_t>
constexpr auto sorted_middle_for() -> decltype(&sorted_middle_kernel<float>) {
  if constexpr (sizeof(scalar_t) > 4) return nullptr;
  else return &sorted_middle_kernel<scalar_t>;
}

// ---- sides and solve ----------------------------------------------------------------------

// A gathered middle set whose bracket spans at most kFlatSpan temperatures: every term
// against the gap's ends is normal, so the sides are plain sums (one exponential per score)
// and the nearest scores, summed in a fixed order; the solve rescales them once.
__device__ inline bool flat_sides(const RowState& st, double inv_t) {
  return st.status == kSolveMiddle && is_finite(st.gap_lo) && is_finite(st.gap_hi) &&
         (st.above0.ref - st.below0.ref) * inv_t <= kFlatSpan;
}

// Grid: [sides blocks, rows]; block j covers the middle slices (or row tiles) j, j + gridDim.x, ...
// Fewer blocks than the level passes: for atom rows (not flat_sides) the merges of the block
// reductions cost exps.
template <typename scalar_t>
__global__ void __launch_bounds__(kLevelThreads)
sides_kernel(const scalar_t* __restrict__ x, const RowState* __restrict__ state, const double* __restrict__ middle,
             const unsigned* __restrict__ slice_count, int64_t cap, int chunks, SidesPartial* __restrict__ partial,
             int64_t rows, int64_t n, double sign, bool preread) {
  const bool settled = preread && rows_settled_early(state, blockIdx.y, gridDim.y, rows, is_done);
  begin_dependent_grid();
  if (settled) return;
  constexpr int V = vec_width<scalar_t>();
  __shared__ union {
    GapSides atoms[kLevelThreads / 32];
    FlatSides flat[kLevelThreads / 32];
  } scratch;
  __shared__ unsigned s_count[kMaxSidesSlices];
  const Atom none{0, 0, 0, 0, 0};
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const RowState st = state[r];
    if (st.status != kSolveMiddle && st.status != kSolveRow) continue;  // uniform
    const double inv_t = inv_temperature(st.t);
    const bool flat = flat_sides(st, inv_t);  // uniform
    GapSides acc{none, none};
    FlatSides fa{0.0, 0.0, INFINITY, 0.0, 0.0, -INFINITY};
    const auto add = [&](double s) {
      if (!is_finite(s)) return;
      if (flat) {
        if (s >= st.gap_hi) {
          fa.above_count += 1.0;
          fa.above_u += exp((st.gap_hi - s) * inv_t);
          fa.above_min = fmin(fa.above_min, s);
        } else if (s <= st.gap_lo) {
          fa.below_count += 1.0;
          fa.below_l += exp((s - st.gap_lo) * inv_t);
          fa.below_max = fmax(fa.below_max, s);
        }
      } else if (s >= st.gap_hi) {
        atom_add(acc.above, s, inv_t);
      } else if (s <= st.gap_lo) {
        atom_add(acc.below, s, inv_t);
      }
    };
    if (st.status == kSolveRow) {
      const scalar_t* xr = x + r * n;
      const bool aligned = is_aligned16(xr);
      const int64_t tile = int64_t(kLevelThreads) * V;
      for (int64_t tl = blockIdx.x; tl * tile < n; tl += gridDim.x) {
        double v[V];
        const int valid = load_vec<scalar_t, V>(xr, n, tl * tile + int64_t(threadIdx.x) * V, aligned, v);
        for (int q = 0; q < valid; ++q) add(sign * v[q]);
      }
    } else {
      // The block's slices as one flat range (their counts first), several loads in
      // flight per thread: slice by slice, each small slice would cost a round trip.
      const int slices = (chunks - static_cast<int>(blockIdx.x) + gridDim.x - 1) / gridDim.x;  // <= kMaxSidesSlices
      if (threadIdx.x < slices) s_count[threadIdx.x] = slice_count[r * chunks + blockIdx.x + threadIdx.x * gridDim.x];
      __syncthreads();
      unsigned total_count = 0;
      for (int q = 0; q < slices; ++q) total_count += s_count[q];
      constexpr int kBatch = 4;
      for (unsigned j0 = threadIdx.x; j0 < total_count; j0 += kBatch * blockDim.x) {
        double v[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          unsigned j = j0 + b * blockDim.x;
          if (j >= total_count) continue;
          int q = 0;
          while (j >= s_count[q]) j -= s_count[q++];
          v[b] = middle[(r * chunks + blockIdx.x + int64_t(q) * gridDim.x) * cap + j];
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
          if (j0 + b * blockDim.x < total_count) add(v[b]);
      }
    }
    if (flat) {
      const FlatSides f = tree_reduce<kLevelThreads>(fa, FlatSidesSum{}, scratch.flat);
      if (threadIdx.x == 0) partial[r * gridDim.x + blockIdx.x].flat = f;
    } else {
      const GapSides total = tree_reduce<kLevelThreads>(acc, GapMerge{inv_t}, scratch.atoms);
      if (threadIdx.x == 0) partial[r * gridDim.x + blockIdx.x].atoms = total;
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kSolveThreads)
solve_kernel(RowState* __restrict__ state, const SidesPartial* __restrict__ partial, int parts,
             double* __restrict__ b_out, double* __restrict__ edge_out, int64_t* __restrict__ diag, int64_t rows,
             double sign, bool preread) {
  const bool settled = preread && rows_settled_early(state, blockIdx.x, gridDim.x, rows, is_done);
  begin_dependent_grid();
  if (settled) return;
  __shared__ union {
    GapSides atoms[kSolveThreads / 32];
    FlatSides flat[kSolveThreads / 32];
  } scratch;
  const Atom none{0, 0, 0, 0, 0};
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    RowState st = state[r];
    if (st.status != kSolveMiddle && st.status != kSolveRow) continue;  // uniform
    const double inv_t = inv_temperature(st.t);
    GapSides g{none, none};
    if (flat_sides(st, inv_t)) {  // uniform
      FlatSides acc{0.0, 0.0, INFINITY, 0.0, 0.0, -INFINITY};
      for (int c = threadIdx.x; c < parts; c += blockDim.x) acc = FlatSidesSum{}(acc, partial[r * parts + c].flat);
      const FlatSides f = tree_reduce<kSolveThreads>(acc, FlatSidesSum{}, scratch.flat);
      // e^{(gap_hi - s)/t} = e^{(gap_hi - min)/t} e^{(min - s)/t}: the nearest score's term is 1
      if (f.above_count > 0.0)
        g.above = Atom{f.above_min, f.above_min, f.above_count, f.above_u * exp((f.above_min - st.gap_hi) * inv_t), 0.0};
      if (f.below_count > 0.0)
        g.below = Atom{f.below_max, f.below_max, f.below_count, 0.0, f.below_l * exp((st.gap_lo - f.below_max) * inv_t)};
    } else {
      const GapMerge merge{inv_t};
      GapSides acc{none, none};
      for (int c = threadIdx.x; c < parts; c += blockDim.x) acc = merge(acc, partial[r * parts + c].atoms);
      g = tree_reduce<kSolveThreads>(acc, merge, scratch.atoms);
    }
    if (threadIdx.x == 0) {
      if (st.status == kSolveMiddle) {  // the scores outside the bracket
        if (st.above0.count > 0.0)
          atom_merge(g.above, Atom{st.above0.ref, st.above0.ref, st.above0.count, st.above0.sum, 0.0}, inv_t);
        if (st.below0.sum > 0.0) atom_merge(g.below, Atom{st.below0.ref, st.below0.ref, 1.0, 0.0, st.below0.sum}, inv_t);
      }
      const double hi = g.above.count > 0.0 ? g.above.lo : INFINITY;
      const double lo = g.below.count > 0.0 ? g.below.hi : -INFINITY;
      b_out[r] = sign * solve_interval(g.above.count, g.above.U, g.below.L, hi, lo, st.k, st.t);
      edge_out[r] = 1.0;
      diag[3 * r] = st.path;
      diag[3 * r + 1] = st.middle;
      diag[3 * r + 2] = st.attempts;
      st.status = kDone;
      state[r] = st;
    }
    __syncthreads();
  }
}

}  // namespace

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

std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_threshold_cuda(const at::Tensor& x_in,
                                                                     const at::Tensor& k_in,
                                                                     const at::Tensor& t_in,
                                                                     bool largest, int64_t method) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  ThresholdIO io = threshold_io(x_in, k_in, t_in, method);
  if (io.x.size(0) == 0) return {io.b, io.edge, io.diag};
  if (io.x.size(1) <= kShortRowMax && method != kMethodBracket)
    solve_short_rows_cuda(io.x, io.k, io.t, largest, io.b, io.edge, io.diag, nullptr, false);
  else
    solve_long_rows_cuda(io.x, io.k, io.t, largest, method == kMethodSort, io.b, io.edge, io.diag);
  return {io.b, io.edge, io.diag};
}

TORCH_LIBRARY_IMPL(fastlapsum, CUDA, m) { m.impl("lapsum_threshold", &lapsum_threshold_cuda); }

}  // namespace fastlapsum
