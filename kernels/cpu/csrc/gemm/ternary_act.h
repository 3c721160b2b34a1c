// BitNet's BitLinear around the ternary GEMM (gemm/gemm_ternary.cpp, `bitlinear_ternary`), in the
// model's dtype T (float or bf16), op for op as kernels/ternary.py's PyTorch path computes it
// (docs/bitnet.md, "The kernel"):
//
//   s   = 127 / max|x|.clamp(min=1e-5)   torch: reciprocal, then * 127, each rounded to T
//   x_q = round(x * s).clamp(-128, 127)  x * s rounded to T, then to the nearest integer (ties even)
//   y   = acc.to(T) / (col_scale * s)    each of the three rounded to T
//
// Every product and quotient is one IEEE fp32 operation rounded to T to nearest even, as ATen's
// reduced-precision kernels compute in fp32 and round back; so the output is the PyTorch path's bit
// for bit (tests/kernels/test_ternary_kernel.py). Finite activations only.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "gemm/int8_vec.h"

namespace orcaserve::ORCA_ISA {
namespace {

template <typename T>
inline float round_to(float x) {  // x rounded to T's precision, as a float
  if constexpr (std::is_same_v<T, float>)
    return x;
  else
    return static_cast<float>(c10::BFloat16(x));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline vi fbits(vf v) { return _mm512_castps_si512(v); }
inline vf frombits(vi v) { return _mm512_castsi512_ps(v); }
inline vf fdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf fabsv(vf v) { return _mm512_abs_ps(v); }
inline vf fmaxv(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf fminv(vf a, vf b) { return _mm512_min_ps(a, b); }
inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
inline vf fnearest(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline int32_t store_codes(int8_t* q, vf v) {  // v: integers in [-128, 127]
  const vi c = _mm512_cvtps_epi32(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(c));
  return _mm512_reduce_add_epi32(c);
}
inline void store_bf16(at::BFloat16* dst, vf v) {  // v already at bf16 precision: its high halves
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(fbits(v), 16)));
}
inline vi iand(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vi srli16(vi v) { return _mm512_srli_epi32(v, 16); }
#else
inline vi fbits(vf v) { return _mm256_castps_si256(v); }
inline vf frombits(vi v) { return _mm256_castsi256_ps(v); }
inline vf fdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf fabsv(vf v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
inline vf fmaxv(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf fminv(vf a, vf b) { return _mm256_min_ps(a, b); }
inline float hmax(vf v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}
inline vf fnearest(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline int32_t store_codes(int8_t* q, vf v) {
  alignas(32) int32_t c[kL];
  _mm256_store_si256(reinterpret_cast<__m256i*>(c), _mm256_cvtps_epi32(v));
  int32_t s = 0;
  for (int j = 0; j < kL; ++j) s += q[j] = static_cast<int8_t>(c[j]);
  return s;
}
inline void store_bf16(at::BFloat16* dst, vf v) {
  const vi b = _mm256_srli_epi32(fbits(v), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
inline vi iand(vi a, vi b) { return _mm256_and_si256(a, b); }
inline vi srli16(vi v) { return _mm256_srli_epi32(v, 16); }
#endif

// round_to<T> lane by lane: bf16 to nearest even by the integer trick ATen's conversions use
// (bits + 0x7fff + the kept half's lowest bit, low half cleared); finite values.
template <typename T>
inline vf vround_to(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const vi b = fbits(v);
    const vi up = iadd(iadd(b, ibcast32(0x7fff)), iand(srli16(b), ibcast32(1)));
    return frombits(iand(up, ibcast32(static_cast<int32_t>(0xffff0000u))));
  }
}

// One row of k activations (as floats: T's values exactly) to int8 codes q[0, kp) (zeros past k) and
// their sum; returns s, the row's scale (a value of T).
template <typename T>
inline float quantize_row(const float* x, int64_t k, int8_t* q, int64_t kp, int32_t* sum) {
  vf m = fzero();
  int64_t i = 0;
  for (; i + kL <= k; i += kL) m = fmaxv(m, fabsv(fload(x + i)));
  float amax = hmax(m);
  for (; i < k; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float floor = round_to<T>(1e-5f);  // clamp(min=1e-5): the bound converted to T
  const float s = round_to<T>(round_to<T>(1.0f / std::max(amax, floor)) * 127.0f);
  const vf vs = fbcast(s), lo = fbcast(-128.0f), hi = fbcast(127.0f);
  int32_t total = 0;
  for (i = 0; i + kL <= k; i += kL)
    total += store_codes(q + i, fminv(fmaxv(fnearest(vround_to<T>(fmul(fload(x + i), vs))), lo), hi));
  for (; i < k; ++i) {
    const float v = std::nearbyint(round_to<T>(x[i] * s));
    total += q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, v)));
  }
  std::fill(q + k, q + kp, int8_t{0});
  *sum = total;
  return s;
}

// y = acc.to(T) / (col_scale * s) for kL columns: cs the columns' scales (values of T), width of
// them stored at dst.
template <typename T>
inline void scale_store(vi acc, const float* cs, float s, T* dst, int64_t width) {
  const vf d = vround_to<T>(fmul(fload(cs), fbcast(s)));
  const vf y = vround_to<T>(fdiv(vround_to<T>(fcvt(acc)), d));
  if (width == kL) {
    if constexpr (std::is_same_v<T, float>)
      fstore(dst, y);
    else
      store_bf16(dst, y);
    return;
  }
  alignas(64) float lanes[kL];
  fstore(lanes, y);
  for (int64_t j = 0; j < width; ++j) dst[j] = static_cast<T>(lanes[j]);  // exact: already T's values
}

}  // namespace
}  // namespace orcaserve::ORCA_ISA
