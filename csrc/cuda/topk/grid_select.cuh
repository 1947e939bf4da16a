// The grid path for few long rows (g_init, g_hist, g_scan, g_collect, g_decide, g_output):
// many CTAs per row; the same select as a fixed sequence of launches over a global
// candidate buffer.
#pragma once

#include <cooperative_groups.h>

#include "../../common/cuda_launch.cuh"
#include "row_pass.cuh"

namespace fastlapsum {
namespace {

enum Stage : int { kSampleA = 0, kSampleB = 1, kRadix0 = 2 };

template <typename T, bool kMask>
__global__ void __launch_bounds__(kBlock) g_init(Params P) {
  begin_dependent_grid();
  const int64_t r = blockIdx.x;
  GState& st = P.st[r];
  for (int i = threadIdx.x; i < kBins; i += kBlock) P.ghist[r * kBins + i] = 0;
  int64_t L, take;
  const bool valid = row_budget<kMask>(P, r, L, take);
  if (threadIdx.x == 0) {
    st.prefix = 0;
    st.L = L;
    st.take = take;
    st.ks = -1;
    st.need = static_cast<uint32_t>(take);
    st.trivial = !valid ? 2u : ((take == 0 || take == L) ? 1u : 0u);
    st.cand_cnt = 0;
    st.out_cnt = 0;
    st.use_cand = 0;
    st.thr = 0;
    const int64_t s = 64, G = 8 * s;
    st.sampled = L >= 64 * G ? 1u : 0u;
    if (st.sampled) {
      const int64_t off = sample_offset(r, s);
      const int64_t S = ((L - off - 8) / G + 1) * 8;
      const double re = static_cast<double>(take) * static_cast<double>(S) / static_cast<double>(L);
      double rs = ceil(re + 5.0 * sqrt(re) + 16.0);
      rs = rs > static_cast<double>(S) ? static_cast<double>(S) : rs;
      st.off = off;
      st.G = G;
      st.S = S;
      st.rstar = static_cast<uint32_t>(rs);
    }
  }
  if (!kMask && valid) pad_row<T>(P, r, take, threadIdx.x, kBlock);
}

// Histogram passes: sample (stage a/b) or radix pass p over candidates / row.
template <typename T, bool kMask>
__global__ void __launch_bounds__(kBlock) g_hist(Params P, int stage) {
  begin_dependent_grid();
  const int64_t r = blockIdx.y;
  const GState& st = P.st[r];
  if (st.trivial) return;
  const bool sample = stage < kRadix0;
  if (sample && !st.sampled) return;
  const int p = stage - kRadix0;
  if (!sample && (st.ks >= 0 || (p == 0 && st.use_cand))) return;
  __shared__ uint32_t hist[kBins];
  for (int i = threadIdx.x; i < kBins; i += kBlock) hist[i] = 0;
  __syncthreads();
  const T* xr = static_cast<const T*>(P.x) + r * P.pitch;
  const uint32_t flip = P.flip;
  if (sample) {
    const int64_t off = st.off, G = st.G, S = st.S;
    const uint32_t d1 = st.d1;
    for (int64_t j = blockIdx.x * int64_t(kBlock) + threadIdx.x; j < S; j += P.bpr * kBlock) {
      const int64_t i = off + (j >> 3) * G + (j & 7);
      const uint32_t key = float_key(to_float(xr[i])) ^ flip;
      if (stage == kSampleA) atomicAdd(&hist[key >> 21], 1u);
      else if ((key >> 21) == d1) atomicAdd(&hist[(key >> 10) & 2047u], 1u);
    }
  } else {
    const int s = digit_shift(p), hi = s + digit_width(p);
    const uint64_t mask = (1ull << digit_width(p)) - 1, prefix = st.prefix;
    auto f = [&](uint64_t c) {
      if (prefix_match(c, prefix, hi)) atomicAdd(&hist[(c >> s) & mask], 1u);
    };
    if (st.use_cand) {
      const uint64_t* cr = P.cand + r * P.cap_g;
      const int64_t C = static_cast<int64_t>(st.cand_cnt);
      constexpr int kU = 4;  // candidate loads in flight per thread
      for (int64_t j0 = blockIdx.x * int64_t(kBlock) * kU; j0 < C; j0 += P.bpr * int64_t(kBlock) * kU) {
        uint64_t c[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int64_t j = j0 + u * kBlock + threadIdx.x;
          c[u] = j < C ? cr[j] : 0;
        }
#pragma unroll
        for (int u = 0; u < kU; ++u)
          if (j0 + u * kBlock + threadIdx.x < C) f(c[u]);
      }
    } else {
      const bool aligned = is_aligned16(xr);
      for_row<T>(xr, st.L, aligned, blockIdx.x, P.bpr, [&](float v, int64_t i) {
        f(composite(float_key(v) ^ flip, static_cast<uint32_t>(i)));
      });
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBins; i += kBlock)
    if (hist[i]) atomicAdd(&P.ghist[r * kBins + i], hist[i]);
}

template <bool kMask>
__global__ void __launch_bounds__(kBlock) g_scan(Params P, int stage) {
  begin_dependent_grid();
  const int64_t r = blockIdx.x;
  GState& st = P.st[r];
  if (st.trivial) return;
  const bool sample = stage < kRadix0;
  if (sample && !st.sampled) return;
  if (!sample && st.ks >= 0) return;
  __shared__ uint32_t hist[kBins];
  __shared__ typename BlockScan::TempStorage tmp;
  __shared__ FindResult res;
  uint32_t* gh = P.ghist + r * kBins;
  for (int i = threadIdx.x; i < kBins; i += kBlock) {
    hist[i] = gh[i];
    gh[i] = 0;
  }
  __syncthreads();
  const uint32_t need = stage == kSampleA ? st.rstar : stage == kSampleB ? st.rem : st.need;
  find_bin(hist, need, tmp, res);
  if (threadIdx.x != 0) return;
  if (stage == kSampleA) {
    st.d1 = res.digit;
    st.rem = need - res.above;
  } else if (stage == kSampleB) {
    st.thr = (st.d1 << 21) | (res.digit << 10);
  } else {
    const int p = stage - kRadix0;
    const int s = digit_shift(p);
    st.prefix |= static_cast<uint64_t>(res.digit) << s;
    const uint32_t left = need - res.above;
    st.need = left;
    if (res.count == left || p == 5) st.ks = s;
  }
}

// Block-staged compaction: every CTA iterates tiles with a thread-independent trip count;
// `produce(push)` pushes this tile's items, which are then flushed to `dst` (capacity
// `cap`) at an offset reserved with one global atomic per tile.
struct StageShared {
  uint32_t cnt;
  unsigned long long base;
};

// A slot in the stage for the calling thread: one shared atomic per group of converged
// lanes of a warp, not one per item (at k = n/16 a tile stages hundreds of items).
// (The histogram atomics stay per lane: aggregating them per bin with labeled_partition
// costs the collect pass more than it saves.)
__device__ __forceinline__ uint32_t stage_slot(StageShared& ss) {
  const cooperative_groups::coalesced_group g = cooperative_groups::coalesced_threads();
  uint32_t first = 0;
  if (g.thread_rank() == 0) first = atomicAdd(&ss.cnt, g.size());
  return g.shfl(first, 0) + g.thread_rank();
}

template <typename Sink>
__device__ __forceinline__ void flush_stage(uint64_t* buf, StageShared& ss, unsigned long long* counter, Sink&& sink) {
  __syncthreads();
  if (threadIdx.x == 0) ss.base = atomicAdd(counter, static_cast<unsigned long long>(ss.cnt));
  __syncthreads();
  for (uint32_t j = threadIdx.x; j < ss.cnt; j += kBlock) sink(ss.base + j, buf[j]);
  __syncthreads();
  if (threadIdx.x == 0) ss.cnt = 0;
  __syncthreads();
}

// Slots in a CTA's stage for `count` items of each lane of a converged warp: one shared
// atomic per warp (an inclusive shuffle scan of the counts), the first slot returned.
__device__ __forceinline__ uint32_t warp_stage_slots(StageShared& ss, uint32_t count) {
  const int lane = threadIdx.x % 32;
  uint32_t incl = count;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const uint32_t t = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += t;
  }
  uint32_t first = 0;
  if (lane == 31 && incl != 0) first = atomicAdd(&ss.cnt, incl);
  return __shfl_sync(0xffffffffu, first, 31) + incl - count;
}

// collect: composites with key >= thr into the candidate buffer + first-digit histogram.
// At k = n/16 one score in 16 is collected, so the pass is lean like the row kernel's: a
// bit per score from one fp32 compare (key_bound), stage slots per warp, and only the set
// bits revisit their scores (an L1 hit: a register is picked by constant index only).
// A tile is kBlock * kUnroll vectors (<= kStageItems scores); the stage is flushed to the
// buffer every kFlushTiles tiles at an offset reserved with one global atomic.
template <typename T, bool kMask>
__global__ void __launch_bounds__(kBlock) g_collect(Params P) {
  begin_dependent_grid();
  constexpr int V = 16 / sizeof(T), U = kUnroll;
  constexpr int64_t kTile = int64_t(kBlock) * U * V;
  constexpr int kFlushTiles = static_cast<int>(kStageItems / kTile);
  static_assert(U * V <= 32 && kFlushTiles >= 1, "a bit per score; a tile fits the stage");
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  uint64_t* buf = reinterpret_cast<uint64_t*>(dyn_smem);
  __shared__ uint32_t hist[kBins];
  __shared__ StageShared ss;
  const int64_t r = blockIdx.y;
  GState& st = P.st[r];
  if (st.trivial) return;
  for (int i = threadIdx.x; i < kBins; i += kBlock) hist[i] = 0;
  if (threadIdx.x == 0) ss.cnt = 0;
  __syncthreads();
  const T* xr = static_cast<const T*>(P.x) + r * P.pitch;
  const bool aligned = is_aligned16(xr);
  const uint32_t flip = P.flip;
  // key >= thr as one fp32 compare (a superset at worst, as in the row kernel)
  const float lo = key_bound(st.thr), hi = key_bound(~st.thr);
  const auto admit = [&](float v) { return flip == 0 ? !(v < lo) : v <= hi; };
  const int64_t L = st.L, cap = P.cap_g;
  uint64_t* cr = P.cand + r * cap;
  // vector indices in 32 bits (a row has < 2^32 scores): whole tiles load and test without
  // per-vector or per-score bounds (row_pass.cuh)
  const uint32_t nv = static_cast<uint32_t>((L + V - 1) / V), whole = static_cast<uint32_t>(L / V);
  const uint32_t step = static_cast<uint32_t>(P.bpr) * kBlock * U;
  const auto load_tile = [&](RawVec<T>(&raw)[U], uint32_t v0) {
    load_tile_vecs<kBlock>(raw, xr, v0, nv, whole, L, aligned);
  };
  int tiles = 0;
  RawVec<T> raw[U], next[U];
  const uint32_t first = blockIdx.x * uint32_t(kBlock) * U;
  if (first < nv) load_tile(raw, first);
  for (uint32_t v0 = first; v0 < nv; v0 += step) {  // uniform trip count
    // the next tile's loads are in flight while this one is tested and flushed
    if (v0 + step < nv) load_tile(next, v0 + step);
    const uint32_t bits = tile_bits<kBlock>(raw, v0, whole, L, [&](float v, uint32_t) { return admit(v); });
    uint32_t slot = warp_stage_slots(ss, static_cast<uint32_t>(__popc(bits)));
    for (uint32_t b = bits; b != 0; b &= b - 1) {
      const int q = __ffs(b) - 1;
      const int64_t i = int64_t(v0 + (q / V) * kBlock + threadIdx.x) * V + q % V;
      const uint32_t key = float_key(to_float(xr[i])) ^ flip;
      buf[slot++] = composite(key, static_cast<uint32_t>(i));
      atomicAdd(&hist[key >> 21], 1u);
    }
    if (++tiles == kFlushTiles || v0 + step >= nv) {  // uniform
      tiles = 0;
      flush_stage(buf, ss, &st.cand_cnt, [&](unsigned long long pos, uint64_t c) {
        if (pos < static_cast<unsigned long long>(cap)) cr[pos] = c;
      });
    }
#pragma unroll
    for (int u = 0; u < U; ++u) raw[u] = next[u];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBins; i += kBlock)
    if (hist[i]) atomicAdd(&P.ghist[r * kBins + i], hist[i]);
}

__global__ void __launch_bounds__(kBlock) g_decide(Params P) {
  begin_dependent_grid();
  const int64_t r = blockIdx.x;
  GState& st = P.st[r];
  if (st.trivial) return;
  const unsigned long long C = st.cand_cnt;
  const bool use = C >= static_cast<unsigned long long>(st.take) && C <= static_cast<unsigned long long>(P.cap_g);
  if (!use)
    for (int i = threadIdx.x; i < kBins; i += kBlock) P.ghist[r * kBins + i] = 0;
  if (threadIdx.x == 0) st.use_cand = use ? 1u : 0u;
}

template <typename T, bool kMask>
__global__ void __launch_bounds__(kBlock) g_output(Params P) {
  begin_dependent_grid();
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  uint64_t* buf = reinterpret_cast<uint64_t*>(dyn_smem);
  __shared__ StageShared ss;
  const int64_t r = blockIdx.y;
  GState& st = P.st[r];
  const T* xr = static_cast<const T*>(P.x) + r * P.pitch;
  const bool aligned = is_aligned16(xr);
  const uint32_t flip = P.flip;
  const int64_t gtid = blockIdx.x * int64_t(kBlock) + threadIdx.x, gthreads = P.bpr * kBlock;
  if (kMask) {
    if (st.trivial) {  // 2: row_budget's NaN row
      mask_row_fill<T>(P, r, st.trivial == 2 ? NAN : (st.take == 0 ? 0.0f : 1.0f), gtid, gthreads);
      return;
    }
    T* mrow = static_cast<T*>(P.out_mask) + r * P.n;
    const uint64_t prefix = st.prefix;
    const int ks = st.ks;
    for_row<T>(xr, P.n, aligned, blockIdx.x, P.bpr, [&](float v, int64_t i) {
      const uint64_t c = composite(float_key(v) ^ flip, static_cast<uint32_t>(i));
      mrow[i] = static_cast<T>(selected(c, prefix, ks) ? 1.0f : 0.0f);
    });
    return;
  }
  if (st.trivial) {
    if (st.take == st.L)
      for (int64_t i = gtid; i < st.L; i += gthreads)
        emit<T>(P, r, i, composite(float_key(to_float(xr[i])) ^ flip, static_cast<uint32_t>(i)));
    return;
  }
  if (threadIdx.x == 0) ss.cnt = 0;
  __syncthreads();
  const uint64_t prefix = st.prefix;
  const int ks = st.ks;
  auto sink = [&](unsigned long long pos, uint64_t c) { emit<T>(P, r, pos, c); };
  if (st.use_cand) {
    const uint64_t* cr = P.cand + r * P.cap_g;
    const int64_t C = static_cast<int64_t>(st.cand_cnt);
    for (int64_t j0 = blockIdx.x * int64_t(kBlock) * 8; j0 < C; j0 += P.bpr * int64_t(kBlock) * 8) {
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const int64_t j = j0 + u * kBlock + threadIdx.x;
        if (j < C) {
          const uint64_t c = cr[j];
          if (selected(c, prefix, ks)) buf[stage_slot(ss)] = c;
        }
      }
      flush_stage(buf, ss, &st.out_cnt, sink);
    }
  } else {
    for_row<T, kUnroll>(
        xr, st.L, aligned, blockIdx.x, P.bpr,
        [&](float v, int64_t i) {
          const uint64_t c = composite(float_key(v) ^ flip, static_cast<uint32_t>(i));
          if (selected(c, prefix, ks)) buf[stage_slot(ss)] = c;
        },
        [&] { flush_stage(buf, ss, &st.out_cnt, sink); });
  }
}

}  // namespace
}  // namespace fastlapsum
