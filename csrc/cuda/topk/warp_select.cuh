// The warp-row kernel (warp_select_kernel): tiny rows (n <= TopkTuning::kWarpMaxN), one warp
// per row, kWarpRows rows per CTA, the whole row in registers. One template for topk and
// hard_mask (kMask), one launch for the batch. Rows of at most kThreadMaxN scores take
// thread_select_kernel instead (a thread a row, at the end of this file).
//
// Layout: lane l holds kC chunks of V = 16/sizeof(T) consecutive scores; chunk c of lane l is
// the vector c*32 + l, so a chunk is one coalesced 16-byte load per lane (scalar loads where
// the row is not 16-byte aligned or the vector crosses the valid length). Each score is kept
// as its 32-bit key (float_key ^ flip; the value is decoded back from it, exactly). Slots past
// the valid length L hold key 0: their indices are larger than every valid one, so their
// composites (key << 32 | ~index) are below every valid composite and never selected
// (take <= L).
//
// Small budgets (topk, take <= kWarpFilterMaxTake: MoE routing): the scores at or above a key
// that take of the lanes' maxima reach are few (~take + 2 on random rows); they are gathered
// one a lane and ranked among themselves, and each selected one is written by its lane
// (warp_filter). Where more than 32 pass (ties), and for hard_mask, the general selection:
//
// Selection (exact, the composite order of topk_cuda.cu): a bisection for the take-th
// largest key G over [lo, hi], a bracket from the lanes' maxima (see below), one warp
// reduction (__reduce_add_sync) of the lanes' counts of key >= mid per step (on long rows
// counting only the few keys above lo, compacted first). It stops early where a mid's count
// equals take (then the selection is exactly key >= mid). Otherwise the selection is key > G
// plus the first r = take - count(key > G) scores with key == G in index order (ties by
// smaller index).
// Positions follow from one warp scan per chunk of the packed counts (key > G) | (key == G)
// << 16: an item's output position is gt_before + min(ties_before, r), so the unsorted
// output is in index order (deterministic). Where take <= kWarpSortMaxK (64) the selected
// composites are staged in shared memory at their positions and written one a lane;
// sorted=True (K <= 64) first sorts them by a register bitonic network over the warp (best
// first; composites are unique, so ties by smaller index come out of the order itself).
#pragma once

#include <cstdint>

#include "../../common/cuda_launch.cuh"
#include "params.cuh"

namespace fastlapsum {
namespace {

constexpr uint32_t kWarpFull = 0xffffffffu;

// Warp-wide sum, min or max of a lane value: one REDUX on sm_80+, a butterfly before.
enum class WarpOp { kSum, kMin, kMax };
template <WarpOp kOp>
__device__ __forceinline__ uint32_t warp_reduce(uint32_t x) {
#if __CUDA_ARCH__ >= 800
  if constexpr (kOp == WarpOp::kSum) return __reduce_add_sync(kWarpFull, x);
  else if constexpr (kOp == WarpOp::kMin) return __reduce_min_sync(kWarpFull, x);
  else return __reduce_max_sync(kWarpFull, x);
#else
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    const uint32_t y = __shfl_xor_sync(kWarpFull, x, d);
    x = kOp == WarpOp::kSum ? x + y : (kOp == WarpOp::kMin ? min(x, y) : max(x, y));
  }
  return x;
#endif
}

// Inclusive prefix sum over the lanes.
__device__ __forceinline__ uint32_t warp_inclusive_sum(uint32_t x, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t y = __shfl_up_sync(kWarpFull, x, d);
    if (lane >= d) x += y;
  }
  return x;
}

// How many of a lane's keys satisfy pred: the tests as bits of a word and one popcount per
// 32 keys (a compare and a bit merge a key, or a P2R per seven; summing 0/1 values took
// about three instructions a key).
template <int kI, typename Pred>
__device__ __forceinline__ uint32_t lane_count(const uint32_t (&key)[kI], Pred pred) {
  uint32_t c = 0;
#pragma unroll
  for (int j0 = 0; j0 < kI; j0 += 32) {
    uint32_t bits = 0;
#pragma unroll
    for (int j = j0; j < kI && j < j0 + 32; ++j) bits |= (pred(key[j]) ? 1u : 0u) << (j - j0);
    c += __popc(bits);
  }
  return c;
}

// Descending bitonic sort of the first `width` (a power of two >= 2) of the warp's 32*S
// composites; element p = s*32 + lane is a[s]. Past `width` the network's stages are not
// run (those elements are left in blocks of `width`, each sorted).
template <int S>
__device__ __forceinline__ void warp_bitonic_desc(uint64_t (&a)[S], int lane, uint32_t width) {
#pragma unroll
  for (int k = 2; k <= 32 * S; k <<= 1) {
    if (static_cast<uint32_t>(k) > width) break;
#pragma unroll
    for (int j = k >> 1; j > 0; j >>= 1) {
      if (j >= 32) {  // partners in the same lane: slots s and s + j/32
        const int js = j / 32;
#pragma unroll
        for (int s = 0; s < S; ++s) {
          if ((s & js) != 0) continue;
          const bool desc = ((s * 32 + lane) & k) == 0;
          const uint64_t x = a[s], y = a[s + js];
          if (desc ? x < y : x > y) {
            a[s] = y;
            a[s + js] = x;
          }
        }
      } else {
        const bool lower = (lane & j) == 0;
#pragma unroll
        for (int s = 0; s < S; ++s) {
          const uint64_t y = __shfl_xor_sync(kWarpFull, a[s], j);
          const bool desc = ((s * 32 + lane) & k) == 0;
          a[s] = (lower == desc) ? (a[s] > y ? a[s] : y) : (a[s] < y ? a[s] : y);
        }
      }
    }
  }
}

// The selected composites, staged at their positions (< take <= 32*S), written one a lane
// (coalesced, where the lanes' own writes would scatter over as many store instructions as
// vectors holding a selected score), sorted first where `sort`.
template <typename T, int S>
__device__ __forceinline__ void warp_staged_out(const Params& P, int64_t r, const uint64_t* stage, uint32_t take,
                                                int lane, bool sort) {
  uint64_t a[S];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    const uint32_t p = s * 32 + lane;
    a[s] = p < take ? stage[p] : 0ull;  // 0: below every composite (no index is ~0)
  }
  if (sort) {
    uint32_t width = 2;  // the network for the smallest power of two >= take
    while (width < take) width <<= 1;
    warp_bitonic_desc<S>(a, lane, width);
  }
#pragma unroll
  for (int s = 0; s < S; ++s) {
    const uint32_t p = s * 32 + lane;
    if (p < take) emit<T>(P, r, p, a[s]);
  }
}

// topk's small budgets (1 <= take <= kWarpFilterMaxTake): the scores at or above a filter key F,
// gathered one a lane in index order and ranked among themselves. F has at least take of the
// lanes' maxima at or above it (so every selected score is >= F: the take-th largest key is):
// a bisection over the lanes' maxima by ballots from `lo` (such a key already), stopped once
// at most take + kWarpFilterSlack maxima are >= its lower end. On random rows ~take + 2
// scores pass; where more than 32 do (ties, too few lanes with a valid score) it returns
// false and the row takes the bisection over all keys. Else lane < total holds candidate
// `comp` and its rank among the candidates in the composite order (larger key first, then
// smaller index: candidates are in index order, so the smaller lane).
template <int kC, int V>
__device__ __forceinline__ bool warp_filter(const uint32_t (&key)[kC * V], uint32_t m1, uint32_t lo, uint32_t hi,
                                            uint32_t take, int lane, uint64_t* stage, uint64_t& comp,
                                            uint32_t& rank, uint32_t& total) {
#pragma unroll 1
  while (lo < hi) {  // count(m1 >= lo) >= take
    const uint32_t mid = lo + ((hi - lo) >> 1) + 1;
    const uint32_t c = __popc(__ballot_sync(kWarpFull, m1 >= mid));
    if (c >= take) {
      lo = mid;
      if (c <= take + TopkTuning::kWarpFilterSlack) break;
    } else {
      hi = mid - 1;
    }
  }
  // bit e of passing(c): score (c*32 + lane)*V + e passes (recomputed where needed: kept in
  // registers, the kC words would spill the 1024-score fp32 build)
  const auto passing = [&](int c) {
    uint32_t bits = 0;
#pragma unroll
    for (int e = 0; e < V; ++e) bits |= (key[c * V + e] >= lo ? 1u : 0u) << e;
    return bits;
  };
  total = warp_reduce<WarpOp::kSum>(lane_count(key, [&](uint32_t k) { return k >= lo; }));
  if (total > 32) return false;
  // Index order is chunk, lane, element: one warp scan per four chunks of their counts,
  // packed 8 bits each (a chunk's count over the warp is <= total <= 32).
  uint32_t before = 0;  // candidates in the chunks before
#pragma unroll
  for (int g = 0; g < kC; g += 4) {
    uint32_t packed = 0;
#pragma unroll
    for (int c = g; c < kC && c < g + 4; ++c) packed |= static_cast<uint32_t>(__popc(passing(c))) << (8 * (c - g));
    const uint32_t incl = warp_inclusive_sum(packed, lane), tot = __shfl_sync(kWarpFull, incl, 31);
    const uint32_t excl = incl - packed;
#pragma unroll
    for (int c = g; c < kC && c < g + 4; ++c) {
      uint32_t p = before + ((excl >> (8 * (c - g))) & 0xFFu);
#pragma unroll
      for (int e = 0; e < V; ++e)
        if (key[c * V + e] >= lo) stage[p++] = composite(key[c * V + e], (c * 32 + lane) * V + e);
      before += (tot >> (8 * (c - g))) & 0xFFu;
    }
  }
  __syncwarp();
  comp = static_cast<uint32_t>(lane) < total ? stage[lane] : 0ull;
  const uint32_t ck = static_cast<uint32_t>(comp >> 32);
  rank = 0;
#pragma unroll 4
  for (uint32_t j = 0; j < total; ++j) {
    const uint32_t o = __shfl_sync(kWarpFull, ck, j);
    rank += (o > ck || (o == ck && j < static_cast<uint32_t>(lane))) ? 1u : 0u;
  }
  return true;
}

// Registers: at most 128 (four CTAs an SM) where a lane holds 64 keys, else 64 (eight).
template <typename T, bool kMask, int kC>
__global__ void __launch_bounds__(TopkTuning::kWarpRows * 32, kC * 16 / sizeof(T) >= 64 ? 4 : 8)
    warp_select_kernel(Params P) {
  begin_dependent_grid();
  constexpr int V = 16 / static_cast<int>(sizeof(T)), kI = kC * V;
  constexpr int kSortMax = TopkTuning::kWarpSortMaxK;
  __shared__ uint64_t stage_all[TopkTuning::kWarpRows][kSortMax];
  constexpr int kCand = kI >= 32 ? TopkTuning::kWarpCandPerLane : 1;  // see the bisection
  __shared__ uint32_t cand_all[TopkTuning::kWarpRows][kI >= 32 ? 32 * kCand : 1];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int64_t r = int64_t(blockIdx.x) * TopkTuning::kWarpRows + w;
  if (r >= P.rows) return;  // the whole warp: nothing below synchronises the CTA
  const T* xr = static_cast<const T*>(P.x) + r * P.pitch;
  const uint32_t flip = P.flip;
  int64_t L64, take64;
  if (!row_budget<kMask>(P, r, L64, take64)) {  // hard_mask: a whole NaN row
    mask_row_fill<T>(P, r, NAN, lane, 32);
    return;
  }
  const uint32_t L = static_cast<uint32_t>(L64), take = static_cast<uint32_t>(take64);
  if (!kMask && take == 0) {
    pad_row<T>(P, r, 0, lane, 32);
    return;
  }

  // ---- the row's keys: every load in flight before the first is used ----
  const bool aligned = is_aligned16(xr);
  uint32_t key[kI];
  {
    RawVec<T> raw[kC];
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      const uint32_t v = c * 32 + lane;
      raw[c] = v * V < L ? load_raw_vec<T>(xr, v, L, aligned) : RawVec<T>{};  // reads only scores < L
    }
#pragma unroll
    for (int c = 0; c < kC; ++c) {
#pragma unroll
      for (int e = 0; e < V; ++e) key[c * V + e] = float_key(raw[c][e]) ^ flip;
      const uint32_t v = c * 32 + lane;
      if ((v + 1) * V > L) {  // the row's tail vector or past it
#pragma unroll
        for (int e = 0; e < V; ++e)
          if (v * V + e >= L) key[c * V + e] = 0u;
      }
    }
  }

  // ---- G, the take-th largest key: bisection of [lo, hi] ----
  // hi: the largest key. lo: a key with at least take keys >= it: the smallest lane maximum
  // (take <= 32; the lanes' maxima are distinct slots), the smallest lane's second largest
  // (take <= 64), else 0. On random rows this bracket is ~2^24 keys wide where the
  // gap between the take-th and next key is ~2^17-2^19: the bisection stops (count == take)
  // after ~6-8 counts, where bits from the top take ~14-18.
  uint32_t m1 = 0, m2 = 0;  // the lane's largest and second largest key (slots, ties too)
  if (take > 32 && take <= 64) {
#pragma unroll
    for (int j = 0; j < kI; ++j) {
      m2 = max(m2, min(m1, key[j]));
      m1 = max(m1, key[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kI; ++j) m1 = max(m1, key[j]);
  }
  uint32_t lo = 0;
  if (take <= 64) {  // lanes with no valid score left out where the others hold take slots
    const uint32_t per = take <= 32 ? 1u : 2u, lanes = min(32u, (L + V - 1) / V);
    const bool skip = lanes * per >= take && static_cast<uint32_t>(lane) * V >= L;
    lo = warp_reduce<WarpOp::kMin>(skip ? 0xFFFFFFFFu : (per == 1 ? m1 : m2));
  }
  uint32_t hi = warp_reduce<WarpOp::kMax>(m1);
  if (take == 0) lo = hi;  // hard_mask's k = 0: G = the largest key, r_ties = 0
  if constexpr (!kMask) {
    if (take <= static_cast<uint32_t>(TopkTuning::kWarpFilterMaxTake)) {  // take >= 1 here
      uint64_t comp;
      uint32_t rank, total;
      if (warp_filter<kC, V>(key, m1, lo, hi, take, lane, stage_all[w], comp, rank, total)) {
        // written at its rank (sorted) or after the selected candidates before it
        const bool sel = static_cast<uint32_t>(lane) < total && rank < take;
        const uint32_t before = __popc(__ballot_sync(kWarpFull, sel) & ((1u << lane) - 1u));
        if (sel) emit<T>(P, r, P.warp_sort != 0 ? rank : before, comp);
        pad_row<T>(P, r, take, lane, 32);
        return;
      }
    }
  }
  // Long rows (32+ keys a lane), take <= 64: every count below is of keys > lo, typically
  // ~4-6 a lane of them; where they fit kCand a lane they are copied (in any order) to
  // registers through shared memory, and the bisection counts those only.
  uint32_t ck[kCand];
  bool use_cand = false;
  if constexpr (kI >= 32) {
    if (take <= 64 && lo < hi) {
      const uint32_t own = lane_count(key, [&](uint32_t k) { return k > lo; });
      const uint32_t incl = warp_inclusive_sum(own, lane), total = __shfl_sync(kWarpFull, incl, 31);
      if (total <= 32u * kCand) {
        uint32_t* cb = cand_all[w];
        uint32_t p = incl - own;
#pragma unroll
        for (int j = 0; j < kI; ++j)
          if (key[j] > lo) cb[p++] = key[j];
        __syncwarp();
#pragma unroll
        for (int s = 0; s < kCand; ++s) {
          const uint32_t q = s * 32 + lane;
          ck[s] = q < total ? cb[q] : 0u;  // 0: never > lo
        }
        use_cand = true;
      }
    }
  }
  // Counts over the row; each pred below holds only for keys above the initial lo.
  const auto count = [&](auto pred) {
    return warp_reduce<WarpOp::kSum>(use_cand ? lane_count(ck, pred) : lane_count(key, pred));
  };
  bool exact = false;
#pragma unroll 1
  while (lo < hi) {  // count(key >= lo) >= take > count(key > hi)
    const uint32_t mid = lo + ((hi - lo) >> 1) + 1;  // in (lo, hi]
    const uint32_t cnt = count([&](uint32_t k) { return k >= mid; });
    if (cnt >= take) {
      lo = mid;
      if (cnt == take) {  // exactly key >= mid
        exact = true;
        break;
      }
    } else {
      hi = mid - 1;
    }
  }
  // selected: key > G, and the first r_ties with key == G in index order
  const uint32_t G = exact ? lo - 1 : lo;  // lo > 0 where exact (lo = some mid > 0)
  const uint32_t r_ties = exact ? 0u : take - count([&](uint32_t k) { return k > G; });

  // ---- output, chunk by chunk in index order ----
  const bool staged = !kMask && take <= kSortMax;  // outputs through shared memory
  uint64_t* stage = stage_all[w];
  T* mrow = kMask ? static_cast<T*>(P.out_mask) + r * P.n : nullptr;
  const bool mask_aligned = kMask && is_aligned16(mrow);
  uint32_t gt_base = 0, tie_base = 0;  // over the chunks before this one
#pragma unroll
  for (int c = 0; c < kC; ++c) {
    const uint32_t v = c * 32 + lane;
    uint32_t gm = 0, tm = 0;  // this lane's vector: key > G, key == G (bit e: score v*V + e)
#pragma unroll
    for (int e = 0; e < V; ++e) {
      gm |= (key[c * V + e] > G ? 1u : 0u) << e;
      tm |= (key[c * V + e] == G ? 1u : 0u) << e;
    }
    const uint32_t own = __popc(gm) | (__popc(tm) << 16);
    const uint32_t incl = warp_inclusive_sum(own, lane);
    const uint32_t tot = __shfl_sync(kWarpFull, incl, 31), excl = incl - own;
    const uint32_t gb = gt_base + (excl & 0xFFFFu), tb = tie_base + (excl >> 16);  // before it
    gt_base += tot & 0xFFFFu;
    tie_base += tot >> 16;
    // Its selected ties: its first r_ties - tb (ties are selected in index order).
    const uint32_t nt = tb < r_ties ? min(static_cast<uint32_t>(__popc(tm)), r_ties - tb) : 0u;
    uint32_t st = tm;
    while (static_cast<uint32_t>(__popc(st)) > nt) st &= ~(0x80000000u >> __clz(st));  // drop the last
    const uint32_t sm = gm | st;
    if constexpr (kMask) {
      if (v * V < P.n) {
        T t[V];
#pragma unroll
        for (int e = 0; e < V; ++e) t[e] = static_cast<T>((sm >> e) & 1u ? 1.0f : 0.0f);
        if (mask_aligned && (v + 1) * V <= P.n) {
          uint4 q;
          memcpy(&q, t, 16);
          reinterpret_cast<uint4*>(mrow)[v] = q;
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e)
            if (v * V + e < P.n) mrow[v * V + e] = t[e];
        }
      }
    } else if (sm != 0) {
      const uint32_t base = gb + min(tb, r_ties);  // selected scores before this vector
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if (((sm >> e) & 1u) == 0) continue;
        const uint32_t pos = base + __popc(sm & ((1u << e) - 1u));
        const uint64_t comp = composite(key[c * V + e], v * V + e);
        if (staged) {
          stage[pos] = comp;
        } else {
          emit<T>(P, r, pos, comp);
        }
      }
    }
  }
  if constexpr (!kMask) {
    if (staged) {
      __syncwarp();
      if (take <= 32) {
        warp_staged_out<T, 1>(P, r, stage, take, lane, P.warp_sort != 0);
      } else {
        warp_staged_out<T, kSortMax / 32>(P, r, stage, take, lane, P.warp_sort != 0);
      }
    }
    pad_row<T>(P, r, take, lane, 32);
  }
}

// Rows of n <= kN (TopkTuning::kThreadMaxN) scores: a thread a row, 128 rows a CTA (a warp
// would hold such a row in one or two lanes). Each valid score's rank among the row's
// composites comes from the n(n-1)/2 pairwise key compares (among equal keys the smaller
// index ranks first); slots past L hold key 0 and rank below every valid score. A selected
// score (rank < take) is written at its rank: the output is sorted in either order.
template <typename T, bool kMask, int kN>
__global__ void __launch_bounds__(TopkTuning::kThreadRowsPerCta) thread_select_kernel(Params P) {
  begin_dependent_grid();
  const int64_t r = int64_t(blockIdx.x) * TopkTuning::kThreadRowsPerCta + threadIdx.x;
  if (r >= P.rows) return;
  const T* xr = static_cast<const T*>(P.x) + r * P.pitch;
  int64_t L64, take64;
  if (!row_budget<kMask>(P, r, L64, take64)) {
    mask_row_fill<T>(P, r, NAN, 0, 1);
    return;
  }
  const uint32_t L = static_cast<uint32_t>(L64), take = static_cast<uint32_t>(take64);
  uint32_t key[kN], rank[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    key[i] = static_cast<uint32_t>(i) < L ? float_key(to_float(xr[i])) ^ P.flip : 0u;
    rank[i] = 0;
  }
#pragma unroll
  for (int i = 1; i < kN; ++i)
#pragma unroll
    for (int j = 0; j < i; ++j) {  // j < i: i ranks first only with a larger key
      const bool i_first = key[i] > key[j];
      rank[j] += i_first ? 1u : 0u;
      rank[i] += i_first ? 0u : 1u;
    }
  if constexpr (kMask) {
    T* mrow = static_cast<T*>(P.out_mask) + r * P.n;
#pragma unroll
    for (int i = 0; i < kN; ++i)
      if (i < P.n) mrow[i] = static_cast<T>(rank[i] < take ? 1.0f : 0.0f);
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i)
      if (rank[i] < take) emit<T>(P, r, rank[i], composite(key[i], i));
    pad_row<T>(P, r, take, 0, 1);
  }
}

}  // namespace
}  // namespace fastlapsum
