// The activations' side of the int8-activation GEMM (gemm/gemm_int8.cpp) for one ISA variant: rows
// of x quantized per block of 32 (codes, scales, the codes' sums) and the per-row terms the tiles
// fold in (docs/int8-activations.md, "How" and "Kernels per ISA").
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "gemm/int8_vec.h"

namespace orcaserve::ORCA_ISA {
namespace {
// One row's activations: per block of 32, d = max|x| / 127 (IEEE division), q = x * (1 / d)
// rounded to nearest even and clamped to [-127, 127] (0 where d is 0); the codes' sums per 16.
// On AVX-512 each half block is one vector, on AVX2 two: the same operations lane by lane (max|x| is
// exact in any order; a NaN x is skipped by the max and clamped to -127, as std::max/std::min do).
// On AVX-512 5-10x faster than the scalar loop, which cost a sixth of a down projection at 32 rows;
// on AVX2 (Zen 3) the scalar loop took 6 ns a value, 50 us for one row of 8192 (docs/one-stream.md,
// "On an AVX2-only CPU").
#if defined(__AVX2__) && !defined(__AVX512F__)
// The int32 lanes of v summed.
inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#endif

void quantize_row(const float* x, int8_t* q, float* scale, int32_t* sums, int64_t K) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
#if defined(__AVX512F__)
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    // max(|x|, m): the second operand where the first is NaN, as std::max(m, |x|) keeps m.
    const __m512 m = _mm512_max_ps(_mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps()));
    const float amax = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      m = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]), m);  // NaN |x|: m kept
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
#else
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
#if defined(__AVX512F__)
    int32_t s[2];
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f), vid = _mm512_set1_ps(id);
    for (int h = 0; h < 2; ++h) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(h ? v1 : v0, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));  // NaN -> -127
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16 * h), _mm512_cvtepi32_epi8(c));
      s[h] = _mm512_reduce_add_epi32(c);
    }
#elif defined(__AVX2__)
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f), vid = _mm256_set1_ps(id);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      c[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));  // NaN -> -127
    }
    // Packed within 128-bit lanes, so 4-byte groups come out as k 0, 8, 16, 24, 4, 12, 20, 28: put back.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const int32_t s[2] = {hsum(_mm256_add_epi32(c[0], c[1])), hsum(_mm256_add_epi32(c[2], c[3]))};
#else
    int32_t s[2] = {0, 0};
    for (int i = 0; i < kBlock; ++i) {
      const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[i] * id)));
      q[b * kBlock + i] = static_cast<int8_t>(v);
      s[i / 16] += static_cast<int32_t>(v);
    }
#endif
    scale[b] = d;
    sums[2 * b] = s[0];
    sums[2 * b + 1] = s[1];
  }
}

// The quantized rows as the tiles read them: codes [M, K], scales [M, nb], the shift's correction
// shift * sum(q) per row, block and span [M, nb, spans], and msum = sa * sum(q) [M, nb] (mins).
struct Rows {
  const int8_t* q;
  const float* scale;
  const int32_t* corr;
  const float* msum;
  int64_t K, nb;
};

// One row's fp32 values: fp32 rows as they are, bf16 rows widened into `tmp` (exact).
inline const float* widen(const float* x, float*, int64_t) { return x; }
inline const float* widen(const at::BFloat16* x, float* tmp, int64_t K) {
  int64_t k = 0;
#if defined(__AVX512F__)
  for (; k + 16 <= K; k += 16) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k)));
    _mm512_storeu_ps(tmp + k, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
  }
#endif
  for (; k < K; ++k) tmp[k] = static_cast<float>(x[k]);
  return tmp;
}

// Rows of x (row stride lda) quantized (quantize_row), in parallel; where `corr` is given, each row's
// shift correction and msum for the tiles (Rows) too, in the same pass (not a serial loop after it).
template <typename In>
void quantize_rows(const In* x, int64_t lda, int64_t M, int64_t K, int8_t* q, float* scale, int32_t* sums,
                   const Int8Format* fmt, int32_t* corr, float* msum) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    // bf16 rows a chunk of blocks at a time (blocks are independent): the widened copy stays in L1.
    constexpr int64_t kChunk = std::is_same_v<In, float> ? INT64_MAX : 16 * kBlock;
    alignas(64) float tmp[std::is_same_v<In, float> ? 1 : kChunk];
    for (int64_t m = m0; m < m1; ++m) {
      const float* sp = scale + m * nb;
      const int32_t* up = sums + m * 2 * nb;
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t n = std::min(kChunk, K - k0), b0 = k0 / kBlock;
        quantize_row(widen(x + m * lda + k0, tmp, n), q + m * K + k0, scale + m * nb + b0, sums + (m * nb + b0) * 2, n);
      }
      if (corr == nullptr) continue;
      const int S = fmt->spans(), shift = fmt->shift();
      for (int64_t b = 0; b < nb; ++b) {
        const int32_t total = up[2 * b] + up[2 * b + 1];
        if (S == 2) {
          corr[(m * nb + b) * 2] = shift * up[2 * b];
          corr[(m * nb + b) * 2 + 1] = shift * up[2 * b + 1];
        } else {
          corr[m * nb + b] = shift * total;
        }
        msum[m * nb + b] = sp[b] * static_cast<float>(total);
      }
    }
  });
}

}  // namespace
}  // namespace orcaserve::ORCA_ISA
