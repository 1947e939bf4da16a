// The per-row kernel (row_select_kernel): one CTA per row selects on chip from the whole
// row, from the candidates a sampled threshold admits, or by streaming the row (exact fallback).
#pragma once

#include "../../common/cuda_launch.cuh"
#include "row_pass.cuh"

namespace fastlapsum {
namespace {

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
  const bool aligned = is_aligned16(xr);
  const uint32_t flip = P.flip;
  T* mrow = kMask ? static_cast<T*>(P.out_mask) + r * P.n : nullptr;

  // The sample's first kT * kSampleUnroll scores for the usual budget (take = K < L: the
  // sample's stride and offset follow from K, cap and r alone), loaded before the row's length is
  // known, so that the two round trips overlap; the sampled path cuts them to the length.
  // Only those a row of n scores samples (a shorter row samples a prefix of them). It pays
  // where the sample takes several rounds of loads (small K on long rows); 4-byte scores
  // only, as 16-bit rows came out slower with it.
  constexpr bool kSpec = !kMask && sizeof(T) == 4;
  const int64_t k_s = row_sample_stride(P.K, P.cap), k_off = sample_offset(r, k_s);  // K's sample
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
    mask_row_fill<T>(P, r, NAN, tid, kT);
    return;
  }
  if (take == 0 || take == L) {  // nothing or everything valid is selected
    if (kMask) {
      mask_row_fill<T>(P, r, take == 0 ? 0.0f : 1.0f, tid, kT);
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
      const int64_t s = row_sample_stride(take, cap);
      const int64_t G = 8 * s;  // L > cap >= 5632 > 512 >= G
      const int64_t off = sample_offset(r, s);
      const int64_t S = ((L - off - 8) / G + 1) * 8;
      double rs = ceil(sample_admit(take, cap, s) * static_cast<double>(S) / static_cast<double>(L));
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
      // A threshold bin of many tied samples (a score much of the row shares) projects past
      // the buffer, i.e. the exact fallback: admit only the scores above the bin where they
      // project to the budget (if too few come, the fallback, as the overflow would have).
      const double per = static_cast<double>(L) / static_cast<double>(S);  // scores a sample stands for
      const uint32_t above = rstar - rem + sh.res.above;                    // samples above the bin
      if (static_cast<double>(above + sh.res.count) * per > kSampleTieSkip * cap &&
          static_cast<double>(above) * per >= static_cast<double>(take) && thr < 0xFFFFFC00u)
        thr += 1u << 10;
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
      C = ordered_row_compact<kT, T, true>(xr, L, aligned, flip, sh.tile_tot, [&](float v, uint32_t) { return !(v < lo); }, add);
    } else {
      const float hi = key_bound(~thr);
      C = ordered_row_compact<kT, T, true>(xr, L, aligned, flip, sh.tile_tot, [&](float v, uint32_t) { return v <= hi; }, add);
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
      ordered_row_compact<kT, T, false>(xr, L, aligned, flip, sh.tile_tot, is_sel_score, out);
    }
    pad_row<T>(P, r, take, tid, kT);
  }
}

}  // namespace
}  // namespace fastlapsum
