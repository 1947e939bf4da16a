// The on-chip sort solver of DESIGN §1.1, shared by the short-row kernel (a whole row,
// short_rows_cuda.cu) and the long-row solver's sorted middle set (sorted_middle.cuh): one
// CTA sorts the finite scores in shared memory (a bucket pass by value, or CUB's block radix
// sort where the buckets would be crowded) and scans them.
//
// With f_j = e^{(s_j - s_{j-1})/t} over the descending scores, both §1.1 sums follow the
// affine recurrence x -> f_j (x + 1):
//   A'_j = sum_{first <= i < j} e^{(s_j - s_i)/t} = f_j (A'_{j-1} + 1)           (prefix)
//   R_j  = sum_{j <= i < end}   e^{(s_i - s_{j-1})/t} = f_j (R_{j+1} + 1)        (suffix)
// so one exponential per score, then two scans of affine maps (plain multiply-adds, one
// raking warp). Psi at each score s_j is (j - first) - A'_j / 2 + (1 + R_{j+1}) / 2; the
// first score where Psi >= k bounds the root's gap, which every thread then solves in
// closed form from the owner's coefficients. Scores outside the sorted ones (a middle
// set's tails) enter as the scans' starting values. Deterministic: fixed arrangement,
// fixed scan trees, and only integer max/and/or/sum reductions (the bucket pass's atomics
// order equal keys only, which are the same score). The scan's pieces (fold_maps,
// run_passes, gap_in_run) also serve the warp-per-row solver of warp_rows.cuh.
#pragma once

#include <cstdint>
#include <cstring>
#include <cfloat>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "../../common/lapsum_math.h"
#include "../../common/order_keys.h"
#include "warp_scan.cuh"

namespace fastlapsum {

constexpr int kSortedThreads = 512;
constexpr int kWarps = kSortedThreads / 32;
static_assert(kSortedThreads % 32 == 0 && kWarps <= 32, "block reductions read one value per warp in a lane");
// Radix digit width: 5 bits (cub's default is 4) sorts a middle set's ~20 varying bits in 4
// passes instead of 5; 6 bits do not fit 48 KB of static shared memory at 512 threads.
constexpr int kSortRadixBits = 5;

// The block sort of kItems keys per thread (sort_descending takes it).
template <typename Key, int kItems>
using BlockSort = cub::BlockRadixSort<Key, kSortedThreads, kItems, cub::NullType, kSortRadixBits>;

// The sort keys by score type: offset keys (order_keys.h), whose low bits stay zero for
// fp16/bf16 rows (widened to fp32), so the sort covers only their 16-19 meaningful bits.
// Rows with a NaN never reach the sort.
template <typename scalar_t>
struct SortKey {
  using Key = uint32_t;
  static constexpr int kBits = 32;
  using Score = float;  // a signed score, exactly (fp16/bf16 widen exactly)
  __device__ static Key key(double s) { return offset_key(static_cast<float>(s)); }
  __device__ static Key key(float s) { return offset_key(s); }
  __device__ static float score(Key k) { return offset_key_to_float(k); }
  __device__ static double value(Key k) { return static_cast<double>(score(k)); }
};

template <>
struct SortKey<double> {
  using Key = uint64_t;
  static constexpr int kBits = 64;
  using Score = double;
  __device__ static Key key(double s) { return offset_key(s); }
  __device__ static double score(Key k) { return offset_key_to_double(k); }
  __device__ static double value(Key k) { return score(k); }
};

// A thread's counts of a row's non-finite scores (settle_row's input).
struct NonFiniteCount {
  int nan = 0, pinf = 0, ninf = 0;
  template <typename Score>  // float or double
  __device__ __forceinline__ void add(Score s) {
    nan += s != s;
    pinf += s == Score(INFINITY);
    ninf += s == -Score(INFINITY);
  }
};

// What the solver needs to know about a row before sorting it.
template <typename Key>
struct Census {
  int nan, pinf, ninf;
  Key key_and, key_or;  // over the real scores: the bits where they differ need sorting
  Key key_min, key_max;  // the finite scores' range (bucket_sort_descending, the outer gap)
};

// A thread's running and/or of its keys and min/max of its finite ones, the census's input.
template <typename Key>
struct KeyStats {
  Key all = ~Key(0), any = 0, min = ~Key(0), max = 0;  // and, or, min, max
  __device__ __forceinline__ void add(Key k, bool finite = true) {
    all &= k;
    any |= k;
    min = finite && k < min ? k : min;
    max = finite && k > max ? k : max;
  }
};

template <typename Key>
struct CensusStorage {
  uint32_t counts[kWarps];
  Key key_and[kWarps], key_or[kWarps], key_min[kWarps], key_max[kWarps];
};

// Block-wide census from each thread's counts (< 1024 per warp: packed 10 bits a field)
// and key and/or/min/max. Every thread gets the totals.
template <typename Key>
__device__ __forceinline__ Census<Key> take_census(CensusStorage<Key>& st, int nan, int pinf, int ninf,
                                                   const KeyStats<Key>& keys) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t packed = warp_sum(uint32_t(nan) | uint32_t(pinf) << 10 | uint32_t(ninf) << 20);
  const Key key_and = warp_and(keys.all), key_or = warp_or(keys.any), key_min = warp_min(keys.min),
            key_max = warp_max(keys.max);
  if (lane == 0) {
    st.counts[warp] = packed;
    st.key_and[warp] = key_and;
    st.key_or[warp] = key_or;
    st.key_min[warp] = key_min;
    st.key_max[warp] = key_max;
  }
  __syncthreads();
  const bool mine = lane < kWarps;
  const uint32_t p = mine ? st.counts[lane] : 0u;
  Census<Key> c;
  c.nan = static_cast<int>(warp_sum(p & 1023u));
  c.pinf = static_cast<int>(warp_sum((p >> 10) & 1023u));
  c.ninf = static_cast<int>(warp_sum(p >> 20));
  c.key_and = warp_and(mine ? st.key_and[lane] : ~Key(0));
  c.key_or = warp_or(mine ? st.key_or[lane] : Key(0));
  c.key_min = warp_min(mine ? st.key_min[lane] : ~Key(0));
  c.key_max = warp_max(mine ? st.key_max[lane] : Key(0));
  return c;
}

// Bucket sort by value. The sets the solver sorts are mostly spread evenly over their range
// (a middle set around the root, the bulk of a row), so one pass into about a bucket per key
// (by value, so monotone), then each key's rank inside its few-key bucket by counting,
// replaces the radix sort's passes (each ~1.7-3.5K cycles at 512 threads: the radix sort is
// most of a short row's or a middle set's on-chip solve). A bucket of more than kMaxBucket
// keys (ties, clusters, outliers that squeeze the bulk into a few buckets) or infinities send
// the keys to the radix sort instead.
constexpr int kMaxBucket = 32;

template <typename Key, int kItems>
struct BucketStorage {
  static constexpr int kBuckets = kSortedThreads * (kItems < 8 ? kItems : 8);
  static constexpr int kPerThread = kBuckets / kSortedThreads;  // consecutive buckets a thread scans
  uint32_t packed[kBuckets / 2];  // 16-bit counts, then first positions: two buckets a word
  Key keys[kSortedThreads * kItems];
  typename cub::BlockScan<uint32_t, kSortedThreads>::TempStorage scan;
};
static_assert(kSortedThreads * 16 <= 0xffff, "16-bit bucket counts and positions");

template <typename Key, int kItems>
union SortStorage {
  typename BlockSort<Key, kItems>::TempStorage radix;
  BucketStorage<Key, kItems> bucket;
};

// The striped keys at positions [0, count) sorted descending into the blocked arrangement,
// or false (nothing changed) where bucket_sort's premise fails. Uniform across the block.
template <typename Key, typename SK, int kItems>
__device__ __forceinline__ bool bucket_sort_descending(BucketStorage<Key, kItems>& st, Key (&keys)[kItems], int count,
                                                       const Census<Key>& c) {
  using S = BucketStorage<Key, kItems>;
  constexpr int kB = S::kBuckets, kP = S::kPerThread;
  static_assert(kP % 2 == 0, "a thread's buckets are whole words");
  const int tid = threadIdx.x;
  const double hi = SK::value(c.key_max), lo = SK::value(c.key_min);
  const double scale = static_cast<double>(kB) / (hi - lo);  // hi > lo: the keys vary
  if (c.pinf + c.ninf != 0 || !(scale > 0.0 && scale <= DBL_MAX)) return false;
  const auto bucket_of = [&](Key key) {
    const double d = (hi - SK::value(key)) * scale;  // monotone in the value: rounding keeps order
    return d < static_cast<double>(kB) ? static_cast<int>(d) : kB - 1;
  };
  const auto field = [&](int b) { return (st.packed[b >> 1] >> ((b & 1) * 16)) & 0xffffu; };
  for (int w = tid; w < kB / 2; w += kSortedThreads) st.packed[w] = 0;
  __syncthreads();
  // Per key: its bucket (high half) and its rank in the bucket, then its position in st.keys
  // (low half); all of a thread's atomics go out together.
  uint32_t at[kItems];
#pragma unroll
  for (int q = 0; q < kItems; ++q) at[q] = static_cast<uint32_t>(bucket_of(keys[q])) << 16;
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    if (q * kSortedThreads + tid >= count) continue;
    const uint32_t b = at[q] >> 16, shift = (b & 1) * 16;
    at[q] |= (atomicAdd(&st.packed[b >> 1], 1u << shift) >> shift) & 0xffffu;
  }
  __syncthreads();
  uint32_t n_in[kP], sum = 0, most = 0;
#pragma unroll
  for (int w = 0; w < kP / 2; ++w) {
    const uint32_t p = st.packed[tid * (kP / 2) + w];
    n_in[2 * w] = p & 0xffffu;
    n_in[2 * w + 1] = p >> 16;
  }
#pragma unroll
  for (int i = 0; i < kP; ++i) {
    sum += n_in[i];
    most = n_in[i] > most ? n_in[i] : most;
  }
  uint32_t first;
  cub::BlockScan<uint32_t, kSortedThreads>(st.scan).ExclusiveSum(sum, first);
  if (__syncthreads_or(most > kMaxBucket)) return false;  // the radix sort may reuse st now
#pragma unroll
  for (int w = 0; w < kP / 2; ++w) {
    const uint32_t second = first + n_in[2 * w];
    st.packed[tid * (kP / 2) + w] = first | second << 16;
    first = second + n_in[2 * w + 1];
  }
  __syncthreads();
  // Into the buckets in arrival order, then each key to its place: after the keys above it
  // and the equal ones that arrived before it (equal keys are the same score: any order).
  // A key alone in its bucket (most of them) is in place already.
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    if (q * kSortedThreads + tid >= count) continue;
    at[q] += field(at[q] >> 16);
    st.keys[at[q] & 0xffffu] = keys[q];
  }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    if (q * kSortedThreads + tid >= count) continue;
    const int b = at[q] >> 16;
    const unsigned slot = at[q] & 0xffffu, begin = field(b);
    const unsigned end = b + 1 < kB ? field(b + 1) : static_cast<unsigned>(count);
    if (end - begin < 2) continue;
    unsigned place = begin;
    for (unsigned j = begin; j < end; ++j) {
      const Key other = st.keys[j];
      place += other > keys[q] || (other == keys[q] && j < slot);
    }
    at[q] = (at[q] & 0xffff0000u) | place;
  }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < kItems; ++q)
    if (q * kSortedThreads + tid < count) st.keys[at[q] & 0xffffu] = keys[q];
  __syncthreads();
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const int j = tid * kItems + q;
    keys[q] = j < count ? st.keys[j] : c.key_and;
  }
  return true;
}

// Pads the striped positions at and past `count` with the and of the real keys (no bit
// beyond theirs, so it sorts at or after the smallest score, a tie meaning equal keys), then
// sorts the keys descending on the bits where they differ, into the blocked arrangement
// (thread tid holds tid * kItems + q): by bucket where the keys spread evenly, else by radix
// on the varying bits. Equal keys need no sort.
template <typename Key, typename SK, int kItems, typename Count>
__device__ __forceinline__ void sort_descending(SortStorage<Key, kItems>& storage, Key (&keys)[kItems], Count count,
                                                const Census<Key>& c) {
#pragma unroll
  for (int q = 0; q < kItems; ++q)
    if (q * kSortedThreads + static_cast<int>(threadIdx.x) >= count) keys[q] = c.key_and;
  const Key varying = c.key_and ^ c.key_or;
  if (varying == 0) return;
  if (bucket_sort_descending<Key, SK, kItems>(storage.bucket, keys, static_cast<int>(count), c)) return;
  int lo_bit, hi_bit;
  if constexpr (sizeof(Key) == 8) {
    lo_bit = __ffsll(static_cast<long long>(varying)) - 1;
    hi_bit = 64 - __clzll(static_cast<long long>(varying));
  } else {
    lo_bit = __ffs(static_cast<int>(varying)) - 1;
    hi_bit = 32 - __clz(static_cast<int>(varying));
  }
  BlockSort<Key, kItems>(storage.radix).SortDescending(keys, lo_bit, hi_bit);
}

// The affine-map scans over thread aggregates: one warp rakes kRake consecutive threads per
// lane. Thread t's slot is [t % kRake][t / kRake]; rows padded to 33 against bank conflicts.
constexpr int kRake = kSortedThreads / 32;
struct ScanStorage {
  double a[kRake][33];   // product of the thread's f (the maps' common slope)
  double fc[kRake][33];  // forward offset in, entering prefix value out
  double rc[kRake][33];  // reverse offset in, entering suffix value out
  double x0, y0;         // the values entering position 0 from below and the last from above
};

// Given each thread's composite maps x -> a x + fc (its positions in increasing order) and
// x -> a x + rc (decreasing order), returns the value entering the thread from below
// (prefix, start st.x0 at position 0) and from above (suffix, start st.y0 past the last
// position); the caller sets x0 and y0 before the call. Fixed order: serial per lane, then a
// Kogge-Stone warp scan.
__device__ __forceinline__ void scan_affine(ScanStorage& st, double a, double fc, double rc, double* x_in,
                                            double* y_in) {
  const int tid = threadIdx.x;
  const int row = tid % kRake, col = tid / kRake;
  st.a[row][col] = a;
  st.fc[row][col] = fc;
  st.rc[row][col] = rc;
  __syncthreads();
  if (tid < 32) {
    const int lane = tid;
    double ga = 1.0, gc = 0.0, hc = 0.0;  // the lane's run: forward map (ga, gc), reverse (ga, hc)
#pragma unroll
    for (int i = 0; i < kRake; ++i) {
      gc = fma(st.a[i][lane], gc, st.fc[i][lane]);
      ga *= st.a[i][lane];
    }
#pragma unroll
    for (int i = kRake - 1; i >= 0; --i) hc = fma(st.a[i][lane], hc, st.rc[i][lane]);
    double x, y;  // what enters the lane's run from below and from above
    warp_enter_maps(ga, gc, hc, st.x0, st.y0, &x, &y);
#pragma unroll
    for (int i = 0; i < kRake; ++i) {
      const double in = x;
      x = fma(st.a[i][lane], x, st.fc[i][lane]);
      st.fc[i][lane] = in;
    }
#pragma unroll
    for (int i = kRake - 1; i >= 0; --i) {
      const double in = y;
      y = fma(st.a[i][lane], y, st.rc[i][lane]);
      st.rc[i][lane] = in;
    }
  }
  __syncthreads();
  *x_in = st.fc[row][col];
  *y_in = st.rc[row][col];
}

// Scores outside the sorted ones, all above / below them (a middle set's tails; zero for a
// whole row): above_count scores with above_sum = sum e^{(above_ref - s)/t}, above_ref at or
// above every sorted score and at or below each of them; below_sum = sum e^{(s - below_ref)/t}
// likewise.
struct SortedTails {
  double above_count, above_sum, above_ref, below_sum, below_ref;
};

// The gap that holds the root, as solve_interval's arguments (C = above_count + j - first):
// the first position j with Psi(s_j) >= k, or j = end (below every finite score).
struct Gap {
  double A, B, hi, lo;
};

// One thread's (or lane's) run of kItems consecutive sorted positions j0 + q folded into one
// map each way. The map at j is x -> f_j x + f_j inside (first, end), the identity elsewhere,
// with f_j = e^{(s_j - s_{j-1})/t} in [0, 1] (equal scores give exactly 1); composed upward
// x -> fa x + fc, and downward x -> fa x + rc with rc = sum_{q inside} prod_{p <= q} f_p.
// v_before = s_{j0 - 1}. Summed as the scores come: no per-score arrays (registers).
template <typename Key, typename SK, int kItems>
__device__ __forceinline__ void fold_maps(const Key (&keys)[kItems], double v_before, int j0, int first, int end,
                                          const GapExp& e, double* fa, double* fc, double* rc) {
  double a = 1.0, up = 0.0, down = 0.0;
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const bool inside = j0 + q > first && j0 + q < end;
    const double f = e(inside ? SK::value(keys[q]) - (q > 0 ? SK::value(keys[q - 1]) : v_before) : 0.0);
    up = fma(f, up, inside ? f : 0.0);
    a *= f;
    down += inside ? a : 0.0;
  }
  *fa = a;
  *fc = up;
  *rc = down;
}

// Psi at position j of the sorted scores: C_j - A'_j / 2 + Q_j / 2 (see solve_sorted).
__device__ __forceinline__ double psi_sorted(double C, double a_prime, double q) { return C - 0.5 * a_prime + 0.5 * q; }

// Does Psi pass k at the position just before a run of positions [j0, ...) (the run's maps
// (fa, fc, rc), x = A'_{j0 - 1} and y = R past the run entering it)? A run with no finite
// score counts as passing, one whose first position is at or before first as failing.
__device__ __forceinline__ bool run_passes(int j0, int first, int end, double above_count, double x, double fa,
                                           double rc, double y, double kf) {
  if (j0 >= end) return true;
  if (j0 - 1 < first) return false;
  return psi_sorted(above_count + static_cast<double>(j0 - 1 - first), x, 1.0 + fma(fa, y, rc)) >= kf;
}

// The root's gap inside the run of `count` <= kMaxCount <= kLanes positions o0 + lane that
// owns it (the last run whose test before it fails), walked a lane each: lane q of the group
// holds the key at o0 + q (lanes >= count: ignored), x = A'_{o0 - 1}, y = R_{o0 + count},
// v_before = s_{o0 - 1} (each the same in every lane). Every lane computes its candidate
// (*gap, *C); returns the group lane whose candidate holds (the same in every lane). The
// whole group calls.
template <typename Key, typename SK, int kLanes = 32, int kMaxCount = kLanes>
__device__ __forceinline__ int gap_in_run(Key key, int o0, int count, double x, double y, double v_before, int first,
                                          int end, double kf, const SortedTails& tails, const GapExp& e, Gap* gap,
                                          double* C) {
  using G = LaneGroup<kLanes>;
  const int lane = G::lane(), j = o0 + lane;
  const bool mine = lane < count;
  // Lane q's map, then the affine scans of the lanes' maps upward (A'_j) and downward (R_j).
  const double vq = mine ? SK::value(key) : 0.0;
  double vp = G::up(vq, 1);
  if (lane == 0) vp = v_before;
  const bool in = mine && j > first && j < end;
  const double f = in ? e(vq - vp) : 1.0;
  double ua = f, uc = in ? f : 0.0, da = ua, dc = uc;
  // Lanes at and past count hold the identity: the scans need kMaxCount lanes' steps only
  // (the up scan is read below count; the down scan at count, where it is the identity).
  warp_scan_maps<kLanes, kMaxCount>(ua, uc, da, dc);
  const double a_j = fma(ua, x, uc);          // A'_j
  double a_prev = G::up(a_j, 1);              // A'_{j-1}
  if (lane == 0) a_prev = x;
  const double r_j = fma(da, y, dc);          // R_j (lanes past count: identity)
  double q_j = 1.0 + G::down(r_j, 1);         // Q_j = 1 + R_{j+1}
  if (lane == kLanes - 1) q_j = 1.0 + y;
  const auto C_at = [&](int i) { return tails.above_count + static_cast<double>(i - first); };
  const bool valid = mine && j >= first && j < end;
  // The next run's test passed at this run's last position, so it is the candidate when
  // rounding fails it here; the run that holds end - 1 stands for j = end.
  const bool last = lane == count - 1 && o0 + count < end;
  const unsigned hit = G::ballot(valid && (psi_sorted(C_at(j), a_j, q_j) >= kf || last));
  const unsigned ends_here = G::ballot(valid && j == end - 1);
  if (hit == 0u) {  // below every finite score: j = end
    *C = C_at(end);
    *gap = tails.below_sum > 0.0 ? Gap{1.0 + a_j, tails.below_sum, vq, tails.below_ref}
                                 : Gap{1.0 + a_j, 0.0, vq, -INFINITY};
  } else {
    *C = C_at(j);
    *gap = j > first                ? Gap{1.0 + a_prev, q_j, vp, vq}
           : tails.above_count > 0.0 ? Gap{tails.above_sum, q_j, tails.above_ref, vq}
                                     : Gap{0.0, q_j, INFINITY, vq};
  }
  return __ffs(hit != 0u ? hit : ends_here) - 1;  // one of them is set
}

// Shared memory of the solve: `scan` and after it may alias the sort's storage (the first
// barrier of solve_sorted ends the sort's use of it); last_v must not.
struct SolveStorage {
  ScanStorage scan;
  int last_failing[kWarps];  // per warp: the last thread whose first position's Psi test fails
  uint64_t walk_keys[32];    // the owner's keys, and what enters them from below and above
  double walk_x, walk_y, walk_v_before;
  Gap gap;  // the root's gap and C
  double C;
};

// The §1.1 solve on the finite sorted scores at positions [first, end) of the blocked
// arrangement (thread tid holds tid * kItems + q), first < end, with the tails outside them.
// Returns b; every thread gets it. last_v: each warp's last sorted score, for the next
// warp's first f.
//
// Psi at position j (at s_j) is C_j - A'_j / 2 + Q_j / 2 with C_j = above_count + j - first
// and Q_j = 1 + R_{j+1}; it grows with j, and the root's gap lies just above the first j
// with Psi >= k. Each thread folds its maps into one (fold_maps), the scans give what
// enters each thread, and each thread tests the position before its first, where A' and R
// are known from those alone. The last thread whose test fails owns the first passing
// position (or, owning end - 1, stands for j = end); one warp then walks its scores, a lane
// each (gap_in_run).
template <typename Key, typename SK, int kItems>
__device__ __forceinline__ double solve_sorted(SolveStorage& st, double (&last_v)[kWarps], const Key (&keys)[kItems],
                                               int first, int end, double kf, double t, const SortedTails& tails) {
  static_assert(kItems <= 32, "the owner's scores are walked a lane each");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int j0 = tid * kItems;
  const GapExp e(t);
  // s_{j0 - 1}: the previous thread's last score.
  double v_before = __shfl_up_sync(kFullMask, SK::value(keys[kItems - 1]), 1);
  if (lane == 31) last_v[warp] = SK::value(keys[kItems - 1]);
  __syncthreads();
  if (lane == 0 && warp > 0) v_before = last_v[warp - 1];

  double fa, fc, rc;
  fold_maps<Key, SK, kItems>(keys, v_before, j0, first, end, e, &fa, &fc, &rc);
  // The tails start the scans: A'_first = sum_above e^{(s_first - s)/t}, and past end - 1
  // R_end = sum_below e^{(s - s_{end-1})/t} (after the barrier above: st may alias the sort's).
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    if (j0 + q == first)
      st.scan.x0 = tails.above_sum > 0.0 ? tails.above_sum * e(SK::value(keys[q]) - tails.above_ref) : 0.0;
    if (j0 + q == end - 1)
      st.scan.y0 = tails.below_sum > 0.0 ? tails.below_sum * e(tails.below_ref - SK::value(keys[q])) : 0.0;
  }
  double x, y;  // A'_{j0 - 1} and R_{j0 + kItems}
  scan_affine(st.scan, fa, fc, rc, &x, &y);

  const bool pass = run_passes(j0, first, end, tails.above_count, x, fa, rc, y, kf);
  const int failing = warp_max(pass ? -1 : tid);
  if (lane == 0) st.last_failing[warp] = failing;
  __syncthreads();
  const int owner = warp_max(lane < kWarps ? st.last_failing[lane] : -1);  // >= 0: thread 0 fails
  if (tid == owner) {
#pragma unroll
    for (int q = 0; q < kItems; ++q) st.walk_keys[q] = keys[q];
    st.walk_x = x;
    st.walk_y = y;
    st.walk_v_before = v_before;
  }
  __syncthreads();
  if (warp == 0) {
    const Key key = lane < kItems ? static_cast<Key>(st.walk_keys[lane]) : Key(0);
    Gap gap;
    double C;
    const int lead = gap_in_run<Key, SK, 32, kItems>(key, owner * kItems, kItems, st.walk_x, st.walk_y,
                                                     st.walk_v_before, first, end, kf, tails, e, &gap, &C);
    if (lane == lead) {
      st.gap = gap;
      st.C = C;
    }
  }
  __syncthreads();
  const Gap g = st.gap;
  return solve_interval(st.C, g.A, g.B, g.hi, g.lo, kf, t);
}

}  // namespace fastlapsum
