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
// order equal keys only, which are the same score).
#pragma once

#include <cstdint>
#include <cstring>
#include <cfloat>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>

#include "../../common/lapsum_math.h"

namespace fastlapsum {

constexpr int kSortedThreads = 512;
constexpr int kWarps = kSortedThreads / 32;
static_assert(kSortedThreads % 32 == 0 && kWarps <= 32, "block reductions read one value per warp in a lane");
// Radix digit width: 5 bits (cub's default is 4) sorts a middle set's ~20 varying bits in 4
// passes instead of 5; 6 bits do not fit 48 KB of static shared memory at 512 threads.
constexpr int kSortRadixBits = 5;
constexpr unsigned kFullMask = 0xffffffffu;

// The block sort of kItems keys per thread (sort_descending takes it).
template <typename Key, int kItems>
using BlockSort = cub::BlockRadixSort<Key, kSortedThreads, kItems, cub::NullType, kSortRadixBits>;

// Order-preserving sort keys: the sign-magnitude bits recentred as an offset integer
// (0x80..0 +- magnitude). Unlike a sign-flip key, trailing zero bits of the magnitude stay
// zero for negative scores, so fp16/bf16 rows (widened to fp32) sort only their 16-19
// meaningful bits. -0 and +0 share a key; rows with a NaN never reach the sort.
template <typename scalar_t>
struct SortKey {
  using Key = uint32_t;
  static constexpr int kBits = 32;
  __device__ static Key key(double s) {
    const float f = static_cast<float>(s);
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    const uint32_t mag = u & 0x7fffffffu;
    return (u >> 31) ? 0x80000000u - mag : 0x80000000u + mag;
  }
  __device__ static double value(Key k) {
    const uint32_t u = k < 0x80000000u ? 0x80000000u | (0x80000000u - k) : k - 0x80000000u;
    float f;
    memcpy(&f, &u, sizeof(f));
    return static_cast<double>(f);
  }
};

template <>
struct SortKey<double> {
  using Key = uint64_t;
  static constexpr int kBits = 64;
  static constexpr uint64_t kMid = 0x8000000000000000ull;
  __device__ static Key key(double s) {
    uint64_t u;
    memcpy(&u, &s, sizeof(u));
    const uint64_t mag = u & (kMid - 1);
    return (u >> 63) ? kMid - mag : kMid + mag;
  }
  __device__ static double value(Key k) {
    const uint64_t u = k < kMid ? kMid | (kMid - k) : k - kMid;
    double d;
    memcpy(&d, &u, sizeof(d));
    return d;
  }
};

// Warp-wide integer reductions (one REDUX on sm_80+; a butterfly before).
template <typename T, typename Op>
__device__ __forceinline__ T warp_fold(T x, Op op) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) x = op(x, __shfl_xor_sync(kFullMask, x, d));
  return x;
}
__device__ __forceinline__ uint32_t warp_sum(uint32_t x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_add_sync(kFullMask, x);
#else
  return warp_fold(x, [](uint32_t a, uint32_t b) { return a + b; });
#endif
}
__device__ __forceinline__ uint32_t warp_and(uint32_t x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_and_sync(kFullMask, x);
#else
  return warp_fold(x, [](uint32_t a, uint32_t b) { return a & b; });
#endif
}
__device__ __forceinline__ uint32_t warp_or(uint32_t x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_or_sync(kFullMask, x);
#else
  return warp_fold(x, [](uint32_t a, uint32_t b) { return a | b; });
#endif
}
__device__ __forceinline__ uint64_t warp_and(uint64_t x) {
  return (uint64_t(warp_and(uint32_t(x >> 32))) << 32) | warp_and(uint32_t(x));
}
__device__ __forceinline__ uint64_t warp_or(uint64_t x) {
  return (uint64_t(warp_or(uint32_t(x >> 32))) << 32) | warp_or(uint32_t(x));
}
__device__ __forceinline__ int warp_max(int x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_max_sync(kFullMask, x);
#else
  return static_cast<int>(warp_fold(static_cast<uint32_t>(x), [](uint32_t a, uint32_t b) {
    return static_cast<int>(a) > static_cast<int>(b) ? a : b;
  }));
#endif
}
__device__ __forceinline__ uint32_t warp_min(uint32_t x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_min_sync(kFullMask, x);
#else
  return warp_fold(x, [](uint32_t a, uint32_t b) { return a < b ? a : b; });
#endif
}
__device__ __forceinline__ uint32_t warp_max(uint32_t x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_max_sync(kFullMask, x);
#else
  return warp_fold(x, [](uint32_t a, uint32_t b) { return a > b ? a : b; });
#endif
}
__device__ __forceinline__ uint64_t warp_min(uint64_t x) {
  return warp_fold(x, [](uint64_t a, uint64_t b) { return a < b ? a : b; });
}
__device__ __forceinline__ uint64_t warp_max(uint64_t x) {
  return warp_fold(x, [](uint64_t a, uint64_t b) { return a > b ? a : b; });
}
// What the solver needs to know about a row before sorting it.
template <typename Key>
struct Census {
  int nan, pinf, ninf;
  Key key_and, key_or;  // over the real scores: the bits where they differ need sorting
  Key key_min, key_max;  // and their range (bucket_sort_descending)
};

// A thread's running and/or/min/max of its keys, the census's input.
template <typename Key>
struct KeyStats {
  Key all = ~Key(0), any = 0, min = ~Key(0), max = 0;  // and, or, min, max
  __device__ __forceinline__ void add(Key k) {
    all &= k;
    any |= k;
    min = k < min ? k : min;
    max = k > max ? k : max;
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
    double ha = ga;
    // (a1, c1) then (a2, c2) = (a1 a2, a2 c1 + c2); forward runs up the lanes, reverse down.
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const double ua = __shfl_up_sync(kFullMask, ga, d), uc = __shfl_up_sync(kFullMask, gc, d);
      const double da = __shfl_down_sync(kFullMask, ha, d), dc = __shfl_down_sync(kFullMask, hc, d);
      if (lane >= d) {
        gc = fma(ga, uc, gc);
        ga *= ua;
      }
      if (lane + d < 32) {
        hc = fma(ha, dc, hc);
        ha *= da;
      }
    }
    // The value entering a lane is the composite map of the lanes before it applied to the
    // start (sums of nonnegative terms: no cancellation).
    const double x0 = st.x0, y0 = st.y0;
    const double xa = __shfl_up_sync(kFullMask, ga, 1), xc = __shfl_up_sync(kFullMask, gc, 1);
    const double ya = __shfl_down_sync(kFullMask, ha, 1), yc = __shfl_down_sync(kFullMask, hc, 1);
    double x = lane == 0 ? x0 : fma(xa, x0, xc), y = lane == 31 ? y0 : fma(ya, y0, yc);
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
// with Psi >= k. Each thread folds its maps into one (no per-score arrays: registers), the
// scans give what enters each thread, and each thread tests the position before its first,
// where A' and R are known from those alone. The last thread whose test fails owns the
// first passing position (or, owning end - 1, stands for j = end); one warp then walks its
// scores, a lane each.
template <typename Key, typename SK, int kItems>
__device__ __forceinline__ double solve_sorted(SolveStorage& st, double (&last_v)[kWarps], const Key (&keys)[kItems],
                                               int first, int end, double kf, double t, const SortedTails& tails) {
  static_assert(kItems <= 32, "the owner's scores are walked a lane each");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int j0 = tid * kItems;
  // (d s) / (t s) for the exponents: a power-of-two s lifts a subnormal t, whose reciprocal
  // inv_temperature caps (right for the mask's 0 * inv_t, wrong for these differences).
  const double scale = t < 0x1p-960 ? 0x1p64 : 1.0;
  const double inv_ts = 1.0 / (t * scale);
  const auto v = [&](int q) { return SK::value(keys[q]); };
  const auto inside = [&](int j) { return j > first && j < end; };
  // s_{j0 - 1}: the previous thread's last score.
  double v_before = __shfl_up_sync(kFullMask, v(kItems - 1), 1);
  if (lane == 31) last_v[warp] = v(kItems - 1);
  __syncthreads();
  if (lane == 0 && warp > 0) v_before = last_v[warp - 1];

  // The map at j: x -> f_j x + f_j inside (first, end), the identity elsewhere; f_j in [0, 1]
  // (the difference is <= 0 and inv_ts finite > 0: never NaN; equal scores give exactly 1).
  // The thread's maps composed upward (fc) and downward: x -> fa x + rc with
  // rc = sum_{q inside} prod_{p <= q} f_p, both summed as the scores come.
  double fa = 1.0, fc = 0.0, rc = 0.0;
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const double f = exp(inside(j0 + q) ? (v(q) - (q > 0 ? v(q - 1) : v_before)) * scale * inv_ts : 0.0);
    fc = fma(f, fc, inside(j0 + q) ? f : 0.0);
    fa *= f;
    rc += inside(j0 + q) ? fa : 0.0;
  }
  // The tails start the scans: A'_first = sum_above e^{(s_first - s)/t}, and past end - 1
  // R_end = sum_below e^{(s - s_{end-1})/t} (after the barrier above: st may alias the sort's).
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    if (j0 + q == first)
      st.scan.x0 = tails.above_sum > 0.0 ? tails.above_sum * exp((v(q) - tails.above_ref) * scale * inv_ts) : 0.0;
    if (j0 + q == end - 1)
      st.scan.y0 = tails.below_sum > 0.0 ? tails.below_sum * exp((tails.below_ref - v(q)) * scale * inv_ts) : 0.0;
  }
  double x, y;  // A'_{j0 - 1} and R_{j0 + kItems}
  scan_affine(st.scan, fa, fc, rc, &x, &y);

  // Psi at s_{j0 - 1} >= k? A thread with no finite score counts as passing, one whose first
  // position is at or before first as failing.
  const auto C = [&](int j) { return tails.above_count + static_cast<double>(j - first); };
  bool pass = j0 >= end;
  if (j0 - 1 >= first && j0 < end) pass = C(j0 - 1) - 0.5 * x + 0.5 * (1.0 + fma(fa, y, rc)) >= kf;
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
    // Lane q holds the owner's position j = o0 + q: its map, then the affine scans of the
    // lanes' maps upward (A'_j) and downward (R_j), one shuffle tree each.
    const int o0 = owner * kItems, j = o0 + lane;
    const bool mine = lane < kItems;
    const double vq = mine ? SK::value(static_cast<Key>(st.walk_keys[lane])) : 0.0;
    double vp = __shfl_up_sync(kFullMask, vq, 1);
    if (lane == 0) vp = st.walk_v_before;
    const bool in = mine && inside(j);
    const double f = in ? exp((vq - vp) * scale * inv_ts) : 1.0;
    double ua = f, uc = in ? f : 0.0, da = ua, dc = uc;  // upward and downward composites
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const double pa = __shfl_up_sync(kFullMask, ua, d), pc = __shfl_up_sync(kFullMask, uc, d);
      const double na = __shfl_down_sync(kFullMask, da, d), nc = __shfl_down_sync(kFullMask, dc, d);
      if (lane >= d) {  // (earlier lanes first) then this one
        uc = fma(ua, pc, uc);
        ua *= pa;
      }
      if (lane + d < 32) {  // (later lanes first, downward) then this one
        dc = fma(da, nc, dc);
        da *= na;
      }
    }
    const double a_j = fma(ua, st.walk_x, uc);                          // A'_j
    double a_prev = __shfl_up_sync(kFullMask, a_j, 1);                  // A'_{j-1}
    if (lane == 0) a_prev = st.walk_x;
    const double r_j = fma(da, st.walk_y, dc);                          // R_j (lanes past kItems: identity)
    double q_j = 1.0 + __shfl_down_sync(kFullMask, r_j, 1);             // Q_j = 1 + R_{j+1}
    if (lane == 31) q_j = 1.0 + st.walk_y;
    const bool valid = mine && j >= first && j < end;
    // The next thread's test passed at the owner's last position, so it is the candidate
    // when rounding fails it here; the owner of end - 1 stands for j = end.
    const bool last = lane == kItems - 1 && o0 + kItems < end;
    const unsigned hit = __ballot_sync(kFullMask, valid && (C(j) - 0.5 * a_j + 0.5 * q_j >= kf || last));
    const unsigned ends_here = __ballot_sync(kFullMask, valid && j == end - 1);
    const int lead = __ffs(hit != 0u ? hit : ends_here) - 1;  // one of them is set
    if (lane == lead) {
      if (hit == 0u) {  // below every finite score: j = end
        st.C = C(end);
        st.gap = tails.below_sum > 0.0 ? Gap{1.0 + a_j, tails.below_sum, vq, tails.below_ref}
                                       : Gap{1.0 + a_j, 0.0, vq, -INFINITY};
      } else {
        st.C = C(j);
        st.gap = j > first                ? Gap{1.0 + a_prev, q_j, vp, vq}
                 : tails.above_count > 0.0 ? Gap{tails.above_sum, q_j, tails.above_ref, vq}
                                           : Gap{0.0, q_j, INFINITY, vq};
      }
    }
  }
  __syncthreads();
  const Gap g = st.gap;
  return solve_interval(st.C, g.A, g.B, g.hi, g.lo, kf, t);
}

}  // namespace fastlapsum
