// Short rows on chip: one CTA per row runs the whole sort solver of DESIGN §1.1 and,
// for the forward op, writes the mask in the same kernel (one read of the row to solve,
// one re-read from L2 and one write for the mask).
//
// One census of the row (non-finite counts, and which key bits vary) settles the rows
// without an interior root and bounds the radix sort to the varying bits. The finite
// scores are sorted descending in shared memory (CUB block radix sort); with
// f_j = e^{(s_j - s_{j-1})/t}, both §1.1 sums follow the affine recurrence x -> f_j (x + 1):
//   A'_j = sum_{first <= i < j} e^{(s_j - s_i)/t} = f_j (A'_{j-1} + 1)           (prefix)
//   R_j  = sum_{j <= i < end}   e^{(s_i - s_{j-1})/t} = f_j (R_{j+1} + 1)        (suffix)
// so one exponential per score, then two scans of affine maps (plain multiply-adds, one
// raking warp). Psi at each score s_j is (j - first) - A'_j / 2 + (1 + R_{j+1}) / 2; the
// first score where Psi >= k bounds the root's gap, which every thread then solves in
// closed form from the owner's coefficients. Deterministic: fixed arrangement, fixed
// scan trees, and only integer min/and/or/sum reductions.
#include <ATen/Dispatch.h>

#include <cfloat>
#include <climits>
#include <cstdint>
#include <cub/block/block_radix_sort.cuh>

#include "../common/cuda_launch.cuh"
#include "../common/gpu_rows.cuh"
#include "threshold_cuda.h"

namespace fastlapsum {
namespace {

constexpr int kShortThreads = 512;
constexpr int kWarps = kShortThreads / 32;
static_assert(kShortThreads % 32 == 0 && kWarps <= 32, "block reductions read one value per warp in a lane");
// cub's default digit width: 5 bits saves a pass in 8 but costs twice the counter
// traffic per pass (and 6 bits does not fit 48 KB of static shared memory at 512 threads).
constexpr int kSortRadixBits = 4;
constexpr unsigned kFullMask = 0xffffffffu;

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
template <typename Op>
__device__ __forceinline__ uint32_t warp_fold(uint32_t x, Op op) {
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
__device__ __forceinline__ int warp_min(int x) {
#if __CUDA_ARCH__ >= 800
  return __reduce_min_sync(kFullMask, x);
#else
  return static_cast<int>(warp_fold(static_cast<uint32_t>(x), [](uint32_t a, uint32_t b) {
    return static_cast<int>(a) < static_cast<int>(b) ? a : b;
  }));
#endif
}

// What the solver needs to know about a row before sorting it.
template <typename Key>
struct Census {
  int nan, pinf, ninf;
  Key key_and, key_or;  // over the real scores: the bits where they differ need sorting
};

template <typename Key>
struct CensusStorage {
  uint32_t counts[kWarps];
  Key key_and[kWarps], key_or[kWarps];
};

// Block-wide census from each thread's counts (< 1024 per warp: packed 10 bits a field)
// and key and/or. Every thread gets the totals.
template <typename Key>
__device__ __forceinline__ Census<Key> take_census(CensusStorage<Key>& st, int nan, int pinf, int ninf, Key key_and,
                                                   Key key_or) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t packed = warp_sum(uint32_t(nan) | uint32_t(pinf) << 10 | uint32_t(ninf) << 20);
  key_and = warp_and(key_and);
  key_or = warp_or(key_or);
  if (lane == 0) {
    st.counts[warp] = packed;
    st.key_and[warp] = key_and;
    st.key_or[warp] = key_or;
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
  return c;
}

// The affine-map scans over thread aggregates: one warp rakes kRake consecutive threads per
// lane. Thread t's slot is [t % kRake][t / kRake]; rows padded to 33 against bank conflicts.
constexpr int kRake = kShortThreads / 32;
struct ScanStorage {
  double a[kRake][33];   // product of the thread's f (the maps' common slope)
  double fc[kRake][33];  // forward offset in, entering prefix value out
  double rc[kRake][33];  // reverse offset in, entering suffix value out
};

// Given each thread's composite maps x -> a x + fc (its positions in increasing order) and
// x -> a x + rc (decreasing order), returns the value entering the thread from below
// (prefix, start 0 at position 0) and from above (suffix, start 0 past the last position).
// Fixed order: serial per lane, then a Kogge-Stone warp scan.
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
    // Starting from 0, the value entering a lane is the offset of the lanes before it.
    double x = __shfl_up_sync(kFullMask, gc, 1), y = __shfl_down_sync(kFullMask, hc, 1);
    if (lane == 0) x = 0.0;
    if (lane == 31) y = 0.0;
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

// The gap that holds the root, as solve_interval's arguments (C = j - first): the first
// position j with Psi(s_j) >= k, or j = end (below every finite score).
struct Gap {
  double A, B, hi, lo;
};

// Shared memory of the solve: `scan` and after it may alias the sort's storage (the first
// barrier of solve_sorted ends the sort's use of it); last_v must not.
struct SolveStorage {
  ScanStorage scan;
  int first_j[kWarps];  // each warp's first candidate position
  Gap gap[kWarps];      // that candidate's coefficients
};

// The §1.1 solve on the finite sorted scores at positions [first, end) of the blocked
// arrangement (thread tid holds tid * kItems + q). Returns b; every thread gets it.
// last_v: each warp's last sorted score, for the next warp's first f.
template <typename Key, typename SK, int kItems>
__device__ __forceinline__ double solve_sorted(SolveStorage& st, double (&last_v)[kWarps], const Key (&keys)[kItems],
                                               int first, int end, double kf, double t) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int j0 = tid * kItems;
  // (d s) / (t s) for the exponents: a power-of-two s lifts a subnormal t, whose reciprocal
  // inv_temperature caps (right for the mask's 0 * inv_t, wrong for these differences).
  const double scale = t < 0x1p-960 ? 0x1p64 : 1.0;
  const double inv_ts = 1.0 / (t * scale);
  double v[kItems];
#pragma unroll
  for (int q = 0; q < kItems; ++q) v[q] = SK::value(keys[q]);
  // s_{j0 - 1}: the previous thread's last score.
  double v_before = __shfl_up_sync(kFullMask, v[kItems - 1], 1);
  if (lane == 31) last_v[warp] = v[kItems - 1];
  __syncthreads();
  if (lane == 0 && warp > 0) v_before = last_v[warp - 1];

  // The map at j: x -> f_j x + f_j inside (first, end), the identity elsewhere. f_j in
  // [0, 1]: the difference is <= 0 (or -inf) and inv_ts finite and > 0, so never NaN; equal
  // scores give exactly 1. Outside, e^0 = 1 without a branch: the exponentials overlap.
  double f[kItems];
  const auto inside = [&](int j) { return j > first && j < end; };
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const double d = v[q] - (q > 0 ? v[q - 1] : v_before);
    f[q] = exp(inside(j0 + q) ? d * scale * inv_ts : 0.0);
  }
  double fa = 1.0, fc = 0.0, rc = 0.0;
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    fc = fma(f[q], fc, inside(j0 + q) ? f[q] : 0.0);
    fa *= f[q];
  }
#pragma unroll
  for (int q = kItems - 1; q >= 0; --q) rc = fma(f[q], rc, inside(j0 + q) ? f[q] : 0.0);
  double x, y;  // A'_{j0 - 1} and R_{j0 + kItems}
  scan_affine(st.scan, fa, fc, rc, &x, &y);

  // Q_j = sum_{j <= i < end} e^{(s_i - s_j)/t} = 1 + R_{j+1}.
  double Q[kItems];
#pragma unroll
  for (int q = kItems - 1; q >= 0; --q) {
    Q[q] = 1.0 + y;
    y = fma(f[q], y, inside(j0 + q) ? f[q] : 0.0);
  }
  // Psi at the lower end of gap j (between s_{j-1} and s_j) is
  //   C - 1/2 e^{(s_j - s_{j-1})/t} P_{j-1} + 1/2 Q_j = C - 1/2 A'_j + 1/2 Q_j,
  // with C = j - first and P_{j-1} = 1 + A'_{j-1} (0 at j = first). This thread's first
  // position with Psi >= k is its candidate; the owner of end - 1 also stands for j = end.
  int cand = INT_MAX;
  Gap gap{0.0, 0.0, 0.0, 0.0};
  double v_prev = v_before;
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const int j = j0 + q;
    const double x_next = fma(f[q], x, inside(j) ? f[q] : 0.0);  // A'_j
    if (j >= first && j < end && cand == INT_MAX) {
      if (static_cast<double>(j - first) - 0.5 * x_next + 0.5 * Q[q] >= kf) {
        cand = j;
        gap = j > first ? Gap{1.0 + x, Q[q], v_prev, v[q]} : Gap{0.0, Q[q], INFINITY, v[q]};
      } else if (j == end - 1) {
        cand = end;
        gap = Gap{1.0 + x_next, 0.0, v[q], -INFINITY};
      }
    }
    x = x_next;
    v_prev = v[q];
  }
  // The first candidate of all: per-warp minima, then each thread takes the minimum of those.
  const int warp_first = warp_min(cand);
  if (cand == warp_first && cand != INT_MAX) st.gap[warp] = gap;
  if (lane == 0) st.first_j[warp] = warp_first;
  __syncthreads();
  const int jstar = warp_min(lane < kWarps ? st.first_j[lane] : INT_MAX);
  const int owner = (jstar < end ? jstar : end - 1) / (kItems * 32);
  const Gap g = st.gap[owner];
  return solve_interval(static_cast<double>(jstar - first), g.A, g.B, g.hi, g.lo, kf, t);
}

// The row's mask (or log mask) from its threshold, re-reading the scores (from L2): all
// loads first, then branch-free per-element math, so the loads and exponentials overlap.
template <typename scalar_t, int kItems>
__device__ __forceinline__ void write_mask(const scalar_t* __restrict__ row, scalar_t* __restrict__ prow, int64_t n,
                                           double sign, double b, double t, double edge, bool log_mode) {
  const int tid = threadIdx.x;
  double s[kItems];
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const int64_t i = q * kShortThreads + tid;
    s[q] = i < n ? sign * static_cast<double>(row[i]) : 0.0;
  }
  const double inv_t = inv_temperature(t);
  if (log_mode) {
#pragma unroll
    for (int q = 0; q < kItems; ++q) s[q] = lapsum_log_prob(s[q], b, t, edge);
  } else {
#pragma unroll
    for (int q = 0; q < kItems; ++q) s[q] = mask_prob<scalar_t>(s[q], b, t, inv_t, edge);
  }
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const int64_t i = q * kShortThreads + tid;
    if (i < n) prow[i] = static_cast<scalar_t>(s[q]);
  }
}

template <typename scalar_t, int kItems>
__global__ void __launch_bounds__(kShortThreads)
short_rows_kernel(const scalar_t* __restrict__ x, const double* __restrict__ k_in, const double* __restrict__ t_in,
                  double* __restrict__ b_out, double* __restrict__ edge_out, int64_t* __restrict__ diag,
                  scalar_t* __restrict__ p_out, bool log_mode, int64_t n, double sign) {
  begin_dependent_grid();
  using SK = SortKey<scalar_t>;
  using Key = typename SK::Key;
  using Sort = cub::BlockRadixSort<Key, kShortThreads, kItems, cub::NullType, kSortRadixBits>;
  __shared__ union {
    typename Sort::TempStorage sort;
    SolveStorage solve;  // after the sort
  } sm;
  __shared__ CensusStorage<Key> census;
  __shared__ double last_v[kWarps];
  static_assert(32 * kItems < 1024, "take_census packs a warp's counts in 10 bits");

  const int64_t r = blockIdx.x;
  const int tid = threadIdx.x;
  const scalar_t* row = x + r * n;
  const double k = k_in[r], t = t_in[r];

  // Striped loads (coalesced); only the keys stay (the mask re-reads the row from L2).
  Key keys[kItems];
  int nan = 0, pinf = 0, ninf = 0;
  Key key_and = ~Key(0), key_or = 0;
#pragma unroll
  for (int q = 0; q < kItems; ++q) {
    const int64_t i = q * kShortThreads + tid;
    if (i < n) {
      const double s = sign * static_cast<double>(row[i]);
      keys[q] = SK::key(s);
      nan += s != s;
      pinf += s == INFINITY;
      ninf += s == -INFINITY;
      key_and &= keys[q];
      key_or |= keys[q];
    }
  }
  const Census<Key> c = take_census(census, nan, pinf, ninf, key_and, key_or);
  double b, edge, kf;
  const bool settled = settle_row(k, t, static_cast<double>(n), c.nan, c.pinf, c.ninf, &b, &edge, &kf);

  if (!settled) {  // uniform across the block
    // Padding takes the and of the real keys: no bit beyond theirs, so it sorts at or after
    // the smallest score (a tie means equal keys) and positions [0, n) hold the row.
#pragma unroll
    for (int q = 0; q < kItems; ++q)
      if (q * kShortThreads + tid >= n) keys[q] = c.key_and;
    const Key varying = c.key_and ^ c.key_or;
    if (varying != 0) {  // else all keys are equal: already sorted
      int lo_bit, hi_bit;
      if constexpr (SK::kBits == 64) {
        lo_bit = __ffsll(static_cast<long long>(varying)) - 1;
        hi_bit = 64 - __clzll(static_cast<long long>(varying));
      } else {
        lo_bit = __ffs(static_cast<int>(varying)) - 1;
        hi_bit = 32 - __clz(static_cast<int>(varying));
      }
      Sort(sm.sort).SortDescending(keys, lo_bit, hi_bit);  // blocked: thread tid holds tid*kItems + q
    }
    const int first = c.pinf, end = static_cast<int>(n) - c.ninf;  // finite positions [first, end)
    b = solve_sorted<Key, SK, kItems>(sm.solve, last_v, keys, first, end, kf, t);
  }
  if (tid == 0) {
    b_out[r] = sign * b;
    edge_out[r] = edge;
    diag[3 * r] = settled ? kPathDirect : kPathSort;
    diag[3 * r + 1] = settled ? 0 : n - c.pinf - c.ninf;
    diag[3 * r + 2] = 0;
  }
  if (p_out == nullptr) return;
  write_mask<scalar_t, kItems>(row, p_out + r * n, n, sign, b, t, edge, log_mode);
}

}  // namespace

void solve_short_rows_cuda(const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest,
                           at::Tensor& b, at::Tensor& edge, at::Tensor& diag, at::Tensor* p,
                           bool log_mode) {
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n <= kShortRowMax, "fastlapsum: internal: row too long for the on-chip solver");
  if (rows == 0) return;
  const double sign = largest ? 1.0 : -1.0;
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "solve_short_rows_cuda", [&] {
    scalar_t* pp = p != nullptr ? p->mutable_data_ptr<scalar_t>() : nullptr;
    const auto launch = [&](auto kernel) {
      launch_dependent(kernel, static_cast<unsigned>(rows), kShortThreads, 0, stream,
          x.const_data_ptr<scalar_t>(), k.const_data_ptr<double>(), t.const_data_ptr<double>(),
          b.mutable_data_ptr<double>(), edge.mutable_data_ptr<double>(), diag.mutable_data_ptr<int64_t>(), pp,
          log_mode, n, sign);
    };
    // The fewest items per thread that hold the row: padding costs every sort pass.
    if (n <= kShortThreads * 2) launch(short_rows_kernel<scalar_t, 2>);
    else if (n <= kShortThreads * 4) launch(short_rows_kernel<scalar_t, 4>);
    else launch(short_rows_kernel<scalar_t, 8>);
  });
}

}  // namespace fastlapsum
