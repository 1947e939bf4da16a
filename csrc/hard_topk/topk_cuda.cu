// fastlapsum.topk and the straight-through hard mask on CUDA: exact sample-guided
// radix selection (docs/DESIGN.md §2; the selector of "Sample-Guided Exact Top-K Selection
// for Long-Context Sparse Attention", HPC-Ops Top-K, §4-5).
//
// Order: every score gets a 32-bit order-preserving key (float_key of its fp32 image,
// complemented for largest=false; NaN ranks above +inf), and every element the unique
// 64-bit composite  c = key << 32 | ~index,  so "larger c" means "better, and among tied
// scores the smaller index". Selecting the top `take` composites is then a radix select
// with no ties; the answer is the same index set as the CPU op (select_cpu.h).
//
// Exact radix select (block_select / grid passes): digits of c at 11+11+10 (the key)
// then 11+11+10 (the index) bits, each pass histograms the elements that match the
// prefix found so far and picks the bin holding the remaining rank; it stops as soon as
// that bin's count equals the rank still needed (usually after the key digits). The
// result is (prefix, ks): an element is selected iff (c >> ks) >= (prefix >> ks), which
// holds for exactly `take` elements.
//
// Paths (chosen on the host from static shapes only; everything data-dependent is
// decided on the device, so no host sync, fixed launch sequence, graph-capturable):
//
// 1. Per-row kernel (row_select_kernel, one 512-thread CTA per row, two an SM; for 16-bit
//    scores with 2.5*K <= 5632, 256 threads, four an SM), used unless the grid path below is
//    chosen. Per row: L = valid length (lengths read on the device,
//    clamped to [0, n]), take = min(K, L).
//    - take == 0 or take == L: write all valid indices directly (+ -1 padding).
//    - L <= cap (cap = smem candidate capacity): load the whole row into shared memory
//      (keys + indices) once and select there (direct exact path for short rows).
//    - else if 2.5*take <= cap: sampled path (the sample's first loads go out with the
//      length's, the row's head is prefetched into L2). Fixed-stride view: groups of 8 contiguous
//      scores (one 32 B sector) every 8*s scores, s = clamp(take/27, 1, 64), with a
//      row-dependent offset; two 11-bit histogram passes over the sample give a 22-bit
//      key threshold T at sample rank ceil(1.75*take*S/L). One fused full-row pass
//      (16-byte vector loads) appends every score with key >= T to the smem buffer and
//      builds the first-digit histogram of the admitted keys. If take <= count <= cap
//      the exact select runs over the smem candidates only.
//    - otherwise (underfill, overflow, or take too large for the buffer): exact
//      fallback, radix select streaming the row from global memory (<= 6 passes + 1).
//    Candidate buffer and outputs are compacted by block scans per tile (no atomics), so
//    the unsorted output order is deterministic (run to run); then -1 / -inf (+inf for
//    smallest) padding.
//    cap = clamp(round_up(4*K, 256), 2048, 24576) entries of (key, index) = 8 B each
//    (64 KiB for K = 2048) in dynamic shared memory, at most 5632 for the 256-thread CTAs;
//    hard_mask uses cap = 8192.
// 2. Grid path (g_* kernels), for few long rows (rows <= 64 and n >= 2^16, where its cost
//    estimate beats the per-row kernel's: use_grid_path): every row
//    gets `bpr` CTAs (blockIdx.x; the rows share one full wave of resident CTAs, where
//    4 per SM made collect 1.33 waves) so a single row of 10^8 scores uses the whole GPU.
//    Fixed sequence of launches: init, sample histogram a, scan, sample histogram b,
//    scan (-> threshold T at sample rank r_e + 5 sqrt(r_e) + 16, r_e = take*S/L, s = 64),
//    collect (grid-wide count + warp-slotted, block-staged compaction of the composites
//    >= T into a bounded per-row global buffer of cap_g = min(n, K + K/8 + 65536) entries,
//    plus the first-digit histogram), decide (candidates valid iff take <= count <= cap_g, else
//    fallback to the full row), 6 x (histogram pass, scan) of the radix select over the
//    candidates (or the row), output. Passes after the select is decided exit at once.
//    This also plays the role of KV-split (several CTAs per row for few long rows),
//    with kernel boundaries instead of a last-arriver counter. Its launches cost ~35 us, so
//    up to 64 rows of up to ~128K scores (fp32) run faster on the per-row kernel. The
//    selected SET is deterministic, but the unsorted output ORDER of this path is not
//    (tiles reserve output ranges with a global atomic); sorted=True is deterministic
//    everywhere.
// sorted=True: the kernels also write the composite (as an order-preserving int64), and
// the K outputs of each row are then permuted by one at::sort of it (descending: best
// first, ties by smaller index, padding last).
// fp64 scores: a simple exact path composed of ATen ops (stable sort of int64 keys).
// Row pitch: any x with stride(1) == 1 is used in place (16-byte vector loads when a
// row's start is 16-byte aligned, scalar loads otherwise).
// hard_mask_cuda: the same selectors with a per-row take = k_r (a whole NaN row where
// k_r is not an integer in [0, n]), the output pass writing the 0/1 mask of the row.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "../common/cuda_launch.cuh"
#include "../common/lapsum_math.h"
#include "../common/tile_scan.cuh"
#include "../ops.h"

namespace fastlapsum {
namespace {

// 512-thread row CTAs, two an SM: for fp32 rows the row pass streams best so; 16-bit rows
// (half the bytes, so a CTA's fixed phases weigh more) run a 256-thread build, four an SM.
constexpr int kBlock = 512;
constexpr int kBins = 2048;
constexpr int kUnroll = 2;     // grid kernels with staged compaction (tile <= kStageItems)
// streaming passes: 16-byte loads in flight per thread (64 B per thread either way; a
// 16-bit row at 4 would hold 32 floats per thread and spill)
template <typename T>
constexpr int row_unroll() { return sizeof(T) >= 4 ? 4 : 2; }
constexpr int kGridMaxRows = 64;
constexpr int64_t kGridMinN = 65536;
constexpr int64_t kQuarterCap = 5632;  // 256-thread row CTAs' candidate buffer (four an SM)
constexpr int kStageItems = 8192;  // grid kernels: staged composites per CTA tile (64 KiB)
constexpr int64_t kHeadPrefetchBytes = 64 * 1024;  // row kernel: the row's first two tiles
constexpr int kSampleUnroll = 8;  // row kernel: independent sample loads in flight per thread

// The row kernel's sampled path needs a candidate buffer of 2.5x the budget (its threshold
// admits ~1.75x): else the row takes the exact fallback.
__host__ __device__ inline bool sample_fits(double take, double cap) { return 2.5 * take <= cap; }

// Warp scans: one barrier per scan (raking has two).
template <int kT>
using BlockScanT = cub::BlockScan<uint32_t, kT, cub::BLOCK_SCAN_WARP_SCANS>;
using BlockScan = BlockScanT<kBlock>;

struct FindResult {
  uint32_t digit, above, count;
};

__device__ __forceinline__ uint64_t composite(uint32_t key, uint32_t idx) {
  return (static_cast<uint64_t>(key) << 32) | static_cast<uint32_t>(~idx);
}
// int64 with the same order as the unsigned composite (sorted=True)
__device__ __forceinline__ int64_t comp_signed(uint64_t c) {
  return static_cast<int64_t>(c ^ 0x8000000000000000ull);
}
__device__ __forceinline__ int digit_shift(int p) {
  return p == 0 ? 53 : p == 1 ? 42 : p == 2 ? 32 : p == 3 ? 21 : p == 4 ? 10 : 0;
}
__device__ __forceinline__ int digit_width(int p) { return (p == 2 || p == 5) ? 10 : 11; }
__device__ __forceinline__ bool prefix_match(uint64_t c, uint64_t prefix, int hi) {
  return hi >= 64 || (c >> hi) == (prefix >> hi);
}
__device__ __forceinline__ bool selected(uint64_t c, uint64_t prefix, int ks) {
  return (c >> ks) >= (prefix >> ks);
}

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}
template <typename T>
__device__ __forceinline__ T from_key(uint32_t key, uint32_t flip) {
  return static_cast<T>(key_to_float(key ^ flip));
}

// Vector v (V = 16/sizeof(T) scores) of a row of length L, raw: one 16-byte load when
// whole and aligned, else scalar loads (lanes past L read as 0; callers skip them).
template <typename T>
__device__ __forceinline__ int4 load_raw_vec(const T* __restrict__ xr, int64_t v, int64_t L, bool aligned) {
  constexpr int V = 16 / sizeof(T);
  if (aligned && (v + 1) * V <= L) return __ldg(reinterpret_cast<const int4*>(xr) + v);
  T t[V];
#pragma unroll
  for (int e = 0; e < V; ++e) t[e] = v * V + e < L ? xr[v * V + e] : T(0.0f);
  int4 q;
  memcpy(&q, t, 16);
  return q;
}

// Score e of a raw vector, as fp32.
template <typename T>
__device__ __forceinline__ float raw_score(const int4& q, int e) {
  T t[16 / sizeof(T)];
  memcpy(t, &q, 16);
  return to_float(t[e]);
}

// The V = 16/sizeof(T) scores of vector v of a row of length L, as fp32 (lanes past L: 0).
template <typename T>
__device__ __forceinline__ void load_vec(const T* __restrict__ xr, int64_t v, int64_t L, bool aligned,
                                         float (&out)[16 / sizeof(T)]) {
  const int4 q = load_raw_vec<T>(xr, v, L, aligned);
#pragma unroll
  for (int e = 0; e < 16 / static_cast<int>(sizeof(T)); ++e) out[e] = raw_score<T>(q, e);
}

struct NoTileEnd {
  __device__ void operator()() const {}
};

// f(score, index) for every index < L handled by CTA `blk` of `nblk` (kT threads each), then
// tile_end() after each tile of kT * U vectors (uniform trip count within the CTA: the loop
// bound does not depend on the thread, so tile_end may synchronise the block).
template <typename T, int U = row_unroll<T>(), int kT = kBlock, typename F, typename TileEnd = NoTileEnd>
__device__ __forceinline__ void for_row(const T* __restrict__ xr, int64_t L, bool aligned, int64_t blk,
                                        int64_t nblk, F&& f, TileEnd&& tile_end = TileEnd{}) {
  constexpr int V = 16 / sizeof(T);
  const int64_t nv = (L + V - 1) / V;
  const int64_t step = nblk * kT * U;
  for (int64_t v0 = blk * kT * U; v0 < nv; v0 += step) {
    float vals[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * kT + threadIdx.x;
      if (v < nv) load_vec<T>(xr, v, L, aligned, vals[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * kT + threadIdx.x;
      if (v < nv) {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int64_t i = v * V + e;
          if (i < L) f(vals[u][e], i);
        }
      }
    }
    tile_end();
  }
}

// Block-wide: the bin (scanning from the top) that holds rank `need` (1-based) of the
// histogram, the count above it and its own count. Ends with a barrier.
template <int kT = kBlock>
__device__ void find_bin(const uint32_t* hist, uint32_t need, typename BlockScanT<kT>::TempStorage& tmp,
                         FindResult& res) {
  constexpr int kPer = kBins / kT;
  uint32_t c[kPer];
  uint32_t s = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    c[j] = hist[kBins - 1 - (threadIdx.x * kPer + j)];
    s += c[j];
  }
  uint32_t run;
  BlockScanT<kT>(tmp).ExclusiveSum(s, run);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (run < need && run + c[j] >= need) {
      res.digit = kBins - 1 - (threadIdx.x * kPer + j);
      res.above = run;
      res.count = c[j];
    }
    run += c[j];
  }
  __syncthreads();
}

template <int kT>
struct RowShared {
  typename BlockScanT<kT>::TempStorage scan;  // find_bin and the output compaction
  uint32_t tile_tot[2][kT / 32];              // ordered_row_compact: warp totals, two in turn
  FindResult res;
};

// Exact block-wide radix select of the top `need` composites of the elements that
// `each(f)` visits (f(key, index)). hist_ready: pass 0's histogram is already in `hist`.
template <int kT, typename Each>
__device__ void block_select(Each&& each, uint32_t need, bool hist_ready, uint32_t* hist, RowShared<kT>& sh,
                             uint64_t& prefix_out, int& ks_out) {
  uint64_t prefix = 0;
  int ks = 0;
  for (int p = 0; p < 6; ++p) {
    const int s = digit_shift(p);
    const int hi = s + digit_width(p);
    const uint64_t mask = (1ull << digit_width(p)) - 1;
    if (!(p == 0 && hist_ready)) {
      for (int i = threadIdx.x; i < kBins; i += kT) hist[i] = 0;
      __syncthreads();
      each([&](uint32_t key, uint32_t idx) {
        const uint64_t c = composite(key, idx);
        if (prefix_match(c, prefix, hi)) atomicAdd(&hist[(c >> s) & mask], 1u);
      });
      __syncthreads();
    }
    find_bin<kT>(hist, need, sh.scan, sh.res);
    const FindResult r = sh.res;
    prefix |= static_cast<uint64_t>(r.digit) << s;
    need -= r.above;
    ks = s;
    __syncthreads();  // sh.res is read by all before the next find_bin writes it
    if (r.count == need) break;
  }
  prefix_out = prefix;
  ks_out = ks;
}

struct Params {
  const void* x;
  int64_t pitch, n, K;
  const int64_t* lengths;  // topk: valid prefix per row (may be null)
  const double* kvec;      // mask: budget per row
  uint32_t flip;           // 0 (largest) or ~0 (smallest)
  int cap;                 // per-row kernel: smem candidate capacity
  void* out_val;           // [rows, K]
  int64_t* out_idx;        // [rows, K]
  int64_t* out_comp;       // [rows, K] or null
  void* out_mask;          // [rows, n]
  // grid path
  struct GState* st;
  uint32_t* ghist;   // [rows, kBins]
  uint64_t* cand;    // [rows, cap_g]
  int64_t cap_g;
  int64_t bpr;       // CTAs per row
};

// Per-row budget: returns false (and the row is a NaN row) for an invalid mask budget.
template <bool kMask>
__device__ __forceinline__ bool row_budget(const Params& P, int64_t r, int64_t& L, int64_t& take) {
  L = P.n;
  if (!kMask && P.lengths != nullptr) {
    const int64_t l = P.lengths[r];
    L = l < 0 ? 0 : (l > P.n ? P.n : l);
  }
  if (kMask) {
    const double kv = P.kvec[r];
    if (!(kv == rint(kv) && kv >= 0.0 && kv <= static_cast<double>(P.n))) return false;
    take = static_cast<int64_t>(kv);
  } else {
    take = P.K < L ? P.K : L;
  }
  return true;
}

template <typename T>
__device__ __forceinline__ void pad_row(const Params& P, int64_t r, int64_t take, int64_t tid, int64_t nthreads) {
  T* ov = static_cast<T*>(P.out_val) + r * P.K;
  int64_t* oi = P.out_idx + r * P.K;
  const T pad = static_cast<T>(P.flip ? INFINITY : -INFINITY);
  for (int64_t j = take + tid; j < P.K; j += nthreads) {
    oi[j] = -1;
    ov[j] = pad;
    if (P.out_comp != nullptr) P.out_comp[r * P.K + j] = std::numeric_limits<int64_t>::min();
  }
}

template <typename T>
__device__ __forceinline__ void emit(const Params& P, int64_t r, uint64_t pos, uint64_t c) {
  const uint32_t key = static_cast<uint32_t>(c >> 32);
  const uint32_t idx = ~static_cast<uint32_t>(c);
  P.out_idx[r * P.K + pos] = idx;
  static_cast<T*>(P.out_val)[r * P.K + pos] = from_key<T>(key, P.flip);
  if (P.out_comp != nullptr) P.out_comp[r * P.K + pos] = comp_signed(c);
}

// The fp32 score of a threshold key, so that key(v) >= key becomes v >= it (and key(v) <=
// key, v <= it), at worst for a superset: the key below +0's decodes to -0, and keys that
// decode to NaN (beyond +inf's or -inf's) bound at that infinity.
__device__ __forceinline__ float key_bound(uint32_t key) {
  const float f = key_to_float(key);
  return f == f ? f : (key >= 0x80000000u ? INFINITY : -INFINITY);
}

// Deterministic block-wide compaction over a row: tiles in row order, and inside a tile
// each thread's items at offsets from one block scan (no atomics: the order of the
// compacted items is a fixed function of the input). pred(score, i) selects (on the fp32
// score: a key per score would cost the pass its ALU-pipe budget); sink(pos, key, i)
// receives the selected items at consecutive positions. Returns the count.
// This is the row kernel's one full pass, so it is lean: each score is tested once, on its
// fp32 value (a bit per score), indices are 32-bit (rows are < 2^32 scores), only threads
// with a hit revisit their scores, and the next tile's loads are issued before a tile is
// tested, so that they are in flight across its scan's barriers (a CTA's loads would
// otherwise come in bursts, one tile at a time). One barrier per tile, the scan's
// (tile_exclusive_sum): tiles alternate between two warp-total arrays, and an array is
// written again only after the barrier of the scan in between, which every thread reaches
// after reading its prefix.
template <int kT, typename T, typename Pred, typename Sink>
__device__ uint32_t ordered_row_compact(const T* __restrict__ xr, int64_t L, bool aligned, uint32_t flip,
                                        uint32_t (&tot)[2][kT / 32], Pred&& pred, Sink&& sink) {
  constexpr int V = 16 / sizeof(T), U = row_unroll<T>();
  static_assert(U * V <= 32, "one bit per score of a thread's tile");
  // Vector indices in 32 bits (a row has < 2^32 scores, so < 2^30 vectors): the loop runs at
  // the kernel's register cap, and 64-bit counters take a register pair each.
  const uint32_t nv = static_cast<uint32_t>((L + V - 1) / V), whole = static_cast<uint32_t>(L / V);
  constexpr uint32_t step = uint32_t(kT) * U;
  const auto load_tile = [&](int4(&raw)[U], uint32_t v0) {
    if (aligned && v0 + step <= whole) {  // a whole aligned tile (uniform): no per-vector checks
      const int4* p = reinterpret_cast<const int4*>(xr) + v0 + threadIdx.x;
#pragma unroll
      for (int u = 0; u < U; ++u) raw[u] = __ldg(p + u * kT);
      return;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t v = v0 + u * kT + threadIdx.x;
      if (v < nv) raw[u] = load_raw_vec<T>(xr, v, L, aligned);
    }
  };
  const auto score = [&](const int4(&raw)[U], int u, int e) { return raw_score<T>(raw[u], e); };
  uint32_t base = 0;
  int par = 0;  // the warp-total array of this tile
  int4 cur[U], next[U];
  load_tile(cur, 0);
  for (uint32_t v0 = 0; v0 < nv; v0 += step) {
    if (v0 + step < nv) load_tile(next, v0 + step);
    const uint32_t i0 = (v0 + threadIdx.x) * V;  // score (u, e) is i0 + u*kT*V + e
    uint32_t bits = 0;
    if (v0 + step <= whole) {  // whole tile (uniform in the block)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int e = 0; e < V; ++e)
          bits |= static_cast<uint32_t>(pred(score(cur, u, e), i0 + u * kT * V + e)) << (u * V + e);
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int64_t i = int64_t(v0 + u * kT + threadIdx.x) * V + e;
          if (i < L && pred(score(cur, u, e), static_cast<uint32_t>(i))) bits |= 1u << (u * V + e);
        }
    }
    uint32_t agg;
    uint32_t pos = tile_exclusive_sum<kT>(static_cast<uint32_t>(__popc(bits)), tot[par], agg);
    // Only the set bits: a test per score here cost the pass as much as the scores' own
    // compares (every warp has a thread with a hit). The rare hits re-read their score, an
    // L1 hit, since a register can only be picked by a constant index.
    pos += base;
    for (uint32_t b = bits; b != 0; b &= b - 1, ++pos) {
      const int k = __ffs(b) - 1;
      const uint32_t i = i0 + (k / V) * kT * V + k % V;
      sink(pos, float_key(to_float(xr[i])) ^ flip, i);
    }
    base += agg;
    par ^= 1;
#pragma unroll
    for (int u = 0; u < U; ++u) cur[u] = next[u];
  }
  __syncthreads();  // the caller may reuse the warp totals
  return base;
}

// The fixed-stride sample: groups of 8 contiguous scores (one 32 B sector) every 8 s
// scores, the first at a row-dependent offset (a multiple of 8 below 8 s).
__device__ __forceinline__ int64_t row_sample_stride(int64_t take) {  // the row kernel's s
  const int64_t s = take / 27;
  return s < 1 ? 1 : (s > 64 ? 64 : s);
}
__device__ __forceinline__ int64_t sample_offset(int64_t r, int64_t s) {
  return static_cast<int64_t>(mix32(static_cast<uint32_t>(r) * 0x9E3779B9u + 0x7F4A7C15u) % static_cast<uint32_t>(s)) * 8;
}

// ---- per-row kernel ----------------------------------------------------------------------

template <typename T, bool kMask, int kT>
__global__ void __launch_bounds__(kT, 1024 / kT) row_select_kernel(Params P) {
  begin_dependent_grid();
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  uint32_t* ckey = reinterpret_cast<uint32_t*>(dyn_smem);
  uint32_t* cidx = ckey + P.cap;
  __shared__ uint32_t hist[kBins];
  __shared__ RowShared<kT> sh;

  const int64_t r = blockIdx.x;
  const int tid = threadIdx.x;
  const T* xr = static_cast<const T*>(P.x) + r * P.pitch;
  const bool aligned = (reinterpret_cast<uintptr_t>(xr) & 15) == 0;
  const uint32_t flip = P.flip;
  T* mrow = kMask ? static_cast<T*>(P.out_mask) + r * P.n : nullptr;

  // The sample's first kT * kSampleUnroll scores for the usual budget (take = K < L: the
  // sample's stride and offset follow from K and r alone), loaded before the row's length is
  // known, so that the two round trips overlap; the sampled path cuts them to the length.
  // Only those a row of n scores samples (a shorter row samples a prefix of them). It pays
  // where the sample takes several rounds of loads (small K on long rows); 4-byte scores
  // only, as 16-bit rows came out slower with it.
  constexpr bool kSpec = !kMask && sizeof(T) == 4;
  const int64_t k_s = row_sample_stride(P.K), k_off = sample_offset(r, k_s);  // K's sample
  float spec[kSampleUnroll];
  int64_t spec_s = 0;  // their stride; 0: none loaded
  if constexpr (kSpec) {
    if (P.n > P.cap && sample_fits(P.K, P.cap)) {
      spec_s = k_s;
      const int64_t off = k_off, G = 8 * spec_s, count = ((P.n - off - 8) / G + 1) * 8;
#pragma unroll
      for (int u = 0; u < kSampleUnroll; ++u) {
        const int64_t j = int64_t(u) * kT + tid;
        spec[u] = j < count ? to_float(xr[off + (j >> 3) * G + (j & 7)]) : 0.0f;
      }
    }
  }
  // Into L2 while this CTA reads its length and samples (its stream is idle until then,
  // and the other CTA of the SM alone does not keep the SM's share of DRAM busy): the
  // row's head, and the sample's sectors past those loaded above for the usual budget.
  // Hints only.
  if (P.n > P.cap) {
    const char* head = reinterpret_cast<const char*>(xr);
    const int64_t row_bytes = P.n * int64_t(sizeof(T)), head_bytes = row_bytes < kHeadPrefetchBytes ? row_bytes : kHeadPrefetchBytes;
    for (int64_t o = int64_t(tid) * 128; o < head_bytes; o += int64_t(kT) * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(head + o));
    if (!kMask) {
      for (int64_t g = tid + (kSpec && spec_s != 0 ? kT * kSampleUnroll / 8 : 0); g < 2 * kT && k_off + g * 8 * k_s < P.n; g += kT)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(xr + k_off + g * 8 * k_s));
    }
  }
  int64_t L, take;
  if (!row_budget<kMask>(P, r, L, take)) {
    for (int64_t i = tid; i < P.n; i += kT) mrow[i] = static_cast<T>(NAN);
    return;
  }
  if (take == 0 || take == L) {  // nothing or everything valid is selected
    if (kMask) {
      const T v = static_cast<T>(take == 0 ? 0.0f : 1.0f);
      for (int64_t i = tid; i < P.n; i += kT) mrow[i] = v;
    } else {
      for (int64_t i = tid; i < L; i += kT) {
        const uint32_t key = float_key(to_float(xr[i])) ^ flip;
        emit<T>(P, r, i, composite(key, static_cast<uint32_t>(i)));
      }
      pad_row<T>(P, r, take, tid, kT);
    }
    return;
  }

  auto row_each = [&](auto&& f) {
    for_row<T, row_unroll<T>(), kT>(xr, L, aligned, 0, 1, [&](float v, int64_t i) { f(float_key(v) ^ flip, static_cast<uint32_t>(i)); });
  };

  // ---- candidate formation: whole row (short rows) or sampled threshold ----
  const int cap = P.cap;
  bool try_cand = true;
  uint32_t thr = 0;
  if (L > cap) {
    if (!sample_fits(take, cap)) {
      try_cand = false;
    } else {
      const int64_t s = row_sample_stride(take);
      const int64_t G = 8 * s;  // L > cap >= 2048 >= G
      const int64_t off = sample_offset(r, s);
      const int64_t S = ((L - off - 8) / G + 1) * 8;
      double rs = ceil(1.75 * static_cast<double>(take) * static_cast<double>(S) / static_cast<double>(L));
      rs = rs < 1.0 ? 1.0 : (rs > static_cast<double>(S) ? static_cast<double>(S) : rs);
      const uint32_t rstar = static_cast<uint32_t>(rs);
      // The first pass keeps the sample's keys in the (still empty) candidate buffer when
      // they fit, so that the second reads shared memory, not the row again (a round trip
      // to L2 or DRAM while the other CTA of the SM streams).
      uint32_t* skeys = ckey;  // cap keys then cap indices: 2 * cap slots
      const bool keep = S <= 2 * static_cast<int64_t>(cap);
      // The first kT * kU scores were loaded at the start when take's stride is K's (the
      // same positions; those at j >= S, past the length, are left out below).
      const bool from_spec = kSpec && s == spec_s;
      auto samp_each = [&](auto&& f) {
        constexpr int kU = kSampleUnroll;
        for (int64_t j0 = 0; j0 < S; j0 += int64_t(kT) * kU) {
          float v[kU];
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const int64_t j = j0 + u * kT + tid;
            v[u] = from_spec && j0 == 0 ? spec[u] : (j < S ? to_float(xr[off + (j >> 3) * G + (j & 7)]) : 0.0f);
          }
#pragma unroll
          for (int u = 0; u < kU; ++u) {
            const int64_t j = j0 + u * kT + tid;
            if (j < S) {
              const uint32_t key = float_key(v[u]) ^ flip;
              if (keep) skeys[j] = key;
              f(key);
            }
          }
        }
      };
      for (int i = tid; i < kBins; i += kT) hist[i] = 0;
      __syncthreads();
      samp_each([&](uint32_t key) { atomicAdd(&hist[key >> 21], 1u); });
      __syncthreads();
      find_bin<kT>(hist, rstar, sh.scan, sh.res);
      const uint32_t d1 = sh.res.digit, rem = rstar - sh.res.above;
      __syncthreads();
      for (int i = tid; i < kBins; i += kT) hist[i] = 0;
      __syncthreads();
      const auto second = [&](uint32_t key) {
        if ((key >> 21) == d1) atomicAdd(&hist[(key >> 10) & 2047u], 1u);
      };
      if (keep) {
        for (int64_t j = tid; j < S; j += kT) second(skeys[j]);
      } else {
        samp_each(second);
      }
      __syncthreads();
      find_bin<kT>(hist, rem, sh.scan, sh.res);
      thr = (d1 << 21) | (sh.res.digit << 10);
      __syncthreads();
    }
  }
  uint32_t C = 0;
  if (try_cand) {
    for (int i = tid; i < kBins; i += kT) hist[i] = 0;
    __syncthreads();
    const auto add = [&](uint32_t pos, uint32_t key, uint32_t i) {
      if (pos < static_cast<uint32_t>(cap)) {
        ckey[pos] = key;
        cidx[pos] = i;
      }
      atomicAdd(&hist[key >> 21], 1u);
    };
    // key >= thr as one fp32 compare, admitting a superset at worst (harmless: the select
    // over the candidates is exact, and an underfill falls back): largest, score >= the
    // bound or NaN (NaN's key is the largest); smallest (keys complemented), score <= the
    // bound of ~thr (NaN, the worst there, left out: needed only when the row underfills).
    if (flip == 0) {
      const float lo = key_bound(thr);
      C = ordered_row_compact<kT, T>(xr, L, aligned, flip, sh.tile_tot, [&](float v, uint32_t) { return !(v < lo); }, add);
    } else {
      const float hi = key_bound(~thr);
      C = ordered_row_compact<kT, T>(xr, L, aligned, flip, sh.tile_tot, [&](float v, uint32_t) { return v <= hi; }, add);
    }
    __syncthreads();
  }
  const bool ok = try_cand && C >= take && C <= static_cast<uint32_t>(cap);

  auto smem_each = [&](auto&& f) {
    for (uint32_t i = tid; i < C; i += kT) f(ckey[i], cidx[i]);
  };

  uint64_t prefix;
  int ks;
  if (ok) {
    block_select(smem_each, static_cast<uint32_t>(take), true, hist, sh, prefix, ks);
  } else {
    block_select(row_each, static_cast<uint32_t>(take), false, hist, sh, prefix, ks);
  }

  // ---- output ----
  if (kMask) {
    for_row<T, row_unroll<T>(), kT>(xr, P.n, aligned, 0, 1, [&](float v, int64_t i) {
      const uint64_t c = composite(float_key(v) ^ flip, static_cast<uint32_t>(i));
      mrow[i] = static_cast<T>(selected(c, prefix, ks) ? 1.0f : 0.0f);
    });
  } else {
    auto is_sel = [&](uint32_t key, uint32_t i) { return selected(composite(key, i), prefix, ks); };
    auto is_sel_score = [&](float v, uint32_t i) { return is_sel(float_key(v) ^ flip, i); };
    auto out = [&](uint32_t pos, uint32_t key, uint32_t i) { emit<T>(P, r, pos, composite(key, i)); };
    if (ok) {
      // The selected candidates, compacted in place in buffer order (kPer consecutive per
      // thread, positions by block scan: a position never passes its candidate's index, and
      // the chunk is in registers before the scan's barrier), then written out coalesced
      // (written from the scan's positions directly, a warp's stores hit 32 sectors each).
      constexpr int kPer = 4;  // 8 would add live registers to a kernel at its 64-register cap
      uint32_t base = 0;
      for (uint32_t i0 = 0; i0 < C; i0 += kT * kPer) {
        uint32_t kk[kPer], ii[kPer], sel = 0;
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
          const uint32_t i = i0 + tid * kPer + j;
          kk[j] = i < C ? ckey[i] : 0u;
          ii[j] = i < C ? cidx[i] : 0u;
          if (i < C && is_sel(kk[j], ii[j])) sel |= 1u << j;
        }
        uint32_t pos, agg;
        BlockScanT<kT>(sh.scan).ExclusiveSum(static_cast<uint32_t>(__popc(sel)), pos, agg);
        pos += base;
#pragma unroll
        for (int j = 0; j < kPer; ++j)
          if (sel & (1u << j)) {
            ckey[pos] = kk[j];
            cidx[pos] = ii[j];
            ++pos;
          }
        base += agg;
        __syncthreads();
      }
      for (uint32_t j = tid; j < base; j += kT) out(j, ckey[j], cidx[j]);
    } else {
      ordered_row_compact<kT, T>(xr, L, aligned, flip, sh.tile_tot, is_sel_score, out);
    }
    pad_row<T>(P, r, take, tid, kT);
  }
}

// ---- grid path ---------------------------------------------------------------------------

struct GState {
  uint64_t prefix;
  int64_t L, take;
  int32_t ks;        // -1 until the select is decided
  uint32_t need;
  uint32_t trivial;  // 1: take == 0 or take == L; 2: NaN row (mask)
  uint32_t sampled;
  int64_t off, G, S;
  uint32_t rstar, d1, rem, thr;
  unsigned long long cand_cnt, out_cnt;
  uint32_t use_cand;
};

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
      const bool aligned = (reinterpret_cast<uintptr_t>(xr) & 15) == 0;
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
  const bool aligned = (reinterpret_cast<uintptr_t>(xr) & 15) == 0;
  const uint32_t flip = P.flip;
  // key >= thr as one fp32 compare (a superset at worst, as in the row kernel)
  const float lo = key_bound(st.thr), hi = key_bound(~st.thr);
  const auto admit = [&](float v) { return flip == 0 ? !(v < lo) : v <= hi; };
  const int64_t L = st.L, cap = P.cap_g;
  uint64_t* cr = P.cand + r * cap;
  const int64_t nv = (L + V - 1) / V, step = P.bpr * int64_t(kBlock) * U;
  const auto load_tile = [&](int4(&raw)[U], int64_t v0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * kBlock + threadIdx.x;
      if (v < nv) raw[u] = load_raw_vec<T>(xr, v, L, aligned);
    }
  };
  int tiles = 0;
  int4 raw[U], next[U];
  const int64_t first = blockIdx.x * int64_t(kBlock) * U;
  if (first < nv) load_tile(raw, first);
  for (int64_t v0 = first; v0 < nv; v0 += step) {  // uniform trip count
    // the next tile's loads are in flight while this one is tested and flushed
    if (v0 + step < nv) load_tile(next, v0 + step);
    uint32_t bits = 0;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const int64_t i = (v0 + u * kBlock + threadIdx.x) * V + e;
        if (i < L && admit(raw_score<T>(raw[u], e))) bits |= 1u << (u * V + e);
      }
    uint32_t slot = warp_stage_slots(ss, static_cast<uint32_t>(__popc(bits)));
    for (uint32_t b = bits; b != 0; b &= b - 1) {
      const int q = __ffs(b) - 1;
      const int64_t i = (v0 + (q / V) * kBlock + threadIdx.x) * V + q % V;
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
  const bool aligned = (reinterpret_cast<uintptr_t>(xr) & 15) == 0;
  const uint32_t flip = P.flip;
  const int64_t gtid = blockIdx.x * int64_t(kBlock) + threadIdx.x, gthreads = P.bpr * kBlock;
  if (kMask) {
    T* mrow = static_cast<T*>(P.out_mask) + r * P.n;
    if (st.trivial) {
      const T v = static_cast<T>(st.trivial == 2 ? NAN : (st.take == 0 ? 0.0f : 1.0f));
      for (int64_t i = gtid; i < P.n; i += gthreads) mrow[i] = v;
      return;
    }
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

// ---- host side ---------------------------------------------------------------------------
// The per-row kernel's candidate buffer (entries) for budget K, and whether it runs as the
// 256-thread build (four CTAs an SM; a buffer of at most kQuarterCap): topk on 16-bit scores
// (the only instantiations of that build) whose sampled path fits that buffer.
int64_t row_cap(bool mask, int64_t K) {
  const int64_t cap = mask ? 8192 : ((4 * K + 255) / 256) * 256;
  return std::max<int64_t>(2048, std::min<int64_t>(cap, 24576));
}
template <typename T, bool kMask>
constexpr bool kHasQuarterBuild = !kMask && sizeof(T) == 2;
template <typename T, bool kMask>
bool quarter_build(int64_t K) { return kHasQuarterBuild<T, kMask> && sample_fits(K, kQuarterCap); }

// Few long rows (rows <= 64, n >= 2^16): the grid path or the per-row kernel, whichever a
// cost estimate fitted to H200 timings of 1-64 rows x 64K-1M scores (fp32 and fp16) puts
// lower. The grid path: ~35 us of launches plus ~625K scores a microsecond. The per-row
// kernel: ~17 us plus one CTA streaming its row at the rate its loads in flight allow
// (~0.8 us a round trip; its few CTAs leave DRAM idle, so each streams at that rate).
// A budget too large for the per-row kernel's sampled path (it would stream the row up to
// seven times) keeps the grid path; so does hard_mask (whose estimate is not fitted).
template <typename T, bool kMask>
bool use_grid_path(int64_t rows, int64_t n, int64_t K) {
  if (rows > kGridMaxRows || n < kGridMinN) return false;
  if (kMask || !sample_fits(K, row_cap(kMask, K))) return true;
  const double threads = quarter_build<T, kMask>(K) ? kBlock / 2 : kBlock;
  const double in_flight = threads * row_unroll<T>() * 16.0;  // bytes
  const double row_us = 17.0 + 0.8 * static_cast<double>(n) * sizeof(T) / in_flight;
  const double grid_us = 35.0 + static_cast<double>(rows) * static_cast<double>(n) / 625000.0;
  return grid_us < row_us;
}

// Scores as a [rows, n] view with unit inner stride (row pitch kept).
at::Tensor rows_view(const at::Tensor& x) {
  if (x.size(1) <= 1 || x.stride(1) == 1) {
    if (x.size(0) <= 1 || x.stride(0) >= x.size(1)) return x;
  }
  return x.contiguous();
}

template <typename T, bool kMask>
void launch(Params P, int64_t rows, const at::Tensor& x) {
  const cudaStream_t stream = current_stream();
  if (rows == 0) return;
  if (use_grid_path<T, kMask>(rows, P.n, P.K)) {
    const int sms = sm_count();  // x's device: the caller holds its guard
    const int stage_bytes = kStageItems * 8;
    set_max_dynamic_smem(g_collect<T, kMask>, stage_bytes, x.get_device());
    set_max_dynamic_smem(g_output<T, kMask>, stage_bytes, x.get_device());
    const int64_t wave = static_cast<int64_t>(resident_blocks(g_collect<T, kMask>, kBlock, stage_bytes, x.get_device())) * sms;
    constexpr int V = 16 / sizeof(T);
    const int64_t max_bpr = std::max<int64_t>(1, (P.n / V + int64_t(kBlock) * kUnroll - 1) / (int64_t(kBlock) * kUnroll));
    P.bpr = std::min<int64_t>(max_bpr, std::max<int64_t>(1, wave / rows));
    const int64_t cap_want = kMask ? P.n / 4 + 65536 : P.K + P.K / 8 + 65536;
    P.cap_g = std::max<int64_t>(1, std::min<int64_t>({P.n, cap_want, (int64_t(1) << 27) / rows}));
    const int64_t st_bytes = ((rows * int64_t(sizeof(GState)) + 255) / 256) * 256;
    const int64_t h_bytes = rows * kBins * 4;
    at::Tensor ws = at::empty({st_bytes + h_bytes + rows * P.cap_g * 8}, x.options().dtype(at::kByte));
    uint8_t* w = ws.mutable_data_ptr<uint8_t>();
    P.st = reinterpret_cast<GState*>(w);
    P.ghist = reinterpret_cast<uint32_t*>(w + st_bytes);
    P.cand = reinterpret_cast<uint64_t*>(w + st_bytes + h_bytes);
    const dim3 grid(static_cast<unsigned>(P.bpr), static_cast<unsigned>(rows));
    launch_dependent(g_init<T, kMask>, rows, kBlock, 0, stream, P);
    for (int stage = kSampleA; stage <= kSampleB; ++stage) {
      launch_dependent(g_hist<T, kMask>, grid, kBlock, 0, stream, P, stage);
      launch_dependent(g_scan<kMask>, rows, kBlock, 0, stream, P, stage);
    }
    launch_dependent(g_collect<T, kMask>, grid, kBlock, stage_bytes, stream, P);
    launch_dependent(g_decide, rows, kBlock, 0, stream, P);
    for (int p = 0; p < 6; ++p) {
      launch_dependent(g_hist<T, kMask>, grid, kBlock, 0, stream, P, kRadix0 + p);
      launch_dependent(g_scan<kMask>, rows, kBlock, 0, stream, P, kRadix0 + p);
    }
    launch_dependent(g_output<T, kMask>, grid, kBlock, stage_bytes, stream, P);
    return;
  }
  const int64_t cap = row_cap(kMask, P.K);
  TORCH_CHECK(rows <= 2147483647LL, "fastlapsum.topk: too many rows for the CUDA kernel");
  const auto launch_rows = [&](auto kernel, int threads, int64_t buffer) {
    P.cap = static_cast<int>(buffer);
    const int smem = static_cast<int>(buffer * 8);
    set_max_dynamic_smem(kernel, smem, x.get_device());
    launch_dependent(kernel, static_cast<unsigned>(rows), threads, smem, stream, P);
  };
  // 16-bit scores: 256-thread CTAs, four an SM (a candidate buffer of at most kQuarterCap, so
  // that four fit), where the sampled path still fits that buffer. A 16-bit row is half the
  // bytes of an fp32 one, so its fixed phases (length, sample, select, output) are a larger
  // share of its time, and four CTAs an SM overlap them with streaming better than two
  // (most at N = 128K, little by 512K); fp32 rows are slower so.
  if constexpr (kHasQuarterBuild<T, kMask>) {
    if (quarter_build<T, kMask>(P.K)) {
      launch_rows(row_select_kernel<T, kMask, kBlock / 2>, kBlock / 2, std::min(cap, kQuarterCap));
      return;
    }
  }
  launch_rows(row_select_kernel<T, kMask, kBlock>, kBlock, cap);
}

// fp64: exact, composed of ATen ops. Signed int64 keys with the order of the doubles
// (NaN highest), complemented for smallest; invalid positions get the lowest key (they
// also have the largest indices, so a stable sort keeps them behind every valid score).
at::Tensor fp64_keys(const at::Tensor& x, bool largest) {
  const at::Tensor b = (x + 0.0).view(at::kLong);  // -0 -> +0
  at::Tensor key = at::where(b.ge(0), b, at::bitwise_xor(b, std::numeric_limits<int64_t>::max()));
  key = at::where(x.isnan(), at::full_like(key, std::numeric_limits<int64_t>::max()), key);
  if (!largest) key = at::bitwise_not(key);
  return key;
}

std::tuple<at::Tensor, at::Tensor> topk_fp64(const at::Tensor& x, int64_t k, bool largest,
                                             const std::optional<at::Tensor>& lengths) {
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor key = fp64_keys(x, largest);
  at::Tensor pad_mask;
  if (lengths.has_value()) {
    const at::Tensor len = lengths->to(at::kLong).clamp(0, n).view({rows, 1});
    const at::Tensor invalid = at::arange(n, x.options().dtype(at::kLong)).view({1, n}).ge(len);
    key = key.masked_fill(invalid, std::numeric_limits<int64_t>::min());
    pad_mask = at::arange(k, x.options().dtype(at::kLong)).view({1, k}).ge(len);
  }
  const at::Tensor order = std::get<1>(key.sort(/*stable=*/true, /*dim=*/1, /*descending=*/true));
  at::Tensor idx = order.narrow(1, 0, k).contiguous();
  at::Tensor values = x.gather(1, idx);
  if (pad_mask.defined()) {
    idx = idx.masked_fill(pad_mask, -1);
    values = values.masked_fill(pad_mask, largest ? -INFINITY : INFINITY);
  }
  return {values, idx};
}

at::Tensor hard_mask_fp64(const at::Tensor& x, const at::Tensor& k, bool largest) {
  const int64_t n = x.size(1);
  const at::Tensor order = std::get<1>(fp64_keys(x, largest).sort(true, 1, true));
  const at::Tensor ar = at::arange(n, x.options().dtype(at::kLong)).expand_as(order);
  const at::Tensor rank = at::empty_like(order).scatter_(1, order, ar);
  const at::Tensor kr = k.round();
  const at::Tensor keep = rank.lt(kr.view({-1, 1}));
  const at::Tensor ok = k.eq(kr).logical_and(k.ge(0)).logical_and(k.le(static_cast<double>(n)));
  const at::Tensor p = keep.to(x.scalar_type());
  return at::where(ok.view({-1, 1}), p, at::full_like(p, NAN));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> topk_cuda(const at::Tensor& x_in, int64_t k, bool largest, bool sorted,
                                             const std::optional<at::Tensor>& lengths) {
  TORCH_CHECK(x_in.dim() == 2, "fastlapsum.topk: expected x of shape [rows, n]");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t rows = x_in.size(0), n = x_in.size(1);
  TORCH_CHECK(k >= 0 && k <= n, "fastlapsum.topk: k must be in [0, n]");
  TORCH_CHECK(n < 4294967295LL, "fastlapsum.topk: rows longer than 2^32 - 2 are not supported on CUDA");
  at::Tensor len;
  if (lengths.has_value()) {
    TORCH_CHECK(lengths->device() == x_in.device(), "fastlapsum.topk: lengths must be on the device of x");
    TORCH_CHECK(lengths->numel() == rows, "fastlapsum.topk: lengths needs one value per row");
    len = lengths->to(at::kLong).contiguous();
  }
  if (x_in.scalar_type() == at::kDouble) {
    auto res = topk_fp64(x_in.contiguous(), k, largest, len.defined() ? std::optional<at::Tensor>(len) : std::nullopt);
    return res;
  }
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kHalf ||
                  x_in.scalar_type() == at::kBFloat16,
              "fastlapsum.topk: expected a floating-point x");
  const at::Tensor x = rows_view(x_in);
  at::Tensor values = at::empty({rows, k}, x.options());
  at::Tensor indices = at::empty({rows, k}, x.options().dtype(at::kLong));
  if (rows == 0 || k == 0) return {values, indices};
  const bool want_comp = sorted && k > 1;
  at::Tensor comp = want_comp ? at::empty({rows, k}, x.options().dtype(at::kLong)) : at::Tensor();
  Params P{};
  P.pitch = rows > 1 ? x.stride(0) : n;
  P.n = n;
  P.K = k;
  P.lengths = len.defined() ? len.const_data_ptr<int64_t>() : nullptr;
  P.flip = largest ? 0u : 0xFFFFFFFFu;
  P.out_idx = indices.mutable_data_ptr<int64_t>();
  P.out_comp = want_comp ? comp.mutable_data_ptr<int64_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fastlapsum_topk_cuda", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      P.x = x.const_data_ptr<scalar_t>();
      P.out_val = values.mutable_data_ptr<scalar_t>();
      launch<scalar_t, false>(P, rows, x);
    }
  });
  if (want_comp) {
    const at::Tensor perm = std::get<1>(comp.sort(/*dim=*/1, /*descending=*/true));
    values = values.gather(1, perm);
    indices = indices.gather(1, perm);
  }
  return {values, indices};
}

at::Tensor hard_mask_cuda(const at::Tensor& x_in, const at::Tensor& k_in, bool largest) {
  TORCH_CHECK(x_in.dim() == 2, "fastlapsum.hard_mask: expected x of shape [rows, n]");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const int64_t rows = x_in.size(0), n = x_in.size(1);
  TORCH_CHECK(k_in.numel() == rows, "fastlapsum.hard_mask: k needs one value per row");
  TORCH_CHECK(n < 4294967295LL, "fastlapsum.hard_mask: rows longer than 2^32 - 2 are not supported on CUDA");
  const at::Tensor k = k_in.to(x_in.device(), at::kDouble).contiguous();
  if (x_in.scalar_type() == at::kDouble) return hard_mask_fp64(x_in.contiguous(), k, largest);
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kHalf ||
                  x_in.scalar_type() == at::kBFloat16,
              "fastlapsum.hard_mask: expected a floating-point x");
  const at::Tensor x = rows_view(x_in);
  at::Tensor mask = at::empty({rows, n}, x.options());
  if (mask.numel() == 0) return mask;
  Params P{};
  P.pitch = rows > 1 ? x.stride(0) : n;
  P.n = n;
  P.K = 0;
  P.kvec = k.const_data_ptr<double>();
  P.flip = largest ? 0u : 0xFFFFFFFFu;
  P.out_mask = nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fastlapsum_hard_mask_cuda", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      P.x = x.const_data_ptr<scalar_t>();
      P.out_mask = mask.mutable_data_ptr<scalar_t>();
      launch<scalar_t, true>(P, rows, x);
    }
  });
  return mask;
}

TORCH_LIBRARY_IMPL(fastlapsum, CUDA, m) { m.impl("topk", &topk_cuda); }

}  // namespace fastlapsum
