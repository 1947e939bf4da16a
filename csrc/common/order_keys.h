// Order keys of scores: unsigned integers whose unsigned order is the order of the scores,
// so that radix selects, radix sorts and nth_element work on integers (docs/DESIGN.md,
// "Order keys"). Host and device; tools/check_order_keys.cpp checks them exhaustively.
//
// Two encodings of a float's bits u (sign bit S):
//  - flip key (float_key, double_key): u | S for x >= 0, ~u for x < 0. What the callers need:
//    -0 and +0 share +0's key (the ops compare values, and ties break by index only);
//    every NaN gets the all-ones key, above +inf's, as in torch.topk (largest: NaN first);
//    key_to_* decodes a key back to the score bit for bit (-0 comes back as +0, and the
//    keys beyond +inf's or below -inf's decode to NaN; row_pass.cuh's key_bound relies on both).
//  - offset key (offset_key): S + |x| for x >= 0, S - |x| for x < 0, i.e. the flip key plus
//    one for negatives. Trailing zero bits of the magnitude stay zero for negative scores,
//    so fp16/bf16 scores widened to fp32 keep their low 13/16 key bits zero, which the block
//    radix sort of the sorted solve skips. -0 and +0 share a key (it decodes to +0); NaN has
//    no key (rows with a NaN never reach that sort).
// fp16 and bf16 scores are keyed as their fp32 value (exact); integer and bool scores (CPU
// top-k) get int_key, the two's complement with the sign bit flipped.
// Direction: a descending order is the ascending order of the keys XOR all ones
// (direction_flip); ties then still break by index, through composite.
// What the callers rely on:
//  - CPU top-k (select_cpu.h): order_key (int64, fp64) or order_key32 in composites (scores
//    of at most 32 bits), NaN on top, -0 == +0, ties to the smaller index.
//  - CPU threshold radix fallback (threshold_cpu.cpp), CUDA threshold (gpu_keys.cuh): flip
//    keys of finite scores only (non-finite ones are counted apart), digits from the top bit.
//  - CUDA top-k: float_key ^ flip in composites, NaN on top; values come back through
//    from_key (a -0 score is returned as +0); key_bound decodes threshold keys.
//  - CUDA sorted solve (SortKey): offset keys of NaN-free rows, values decoded exactly.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "host_device.h"

namespace fastlapsum {

template <typename U>
constexpr U kSignBit = U(1) << (8 * sizeof(U) - 1);

// The flip key of bits u, branch-free (nan: the score is a NaN).
template <typename U>
FLS_HD U flip_key_bits(U u, bool nan) {
  using S = std::make_signed_t<U>;
  u = u == kSignBit<U> ? U(0) : u;  // -0 == +0
  u ^= static_cast<U>(static_cast<S>(u) >> (8 * sizeof(U) - 1)) | kSignBit<U>;
  return nan ? ~U(0) : u;
}
template <typename U>
FLS_HD U flip_key_decode(U k) {
  return (k & kSignBit<U>) ? (k & ~kSignBit<U>) : ~k;
}
template <typename U>
FLS_HD U offset_key_bits(U u) {
  const U mag = u & ~kSignBit<U>;
  return (u & kSignBit<U>) ? kSignBit<U> - mag : kSignBit<U> + mag;
}
template <typename U>
FLS_HD U offset_key_decode(U k) {
  return k < kSignBit<U> ? kSignBit<U> | (kSignBit<U> - k) : k - kSignBit<U>;
}

// The bits of x as To (same width).
template <typename To, typename From>
FLS_HD To bits_as(From x) {
  static_assert(sizeof(To) == sizeof(From), "same width");
  To y;
  memcpy(&y, &x, sizeof(y));
  return y;
}

FLS_HD uint32_t float_key(float x) { return flip_key_bits(bits_as<uint32_t>(x), x != x); }
FLS_HD uint64_t double_key(double x) { return flip_key_bits(bits_as<uint64_t>(x), x != x); }
FLS_HD float key_to_float(uint32_t k) { return bits_as<float>(flip_key_decode(k)); }
FLS_HD double key_to_double(uint64_t k) { return bits_as<double>(flip_key_decode(k)); }

FLS_HD uint32_t offset_key(float x) { return offset_key_bits(bits_as<uint32_t>(x)); }
FLS_HD uint64_t offset_key(double x) { return offset_key_bits(bits_as<uint64_t>(x)); }
FLS_HD float offset_key_to_float(uint32_t k) { return bits_as<float>(offset_key_decode(k)); }
FLS_HD double offset_key_to_double(uint64_t k) { return bits_as<double>(offset_key_decode(k)); }

FLS_HD uint64_t int_key(int64_t v) { return static_cast<uint64_t>(v) ^ kSignBit<uint64_t>; }

// The 64-bit key of any score type of the CPU top-k (floating types through fp64, exact).
template <typename scalar_t>
FLS_HD uint64_t order_key(scalar_t v) {
  if constexpr (std::is_integral_v<scalar_t>) return int_key(static_cast<int64_t>(v));
  else return double_key(static_cast<double>(v));
}

// The 32-bit key of a score of at most 32 bits (CPU top-k composites): float_key of its exact
// fp32 value, or int_key's encoding in 32 bits.
template <typename scalar_t>
FLS_HD uint32_t order_key32(scalar_t v) {
  static_assert(sizeof(scalar_t) <= 4, "order_key32: scores of at most 32 bits");
  if constexpr (std::is_integral_v<scalar_t>) return static_cast<uint32_t>(static_cast<int32_t>(v)) ^ kSignBit<uint32_t>;
  else return float_key(static_cast<float>(v));
}

// XOR a key with this to rank descending (largest) or ascending (smallest) as larger keys.
template <typename U>
FLS_HD U direction_flip(bool largest) {
  return largest ? U(0) : ~U(0);
}

// (key, index) as one 64-bit key: larger key first, then the smaller index (its complement
// is larger); no index is ~0, so 0 is below every composite.
FLS_HD uint64_t composite(uint32_t key, uint32_t idx) {
  return (static_cast<uint64_t>(key) << 32) | static_cast<uint32_t>(~idx);
}
// int64 with the same order as the unsigned composite (an at::sort of composites).
FLS_HD int64_t comp_signed(uint64_t c) { return static_cast<int64_t>(c ^ kSignBit<uint64_t>); }
// The score of a flipped 32-bit key, as T (fp32/fp16/bf16: exact).
template <typename T>
FLS_HD T from_key(uint32_t key, uint32_t flip) {
  return static_cast<T>(key_to_float(key ^ flip));
}

}  // namespace fastlapsum
