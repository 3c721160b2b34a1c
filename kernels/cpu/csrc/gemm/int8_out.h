// Where a tile row of gemm_int8.cpp's results goes: stored into y (linear_int8), or, for a greedy
// lm_head, reduced panel by panel to the row's argmax as the GEMM computes it (linear_int8_argmax;
// docs/one-stream.md, "The argmax inside the lm_head"): no [rows, V] logits tensor is written and
// read again by the sampler. The argmax is torch.argmax's answer over the values as the GEMM would
// have stored them (bf16 rounded, for bf16 activations): the first NaN if a row has one (torch counts NaN as the largest value), else the
// first index of the maximum (-0 and +0 equal, -inf a value like any other).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "gemm/bf16_round.h"
#include "gemm/int8_vec.h"

namespace orcaserve::ORCA_ISA {
namespace {

// One tile row's ncols results (+ bias) into y: fp32 as they are, bf16 rounded to nearest even with
// NaN made 0x7FC0 (c10::BFloat16's rounding, lane by lane on AVX-512, bit for bit the scalar cast).
inline void put(float v, float* dst) { *dst = v; }
inline void put(float v, at::BFloat16* dst) { *dst = static_cast<at::BFloat16>(v); }

template <typename Out>
inline void store_row(const float* src, const float* bias, Out* dst, int64_t ncols) {
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (; j < ncols; j += kL) {
    const __mmask16 live = static_cast<__mmask16>(ncols - j >= kL ? 0xFFFF : (1u << (ncols - j)) - 1);
    __m512 v = _mm512_loadu_ps(src + j);  // the tile's buffer holds a whole panel
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, bias + j));
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_mask_storeu_ps(dst + j, live, v);
    } else {
      _mm256_mask_storeu_epi16(dst + j, live, _mm512_cvtepi32_epi16(bf16_bits(v)));
    }
  }
#endif
  for (; j < ncols; ++j) put(bias ? src[j] + bias[j] : src[j], dst + j);
}

// Whether (v, at a later index) replaces (best, at an earlier one) as the argmax so far.
inline bool beats(float v, float best) { return v > best || (std::isnan(v) && !std::isnan(best)); }

inline float as_float(float v) { return v; }
inline float as_float(at::BFloat16 v) { return static_cast<float>(v); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <typename Out>
inline __m512 load16(const Out* p) {  // 16 values as fp32 (bf16 widened exactly, NaN stays NaN)
  if constexpr (std::is_same_v<Out, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
#endif

// One panel's n (>= 1) stored values: (the largest, its first index), by `beats`.
template <typename Out>
inline void panel_argmax(const Out* v, int n, float* best, int32_t* index) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (n == 32) {  // a whole AVX-512 panel without NaN: the vector max, then its first lane
    const __m512 a = load16(v), c = load16(v + 16);
    if ((_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q)) == 0) {
      const float b = _mm512_reduce_max_ps(_mm512_max_ps(a, c));
      const __m512 bv = _mm512_set1_ps(b);
      const uint32_t hit = _mm512_cmp_ps_mask(a, bv, _CMP_EQ_OQ) |
                           (static_cast<uint32_t>(_mm512_cmp_ps_mask(c, bv, _CMP_EQ_OQ)) << 16);
      *best = b;
      *index = __builtin_ctz(hit);
      return;
    }
  }
#endif
  float b = as_float(v[0]);
  int32_t at = 0;
  for (int j = 1; j < n; ++j) {
    const float x = as_float(v[j]);
    if (beats(x, b)) {
      b = x;
      at = j;
    }
  }
  *best = b;
  *index = at;
}

// Per row of M, the panels' results [M, P] (panel p covering columns p * width on) reduced in
// panel order: the row's argmax.
inline void reduce_panels(const std::vector<float>& best, const std::vector<int32_t>& index, int64_t M, int64_t P,
                          int64_t width, int64_t* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* b = best.data() + m * P;
    const int32_t* i = index.data() + m * P;
    int64_t at = 0;
    for (int64_t p = 1; p < P; ++p)
      if (beats(b[p], b[at])) at = p;
    out[m] = at * width + i[at];
  }
}

}  // namespace
}  // namespace orcaserve::ORCA_ISA
