// CUDA threshold solver: the radix bracket of DESIGN §1.2, run as the primary GPU
// solver until the certified sample bracket lands on the GPU.
//
// Each level histograms one digit of the order-preserving key of the scores still in
// play (11 + 11 + 10 bits for 32-bit keys, 11 x 5 + 9 for fp64) into range atoms: a
// count and the exponential sums relative to the bin's key-range edges (fixed, so that
// blocks can add them with atomics; a term that underflows against an edge is also
// negligible for every threshold outside the bin). A one-block-per-row kernel scans the
// atoms with the shared closed-form scan: it finds the gap holding the root, or names
// the bin to refine (the final level's bins are single values, so every row has its
// gap by then). A last pass then sums the scores on either side of the gap relative to
// the nearest score with deterministic block reductions (no float atomics) and solves
// in closed form, so the answer is exact and the same on every run. Fixed launch count,
// O(n) per level, no host sync.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <cfloat>
#include <cub/block/block_reduce.cuh>
#include <type_traits>

#include "../common/atom_scan.h"
#include "../common/cuda_launch.cuh"
#include "../common/op_io.h"
#include "../ops.h"

namespace fastlapsum {
namespace {

constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;

struct RadixRow {
  Tail above, below;
  uint64_t prefix;  // key bits fixed so far
  int done;         // how many
  int active;       // still refining
  double k, t;      // finite-score budget and temperature
  int solving;      // gap found: solve in the last pass
  double gap_lo, gap_hi;  // no score lies strictly inside; the root does
};

// Scores on each side of the gap: `above` (s >= gap_hi) and `below` (s <= gap_lo).
struct GapSides {
  Atom above, below;
};

struct GapMerge {
  double t;
  __device__ GapSides operator()(GapSides a, const GapSides& b) const {
    atom_merge(a.above, b.above, t);
    atom_merge(a.below, b.below, t);
    return a;
  }
};

struct BinSums {  // global histogram entry
  unsigned long long count;
  double U, L;
};

// 32-bit keys for fp32/fp16/bf16 scores, 64-bit for fp64.
template <typename scalar_t>
struct KeyTraits {
  using Key = uint32_t;
  static constexpr int kBits = 32;
  __device__ static Key key(double s) { return float_key(static_cast<float>(s)); }
  __device__ static double value(Key k) {
    const float v = key_to_float(k);
    if (v != v) return k > float_key(INFINITY) ? FLT_MAX : -FLT_MAX;  // NaN range: an end
    return fmax(fmin(static_cast<double>(v), FLT_MAX), -FLT_MAX);
  }
};
template <>
struct KeyTraits<double> {
  using Key = uint64_t;
  static constexpr int kBits = 64;
  __device__ static Key key(double s) { return double_key(s); }
  __device__ static double value(Key k) {
    const double v = key_to_double(k);
    if (v != v) return k > double_key(INFINITY) ? DBL_MAX : -DBL_MAX;
    return fmax(fmin(v, DBL_MAX), -DBL_MAX);
  }
};

__host__ __device__ constexpr int levels_for(int bits) { return (bits + kDigitBits - 1) / kDigitBits; }
__device__ inline int digit_bits(int bits, int done) { return bits - done < kDigitBits ? bits - done : kDigitBits; }

template <typename scalar_t>
__global__ void radix_hist_kernel(const scalar_t* __restrict__ x, const RadixRow* __restrict__ state,
                                  const double* __restrict__ t_in, BinSums* __restrict__ hist,
                                  unsigned long long* __restrict__ nonfinite, int64_t rows, int64_t n,
                                  double sign, bool first) {
  using KT = KeyTraits<scalar_t>;
  using Key = typename KT::Key;
  __shared__ unsigned int s_count[kBins];
  __shared__ double s_U[kBins], s_L[kBins];
  __shared__ unsigned long long s_nonfinite[3];
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    // the first level runs before any row state exists
    const RadixRow st = first ? RadixRow{{}, {}, 0, 0, 1, 0.0, t_in[r], 0, 0.0, 0.0} : state[r];
    if (!st.active) continue;  // uniform across the block
    for (int j = threadIdx.x; j < kBins; j += blockDim.x) { s_count[j] = 0; s_U[j] = 0; s_L[j] = 0; }
    if (threadIdx.x < 3) s_nonfinite[threadIdx.x] = 0;
    __syncthreads();
    const int bits = digit_bits(KT::kBits, st.done);
    const int shift = KT::kBits - st.done - bits;
    const Key low_mask = (shift == 0) ? Key(0) : ((Key(1) << shift) - 1);
    const double t = st.t;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
      const double s = sign * static_cast<double>(x[r * n + i]);
      if (!is_finite(s)) {
        if (first) atomicAdd(&s_nonfinite[s != s ? 0 : (s > 0 ? 1 : 2)], 1ull);
        continue;
      }
      const Key key = KT::key(s);
      if (st.done > 0 && static_cast<uint64_t>(key >> (KT::kBits - st.done)) != st.prefix) continue;
      const int bin = static_cast<int>((key >> shift) & ((Key(1) << bits) - 1));
      atomicAdd(&s_count[bin], 1u);
      atomicAdd(&s_U[bin], exp((KT::value(key & ~low_mask) - s) / t));
      atomicAdd(&s_L[bin], exp((s - KT::value(key | low_mask)) / t));
    }
    __syncthreads();
    BinSums* h = hist + r * kBins;
    for (int j = threadIdx.x; j < kBins; j += blockDim.x) {
      if (s_count[j] == 0) continue;
      atomicAdd(&h[j].count, static_cast<unsigned long long>(s_count[j]));
      atomicAdd(&h[j].U, s_U[j]);
      atomicAdd(&h[j].L, s_L[j]);
    }
    if (first && threadIdx.x < 3 && s_nonfinite[threadIdx.x] > 0)
      atomicAdd(&nonfinite[3 * r + threadIdx.x], s_nonfinite[threadIdx.x]);
    __syncthreads();
  }
}

// One block per row: thread 0 settles the row or scans its atoms; all threads then
// clear the row's histogram for the next level.
template <typename scalar_t>
__global__ void radix_scan_kernel(RadixRow* __restrict__ state, BinSums* __restrict__ hist,
                                  const unsigned long long* __restrict__ nonfinite,
                                  const double* __restrict__ k_in, const double* __restrict__ t_in,
                                  double* __restrict__ b_out, double* __restrict__ edge_out,
                                  int64_t* __restrict__ diag, int64_t rows, int64_t n, double sign,
                                  bool first) {
  using KT = KeyTraits<scalar_t>;
  using Key = typename KT::Key;
  __shared__ short s_bins[kBins];
  __shared__ double s_B[kBins + 1];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    BinSums* h = hist + r * kBins;
    if (threadIdx.x == 0) {
      RadixRow st = state[r];
      double b = NAN, edge = 1.0;
      bool done = false;
      if (first) {
        const double k = k_in[r], t = t_in[r], nn = static_cast<double>(n);
        const double pinf = static_cast<double>(nonfinite[3 * r + 1]);
        const double ninf = static_cast<double>(nonfinite[3 * r + 2]);
        st = RadixRow{Tail{0.0, 0.0, INFINITY}, Tail{0.0, 0.0, -INFINITY}, 0, 0, 1, k - pinf, t, 0, 0.0, 0.0};
        done = true;
        if (!(k >= 0.0 && k <= nn) || !(t > 0.0) || !is_finite(t) || nonfinite[3 * r] > 0) {
          edge = NAN;
        } else if (k <= pinf) {
          b = INFINITY;
          edge = pinf > 0 ? k / pinf : 0.0;
        } else if (k >= nn - ninf) {
          b = -INFINITY;
          edge = ninf > 0 ? (k - (nn - ninf)) / ninf : 1.0;
        } else {
          done = false;
        }
        if (done) {
          diag[3 * r] = kPathDirect;
          diag[3 * r + 1] = 0;
          diag[3 * r + 2] = 0;
        }
      }
      if (!done && st.active) {
        const int bits = digit_bits(KT::kBits, st.done);
        const int shift = KT::kBits - st.done - bits;
        const Key low_mask = (shift == 0) ? Key(0) : ((Key(1) << shift) - 1);
        const Key base = st.done == 0 ? Key(0) : static_cast<Key>(st.prefix << (KT::kBits - st.done));
        int P = 0;
        for (int j = (1 << bits) - 1; j >= 0; --j)
          if (h[j].count > 0) s_bins[P++] = static_cast<short>(j);
        const auto atom_at = [&](int64_t i) {
          const int j = s_bins[i];
          const Key lo_key = base | (static_cast<Key>(j) << shift);
          const BinSums& bs = h[j];
          return Atom{KT::value(lo_key), KT::value(lo_key | low_mask), static_cast<double>(bs.count), bs.U, bs.L};
        };
        const ScanResult res = scan_atoms(atom_at, P, st.above, st.below, st.k, st.t, s_B);
        if (res.inside >= 0 && shift > 0) {
          st.prefix = (st.prefix << bits) | static_cast<uint64_t>(s_bins[res.inside]);
          st.done += bits;
          st.above = res.above;
          st.below = res.below;
        } else {
          st.active = 0;
          st.solving = 1;
          edge_out[r] = 1.0;
          if (res.inside >= 0) {  // a single-key bin is a point: the gap is [v, v]
            st.gap_lo = st.gap_hi = atom_at(res.inside).lo;
          } else {
            st.gap_lo = res.gap_lo;
            st.gap_hi = res.gap_hi;
          }
        }
      }
      if (done) {
        st.active = 0;
        b_out[r] = sign * b;
        edge_out[r] = edge;
      }
      state[r] = st;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < kBins; j += blockDim.x) h[j] = BinSums{0, 0.0, 0.0};
    __syncthreads();
  }
}

template <typename scalar_t>
__global__ void gap_sides_kernel(const scalar_t* __restrict__ x, const RadixRow* __restrict__ state,
                                 GapSides* __restrict__ partial, int64_t rows, int64_t n, double sign) {
  using Reduce = cub::BlockReduce<GapSides, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  const Atom none{0, 0, 0, 0, 0};
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const RadixRow st = state[r];
    if (!st.solving) continue;  // uniform across the block
    GapSides acc{none, none};
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
      const double s = sign * static_cast<double>(x[r * n + i]);
      if (!is_finite(s)) continue;
      if (s >= st.gap_hi) atom_add(acc.above, s, st.t);
      else if (s <= st.gap_lo) atom_add(acc.below, s, st.t);
    }
    const GapSides total = Reduce(tmp).Reduce(acc, GapMerge{st.t});
    if (threadIdx.x == 0) partial[r * gridDim.x + blockIdx.x] = total;
    __syncthreads();
  }
}

// One thread per row folds the row's partials in order and solves on the gap between
// the nearest scores: C = #above, A = sum e^{(min_above - s)/t}, B = sum e^{(s - max_below)/t}.
__global__ void gap_solve_kernel(const RadixRow* __restrict__ state, const GapSides* __restrict__ partial,
                                 int chunks, double* __restrict__ b_out, int64_t* __restrict__ diag,
                                 int64_t rows, double sign) {
  const int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (r >= rows) return;
  const RadixRow st = state[r];
  if (!st.solving) return;
  GapSides g{Atom{0, 0, 0, 0, 0}, Atom{0, 0, 0, 0, 0}};
  const GapMerge merge{st.t};
  for (int c = 0; c < chunks; ++c) g = merge(g, partial[r * chunks + c]);
  const double hi = g.above.count > 0 ? g.above.lo : INFINITY;
  const double lo = g.below.count > 0 ? g.below.hi : -INFINITY;
  b_out[r] = sign * solve_interval(g.above.count, g.above.U, g.below.L, hi, lo, st.k, st.t);
  diag[3 * r] = kPathRadix;
  diag[3 * r + 1] = 0;
  diag[3 * r + 2] = 0;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_threshold_cuda(const at::Tensor& x_in,
                                                                     const at::Tensor& k_in,
                                                                     const at::Tensor& t_in,
                                                                     bool largest, int64_t method) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  ThresholdIO io = threshold_io(x_in, k_in, t_in, method);
  // plain references, not a structured binding: lambdas below capture them (C++17 builds)
  const at::Tensor &x = io.x, &k = io.k, &t = io.t;
  at::Tensor &b = io.b, &edge = io.edge, &diag = io.diag;
  const int64_t rows = x.size(0), n = x.size(1);
  if (rows == 0) return {b, edge, diag};
  // workspaces from the caching allocator; sizes depend on the shape only
  at::Tensor state = at::empty({rows * int64_t(sizeof(RadixRow))}, x.options().dtype(at::kByte));
  at::Tensor hist = at::zeros({rows * kBins * int64_t(sizeof(BinSums))}, x.options().dtype(at::kByte));
  at::Tensor nonfinite = at::zeros({rows, 3}, x.options().dtype(at::kLong));
  const double sign = largest ? 1.0 : -1.0;
  const cudaStream_t stream = current_stream();
  const dim3 hist_grid = row_grid(rows, n, 16, 1024);
  const unsigned scan_grid = static_cast<unsigned>(rows < 65535 ? rows : 65535);
  at::Tensor sides = at::empty({rows * int64_t(hist_grid.x) * int64_t(sizeof(GapSides))}, x.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "lapsum_threshold_cuda", [&] {
    auto* st = reinterpret_cast<RadixRow*>(state.mutable_data_ptr());
    auto* hs = reinterpret_cast<BinSums*>(hist.mutable_data_ptr());
    auto* nf = reinterpret_cast<unsigned long long*>(nonfinite.mutable_data_ptr<int64_t>());
    const int levels = levels_for(KeyTraits<scalar_t>::kBits);
    for (int level = 0; level < levels; ++level) {
      const bool first = level == 0;
      radix_hist_kernel<scalar_t><<<hist_grid, kThreads, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), st, t.const_data_ptr<double>(), hs, nf, rows, n, sign, first);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      radix_scan_kernel<scalar_t><<<scan_grid, kThreads, 0, stream>>>(
          st, hs, nf, k.const_data_ptr<double>(), t.const_data_ptr<double>(), b.mutable_data_ptr<double>(),
          edge.mutable_data_ptr<double>(), diag.mutable_data_ptr<int64_t>(), rows, n, sign, first);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    gap_sides_kernel<scalar_t><<<hist_grid, kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), st, reinterpret_cast<GapSides*>(sides.mutable_data_ptr()), rows, n, sign);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    gap_solve_kernel<<<static_cast<unsigned>((rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        st, reinterpret_cast<const GapSides*>(sides.const_data_ptr()), static_cast<int>(hist_grid.x),
        b.mutable_data_ptr<double>(), diag.mutable_data_ptr<int64_t>(), rows, sign);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {b, edge, diag};
}

TORCH_LIBRARY_IMPL(fastlapsum, CUDA, m) { m.impl("lapsum_threshold", &lapsum_threshold_cuda); }

}  // namespace fastlapsum
