// The exact budget-curve scan (DESIGN §1.1 with the tails of §1.2 folded in).
//
// The scores that matter are given as "atoms" in descending order: a single sorted
// score (a point) or a radix bin (a range [lo, hi] with its count and two rescaled
// exponential sums). Scores outside the atoms are summarised by two tails whose
// exponential sums are relative to a reference that bounds them. The scan walks the
// gaps between atoms with the prefix/suffix recurrences of §1.1, finds the gap whose
// end values of Psi bracket k, and solves it in closed form. If k falls strictly
// inside a range atom, it reports that atom and the tails to refine it with.
#pragma once

#include "lapsum_math.h"

namespace fastlapsum {

// Scores all above (or all below) the current region.
//   above: count of scores, sum = sum e^{(ref - s)/t}, ref <= every such s
//   below: sum = sum e^{(s - ref)/t}, ref >= every such s (count not needed)
struct Tail {
  double count;
  double sum;
  double ref;
};

// A group of scores lying in [lo, hi] with U = sum e^{(lo - s)/t}, L = sum e^{(s - hi)/t}.
struct Atom {
  double lo, hi, count, U, L;
};

FLS_HD Atom point_atom(double s) { return Atom{s, s, 1.0, 1.0, 1.0}; }

// Add one score to a range atom, rescaling the sums when an end moves (online, so
// that the exponents stay <= 0 whatever order the scores come in). inv_t = 1/t
// (inv_temperature): these run once per score or per merge, so no division.
FLS_HD void atom_add(Atom& a, double s, double inv_t) {
  if (a.count == 0.0) {
    a = point_atom(s);
    return;
  }
  if (s >= a.lo) a.U += exp((a.lo - s) * inv_t);
  else { a.U = a.U * exp((s - a.lo) * inv_t) + 1.0; a.lo = s; }
  if (s <= a.hi) a.L += exp((s - a.hi) * inv_t);
  else { a.L = a.L * exp((a.hi - s) * inv_t) + 1.0; a.hi = s; }
  a.count += 1.0;
}

FLS_HD void atom_merge(Atom& a, const Atom& b, double inv_t) {
  if (b.count == 0.0) return;
  if (a.count == 0.0) { a = b; return; }
  // each sum is rescaled to the merged end; the side that holds that end scales by e^0 = 1
  const double eu = exp(-fabs(a.lo - b.lo) * inv_t), el = exp(-fabs(a.hi - b.hi) * inv_t);
  a.U = a.lo <= b.lo ? a.U + b.U * eu : a.U * eu + b.U;
  a.L = a.hi >= b.hi ? a.L + b.L * el : a.L * el + b.L;
  a.lo = a.lo < b.lo ? a.lo : b.lo;
  a.hi = a.hi > b.hi ? a.hi : b.hi;
  a.count += b.count;
}

// What walk_gaps found: the root lies in the gap (lo, above's upper end) with `above` the
// sums over everything above the gap and B those below it against lo; or, where inside >= 0,
// strictly inside range atom `inside`, with `above` the sums above that atom and B, lo those
// below it.
template <typename Above>
struct GapHit {
  Above above;
  double B, lo;
  int64_t inside;
};

// The walk of §1.1 over the gaps between atoms, highest first, in any frame of sums. Gap j
// lies above atom j (above the lower tail, whose top is lo_end, for j = P); below_at(j) is
// B there: the sums of atom j and everything below it. The root lies in the first gap whose
// lower end has Psi >= k (the last gap if none), unless the atom above that gap is a range
// whose lower end still has Psi > k: then inside it. Empty atoms (count 0) are no atoms.
// The Curve gives the frame: its Above (the sums above a gap), add (an atom joins them),
// psi_lo / psi_hi (Psi at the gap's lower / upper end).
template <typename Curve, typename AtomAt, typename BelowAt>
FLS_HD GapHit<typename Curve::Above> walk_gaps(const Curve& curve, AtomAt atom_at, BelowAt below_at, int64_t P,
                                               typename Curve::Above above, double lo_end, double k) {
  using Hit = GapHit<typename Curve::Above>;
  typename Curve::Above prev = above;  // the sums above the last atom passed
  int64_t prev_j = -1;
  bool prev_range = false;
  double B = 0.0, lo = lo_end;
  bool found = false;
  for (int64_t j = 0; j < P; ++j) {
    const auto a = atom_at(j);
    if (a.count == 0.0) continue;
    B = below_at(j);
    if (curve.psi_lo(above, B, a.hi) >= k) {
      lo = a.hi;
      found = true;
      break;
    }
    prev = above;
    prev_j = j;
    prev_range = a.lo < a.hi;
    curve.add(above, a);
  }
  if (!found) B = below_at(P);
  // Psi(prev.hi) < k <= Psi(lo): the root lies inside the atom above the gap where Psi at
  // that atom's lower end is still > k.
  if (prev_range && curve.psi_hi(above, B, lo) > k) return Hit{prev, B, lo, prev_j};
  return Hit{above, B, lo, -1};
}

// The frame of atoms with edge-relative sums: above a gap, a Tail (count C, A against the
// gap's upper end hi = ref); below it, B against its lower end lo.
struct AtomCurve {
  using Above = Tail;
  double t;
  FLS_HD void add(Tail& s, const Atom& a) const {
    s.sum = (s.sum > 0.0 ? s.sum * exp((a.lo - s.ref) / t) : 0.0) + a.U;
    s.count += a.count;
    s.ref = a.lo;
  }
  FLS_HD double psi_lo(const Tail& s, double B, double lo) const { return psi_at_lo(s.count, s.sum, B, s.ref, lo, t); }
  FLS_HD double psi_hi(const Tail& s, double B, double lo) const { return psi_at_hi(s.count, s.sum, B, s.ref, lo, t); }
};

// The gap or the range atom that holds the root, over atoms (atom_at(i), i = 0 the highest;
// empty ones skipped) between the tails. suffix_B is scratch of length P + 1. Requires
// Psi(above.ref) <= k <= Psi(below.ref).
template <typename AtomAt>
FLS_HD GapHit<Tail> find_gap(AtomAt atom_at, int64_t P, Tail above, Tail below, double k, double t,
                             double* suffix_B) {
  // suffix_B[j]: sum over atoms j.. and the lower tail of e^{(s - lo_j)/t}, lo_j = atom j's hi.
  suffix_B[P] = below.sum;
  double lo_next = below.ref;
  for (int64_t j = P - 1; j >= 0; --j) {
    const Atom a = atom_at(j);
    if (a.count == 0.0) {
      suffix_B[j] = suffix_B[j + 1];
      continue;
    }
    const double carry = suffix_B[j + 1] > 0.0 ? suffix_B[j + 1] * exp((lo_next - a.hi) / t) : 0.0;
    suffix_B[j] = carry + a.L;
    lo_next = a.hi;
  }
  return walk_gaps(AtomCurve{t}, atom_at, [&](int64_t j) { return suffix_B[j]; }, P, above, below.ref, k);
}

struct ScanResult {
  double b;        // the root, when found
  int64_t inside;  // -1, or the index of the range atom that holds the root
  Tail above;      // tails around that atom, for the refinement
  Tail below;
};

// find_gap, and the root solved in closed form when it lies in a gap.
template <typename AtomAt>
FLS_HD ScanResult scan_atoms(AtomAt atom_at, int64_t P, Tail above, Tail below, double k,
                             double t, double* suffix_B) {
  const GapHit<Tail> h = find_gap(atom_at, P, above, below, k, t, suffix_B);
  if (h.inside >= 0) return ScanResult{0.0, h.inside, h.above, Tail{0.0, h.B, h.lo}};
  const Tail& a = h.above;
  return ScanResult{solve_interval(a.count, a.sum, h.B, a.ref, h.lo, k, t), -1, Tail{}, Tail{}};
}

}  // namespace fastlapsum
