// Exhaustive host check of csrc/common/order_keys.h against the order the ops use (IEEE
// order of values, -0 == +0, every NaN above +inf):
//   g++ -O2 -std=c++17 tools/check_order_keys.cpp -o /tmp/check_order_keys && /tmp/check_order_keys
// fp32, fp16 and bf16: every bit pattern; fp64: every sign/exponent/top-12-mantissa pattern
// with edge and random low bits; int64: edges and random pairs. Walks the values in increasing
// order and checks that each key is above the previous one (equal only for -0 -> +0), that NaNs
// take the all-ones flip key, and that keys decode back bit for bit. Prints the failures per
// check and exits non-zero if any.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../csrc/common/order_keys.h"

using namespace fastlapsum;

namespace {

uint64_t g_failures = 0;
void report(const char* what, uint64_t fails, uint64_t checked) {
  std::printf("%-44s %12llu checked, %llu failures\n", what, (unsigned long long)checked, (unsigned long long)fails);
  g_failures += fails;
}

// The bit patterns of a width in increasing value order: -NaNs excluded, -inf .. -0, +0 ..
// +inf (exp_mask: the all-ones exponent with a zero mantissa, i.e. +inf's bits).
template <typename U, typename F>
void for_each_ordered(U inf_bits, F&& f) {
  const U sign = kSignBit<U>;
  for (U m = inf_bits;; --m) {  // negative values: magnitude from inf down to 0
    f(static_cast<U>(sign | m));
    if (m == 0) break;
  }
  for (U m = 0;; ++m) {
    f(m);
    if (m == inf_bits) break;
  }
}

// Monotone walk: key strictly increasing except -0 -> +0 (equal), decode exact.
template <typename U, typename Fl, typename Key, typename Dec>
void walk(const char* name, U inf_bits, Key key, Dec dec) {
  uint64_t fails = 0, n = 0, dec_fails = 0;
  bool have_prev = false;
  U prev_key = 0, prev_bits = 0;
  for_each_ordered<U>(inf_bits, [&](U bits) {
    const Fl x = bits_as<Fl>(bits);
    const U k = key(x);
    ++n;
    if (have_prev) {
      const bool zero_pair = prev_bits == kSignBit<U> && bits == 0;
      const bool ok = zero_pair ? k == prev_key : k > prev_key;
      if (!ok && fails++ < 5) std::printf("  %s order: bits %llx after %llx\n", name, (unsigned long long)bits, (unsigned long long)prev_bits);
    }
    const U back = bits_as<U>(dec(k));
    const U want = bits == kSignBit<U> ? U(0) : bits;  // -0 decodes to +0
    if (back != want && dec_fails++ < 5) std::printf("  %s decode: %llx -> %llx\n", name, (unsigned long long)bits, (unsigned long long)back);
    prev_key = k, prev_bits = bits, have_prev = true;
  });
  char buf[96];
  std::snprintf(buf, sizeof buf, "%s: order", name);
  report(buf, fails, n);
  std::snprintf(buf, sizeof buf, "%s: decode(key(x)) == x", name);
  report(buf, dec_fails, n);
}

// fp16 / bf16 bits widened to fp32 exactly.
float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
  float v;
  if (e == 31) v = m ? NAN : INFINITY;
  else if (e == 0) v = std::ldexp(float(m), -24);
  else v = std::ldexp(float(m | 1024), int(e) - 25);
  return bits_as<float>(bits_as<uint32_t>(v) | sign);
}
float bf16_to_float(uint16_t b) { return bits_as<float>(uint32_t(b) << 16); }

// The 16-bit formats keyed through fp32: order of all patterns, NaN key, decode, and the
// offset key's zero low bits (low_zero of them) that the sorted solve's radix sort relies on.
template <typename Widen>
void check16(const char* name, uint16_t inf_bits, int low_zero, Widen widen) {
  uint64_t fails = 0, nan_fails = 0, low_fails = 0, n = 0;
  bool have_prev = false;
  uint32_t pk = 0, pok = 0;
  uint16_t pb = 0;
  const uint32_t low_mask = (1u << low_zero) - 1;
  for_each_ordered<uint16_t>(inf_bits, [&](uint16_t bits) {
    const float x = widen(bits);
    const uint32_t k = float_key(x), ok = offset_key(x);
    ++n;
    if (have_prev) {
      const bool zero_pair = pb == 0x8000 && bits == 0;
      if (!(zero_pair ? (k == pk && ok == pok) : (k > pk && ok > pok))) ++fails;
    }
    const uint32_t want = bits == 0x8000 ? 0u : bits_as<uint32_t>(x);
    if (bits_as<uint32_t>(key_to_float(k)) != want || bits_as<uint32_t>(offset_key_to_float(ok)) != want) ++fails;
    if (ok & low_mask) ++low_fails;
    pk = k, pok = ok, pb = bits, have_prev = true;
  });
  for (uint32_t b = 0; b < 65536; ++b) {
    const float x = widen(static_cast<uint16_t>(b));
    if (x != x && float_key(x) != 0xFFFFFFFFu) ++nan_fails;
  }
  char buf[96];
  std::snprintf(buf, sizeof buf, "%s: order + decode (flip and offset)", name);
  report(buf, fails, n);
  std::snprintf(buf, sizeof buf, "%s: NaN -> all-ones flip key", name);
  report(buf, nan_fails, 65536);
  std::snprintf(buf, sizeof buf, "%s: offset key low %d bits zero", name, low_zero);
  report(buf, low_fails, n);
}

}  // namespace

int main() {
  // fp32: every pattern.
  walk<uint32_t, float>("fp32 flip key", 0x7F800000u, [](float x) { return float_key(x); },
                        [](uint32_t k) { return key_to_float(k); });
  walk<uint32_t, float>("fp32 offset key", 0x7F800000u, [](float x) { return offset_key(x); },
                        [](uint32_t k) { return offset_key_to_float(k); });
  {
    uint64_t fails = 0, n = 0;
    for (uint64_t b = 0x7F800001ull; b <= 0x7FFFFFFFull; ++b)
      for (uint32_t s : {0u, 0x80000000u}) {
        ++n;
        if (float_key(bits_as<float>(static_cast<uint32_t>(b) | s)) != 0xFFFFFFFFu) ++fails;
      }
    report("fp32: NaN -> all-ones flip key", fails, n);
  }
  // fp64: sign, exponent and 12 mantissa bits exhaustive, the low 40 bits at edges and random.
  {
    std::mt19937_64 rng(1);
    const uint64_t lows[] = {0, 1, 2, 0x5555555555ull, 0xFFFFFFFFFEull, 0xFFFFFFFFFFull};
    uint64_t fails = 0, dec_fails = 0, n = 0;
    bool have_prev = false;
    uint64_t pk = 0, pb = 0;
    auto visit = [&](uint64_t bits) {
      const double x = bits_as<double>(bits);
      const uint64_t k = double_key(x), ok = offset_key(x);
      ++n;
      if (have_prev) {
        const bool zero_pair = pb == kSignBit<uint64_t> && bits == 0;
        if (!(zero_pair ? k == pk : k > pk)) ++fails;
        if (!(zero_pair ? ok == offset_key(bits_as<double>(pb)) : ok > offset_key(bits_as<double>(pb)))) ++fails;
      }
      const uint64_t want = bits == kSignBit<uint64_t> ? 0 : bits;
      if (bits_as<uint64_t>(key_to_double(k)) != want || bits_as<uint64_t>(offset_key_to_double(ok)) != want) ++dec_fails;
      pk = k, pb = bits, have_prev = true;
    };
    const uint64_t inf = 0x7FF0000000000000ull;
    // negatives, magnitude decreasing: high part from inf's down to 0, lows decreasing
    for (uint64_t hi = inf >> 40;; --hi) {
      for (int j = 5; j >= 0; --j) {
        const uint64_t m = (hi << 40) | lows[j];
        if (m <= inf) visit(kSignBit<uint64_t> | m);
      }
      if (hi == 0) break;
    }
    for (uint64_t hi = 0; hi <= inf >> 40; ++hi)
      for (int j = 0; j < 6; ++j) {
        const uint64_t m = (hi << 40) | lows[j];
        if (m <= inf) visit(m);
      }
    report("fp64: order (flip and offset), edge walk", fails, n);
    report("fp64: decode(key(x)) == x", dec_fails, n);
    uint64_t rf = 0, nan_fails = 0;
    const uint64_t R = 20000000;
    for (uint64_t i = 0; i < R; ++i) {
      const double a = bits_as<double>(rng()), b = bits_as<double>(rng());
      if (a != a) {
        if (double_key(a) != ~uint64_t(0)) ++nan_fails;
        continue;
      }
      if (b != b) continue;
      if ((a < b) != (double_key(a) < double_key(b)) || (a == b) != (double_key(a) == double_key(b))) ++rf;
      if ((a < b) != (offset_key(a) < offset_key(b)) || (a == b) != (offset_key(a) == offset_key(b))) ++rf;
    }
    report("fp64: random pairs, key order == value order", rf, R);
    report("fp64: random NaN -> all-ones flip key", nan_fails, R);
  }
  check16("fp16", 0x7C00, 13, half_to_float);
  check16("bf16", 0x7F80, 16, bf16_to_float);
  // int64 (and the narrower integers and bool, which widen to it).
  {
    std::mt19937_64 rng(2);
    std::vector<int64_t> edge = {INT64_MIN, INT64_MIN + 1, -2, -1, 0, 1, 2, INT64_MAX - 1, INT64_MAX};
    uint64_t fails = 0, n = 0;
    for (size_t i = 1; i < edge.size(); ++i, ++n)
      if (!(int_key(edge[i]) > int_key(edge[i - 1]))) ++fails;
    for (int i = 0; i < 20000000; ++i, ++n) {
      const int64_t a = static_cast<int64_t>(rng()) >> (i % 64), b = static_cast<int64_t>(rng()) >> (i % 64);
      if ((a < b) != (int_key(a) < int_key(b)) || (a == b) != (int_key(a) == int_key(b))) ++fails;
    }
    if (!(order_key(true) > order_key(false)) || order_key(int8_t(-1)) != int_key(-1)) ++fails;
    report("int64: key order == value order", fails, n);
  }
  // Direction flip and composites: descending = ascending keys flipped; ties by smaller index.
  {
    uint64_t fails = 0;
    const float xs[] = {-INFINITY, -1.0f, -0.0f, 0.0f, 1e-45f, 2.0f, INFINITY, NAN};
    for (float a : xs)
      for (float b : xs) {
        const uint32_t up = direction_flip<uint32_t>(true), down = direction_flip<uint32_t>(false);
        if (((float_key(a) ^ up) > (float_key(b) ^ up)) != (float_key(a) > float_key(b))) ++fails;
        if (((float_key(a) ^ down) > (float_key(b) ^ down)) != (float_key(a) < float_key(b))) ++fails;
        if (a == a && from_key<float>(float_key(a) ^ down, down) != a) ++fails;
      }
    if (!(composite(5, 3) > composite(5, 4)) || !(composite(6, 100) > composite(5, 0))) ++fails;
    if (!(comp_signed(composite(0x80000000u, 0)) > comp_signed(composite(0x7FFFFFFFu, 0)))) ++fails;
    if (!(composite(0, 0xFFFFFFFEu) > 0)) ++fails;
    report("direction flip, composite, from_key", fails, 8 * 8 * 3 + 4);
  }
  std::printf("total failures: %llu\n", (unsigned long long)g_failures);
  return g_failures ? 1 : 0;
}
