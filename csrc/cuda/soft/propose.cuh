// Propose: the certified bracket's key range from a row's noised sample, by a radix select
// whose blocks trade each digit's histogram through global memory (propose_kernel), or run
// inside the gathering pass over the row's parked tiles (propose_from_tile).
#pragma once

#include <cub/block/block_scan.cuh>

#include "../../common/bracket_rule.h"
#include "../../common/cuda_launch.cuh"
#include "bins.cuh"
#include "tuning.cuh"

namespace fastlapsum {
namespace {

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
// here before the first barrier. An instance for each of SoftTuning's kProposeMinBlocks and
// kProposeMinBlocksOneWave CTAs an SM (the plan's propose_min_blocks): the same code.
template <typename scalar_t, int kMinBlocks>
__global__ void __launch_bounds__(kProposeThreads, kMinBlocks)
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

}  // namespace
}  // namespace fastlapsum
