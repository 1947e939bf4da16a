// CPU threshold solvers for the LapSum budget equation (DESIGN §1.1, §1.2).
//
// Per row: count non-finite scores and settle the cases with no interior root;
// otherwise solve on the finite scores with the sort solver or the certified sample
// bracket, whose exact fallback is the radix bracket. Rows run in parallel; a long
// row's passes are split into a fixed number of parts (fixed so that the answer does
// not depend on the thread count).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <array>
#include <limits>
#include <vector>

#include "../common/atom_scan.h"
#include "../common/bracket_rule.h"
#include "../common/cpu_rows.h"
#include "../common/cpu_vec.h"
#include "../common/order_keys.h"
#include "../common/op_io.h"
#include "../common/plan.h"
#include "../ops.h"

namespace fastlapsum {
namespace {

struct RowSolution {
  double b;
  double edge;
  int64_t path;
  int64_t middle;
  int64_t attempts;
  double kth = NAN;  // the kf-th largest finite score where the solve ordered it (kf integral), else NaN
};

// The kf-th largest of the scores `sorted` (descending) that rank below the `above` others, or
// NaN where kf is not an integer or that score is not among them.
double kth_of(const std::vector<double>& sorted, double above, double kf) {
  const double j = kf - above;  // 1-based rank among the sorted
  if (kf != std::nearbyint(kf) || !(j >= 1.0) || j > static_cast<double>(sorted.size())) return NAN;
  return sorted[static_cast<size_t>(j) - 1];
}

struct Counts {
  int64_t nan = 0, pinf = 0, ninf = 0;
};

// The non-finite scores of [i0, i1) of a row, on four lanes.
template <typename scalar_t>
FLS_CPU_CLONES Counts count_part(const scalar_t* x, int64_t i0, int64_t i1, double sign) {
  F64x4 nan{}, pinf{}, ninf{};
  for (int64_t i = i0; i < i1; i += kLanes) {
    const F64x4 s = load_lanes_tail(x, i, i1, sign, 0.0);  // absent lanes 0: finite
    nan += s != s ? 1.0 : 0.0;
    pinf += s == INFINITY ? 1.0 : 0.0;
    ninf += s == -INFINITY ? 1.0 : 0.0;
  }
  return Counts{static_cast<int64_t>(lane_sum(nan)), static_cast<int64_t>(lane_sum(pinf)),
                static_cast<int64_t>(lane_sum(ninf))};
}

template <typename scalar_t>
Counts count_nonfinite(const Row<scalar_t>& row) {
  Counts total;
  for (const Counts& c : over_parts<Counts>(row.n, Counts{}, [&](int64_t i0, int64_t i1, Counts& c) {
         c = count_part(row.p, i0, i1, row.sign);
       })) {
    total.nan += c.nan; total.pinf += c.pinf; total.ninf += c.ninf;
  }
  return total;
}

// §1.1: sort the finite scores and scan them as point atoms.
template <typename scalar_t>
double solve_sort(const Row<scalar_t>& row, int64_t finite, double k, double t, double* kth) {
  std::vector<double> s;
  s.reserve(finite);
  for (int64_t i = 0; i < row.n; ++i) {
    const double v = row(i);
    if (std::isfinite(v)) s.push_back(v);
  }
  std::sort(s.begin(), s.end(), std::greater<double>());
  std::vector<double> scratch(s.size() + 1);
  const ScanResult r = scan_atoms([&](int64_t i) { return point_atom(s[i]); },
                                  static_cast<int64_t>(s.size()), Tail{0.0, 0.0, INFINITY},
                                  Tail{0.0, 0.0, -INFINITY}, k, t, scratch.data());
  *kth = kth_of(s, 0.0, k);
  return r.b;
}

// §1.1.1: the root in the outer gap (above the max where 2 kf <= nf, else below the min),
// in O(n) without a sort, or NaN where it lies among the scores.
template <typename scalar_t>
double solve_outer_gap(const Row<scalar_t>& row, int64_t finite, double kf, double t) {
  const double nf = static_cast<double>(finite), side = outer_gap_side(kf, nf);
  double m = -INFINITY;  // max of side * s over the finite scores
  for (int64_t i = 0; i < row.n; ++i) {
    const double v = side * row(i);
    if (std::isfinite(v) && v > m) m = v;
  }
  const GapExp e(t);
  GapSum S{0, 0};
  for (int64_t i = 0; i < row.n; ++i) {
    const double v = side * row(i);
    if (std::isfinite(v)) S.add(e(v - m));
  }
  return outer_gap_root_on(side, m, S.value(), kf, nf, t);
}

// §1.2 fallback: the radix bracket. Each level histograms the next 11-bit digit of
// the order-preserving key of the scores still in play into range atoms; the scan
// either solves in a gap or names the bin to refine. Exact, O(n) per level, and a
// bin that holds one distinct value can never contain the root, so it terminates.
template <typename scalar_t>
double solve_radix(const Row<scalar_t>& row, double k, double t) {
  constexpr int kDigitBits = 11;
  constexpr int kBins = 1 << kDigitBits;
  Tail above{0.0, 0.0, INFINITY}, below{0.0, 0.0, -INFINITY};
  const double inv_t = inv_temperature(t);
  uint64_t prefix = 0;
  std::vector<double> scratch(kBins + 1);
  for (int done = 0; done < 64; done += kDigitBits) {
    const int bits = std::min(kDigitBits, 64 - done);
    const int shift = 64 - done - bits;
    using Hist = std::vector<Atom>;
    const Hist empty(kBins, Atom{0, 0, 0, 0, 0});
    auto parts = over_parts<Hist>(row.n, empty, [&](int64_t i0, int64_t i1, Hist& h) {
      for (int64_t i = i0; i < i1; ++i) {
        const double s = row(i);
        if (!std::isfinite(s)) continue;
        const uint64_t key = double_key(s);
        if (done > 0 && (key >> (64 - done)) != prefix) continue;
        atom_add(h[(key >> shift) & ((1u << bits) - 1)], s, inv_t);
      }
    });
    Hist& hist = parts[0];
    for (size_t p = 1; p < parts.size(); ++p)
      for (int j = 0; j < kBins; ++j) atom_merge(hist[j], parts[p][j], inv_t);
    std::vector<int> bins;  // non-empty bins, highest first
    for (int j = (1 << bits) - 1; j >= 0; --j)
      if (hist[j].count > 0) bins.push_back(j);
    const ScanResult r = scan_atoms([&](int64_t i) { return hist[bins[i]]; },
                                    static_cast<int64_t>(bins.size()), above, below, k, t,
                                    scratch.data());
    if (r.inside < 0) return r.b;
    prefix = (prefix << bits) | static_cast<uint64_t>(bins[r.inside]);
    above = r.above;
    below = r.below;
  }
  return NAN;  // unreachable: a 64-bit prefix is a single value
}

// The sample's Laplace noise by slot (laplace_noise), computed once: a sample takes fewer than
// 2 kMaxSample slots, and an fp64 log per slot and call cost about what certifying costs.
double sample_noise(int64_t slot) {
  static const std::vector<double> table = [] {
    std::vector<double> v(2 * kMaxSample);
    for (size_t s = 0; s < v.size(); ++s) v[s] = laplace_noise(static_cast<uint32_t>(s));
    return v;
  }();
  return slot < static_cast<int64_t>(table.size()) ? table[slot] : laplace_noise(static_cast<uint32_t>(slot));
}

// A certification pass over one part of a row (§1.2): h = #{s >= aR}, SR = sum e^{(aR-s)/t}
// over those, SL = sum e^{(s-aL)/t} over s < aL, and over the middle aL <= s < aR its count and
// midR = sum e^{(s-aR)/t}; the middle's scores gathered into `mid` while it holds fewer than
// `cap` (midL = sum e^{(aL-s)/t} is taken from them, middle_left). One exponential a score, to
// the end that its sums need (branch-free, four lanes); non-finite scores count nowhere.
struct BracketSums {
  double h = 0, SR = 0, SL = 0, midR = 0;
  int64_t count = 0;
  std::vector<double> mid;
};

// A thread's scratch for one part's gathered middle (grown, never shrunk): the gather writes
// every score and advances only past the kept ones, so it needs room for one more.
inline double* middle_scratch(int64_t len) {
  thread_local std::vector<double> buf;
  if (static_cast<int64_t>(buf.size()) < len) buf.resize(len);
  return buf.data();
}

// Four scores' sides of the bracket and exponentials (bracket_sums).
struct BracketLanes {
  I64x4 above, below, mid;
  F64x4 e;
};
[[gnu::always_inline]] inline BracketLanes bracket_lanes(F64x4 s, double aL, double aR, const GapExp& ex) {
  const I64x4 finite = s - s == 0.0, above = finite & (s >= aR), below = finite & (s < aL),
              mid = finite & ~above & ~below;
  return {above, below, mid, exp_nonpos((below ? s - aL : (above ? aR - s : s - aR)) * ex.scale * ex.inv_ts)};
}

// bracket_sums' running lane sums and gathered middle. bracket_add is branch-free: every lane's
// score is written at `held`, which advances past the middle's while fewer than `room` are held.
// (A function, not a lambda: a lambda in a target_clones function is built for the baseline
// ISA and called across the ABI.)
struct BracketAcc {
  F64x4 h{}, SR{}, SL{}, midR{}, count{};
  double* kept;
  int64_t room, held = 0;
};
[[gnu::always_inline]] inline void bracket_add(BracketAcc& a, F64x4 s, const BracketLanes& v) {
  a.h += v.above ? 1.0 : 0.0;
  a.SR += v.above ? v.e : 0.0;
  a.SL += v.below ? v.e : 0.0;
  a.midR += v.mid ? v.e : 0.0;
  a.count += v.mid ? 1.0 : 0.0;
  for (int l = 0; l < kLanes; ++l) {
    a.kept[a.held] = s[l];
    a.held += v.mid[l] != 0 && a.held < a.room ? 1 : 0;
  }
}

template <typename scalar_t>
FLS_CPU_CLONES void bracket_sums(const scalar_t* x, int64_t i0, int64_t i1, double sign, double aL, double aR,
                                 GapExp ex, int64_t cap, BracketSums& out) {
  const int64_t room = std::min(cap, i1 - i0);
  BracketAcc a;
  a.kept = middle_scratch(room + 1);
  a.room = room;
  int64_t i = i0;
  // Two vectors a step, their exponentials' dependent chains side by side; the sums still add
  // in the order of the scores.
  for (; i + 2 * kLanes <= i1; i += 2 * kLanes) {
    const F64x4 s0 = load_lanes(x, i, sign), s1 = load_lanes(x, i + kLanes, sign);
    const BracketLanes v0 = bracket_lanes(s0, aL, aR, ex), v1 = bracket_lanes(s1, aL, aR, ex);
    bracket_add(a, s0, v0);
    bracket_add(a, s1, v1);
  }
  for (; i < i1; i += kLanes) {
    const F64x4 s = load_lanes_tail(x, i, i1, sign, NAN);  // absent lanes NaN: counted nowhere
    bracket_add(a, s, bracket_lanes(s, aL, aR, ex));
  }
  out.h = lane_sum(a.h);
  out.SR = lane_sum(a.SR);
  out.SL = lane_sum(a.SL);
  out.midR = lane_sum(a.midR);
  out.count = static_cast<int64_t>(lane_sum(a.count));
  out.mid.assign(a.kept, a.kept + a.held);
}

// midL of the gathered middle scores [p, p + len).
FLS_CPU_CLONES double middle_left(const double* p, int64_t len, double aL, GapExp ex) {
  F64x4 sum{};
  for (int64_t i = 0; i < len; i += kLanes) {
    F64x4 e = exp_nonpos((aL - load_lanes_tail(p, i, len, 1.0, aL)) * ex.scale * ex.inv_ts);
    for (int l = 0; l < kLanes; ++l)
      if (i + l >= len) e[l] = 0.0;  // absent lanes
    sum += e;
  }
  return lane_sum(sum);
}

// §1.2: propose a bracket from the noised systematic sample, certify it in one pass, then gather
// and sort the middle set and solve on it with the tails folded in; widen on failure (the
// failed side tells where b is), then fall back to the radix bracket.
template <typename scalar_t>
RowSolution solve_bracket(const Row<scalar_t>& row, int64_t row_index, int64_t finite, double k,
                          double t) {
  const SampleGeometry g = sample_geometry(row.n, row_index);
  std::vector<double> y;
  y.reserve(g.count);
  for (int64_t s = 0; s < g.count; ++s) {
    const double v = row(g.offset + s * g.stride);
    if (std::isfinite(v)) y.push_back(v + t * sample_noise(s));
  }
  const int64_t m = static_cast<int64_t>(y.size());
  // The i-th smallest noised sample: a selection, not a sort (a try needs two of the
  // sample's order statistics, and the sample is up to ~65536 scores). Each selection leaves y
  // partitioned about its index, so the next selects only between the nearest two chosen.
  std::vector<int64_t> chosen;
  const auto order_stat = [&](int64_t i) {
    int64_t lo = 0, hi = m;
    for (const int64_t c : chosen) {
      if (c == i) return y[i];
      if (c < i) lo = std::max(lo, c + 1);
      else hi = std::min(hi, c);
    }
    std::nth_element(y.begin() + lo, y.begin() + i, y.begin() + hi);
    chosen.push_back(i);
    return y[i];
  };
  const GapExp ex(t);
  double known_lo = -INFINITY, known_hi = INFINITY;  // b >= known_lo, b < known_hi
  int64_t middle = 0;
  int tries = 0;  // certification passes made
  for (int attempt = 0; attempt < kBracketAttempts && m > 0; ++attempt) {
    int64_t il, iu;
    bracket_indices(m, static_cast<double>(finite), k, attempt, &il, &iu);
    const double aL = std::max(il < 0 ? -INFINITY : order_stat(il), known_lo);
    const double aR = std::min(iu >= m ? INFINITY : order_stat(iu), known_hi);
    if (!(aL < aR)) continue;  // what earlier tries learnt leaves no room: widen
    const int64_t cap = middle_capacity(finite, m, il, iu);
    ++tries;
    const auto parts = over_parts<BracketSums>(row.n, BracketSums{}, [&](int64_t i0, int64_t i1, BracketSums& q) {
      bracket_sums(row.p, i0, i1, row.sign, aL, aR, ex, cap, q);
    });
    BracketSums tot;
    for (const BracketSums& q : parts) {
      tot.h += q.h; tot.SR += q.SR; tot.SL += q.SL;
      tot.midR += q.midR; tot.count += q.count;
    }
    middle = tot.count;
    const double G = std::isfinite(aL) && std::isfinite(aR) ? std::exp((aL - aR) / t) : 0.0;
    const double psiR = tot.h - 0.5 * tot.SR + 0.5 * tot.midR + 0.5 * tot.SL * G;
    const bool gathered = std::all_of(parts.begin(), parts.end(), [](const BracketSums& q) {
      return static_cast<int64_t>(q.mid.size()) == q.count;
    });
    if (!gathered) {  // a part's middle outgrew the gather, so count > cap: widen only where b lies above
      if (psiR > k) {
        known_lo = std::max(known_lo, aR);
        continue;
      }
      break;  // the exact fallback
    }
    std::vector<double> mid;
    mid.reserve(tot.count);
    for (const BracketSums& q : parts) mid.insert(mid.end(), q.mid.begin(), q.mid.end());
    const double midL = middle_left(mid.data(), static_cast<int64_t>(mid.size()), aL, ex);
    const double psiL = tot.h + tot.count - 0.5 * tot.SR * G - 0.5 * midL + 0.5 * tot.SL;
    if (psiR > k) known_lo = std::max(known_lo, aR);  // b lies above the bracket
    if (psiL < k) known_hi = std::min(known_hi, aL);  // b lies below it
    if (psiR > k || psiL < k) continue;
    if (tot.count > cap) break;  // certified but too wide to gather: ties, go exact
    std::sort(mid.begin(), mid.end(), std::greater<double>());
    std::vector<double> scratch(mid.size() + 1);
    const ScanResult r = scan_atoms([&](int64_t i) { return point_atom(mid[i]); },
                                    static_cast<int64_t>(mid.size()), Tail{tot.h, tot.SR, aR},
                                    Tail{0.0, tot.SL, aL}, k, t, scratch.data());
    return RowSolution{r.b, 1.0, tries == 1 ? kPathBracket : kPathBracketRetry, middle, tries,
                       kth_of(mid, tot.h, k)};
  }
  return RowSolution{solve_radix(row, k, t), 1.0, kPathRadix, middle, tries};
}

template <typename scalar_t>
RowSolution solve_row(const Row<scalar_t>& row, int64_t row_index, double k, double t,
                      int64_t method) {
  const bool valid = k >= 0.0 && k <= static_cast<double>(row.n) && t > 0.0 && std::isfinite(t);
  const Counts c = valid ? count_nonfinite(row) : Counts{};
  double b, edge, kf;
  if (settle_row(k, t, static_cast<double>(row.n), static_cast<double>(c.nan), static_cast<double>(c.pinf),
                 static_cast<double>(c.ninf), &b, &edge, &kf))
    return RowSolution{b, edge, kPathDirect, 0, 0};
  const int64_t finite = row.n - c.pinf - c.ninf;
  if (!plan_sorts(row.n, method, kAutoSortMaxNCpu)) return solve_bracket(row, row_index, finite, kf, t);
  const double gap = solve_outer_gap(row, finite, kf, t);
  if (!std::isnan(gap)) return RowSolution{gap, 1.0, kPathOuterGap, 0, 0};
  double kth;
  const double b_sort = solve_sort(row, finite, kf, t, &kth);
  return RowSolution{b_sort, 1.0, kPathSort, finite, 0, kth};
}

}  // namespace

namespace {

// Every row's threshold into io (b, edge, diag); kth (rows values, or nullptr) gets each row's
// k-th largest score where its solve ordered it (NaN elsewhere), for the straight-through mask.
void solve_rows(ThresholdIO& io, bool largest, int64_t method, double* kth) {
  const int64_t rows = io.x.size(0), n = io.x.size(1);
  const double sign = largest ? 1.0 : -1.0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, io.x.scalar_type(), "lapsum_threshold", [&] {
    const scalar_t* xp = io.x.const_data_ptr<scalar_t>();
    const double* kp = io.k.const_data_ptr<double>();
    const double* tp = io.t.const_data_ptr<double>();
    double* bp = io.b.mutable_data_ptr<double>();
    double* ep = io.edge.mutable_data_ptr<double>();
    int64_t* dp = io.diag.mutable_data_ptr<int64_t>();
    at::parallel_for(0, rows, rows_grain(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const RowSolution s = solve_row(Row<scalar_t>{xp + r * n, n, sign}, r, kp[r], tp[r], method);
        bp[r] = sign * s.b;
        ep[r] = s.edge;
        dp[3 * r] = s.path;
        dp[3 * r + 1] = s.middle;
        dp[3 * r + 2] = s.attempts;
        if (kth) kth[r] = s.kth;
      }
    });
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> lapsum_threshold_cpu(const at::Tensor& x_in,
                                                                    const at::Tensor& k_in,
                                                                    const at::Tensor& t_in,
                                                                    bool largest, int64_t method) {
  ThresholdIO io = threshold_io(x_in, k_in, t_in, method);
  solve_rows(io, largest, method, nullptr);
  return {io.b, io.edge, io.diag};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> soft_topk_forward_cpu(
    const at::Tensor& x, const at::Tensor& k, const at::Tensor& t, bool largest, int64_t method,
    int64_t mode, int64_t /*k_max: the CPU mask needs no plan*/) {
  TORCH_CHECK(mode >= kModeSoft && mode <= kModeHard, "fastlapsum: mode must be 0 (soft), 1 (log) or 2 (hard)");
  ThresholdIO io = threshold_io(x, k, t, method);
  at::Tensor p;
  if (mode == kModeHard) {
    // the solve's own order gives most rows' k-th score: the mask needs no second selection there
    at::Tensor kth = at::empty({io.x.size(0)}, io.b.options());
    solve_rows(io, largest, method, kth.mutable_data_ptr<double>());
    p = hard_mask_cpu(io.x, io.k, io.b, largest, &kth);  // a NaN row stays NaN; otherwise exactly k ones
  } else {
    solve_rows(io, largest, method, nullptr);
    p = lapsum_mask_cpu(io.x, io.b, io.t, io.edge, largest, mode == kModeLog);
  }
  return {p, io.b, io.diag};
}

}  // namespace fastlapsum
