// The LoRA update's shrink and bf16 expand on AVX-512 without AVX-512 BF16 (the avx512 variant;
// docs/lora.md "The avx512 path: FMAs on bf16 widened in registers"): bf16 widened to fp32 in
// registers as it is read (no per-task buffer of A), register blocks of rows by rows of A, the 16
// lane sums of a block in one tree, and the expand's roundings on the fp32 bits. The outputs are
// bit for bit those of the code it replaced (the same fp32 sums in the same order, the same
// roundings). Included by gemm/lora_task.h alone.
#pragma once

#include "gemm/bf16_round.h"
#include "gemm/lora_vec.h"

#if defined(CPU_CAPABILITY_AVX512) && !defined(ORCA_DPBF16)
#define ORCA_LORA_FMA512 1
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace orcaserve::ORCA_ISA {
namespace lora {

// 32 bf16 (one 512-bit load) as fp32 in order: values 0-15 (half 0) or 16-31 (half 1), one vpermw
// each, the value's 16 bits into the high half of its lane (word 2i + 1), the low half zeroed.
inline __m512 widen_half(__m512i v, int half) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i idx = _mm512_slli_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * half)), 16);
  return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xaaaaaaaau, idx, v));
}

// The 16 (or fewer, zeros past N) vectors' lane sums at once: lane 4 (i % 4) + i / 4 holds v[i]'s.
// Each sum adds the pairs ATen's vec_reduce_all adds, in its order (lane l + l ^ 8, then + l ^ 4,
// + l ^ 2, + l ^ 1), so it is that reduction's value bit for bit; 45 shuffles and adds for 16.
template <int N>
inline __m512 sums_tree(const __m512* v) {
  static_assert(N >= 1 && N <= 16);
  __m512 c[8], d[4], e[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // lanes 0-7: v[2i]'s l + l ^ 8; lanes 8-15: v[2i + 1]'s
    const __m512 a = 2 * i < N ? v[2 * i] : _mm512_setzero_ps(), b = 2 * i + 1 < N ? v[2 * i + 1] : _mm512_setzero_ps();
    c[i] = 2 * i < N ? _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee)) : a;
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // 128-bit lane k: v[4i + k]'s four sums
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {  // 128-bit lane k: v[8i + k]'s two sums, then v[8i + 4 + k]'s
    const __m512d x = _mm512_castps_pd(d[2 * i]), y = _mm512_castps_pd(d[2 * i + 1]);
    e[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xdd));
}

// out[q * NJ + p] = x row q . a row p over `in` values (fp32 rows xr; a's rows of T, lda apart),
// each lane summing values l, l + 16, l + 32, ... in order as lora_vec.h's `dots` (the masked tail
// included), then its lanes as vec_reduce_all, and rounded to T (c10's rounding). bf16 A is
// widened in registers, 32 values a load. `ahead` rows of A past these NJ are requested at the
// same offsets meanwhile.
template <typename T, int NR, int NJ>
inline void dots_fma(const float* const* xr, const T* a, int64_t lda, int64_t in, int64_t ahead, float* out) {
  static_assert(NR * NJ <= 16);
  constexpr bool kBf16 = !std::is_same_v<T, float>;
  __m512 acc[NR * NJ];
#pragma GCC unroll 16
  for (int i = 0; i < NR * NJ; ++i) acc[i] = _mm512_setzero_ps();
  // one half (16 values) of the 32 at k: A's NJ rows widened, then each row of x against them;
  // Tail: masked loads (mx, ma), zeros past the end
  auto half = [&](auto tail, int64_t k, int h, __mmask16 mx, __mmask32 ma) {
    constexpr bool Tail = decltype(tail)::value;
    __m512 av[NJ];
#pragma GCC unroll 8
    for (int p = 0; p < NJ; ++p) {
      if constexpr (kBf16) {
        const T* ap = a + p * lda + k;
        av[p] = widen_half(Tail ? _mm512_maskz_loadu_epi16(ma, ap) : _mm512_loadu_si512(ap), h);
      } else {
        const float* ap = a + p * lda + k + 16 * h;
        av[p] = Tail ? _mm512_maskz_loadu_ps(mx, ap) : _mm512_loadu_ps(ap);
      }
    }
#pragma GCC unroll 4
    for (int q = 0; q < NR; ++q) {
      const float* xp = xr[q] + k + 16 * h;
      const __m512 xv = Tail ? _mm512_maskz_loadu_ps(mx, xp) : _mm512_loadu_ps(xp);
#pragma GCC unroll 8
      for (int p = 0; p < NJ; ++p) acc[q * NJ + p] = _mm512_fmadd_ps(xv, av[p], acc[q * NJ + p]);
    }
  };
  using Full = std::false_type;
  using Tail = std::true_type;
  int64_t k = 0;
  for (; k + 32 <= in; k += 32) {
#pragma GCC unroll 8
    for (int p = 0; p < NJ; ++p)
      if (p < ahead) prefetch(a + (NJ + p) * lda + k, 32 * sizeof(T));
    half(Full{}, k, 0, 0, 0);
    half(Full{}, k, 1, 0, 0);
  }
  if (k < in) {  // the last in - k < 32 values: a full half and a masked one, or a masked one
    const int rest = static_cast<int>(in - k);
    const __mmask32 ma = (__mmask32(1) << rest) - 1;
    if (rest >= 16) {
      half(std::bool_constant<kBf16>{}, k, 0, 0xffff, ma);  // bf16: A's 32-value load masked
    } else {
      half(Tail{}, k, 0, static_cast<__mmask16>((1u << rest) - 1), ma);
    }
    if (rest > 16) half(Tail{}, k, 1, static_cast<__mmask16>((1u << (rest - 16)) - 1), ma);
  }
  __m512 sums = sums_tree<NR * NJ>(acc);
  if constexpr (kBf16) sums = bf16_round(sums);
  alignas(64) float s[16];
  _mm512_store_ps(s, sums);
#pragma GCC unroll 16
  for (int i = 0; i < NR * NJ; ++i) out[i] = s[4 * (i % 4) + i / 4];
}

// n bf16 values at src as fp32 at dst (exact), 32 at a time.
inline void widen_row(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t k = 0;
  for (; k + 32 <= n; k += 32) {
    const __m512i v = _mm512_loadu_si512(src + k);
    _mm512_storeu_ps(dst + k, widen_half(v, 0));
    _mm512_storeu_ps(dst + k + 16, widen_half(v, 1));
  }
  if (k < n) {
    const int rest = static_cast<int>(n - k);
    const __m512i v = _mm512_maskz_loadu_epi16((__mmask32(1) << rest) - 1, src + k);
    _mm512_mask_storeu_ps(dst + k, rest >= 16 ? 0xffff : static_cast<__mmask16>((1u << rest) - 1), widen_half(v, 0));
    if (rest > 16) _mm512_mask_storeu_ps(dst + k + 16, static_cast<__mmask16>((1u << (rest - 16)) - 1), widen_half(v, 1));
  }
}

// The shrink of a task's n rows: h[i r + j] = A row j . x row i, rounded to T (c10's rounding),
// register blocks of NR <= 4 rows by 4 rows of A (8 for 1-2 rows: each widened A vector feeds
// every row of the block). A block's bf16 rows are widened into xs (NR in floats, in L1).
template <typename T>
void shrink_fma(const T* a, int64_t r, const T* const* xr, int64_t n, int64_t in, float* xs, float* h) {
  row_blocks(n, [&](auto nr, int64_t i) {
    constexpr int NR = decltype(nr)::value;
    const float* xf[NR];
    for (int q = 0; q < NR; ++q) {
      if constexpr (std::is_same_v<T, float>) {
        xf[q] = xr[i + q];
      } else {
        widen_row(xr[i + q], xs + q * in, in);
        xf[q] = xs + q * in;
      }
    }
    int64_t j = 0;
    auto block = [&](auto nj) {  // A's rows j .. j + NJ
      constexpr int NJ = decltype(nj)::value;
      float s[NR * NJ];
      const int64_t ahead = i == 0 ? std::min<int64_t>(NJ, r - j - NJ) : 0;  // A from memory: the first block
      dots_fma<T, NR, NJ>(xf, a + j * in, in, in, ahead, s);
      for (int q = 0; q < NR; ++q)
        for (int p = 0; p < NJ; ++p) h[(i + q) * r + j + p] = s[q * NJ + p];
      j += NJ;
    };
    constexpr int NJ = NR <= 2 ? 8 : 4;
    while (j + NJ <= r) block(Rows<NJ>{});
    if (NJ == 8 && r - j >= 4) block(Rows<4>{});
    if (r - j >= 2) block(Rows<2>{});
    if (r - j >= 1) block(Rows<1>{});
  });
}

// The middle rounding of the bf16 expand (of the scaled update), by the scale (per task):
// none where the product is a bf16 value already (a power of two of at least 1), the integer
// rounding where the scale is finite and nonzero, else that with a NaN kept a NaN.
enum class Scaled { kExact, kPlain, kAny };

inline Scaled scaled(float s) {
  int exponent = 0;
  if (!std::isfinite(s) || s == 0.f) return Scaled::kAny;
  return std::fabs(s) >= 1.f && std::fabs(std::frexp(s, &exponent)) == 0.5f ? Scaled::kExact : Scaled::kPlain;
}

// v rounded to bf16, in fp32. Not c10's NaN (0x7fc00000): a NaN whose low 16 bits are zero stays
// itself, as every NaN of the expand is (from bf16 values, or the default NaN), and only the last
// rounding's NaN (all of them 0xffff, ATen's) reaches y.
inline __m512 round_num(__m512 v) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(round_bits(_mm512_castps_si512(v)), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}

// yr[q][o0, o0 + m) += rounded(rounded(h row q . B^T) * scale) for NR rows, one block of 32 outputs
// (m of them; Full: all 32) in bf16: B^T's and y's 32 values widened as two vectors, the even
// outputs (vpslld) and the odd ones (vpandd), each output's sum over the ranks in order; the
// roundings ATen's (lora_vec.h's round2 and store2, NaN to 0xffff) on the fp32 bits.
template <int NR, bool Full, Scaled S>
inline void expand_block_fma(const at::BFloat16* bt, int64_t ldbt, int64_t bblk, int64_t r, float scale_value,
                             const float* h, at::BFloat16* const* yr, int64_t o0, int64_t m, bool ahead) {
  const __mmask32 mask = Full ? ~__mmask32(0) : (__mmask32(1) << m) - 1;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  __m512 ev[NR], od[NR];
#pragma GCC unroll 8
  for (int q = 0; q < NR; ++q) ev[q] = od[q] = _mm512_setzero_ps();
  for (int64_t j = 0; j < r; ++j) {
    const at::BFloat16* bj = bt + j * ldbt + o0 / kOut * bblk;
    if (ahead) prefetch(bj + kAhead * bblk, kOut * 2);
    const __m512i v = Full ? _mm512_loadu_si512(bj) : _mm512_maskz_loadu_epi16(mask, bj);
    const __m512 be = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), bo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
#pragma GCC unroll 8
    for (int q = 0; q < NR; ++q) {
      const __m512 hv = _mm512_set1_ps(h[q * r + j]);
      ev[q] = _mm512_fmadd_ps(hv, be, ev[q]);
      od[q] = _mm512_fmadd_ps(hv, bo, od[q]);
    }
  }
  const __m512 scale = _mm512_set1_ps(scale_value);
  const __m512i ones = _mm512_set1_epi32(-1);
#pragma GCC unroll 8
  for (int q = 0; q < NR; ++q) {
    __m512 de = _mm512_mul_ps(round_num(ev[q]), scale), dd = _mm512_mul_ps(round_num(od[q]), scale);
    if constexpr (S == Scaled::kPlain) {
      de = round_num(de);
      dd = round_num(dd);
    } else if constexpr (S == Scaled::kAny) {  // a NaN scale's payload: made the NaN round_num keeps
      const __m512 nan = _mm512_castsi512_ps(high);
      de = round_num(_mm512_mask_mov_ps(de, _mm512_cmp_ps_mask(de, de, _CMP_UNORD_Q), nan));
      dd = round_num(_mm512_mask_mov_ps(dd, _mm512_cmp_ps_mask(dd, dd, _CMP_UNORD_Q), nan));
    }
    at::BFloat16* yq = yr[q] + o0;
    const __m512i yv = Full ? _mm512_loadu_si512(yq) : _mm512_maskz_loadu_epi16(mask, yq);
    const __m512 se = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(yv, 16)), de);
    const __m512 so = _mm512_add_ps(_mm512_castsi512_ps(_mm512_and_si512(yv, high)), dd);
    // the last rounding, a NaN to 0xffff, and the even and odd outputs' high halves back in order
    const __m512i te = _mm512_mask_mov_epi32(round_bits(_mm512_castps_si512(se)), _mm512_cmp_ps_mask(se, se, _CMP_UNORD_Q), ones);
    const __m512i to = _mm512_mask_mov_epi32(round_bits(_mm512_castps_si512(so)), _mm512_cmp_ps_mask(so, so, _CMP_UNORD_Q), ones);
    const __m512i v = _mm512_mask_blend_epi16(0xaaaaaaaau, _mm512_srli_epi32(te, 16), to);
    Full ? _mm512_storeu_si512(yq, v) : _mm512_mask_storeu_epi16(yq, mask, v);
  }
}

// The bf16 expand of NR rows over every output, 32 at a time.
template <int NR>
void expand_fma(const at::BFloat16* bt, int64_t ldbt, int64_t bblk, int64_t r, float scale, const float* h,
                at::BFloat16* const* yr, int64_t out) {
  auto run = [&](auto kind) {
    constexpr Scaled S = decltype(kind)::value;
    int64_t o0 = 0;
    for (; o0 + kOut <= out; o0 += kOut)
      expand_block_fma<NR, true, S>(bt, ldbt, bblk, r, scale, h, yr, o0, kOut, o0 + (kAhead + 1) * kOut <= out);
    if (o0 < out) expand_block_fma<NR, false, S>(bt, ldbt, bblk, r, scale, h, yr, o0, out - o0, false);
  };
  switch (scaled(scale)) {
    case Scaled::kExact:
      run(std::integral_constant<Scaled, Scaled::kExact>{});
      break;
    case Scaled::kPlain:
      run(std::integral_constant<Scaled, Scaled::kPlain>{});
      break;
    default:
      run(std::integral_constant<Scaled, Scaled::kAny>{});
  }
}

}  // namespace lora
}  // namespace orcaserve::ORCA_ISA
#endif
