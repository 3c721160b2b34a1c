// The vdpbf16ps pieces of the LoRA update on bf16 (gemm/lora.cpp, avx512_bf16 and amx; docs/lora.md
// "The segmented update in the dispatch table"): the shrink four rows of A at a time with its 16
// sums reduced together, the expand two ranks at a time, each rounding c10's (gemm/bf16_round.h).
#pragma once

#include "gemm/bf16_round.h"
#include "gemm/lora_vec.h"

#ifdef ORCA_DPBF16
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace orcaserve::ORCA_ISA {
namespace lora {

// Lane k: the sum of v[k]'s 16 lanes, for the 16 vectors at once (a tree of 45 shuffles and adds
// instead of 16 horizontal sums; another order of the fp32 sums).
inline __m512 sums16(const __m512* v) {
  __m512 s8[8], s4[4], s2[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], a = v[2i], b = v[2i+1]
    s8[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: v[4i .. 4i+3]'s sums over that lane
    const __m512d x = _mm512_castps_pd(s8[2 * i]), y = _mm512_castps_pd(s8[2 * i + 1]);
    s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // [v[8i..8i+3] over lanes 0-1, 2-3; v[8i+4..8i+7] over lanes 0-1, 2-3]
    s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x88), _mm512_shuffle_f32x4(s2[0], s2[1], 0xdd));
}

// bf16_round for a vector with no NaN lane but a quiet 0x7fc00000 (which the integer rounding keeps).
inline __m512 bf16_round_num(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd),
                                              _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// h's n rows of r values (each already a bf16 value in fp32) as bf16 pairs (j, j + 1) per row, a
// zero past an odd r: false, nothing more written, if one is a bf16 denormal (vdpbf16ps would read it
// as zero; the FMA expand then runs).
inline bool h_pairs(const float* h, int64_t n, int64_t r, uint32_t* hp) {
  const int64_t pairs = (r + 1) / 2;
  for (int64_t i = 0; i < n; ++i, h += r, hp += pairs)
    for (int64_t j = 0; j < r; j += 2) {
      uint32_t b0, b1 = 0;
      std::memcpy(&b0, h + j, 4);
      if (j + 1 < r) std::memcpy(&b1, h + j + 1, 4);
      const uint32_t e0 = b0 & 0x7f800000u, e1 = b1 & 0x7f800000u;
      if ((e0 == 0 && (b0 & 0x7fffffffu) != 0) || (e1 == 0 && (b1 & 0x7fffffffu) != 0)) return false;
      hp[j / 2] = (b0 >> 16) | (b1 & 0xffff0000u);
    }
  return true;
}
// out lane q * 4 + p = x row q . a row p, for NR <= 4 rows and 4 rows of A, on bf16 as stored
// (vdpbf16ps) and summed across the lanes for all 16 pairs at once (`sums16`). A's row p, values
// [32 i, 32 i + 32) at a + p lda + i astep: rows as stored (lda = in, astep = 32) or the blocked
// stacks' (lda = 32, astep = 128: the four rows' 32 values side by side, read in order).
template <int NR>
inline __m512 dots4(const at::BFloat16* const* xr, const at::BFloat16* a, int64_t lda, int64_t astep, int64_t in) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 32) {
    const __mmask32 mask = in - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (in - k)) - 1;
    __m512i av[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) av[p] = _mm512_maskz_loadu_epi16(mask, a + p * lda + k / 32 * astep);
#pragma GCC unroll 4
    for (int q = 0; q < NR; ++q) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, xr[q] + k);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) acc[q * 4 + p] = _mm512_dpbf16_ps(acc[q * 4 + p], (__m512bh)xv, (__m512bh)av[p]);
    }
  }
  return sums16(acc);
}

// The shrink's first r / 4 * 4 ranks (returned) for the n rows xr, four rows of A [r, in] at a
// time: h[i r + j] = A row j . x row i, rounded to bf16, in fp32. `blocked`: A as the blocked
// stacks hold it (r a multiple of 4, each four rows [in / 32][4][32], `in` padded to 32s: agroup
// apart), read in order.
inline int64_t shrink4(const at::BFloat16* a, int64_t r, const at::BFloat16* const* xr, int64_t n, int64_t in,
                       float* h, bool blocked = false, int64_t agroup = 0) {
  const int64_t row_bytes = in * 2, r4 = r / 4 * 4;
  const int64_t lda = blocked ? 32 : in, astep = blocked ? 128 : 32, group = blocked ? agroup : 4 * in;
  prefetch(a, blocked ? std::min<int64_t>(r, kAhead) / 4 * agroup * 2 : std::min<int64_t>(r, kAhead) * row_bytes);
  for (int64_t j = 0; j < r4; j += 4) {
    if (blocked) {
      if (j + kAhead < r) prefetch(a + (j + kAhead) / 4 * agroup, agroup * 2);
    } else if (j + kAhead < r) {
      prefetch(a + (j + kAhead) * in, std::min<int64_t>(4, r - j - kAhead) * row_bytes);
    }
    row_blocks(n, [&](auto nr, int64_t i) {
      constexpr int NR = decltype(nr)::value;
      alignas(64) float s[16];
      _mm512_store_ps(s, bf16_round(dots4<NR>(xr + i, a + j / 4 * group, lda, astep, in)));
      for (int q = 0; q < NR; ++q) std::memcpy(h + (i + q) * r + j, s + q * 4, 4 * sizeof(float));
    });
  }
  return r4;
}

// yr[q][o0, o0 + m) += rounded(rounded(h row q . B^T) * scale) for NR rows, one block of kOut
// outputs (lora.cpp's expand_block) with vdpbf16ps: h's values are bf16 already (the shrink rounded
// them), taken two ranks at a time (hp: row q's pair p at q * pairs + p, `h_pairs`) against B^T's
// rows j and j + 1 interleaved (products exact in fp32, sums in fp32, another order than the
// FMAs'). B^T's row j, outputs of block o0 / kOut, at bt + j ldbt + o0 / kOut bblk: B^T [r, out]
// (ldbt = out, bblk = kOut) or the blocked stacks' [out / kOut][r][kOut] (ldbt = kOut, bblk = r kOut).
template <int NR, bool Full>
inline void expand_block_dp(const at::BFloat16* bt, int64_t ldbt, int64_t bblk, int64_t r, float scale_value,
                            const uint32_t* hp, at::BFloat16* const* yr, int64_t o0, int64_t m, bool ahead) {
  const int64_t pairs = (r + 1) / 2;
  const __mmask32 mask = Full ? ~__mmask32(0) : (__mmask32(1) << m) - 1;
  __m512 lo[NR], hi[NR];
#pragma GCC unroll 8
  for (int q = 0; q < NR; ++q) lo[q] = hi[q] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const at::BFloat16* b0 = bt + 2 * p * ldbt + o0 / kOut * bblk;
    const bool two = 2 * p + 1 < r;
    if (ahead) {
      prefetch(b0 + kAhead * bblk, kOut * 2);
      if (two) prefetch(b0 + ldbt + kAhead * bblk, kOut * 2);
    }
    const __m512i v0 = Full ? _mm512_loadu_si512(b0) : _mm512_maskz_loadu_epi16(mask, b0);
    const __m512i v1 = !two ? _mm512_setzero_si512()
                            : (Full ? _mm512_loadu_si512(b0 + ldbt) : _mm512_maskz_loadu_epi16(mask, b0 + ldbt));
    const __m512bh bl = (__m512bh)_mm512_unpacklo_epi16(v0, v1), bh = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
#pragma GCC unroll 8
    for (int q = 0; q < NR; ++q) {
      const __m512bh hv = (__m512bh)_mm512_set1_epi32(static_cast<int>(hp[q * pairs + p]));
      lo[q] = _mm512_dpbf16_ps(lo[q], bl, hv);
      hi[q] = _mm512_dpbf16_ps(hi[q], bh, hv);
    }
  }
  // lo, hi in vpunpck*wd's order (outputs 8l + 0-3 and 8l + 4-7 of each 128-bit lane l): y is read
  // in that order too, and packed back into the outputs' (vpackusdw undoes the interleave).
  // The first rounding (of the sums) and the last (of y plus the update): vcvtne2ps2bf16 (c10's bit
  // for bit where no lane is a denormal or a NaN, `hw_rounds`), the first's widened back to fp32 by a
  // masked vpermw a vector, the last's permuted back from the interleaved order; else in software
  // (docs/lora.md "The segmented update in the dispatch table"). The middle one, of the scaled update: none where the scale is a power of two of at least 1 (PEFT's
  // lora_alpha = 2 r, r: the product of a bf16 value, or of the 0x7fc00000 the first rounding makes
  // of a NaN, by it is exact, a bf16 value or an infinity already); without its NaN fix-up where
  // the scale is finite and nonzero (a NaN there is that 0x7fc00000 carried through the product,
  // which the integer rounding keeps).
  const __m512 scale = _mm512_set1_ps(scale_value);
  const bool plain_scale = std::isfinite(scale_value) && scale_value != 0.f;
  int exponent = 0;
  const bool exact_scale = plain_scale && std::fabs(scale_value) >= 1.f &&
                           std::fabs(std::frexp(scale_value, &exponent)) == 0.5f;
  // vcvtne2ps2bf16's 32 values back to fp32 in the same lanes: word 2i + 1 of lane i takes value i
  // (lo) or 16 + i (hi), word 2i zero (kOddWords)
  constexpr __mmask32 kOddWords = 0xaaaaaaaau;
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i widen_lo = _mm512_slli_epi32(lanes, 16);
  const __m512i widen_hi = _mm512_slli_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32(16)), 16);
  const __m512i order = _mm512_set_epi16(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8, 23, 22, 21, 20,
                                         7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
#pragma GCC unroll 8
  for (int q = 0; q < NR; ++q) {
    at::BFloat16* yq = yr[q] + o0;
    const __m512i yv = Full ? _mm512_loadu_si512(yq) : _mm512_maskz_loadu_epi16(mask, yq);
    const __m512i zero = _mm512_setzero_si512();
    const __m512 ylo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, yv));
    const __m512 yhi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, yv));
    __m512 dlo, dhi;  // the first rounding, of the expand's sums
    if (hw_rounds(lo[q], hi[q])) {
      const __m512i d = (__m512i)_mm512_cvtne2ps_pbh(hi[q], lo[q]);
      dlo = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kOddWords, widen_lo, d));
      dhi = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kOddWords, widen_hi, d));
    } else {
      dlo = bf16_round(lo[q]);
      dhi = bf16_round(hi[q]);
    }
    const __m512 plo = _mm512_mul_ps(dlo, scale), phi = _mm512_mul_ps(dhi, scale);
    const __m512 slo = _mm512_add_ps(ylo, exact_scale ? plo : plain_scale ? bf16_round_num(plo) : bf16_round(plo));
    const __m512 shi = _mm512_add_ps(yhi, exact_scale ? phi : plain_scale ? bf16_round_num(phi) : bf16_round(phi));
    __m512i v;
    if (hw_rounds(slo, shi)) {
      v = _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(shi, slo));
    } else {
      v = _mm512_packus_epi32(bf16_bits(slo), bf16_bits(shi));
    }
    Full ? _mm512_storeu_si512(yq, v) : _mm512_mask_storeu_epi16(yq, mask, v);
  }
}

}  // namespace lora
}  // namespace orcaserve::ORCA_ISA
#endif
