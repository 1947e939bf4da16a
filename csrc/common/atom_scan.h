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

struct ScanResult {
  double b;        // the root, when found
  int64_t inside;  // -1, or the index of the range atom that holds the root
  Tail above;      // tails around that atom, for the refinement
  Tail below;
};

// atom_at(i) returns Atom i (i = 0 is the highest). suffix_B is scratch of length
// P + 1. Requires Psi(above.ref) <= k <= Psi(below.ref).
template <typename AtomAt>
FLS_HD ScanResult scan_atoms(AtomAt atom_at, int64_t P, Tail above, Tail below, double k,
                             double t, double* suffix_B) {
  // suffix_B[j]: sum over atoms j.. and the lower tail of e^{(s - lo_j)/t}, lo_j = atom j's hi.
  suffix_B[P] = below.sum;
  double lo_next = below.ref;
  for (int64_t j = P - 1; j >= 0; --j) {
    const Atom a = atom_at(j);
    const double carry = suffix_B[j + 1] > 0.0 ? suffix_B[j + 1] * exp((lo_next - a.hi) / t) : 0.0;
    suffix_B[j] = carry + a.L;
    lo_next = a.hi;
  }
  double C = above.count, A = above.sum, hi = above.ref;
  double C_prev = C, A_prev = A, hi_prev = hi;
  Atom prev{0, 0, 0, 0, 0};
  for (int64_t j = 0; j <= P; ++j) {
    const Atom a = j < P ? atom_at(j) : Atom{below.ref, below.ref, 0, 0, 0};
    const double lo = a.hi;
    const double B = suffix_B[j];
    if (j == P || psi_at_lo(C, A, B, hi, lo, t) >= k) {
      if (j > 0 && prev.lo < prev.hi && psi_at_hi(C, A, B, hi, lo, t) > k) {
        // Psi(prev.hi) < k < Psi(prev.lo): the root lies inside the previous atom.
        return ScanResult{0.0, j - 1, Tail{C_prev, A_prev, hi_prev}, Tail{0.0, B, lo}};
      }
      return ScanResult{solve_interval(C, A, B, hi, lo, k, t), -1, Tail{}, Tail{}};
    }
    C_prev = C; A_prev = A; hi_prev = hi;
    A = (A > 0.0 ? A * exp((a.lo - hi) / t) : 0.0) + a.U;
    C += a.count;
    hi = a.lo;
    prev = a;
  }
  return ScanResult{NAN, -1, Tail{}, Tail{}};  // unreachable
}

}  // namespace fastlapsum
