// CUDA threshold solver for rows of any length: the certified sample bracket of DESIGN
// §1.2, with the radix bracket over the whole row as its exact fallback, in one fixed
// launch sequence (no host sync; a row that is done skips the remaining launches).
//
//  propose  one CTA per row: the noised systematic sample of bracket_rule.h and two of its
//           order statistics (radix select in shared memory) -> the bracket's key range.
//  level    a grid over each row. Scores above / below the row's key range go to the two
//           tails (fp64 sums against the range ends, reduced per block in a fixed order);
//           scores inside go to up to 2048 range atoms ("bins"). On the first level they
//           are also gathered into the row's middle buffer (one bounded slice per block,
//           in a deterministic order); later levels of a bracketed row read only that.
//  scan     one CTA per row: folds the tails; on the first level checks the certificate
//           Psi(a_R) <= k <= Psi(a_L) (a failure, or a middle set too big for its slices,
//           sends the row to the radix fallback over the whole row); then the closed-form
//           scan over the bins, in parallel: the root lies in a gap (solve it) or strictly
//           inside one bin, whose key range the next level refines.
//  sides    sums of the scores on each side of the final gap against the nearest score,
//           with fixed-order reductions; solve: one CTA per row folds them and solves.
// Bins are summed with float atomics: they only locate the root. Every number the root is
// computed from is reduced in a fixed order, so the answer is the same on every run.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cfloat>
#include <limits>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "../common/atom_scan.h"
#include "../common/bracket_rule.h"
#include "../common/cuda_launch.cuh"
#include "../common/gpu_rows.cuh"
#include "../common/op_io.h"
#include "../ops.h"
#include "gpu_keys.cuh"
#include "threshold_cuda.h"

namespace fastlapsum {
namespace {

constexpr int kBins = 2048;
constexpr int kDigitBits = 11;
constexpr int kLevelThreads = 512;
// 16-byte vectors per thread per tile of the row pass, their loads issued together and kept
// raw until used (4 converted to fp64 up front took 126 registers: one block per SM).
constexpr int kLevelUnroll = 4;
constexpr int kScanThreads = 256;  // 512 (4 bins per thread) measured no faster on the H200
constexpr int kScanBins = kBins / kScanThreads;  // consecutive bins per scan thread
constexpr int kProposeThreads = 1024;
constexpr int kSolveThreads = 256;
constexpr int64_t kMaxChunks = 1024;  // blocks per row in the row-wide passes
constexpr int64_t kSideBlocks = 128;  // blocks per row of the sides pass

enum RowStatus : int { kRefineMiddle = 0, kRefineRow = 1, kSolveMiddle = 2, kSolveRow = 3, kDone = 4 };

struct RowState {
  int status;
  int certify;              // the next scan is the first level (certification, settling)
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

template <typename KT>
__device__ inline Atom bin_atom(const BinSums& h, uint64_t lo, uint64_t hi, int shift, int bin) {
  if (h.count == 0) return Atom{0, 0, 0, 0, 0};
  using Key = typename KT::Key;
  const BinKeys b = bin_keys(lo, hi, shift, bin);
  return Atom{KT::value(Key(b.first)), KT::value(Key(b.last)), static_cast<double>(h.count), h.U, h.L};
}

// ---- propose ------------------------------------------------------------------------------

// Radix select of two order statistics (ascending ranks) of the noised sample. rank < 0 or
// >= m leaves that end open.
template <typename scalar_t>
__global__ void __launch_bounds__(kProposeThreads)
propose_kernel(const scalar_t* __restrict__ x, const double* __restrict__ k_in, const double* __restrict__ t_in,
               RowState* __restrict__ state, typename KeyTraits<scalar_t>::Key* __restrict__ sample_keys,
               int64_t sample_cap, int64_t rows, int64_t n, double sign, bool sort) {
  using KT = KeyTraits<scalar_t>;
  using Key = typename KT::Key;
  using Scan = cub::BlockScan<unsigned, kProposeThreads>;
  __shared__ unsigned hist[2][kBins];
  __shared__ typename Scan::TempStorage scan;
  __shared__ uint64_t s_prefix[2];
  __shared__ int64_t s_rank[2];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const double k = k_in[r], t = t_in[r], nn = static_cast<double>(n);
    RowState st{};
    st.status = sort ? kRefineRow : kRefineMiddle;
    st.certify = 1;
    st.lo_key = KT::min_key();
    st.hi_key = KT::max_key();
    st.k = k;
    st.t = t;
    st.above0 = Tail{0.0, 0.0, INFINITY};
    st.below0 = Tail{0.0, 0.0, -INFINITY};
    st.path = sort ? kPathRadix : kPathBracket;
    st.attempts = sort ? 0 : 1;
    if (!sort) {
      const SampleGeometry g = sample_geometry(n, r);
      int64_t il, iu;
      bracket_indices(g.count, nn, (k >= 0.0 && k <= nn) ? k : 0.5 * nn, 0, &il, &iu);
      if (threadIdx.x == 0) {
        s_rank[0] = il;
        s_rank[1] = iu;
        s_prefix[0] = s_prefix[1] = 0;
      }
      __syncthreads();
      int done = 0;
      for (int level = 0; level < digits_for(KT::kBits); ++level) {
        const int bits = KT::kBits - done < kDigitBits ? KT::kBits - done : kDigitBits;
        const int shift = KT::kBits - done - bits;
        for (int j = threadIdx.x; j < 2 * kBins; j += blockDim.x) hist[j / kBins][j % kBins] = 0;
        __syncthreads();
        const uint64_t p0 = s_prefix[0], p1 = s_prefix[1];
        const bool want0 = s_rank[0] >= 0 && s_rank[0] < g.count, want1 = s_rank[1] >= 0 && s_rank[1] < g.count;
        // kBatch independent loads in flight per thread. The first digit gathers the strided
        // sample (each score its own memory transaction: latency-bound), noises it and keeps
        // the keys in the row's workspace slice; later digits read those back, coalesced.
        constexpr int kBatch = 8;
        Key* keys = sample_keys + r * sample_cap;
        for (int64_t base = threadIdx.x; base < g.count; base += int64_t(kBatch) * blockDim.x) {
          Key kq[kBatch];
          if (level == 0) {
            double v[kBatch];
#pragma unroll
            for (int q = 0; q < kBatch; ++q) {
              const int64_t i = base + int64_t(q) * blockDim.x;
              v[q] = i < g.count ? static_cast<double>(x[r * n + g.offset + i * g.stride]) : 0.0;
            }
#pragma unroll
            for (int q = 0; q < kBatch; ++q) {
              const int64_t i = base + int64_t(q) * blockDim.x;
              kq[q] = KT::key(sign * v[q] + t * static_cast<double>(laplace_noise_f(static_cast<uint32_t>(i))));
              if (i < g.count) keys[i] = kq[q];
            }
          } else {
#pragma unroll
            for (int q = 0; q < kBatch; ++q) {
              const int64_t i = base + int64_t(q) * blockDim.x;
              kq[q] = i < g.count ? keys[i] : Key(0);
            }
          }
#pragma unroll
          for (int q = 0; q < kBatch; ++q) {
            const int64_t i = base + int64_t(q) * blockDim.x;
            if (i >= g.count) continue;
            const uint64_t key = kq[q];
            const int digit = static_cast<int>((key >> shift) & ((uint64_t(1) << bits) - 1));
            const uint64_t top = done == 0 ? 0 : key >> (KT::kBits - done);
            if (want0 && top == p0) atomicAdd(&hist[0][digit], 1u);
            if (want1 && top == p1) atomicAdd(&hist[1][digit], 1u);
          }
        }
        __syncthreads();
        for (int target = 0; target < 2; ++target) {
          unsigned c[2] = {hist[target][2 * threadIdx.x], hist[target][2 * threadIdx.x + 1]}, e[2];
          Scan(scan).ExclusiveSum(c, e);
          const int64_t rank = s_rank[target];
          __syncthreads();
          for (int q = 0; q < 2; ++q)
            if (rank >= e[q] && rank < static_cast<int64_t>(e[q]) + c[q]) {
              s_rank[target] = rank - e[q];
              s_prefix[target] = (s_prefix[target] << bits) | static_cast<uint64_t>(2 * threadIdx.x + q);
            }
          __syncthreads();
        }
        done += bits;
      }
      const uint64_t lo = il >= 0 && il < g.count ? s_prefix[0] : 0;
      const uint64_t hi = iu >= 0 && iu < g.count ? s_prefix[1] : ~uint64_t(0);
      const uint64_t kmin = KT::min_key(), kmax = KT::max_key();
      st.lo_key = lo < kmin ? kmin : (lo > kmax ? kmax : lo);
      st.hi_key = hi < kmin ? kmin : (hi > kmax ? kmax : hi);
      if (st.hi_key < st.lo_key) st.hi_key = st.lo_key;
    }
    if (threadIdx.x == 0) state[r] = st;
    __syncthreads();
  }
}

// ---- level --------------------------------------------------------------------------------

template <typename scalar_t>
__global__ void __launch_bounds__(kLevelThreads, 2)
level_kernel(const scalar_t* __restrict__ x, const RowState* __restrict__ state, double* __restrict__ middle,
             unsigned* __restrict__ slice_count, int64_t cap, BinSums* __restrict__ hist,
             LevelPartial* __restrict__ partial, int64_t rows, int64_t n, double sign) {
  using KT = KeyTraits<scalar_t>;
  using Key = typename KT::Key;
  constexpr int V = vec_width<scalar_t>();
  using Reduce = cub::BlockReduce<LevelPartial, kLevelThreads>;
  using TileScan = cub::BlockScan<int, kLevelThreads>;
  __shared__ typename Reduce::TempStorage red;
  __shared__ typename TileScan::TempStorage tscan;
  __shared__ unsigned s_count[kBins];
  __shared__ double s_U[kBins], s_L[kBins];
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const RowState st = state[r];
    if (st.status != kRefineMiddle && st.status != kRefineRow) continue;  // uniform across the block
    const bool from_row = st.status == kRefineRow || st.certify;
    const bool gather = st.status == kRefineMiddle && st.certify;
    for (int j = threadIdx.x; j < kBins; j += blockDim.x) { s_count[j] = 0; s_U[j] = 0.0; s_L[j] = 0.0; }
    __syncthreads();
    const uint64_t lo = st.lo_key, hi = st.hi_key;
    const int shift = bin_shift(lo, hi);
    const double a_hi = KT::value(Key(hi)), a_lo = KT::value(Key(lo)), inv_t = inv_temperature(st.t);
    LevelPartial acc{0.0, 0.0, 0.0, 0, 0, 0, 0, 0};
    // Classifies one (signed) score; true when it lies in the key range.
    const auto consider = [&](double s) -> bool {
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
      atomicAdd(&s_count[bin], 1u);
      atomicAdd(&s_U[bin], exp_term<scalar_t>((KT::value(Key(edges.first)) - s) * inv_t));
      atomicAdd(&s_L[bin], exp_term<scalar_t>((s - KT::value(Key(edges.last))) * inv_t));
      acc.middle += 1;
      return true;
    };
    const int64_t slice_id = r * gridDim.x + blockIdx.x;
    if (from_row) {
      // Fast classification in the compute type (fp32 for fp32/fp16/bf16 rows): the range
      // ends are key values, so exact in it, and the comparisons agree with consider()'s.
      // Both tails take the same branch-free path (one exponential, its sum picked by a
      // select); their sums over a tile are kept in it and flushed to the fp64 sums.
      // Measured slower on the H200 (1e8, fp32), so not done: gathering per warp with
      // ballots instead of the block scan (level 455 vs 375 us under ncu), and a
      // straight-line tile pass with bit masks and consider() after (forward 0.90 vs 0.82 ms).
      using F = compute_t<scalar_t>;
      const F hi_c = static_cast<F>(a_hi), lo_c = static_cast<F>(a_lo), sign_c = static_cast<F>(sign);
      const ScaledExp<F> tail_exp(inv_t);
      const scalar_t* xr = x + r * n;
      const bool aligned = is_aligned16(xr);
      const int64_t tile = level_tile<scalar_t>();
      const int64_t tiles = (n + tile - 1) / tile;
      double* slice = gather ? middle + slice_id * cap : nullptr;
      int64_t used = 0;  // the same in every thread
      unsigned above_n = 0, pinf_n = 0, ninf_n = 0;
      for (int64_t tl = blockIdx.x; tl < tiles; tl += gridDim.x) {
        RawVec<scalar_t> vec[kLevelUnroll];
#pragma unroll
        for (int u = 0; u < kLevelUnroll; ++u)  // loads first: kLevelUnroll vectors in flight
          vec[u] = load_raw<scalar_t>(xr, n, tl * tile + (int64_t(u) * kLevelThreads + threadIdx.x) * V, aligned);
        static_assert(kLevelUnroll * V <= 32, "one bit per score of a thread's tile");
        unsigned in_bits = 0;
        int count = 0;
        F above_part = 0, below_part = 0;
#pragma unroll
        for (int u = 0; u < kLevelUnroll; ++u)
#pragma unroll
          for (int q = 0; q < V; ++q) {
            if (q >= vec[u].valid) continue;
            const F s = vec[u][q] * sign_c;
            const bool above = s > hi_c;
            if (above || s < lo_c) {  // e^{-distance/t}: 0 for +-inf
              const F e = tail_exp(above ? hi_c - s : s - lo_c);
              above_part += above ? e : F(0);
              below_part += above ? F(0) : e;
              above_n += above && s != std::numeric_limits<F>::infinity();
              pinf_n += s == std::numeric_limits<F>::infinity();
              ninf_n += s == -std::numeric_limits<F>::infinity();
            } else if (consider(static_cast<double>(s))) {
              in_bits |= 1u << (u * V + q);
              ++count;
            }
          }
        acc.above_sum += static_cast<double>(above_part);
        acc.below_sum += static_cast<double>(below_part);
        if (gather) {  // one block scan per tile keeps the buffer's order deterministic
          int offset, total;
          TileScan(tscan).ExclusiveSum(count, offset, total);
          if (in_bits != 0) {
#pragma unroll
            for (int u = 0; u < kLevelUnroll; ++u)
#pragma unroll
              for (int q = 0; q < V; ++q)
                if ((in_bits >> (u * V + q)) & 1u) {
                  if (used + offset < cap) slice[used + offset] = static_cast<double>(vec[u][q] * sign_c);
                  ++offset;
                }
          }
          used += total;
          __syncthreads();
        }
      }
      acc.above_count += static_cast<double>(above_n);
      acc.pinf += pinf_n;
      acc.ninf += ninf_n;
      if (gather && threadIdx.x == 0) slice_count[slice_id] = static_cast<unsigned>(used < cap ? used : cap);
      acc.overflow = used > cap;
    } else {
      const unsigned count = slice_count[slice_id];
      const double* slice = middle + slice_id * cap;
      for (unsigned j = threadIdx.x; j < count; j += blockDim.x) consider(slice[j]);
    }
    const LevelPartial total = Reduce(red).Reduce(acc, LevelPartialSum{});
    if (threadIdx.x == 0) partial[slice_id] = total;
    __syncthreads();
    BinSums* h = hist + r * kBins;
    for (int j = threadIdx.x; j < kBins; j += blockDim.x) {
      if (s_count[j] == 0) continue;
      atomicAdd(&h[j].count, static_cast<unsigned long long>(s_count[j]));
      atomicAdd(&h[j].U, s_U[j]);
      atomicAdd(&h[j].L, s_L[j]);
    }
    __syncthreads();
  }
}

// ---- scan ---------------------------------------------------------------------------------

__device__ inline RowState fallback_state(RowState st, uint64_t min_key, uint64_t max_key) {
  st.status = kRefineRow;
  st.certify = 0;
  st.lo_key = min_key;
  st.hi_key = max_key;
  st.above0 = Tail{0.0, 0.0, INFINITY};
  st.below0 = Tail{0.0, 0.0, -INFINITY};
  st.path = kPathRadix;
  return st;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kScanThreads)
scan_kernel(RowState* __restrict__ state, BinSums* __restrict__ hist, const LevelPartial* __restrict__ partial,
            int chunks, const double* __restrict__ k_in, double* __restrict__ b_out, double* __restrict__ edge_out,
            int64_t* __restrict__ diag, int64_t rows, int64_t n, double sign) {
  using KT = KeyTraits<scalar_t>;
  using Key = typename KT::Key;
  using Fold = cub::BlockReduce<LevelPartial, kScanThreads>;
  using AtomScan = cub::BlockScan<Atom, kScanThreads, cub::BLOCK_SCAN_WARP_SCANS>;  // raking would need 40 KB
  using MinIndex = cub::BlockReduce<int, kScanThreads>;
  __shared__ union {
    typename Fold::TempStorage fold;
    typename AtomScan::TempStorage scan;
    typename MinIndex::TempStorage min;
  } tmp;
  __shared__ double suf_hi[kBins], suf_L[kBins];  // suffix (lower bins + lower tail) of each bin
  __shared__ LevelPartial s_total;
  __shared__ Atom s_prefix_all, s_suffix_all;
  __shared__ double s_gap_lo, s_gap_hi;
  __shared__ int s_inside, s_first;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    RowState st = state[r];
    if (st.status != kRefineMiddle && st.status != kRefineRow) continue;  // uniform
    BinSums* h = hist + r * kBins;
    LevelPartial acc{0.0, 0.0, 0.0, 0, 0, 0, 0, 0};
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) acc = LevelPartialSum{}(acc, partial[r * chunks + c]);
    const LevelPartial tot = Fold(tmp.fold).Reduce(acc, LevelPartialSum{});
    if (threadIdx.x == 0) s_total = tot;
    __syncthreads();
    const LevelPartial total = s_total;
    const double t = st.t;
    const uint64_t lo = st.lo_key, hi = st.hi_key;
    bool finished = false;  // uniform: every thread decides the same
    if (st.certify) {
      double b, edge, kf;
      if (settle_row(k_in[r], t, static_cast<double>(n), static_cast<double>(total.nan),
                     static_cast<double>(total.pinf), static_cast<double>(total.ninf), &b, &edge, &kf)) {
        if (threadIdx.x == 0) {
          b_out[r] = sign * b;
          edge_out[r] = edge;
          diag[3 * r] = kPathDirect;
          diag[3 * r + 1] = 0;
          diag[3 * r + 2] = 0;
        }
        st.status = kDone;
        finished = true;
      } else {
        st.k = kf;
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
      if (st.status == kRefineMiddle && !st.certify) {  // add the scores outside the bracket
        if (st.above0.count > 0.0) {
          above.count += st.above0.count;
          above.sum += st.above0.sum * exp((a_hi - st.above0.ref) / t);
        }
        if (st.below0.sum > 0.0) below.sum += st.below0.sum * exp((st.below0.ref - a_lo) / t);
      }
      if (st.certify) {
        st.above0 = above;
        st.below0 = below;
      }
      const int shift = bin_shift(lo, hi);
      const AtomMerge merge{inv_temperature(t)};
      const Atom none{0, 0, 0, 0, 0};
      const Atom above_atom = above.count > 0.0 ? Atom{above.ref, above.ref, above.count, above.sum, 0.0} : none;
      const Atom below_atom = below.sum > 0.0 ? Atom{below.ref, below.ref, 1.0, 0.0, below.sum} : none;
      const int base = kScanBins * static_cast<int>(threadIdx.x);
      // Suffixes: bins in ascending order after the lower tail; each thread folds its own
      // bins, one block scan places the threads, a second walk writes every bin's suffix.
      Atom run = none;
      for (int q = 0; q < kScanBins; ++q) run = merge(run, bin_atom<KT>(h[base + q], lo, hi, shift, base + q));
      AtomScan(tmp.scan).ExclusiveScan(run, run, below_atom, merge);
      for (int q = 0; q < kScanBins; ++q) {
        const int bin = base + q;
        suf_hi[bin] = run.count > 0.0 ? run.hi : -INFINITY;
        suf_L[bin] = run.count > 0.0 ? run.L : 0.0;
        run = merge(run, bin_atom<KT>(h[bin], lo, hi, shift, bin));
      }
      if (threadIdx.x == blockDim.x - 1) s_suffix_all = run;
      __syncthreads();
      // Prefixes: bins in descending order after the upper tail. Psi at each bin's upper
      // and lower edge; the root is in the gap above the first (highest) bin whose upper
      // edge has Psi >= k, or strictly inside a bin.
      run = none;
      for (int q = 0; q < kScanBins; ++q) {
        const int bin = kBins - 1 - (base + q);
        run = merge(run, bin_atom<KT>(h[bin], lo, hi, shift, bin));
      }
      AtomScan(tmp.scan).ExclusiveScan(run, run, above_atom, merge);
      const double k = st.k;
      int first = kBins, inside = kBins;
      double gap_lo[kScanBins], gap_hi[kScanBins];
      for (int q = 0; q < kScanBins; ++q) {
        const int index = base + q, bin = kBins - 1 - index;  // index: descending order
        const Atom a = bin_atom<KT>(h[bin], lo, hi, shift, bin);
        const Atom p = run;
        run = merge(run, a);
        gap_lo[q] = a.hi;
        gap_hi[q] = p.count > 0.0 ? p.lo : above.ref;
        if (a.count == 0.0) continue;
        const double C = p.count, A = p.count > 0.0 ? p.U : 0.0, top = p.count > 0.0 ? p.lo : INFINITY;
        const double sL = suf_L[bin], sH = suf_hi[bin];
        const double L_incl = a.L + (sL > 0.0 ? sL * exp((sH - a.hi) / t) : 0.0);
        const double psi_hi = psi_at_lo(C, A, L_incl, top, a.hi, t);
        if (psi_hi >= k && index < first) first = index;
        if (a.lo < a.hi && psi_hi < k && index < inside) {
          const double U_incl = a.U + (A > 0.0 ? A * exp((a.lo - top) / t) : 0.0);
          const double psi_lo = psi_at_hi(C + a.count, U_incl, sL, a.lo, sL > 0.0 ? sH : -INFINITY, t);
          if (psi_lo > k) inside = index;
        }
      }
      if (threadIdx.x == blockDim.x - 1) s_prefix_all = run;
      __syncthreads();  // tmp.scan -> tmp.min
      const int first_all = MinIndex(tmp.min).Reduce(first, MinInt{});
      __syncthreads();
      const int inside_all = MinIndex(tmp.min).Reduce(inside, MinInt{});
      if (threadIdx.x == 0) {
        s_first = first_all;
        s_inside = inside_all;
      }
      __syncthreads();
      const Atom pa = s_prefix_all, sa = s_suffix_all;
      const double psi_top = psi_at_hi(above.count, above.sum, sa.count > 0.0 ? sa.L : 0.0, above.ref,
                                       sa.count > 0.0 ? sa.hi : -INFINITY, t);
      const double psi_bottom = psi_at_lo(pa.count, pa.count > 0.0 ? pa.U : 0.0, below.sum,
                                          pa.count > 0.0 ? pa.lo : INFINITY, below.ref, t);
      if (st.certify && st.status == kRefineMiddle && !(psi_top <= k && psi_bottom >= k)) {
        st = fallback_state(st, KT::min_key(), KT::max_key());  // the sample missed: exact fallback
      } else if (s_inside < kBins) {
        const BinKeys refine = bin_keys(lo, hi, shift, kBins - 1 - s_inside);
        st.lo_key = refine.first;
        st.hi_key = refine.last;
      } else {
        // The gap above bin `first` (or below every bin): owners publish its ends.
        if (s_first == kBins && threadIdx.x == 0) {
          s_gap_lo = below.ref;
          s_gap_hi = pa.count > 0.0 ? pa.lo : above.ref;
        }
        for (int q = 0; q < kScanBins; ++q)
          if (base + q == s_first) {
            s_gap_lo = gap_lo[q];
            s_gap_hi = gap_hi[q];
          }
        __syncthreads();
        st.gap_lo = s_gap_lo;
        st.gap_hi = s_gap_hi;
        st.status = st.status == kRefineMiddle ? kSolveMiddle : kSolveRow;
      }
      st.certify = 0;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < kBins; j += blockDim.x) h[j] = BinSums{0, 0.0, 0.0};
    if (threadIdx.x == 0) state[r] = st;
    __syncthreads();
  }
}

// ---- sides and solve ----------------------------------------------------------------------

// Grid: [sides blocks, rows]; block j covers the middle slices (or row tiles) j, j + gridDim.x, ...
// Fewer blocks than the level passes: the merges of the block reductions cost exps.
template <typename scalar_t>
__global__ void __launch_bounds__(kLevelThreads)
sides_kernel(const scalar_t* __restrict__ x, const RowState* __restrict__ state, const double* __restrict__ middle,
             const unsigned* __restrict__ slice_count, int64_t cap, int chunks, GapSides* __restrict__ partial,
             int64_t rows, int64_t n, double sign) {
  constexpr int V = vec_width<scalar_t>();
  using Reduce = cub::BlockReduce<GapSides, kLevelThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const Atom none{0, 0, 0, 0, 0};
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const RowState st = state[r];
    if (st.status != kSolveMiddle && st.status != kSolveRow) continue;  // uniform
    const double inv_t = inv_temperature(st.t);
    GapSides acc{none, none};
    const auto add = [&](double s) {
      if (!is_finite(s)) return;
      if (s >= st.gap_hi) atom_add(acc.above, s, inv_t);
      else if (s <= st.gap_lo) atom_add(acc.below, s, inv_t);
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
      for (int c = blockIdx.x; c < chunks; c += gridDim.x) {
        const int64_t slice_id = r * chunks + c;
        const unsigned count = slice_count[slice_id];
        const double* slice = middle + slice_id * cap;
        for (unsigned j = threadIdx.x; j < count; j += blockDim.x) add(slice[j]);
      }
    }
    const GapSides total = Reduce(tmp).Reduce(acc, GapMerge{inv_t});
    if (threadIdx.x == 0) partial[r * gridDim.x + blockIdx.x] = total;
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kSolveThreads)
solve_kernel(RowState* __restrict__ state, const GapSides* __restrict__ partial, int parts,
             double* __restrict__ b_out, double* __restrict__ edge_out, int64_t* __restrict__ diag, int64_t rows,
             double sign) {
  using Reduce = cub::BlockReduce<GapSides, kSolveThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const Atom none{0, 0, 0, 0, 0};
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    RowState st = state[r];
    if (st.status != kSolveMiddle && st.status != kSolveRow) continue;  // uniform
    const double inv_t = inv_temperature(st.t);
    const GapMerge merge{inv_t};
    GapSides acc{none, none};
    for (int c = threadIdx.x; c < parts; c += blockDim.x) acc = merge(acc, partial[r * parts + c]);
    GapSides g = Reduce(tmp).Reduce(acc, merge);
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
    constexpr int64_t kTilesPerBlock = 8 / kLevelUnroll;  // ~16K fp32 scores per block
    int64_t chunks = (tiles + kTilesPerBlock - 1) / kTilesPerBlock;
    chunks = chunks < 1 ? 1 : (chunks > kMaxChunks ? kMaxChunks : chunks);
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
    at::Tensor state = bytes(rows * int64_t(sizeof(RowState)));
    at::Tensor hist = at::zeros({rows * kBins * int64_t(sizeof(BinSums))}, x.options().dtype(at::kByte));
    at::Tensor partial = bytes(rows * chunks * int64_t(sizeof(LevelPartial)));
    const int64_t side_blocks = chunks < kSideBlocks ? chunks : kSideBlocks;
    at::Tensor sides = bytes(rows * side_blocks * int64_t(sizeof(GapSides)));
    at::Tensor counts = bytes(rows * chunks * int64_t(sizeof(unsigned)) + 1);
    at::Tensor middle = at::empty({sort ? 1 : rows * chunks * cap}, x.options().dtype(at::kDouble));
    using Key = typename KeyTraits<scalar_t>::Key;
    const int64_t sample_cap = sort ? 0 : sample_geometry(n, 0).count;  // offset 0: the largest sample
    at::Tensor sample_keys = bytes(rows * sample_cap * int64_t(sizeof(Key)) + 1);
    auto* st = reinterpret_cast<RowState*>(state.mutable_data_ptr());
    auto* hs = reinterpret_cast<BinSums*>(hist.mutable_data_ptr());
    auto* lp = reinterpret_cast<LevelPartial*>(partial.mutable_data_ptr());
    auto* sp = reinterpret_cast<GapSides*>(sides.mutable_data_ptr());
    auto* cp = reinterpret_cast<unsigned*>(counts.mutable_data_ptr());
    double* mp = middle.mutable_data_ptr<double>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const unsigned row_blocks = static_cast<unsigned>(rows < 65535 ? rows : 65535);
    const dim3 grid(static_cast<unsigned>(chunks), row_blocks);
    propose_kernel<scalar_t><<<row_blocks, kProposeThreads, 0, stream>>>(
        xp, k.const_data_ptr<double>(), t.const_data_ptr<double>(), st,
        reinterpret_cast<Key*>(sample_keys.mutable_data_ptr()), sample_cap, rows, n, sign, sort);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // The first level certifies; a row sent to the fallback then needs a level per digit.
    const int levels = 1 + digits_for(KeyTraits<scalar_t>::kBits);
    for (int level = 0; level < levels; ++level) {
      level_kernel<scalar_t><<<grid, kLevelThreads, 0, stream>>>(xp, st, mp, cp, cap, hs, lp, rows, n, sign);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      scan_kernel<scalar_t><<<row_blocks, kScanThreads, 0, stream>>>(
          st, hs, lp, static_cast<int>(chunks), k.const_data_ptr<double>(), b.mutable_data_ptr<double>(),
          edge.mutable_data_ptr<double>(), diag.mutable_data_ptr<int64_t>(), rows, n, sign);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    sides_kernel<scalar_t><<<dim3(static_cast<unsigned>(side_blocks), row_blocks), kLevelThreads, 0, stream>>>(
        xp, st, mp, cp, cap, static_cast<int>(chunks), sp, rows, n, sign);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    solve_kernel<<<row_blocks, kSolveThreads, 0, stream>>>(st, sp, static_cast<int>(side_blocks), b.mutable_data_ptr<double>(),
                                                           edge.mutable_data_ptr<double>(),
                                                           diag.mutable_data_ptr<int64_t>(), rows, sign);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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
