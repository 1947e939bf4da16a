// The level pass (level_kernel): a grid over each row or its middle set that sums the
// tails, adds the bins, and on a bracketed row's first level gathers the middle set. Its
// kScan instance also runs the scan (bin_scan.cuh) of each row, in one of the row's blocks.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <type_traits>

#include "../../common/tile_scan.cuh"
#include "bin_scan.cuh"
#include "last_block.cuh"
#include "propose.cuh"
#include "settled.cuh"

namespace fastlapsum {
namespace {

// kScan: a binning level whose scan runs in one of the row's blocks once all have finished
// the row (last_block.cuh: arrive, then claim after the row loop; `arrivals`, a counter a
// row, zero before and after), not in a scan_kernel launch after it. Not for a gathering
// level (no scan follows it).
template <typename scalar_t, bool kScan>
__global__ void __launch_bounds__(kLevelThreads, 2)
level_kernel(const scalar_t* __restrict__ x, RowState* __restrict__ state, double* __restrict__ middle,
             unsigned* __restrict__ slice_count, int64_t cap, BinSums* __restrict__ hist,
             LevelPartial* __restrict__ partial, const double* __restrict__ k_in, const double* __restrict__ t_in,
             unsigned* __restrict__ first_hist, unsigned* __restrict__ later_hist, unsigned* __restrict__ arrivals,
             double* __restrict__ b_out, double* __restrict__ edge_out, int64_t* __restrict__ diag, int64_t rows,
             int64_t n, double sign, int level, bool preread, bool propose) {
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
    std::conditional_t<kScan, ScanStorage<kLevelThreads>, char> scan;  // after the row's bins are flushed
  } sb;
  __shared__ int s_last;
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
  // kScan: bit j set when this block arrived for its row j (blockIdx.y + j gridDim.y; rows past
  // the 32nd are claimed regardless), so that a launch whose rows are settled claims nothing.
  [[maybe_unused]] unsigned arrived = 0;
  [[maybe_unused]] const auto arrive_row = [&](int64_t r) {
    arrive(arrivals + r);
    const int64_t j = (r - blockIdx.y) / gridDim.y;
    if (j < 32) arrived |= 1u << j;
  };
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
      if constexpr (kScan) arrive_row(r);  // every block of the row arrives, these too
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
    if constexpr (kScan) arrive_row(r);  // the bins and partials are in (its barrier: the bins are free)
    else __syncthreads();
  }
  // The scans, after the row loop: scan_row called inside it, or inlined, makes the tile loop
  // spill more. A block claims only rows it arrived for (a settled row has no arrivals), so a
  // launch over settled rows makes no atomics.
  if constexpr (kScan)
    for (int64_t r = blockIdx.y, j = 0; r < rows; r += gridDim.y, ++j)
      if ((j >= 32 || (arrived >> j & 1u)) && claim(arrivals + r, gridDim.x, s_last))
        scan_row<scalar_t, kLevelThreads>(sb.scan, r, state, hist + r * kBins, partial + r * gridDim.x, gridDim.x,
                                          k_in, b_out, edge_out, diag, n, sign);
}

}  // namespace
}  // namespace fastlapsum
