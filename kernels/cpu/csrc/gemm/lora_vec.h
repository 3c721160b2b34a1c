// The vector pieces of the LoRA update (gemm/lora.cpp; docs/lora.md "The segmented update in the
// dispatch table"): register blocks of rows, kOut outputs of T as two fp32 vectors, T's rounding,
// and the shrink's dot products (fp32 FMAs, or vdpbf16ps on bf16 as stored).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <utility>

#include "rows.h"

namespace orcaserve::ORCA_ISA {
namespace lora {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kW = Vec::size();
constexpr int64_t kChunk = 16;  // rows per task: the adapter's weights read once per task
constexpr int64_t kAhead = 4;  // rows of A, blocks of B^T's outputs, requested that far ahead
constexpr int64_t kOut = 2 * kW;  // outputs per expand block (one Vectorized<BFloat16>)
template <int N>
using Rows = std::integral_constant<int, N>;

// The cache lines of [p, p + bytes) requested ahead (into L1): the adapters' weights stream from
// memory once a step, each task's A and B^T a few KB (docs/lora.md "What it costs").
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T0);
}

template <typename T>
inline float rounded(float v) {  // v as T would hold it (nearest even), back in fp32
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return static_cast<float>(T(v));
  }
}

// f(Rows<NR>{}, i) for each block of NR <= 4 rows of n, i its first row: the register blocks.
template <typename F>
inline void row_blocks(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) f(Rows<4>{}, i);
  if (n - i == 3) f(Rows<3>{}, i);
  if (n - i == 2) f(Rows<2>{}, i);
  if (n - i == 1) f(Rows<1>{}, i);
}

// The same with blocks of 8 rows first (the vdpbf16ps expand: 16 accumulators of 32 registers), the
// rest as row_blocks. A row's sums run in the same order in a block of any size.
template <typename F>
inline void row_blocks8(int64_t n, F&& f) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) f(Rows<8>{}, i);
  row_blocks(n - i, [&](auto nr, int64_t k) { f(nr, i + k); });
}

// kOut values of T at p (the first m; zeros past them) as two fp32 vectors, and back.
template <typename T>
inline std::pair<Vec, Vec> load2(const T* p, int64_t m) {
  if constexpr (std::is_same_v<T, float>) {
    if (m >= kOut) return {Vec::loadu(p), Vec::loadu(p + kW)};
    return {Vec::loadu(p, std::min(m, kW)), m > kW ? Vec::loadu(p + kW, m - kW) : Vec(0.f)};
  } else {
    using TVec = at::vec::Vectorized<T>;
    auto [lo, hi] = at::vec::convert_to_float<T>(m >= kOut ? TVec::loadu(p) : TVec::loadu(p, m));
    return {lo, hi};
  }
}

#ifdef ORCA_DPBF16
// Two vectors as 32 bf16 in two instructions (vcvtneps2bf16, nearest even) where that is c10's
// rounding bit for bit: no lane a denormal (the instruction reads them as zero) nor a NaN (its
// payload differs); the caller rounds in software otherwise. fp32 normals round to bf16 normals
// or infinity alike both ways (bf16 has fp32's exponent range).
inline bool hw_rounds(Vec lo, Vec hi) {
  constexpr int kOdd = 0x01 | 0x20 | 0x80;  // vfpclassps: quiet NaN, denormal, signalling NaN
  return (_mm512_fpclass_ps_mask(lo, kOdd) | _mm512_fpclass_ps_mask(hi, kOdd)) == 0;
}
inline __m512i hw_bf16(Vec lo, Vec hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(to_bf16(lo)), to_bf16(hi), 1);
}
inline Vec bf16_half(__m512i v, int half) {  // 16 of the 32 bf16 as fp32 (exact)
  const __m256i h = half == 0 ? _mm512_castsi512_si256(v) : _mm512_extracti64x4_epi64(v, 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

template <typename T>
inline void store2(T* p, int64_t m, Vec lo, Vec hi) {
  if constexpr (std::is_same_v<T, float>) {
    if (m >= kOut) {
      lo.store(p);
      hi.store(p + kW);
    } else {
      lo.store(p, std::min(m, kW));
      if (m > kW) hi.store(p + kW, m - kW);
    }
  } else {
#ifdef ORCA_DPBF16
    if (hw_rounds(lo, hi)) {
      const __m512i v = hw_bf16(lo, hi);
      m >= kOut ? _mm512_storeu_si512(p, v) : _mm512_mask_storeu_epi16(p, (__mmask32(1) << m) - 1, v);
      return;
    }
#endif
    const auto v = at::vec::convert_from_float<T>(lo, hi);
    m >= kOut ? v.store(p) : v.store(p, m);
  }
}

// Two vectors rounded to T (nearest even, as c10's scalar conversion), back in fp32.
template <typename T>
inline void round2(Vec& lo, Vec& hi) {
  if constexpr (!std::is_same_v<T, float>) {
#ifdef ORCA_DPBF16
    if (hw_rounds(lo, hi)) {
      const __m512i v = hw_bf16(lo, hi);
      lo = bf16_half(v, 0);
      hi = bf16_half(v, 1);
      return;
    }
#endif
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(lo, hi));
  }
}

// out[q * NJ + p] = x row q . a row p (fp32, `in` long; a's rows lda apart).
template <int NR, int NJ>
inline void dots(const float* const* xr, const float* a, int64_t lda, int64_t in, float* out) {
  Vec acc[NR][NJ];  // the loops over them unrolled: in registers
#pragma GCC unroll 4
  for (int q = 0; q < NR; ++q)
#pragma GCC unroll 2
    for (int p = 0; p < NJ; ++p) acc[q][p] = Vec(0.f);
  int64_t k = 0;
  for (; k + kW <= in; k += kW) {
    Vec av[NJ];
#pragma GCC unroll 2
    for (int p = 0; p < NJ; ++p) av[p] = Vec::loadu(a + p * lda + k);
#pragma GCC unroll 4
    for (int q = 0; q < NR; ++q) {
      const Vec xv = Vec::loadu(xr[q] + k);
#pragma GCC unroll 2
      for (int p = 0; p < NJ; ++p) acc[q][p] = at::vec::fmadd(xv, av[p], acc[q][p]);
    }
  }
  if (k < in) {  // the last in - k values, zeros past them
    Vec av[NJ];
#pragma GCC unroll 2
    for (int p = 0; p < NJ; ++p) av[p] = Vec::loadu(a + p * lda + k, in - k);
#pragma GCC unroll 4
    for (int q = 0; q < NR; ++q) {
      const Vec xv = Vec::loadu(xr[q] + k, in - k);
#pragma GCC unroll 2
      for (int p = 0; p < NJ; ++p) acc[q][p] = at::vec::fmadd(xv, av[p], acc[q][p]);
    }
  }
  for (int q = 0; q < NR; ++q)
    for (int p = 0; p < NJ; ++p)
      out[q * NJ + p] = at::vec::vec_reduce_all<float>([](Vec u, Vec v) { return u + v; }, acc[q][p]);
}

#ifdef ORCA_DPBF16
// The same on bf16 as stored: vdpbf16ps, 32 values a step (products exact in fp32, sums in fp32).
template <int NR, int NJ>
inline void dots(const at::BFloat16* const* xr, const at::BFloat16* a, int64_t lda, int64_t in, float* out) {
  __m512 acc[NR][NJ];
  for (int q = 0; q < NR; ++q)
    for (int p = 0; p < NJ; ++p) acc[q][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < in; k += 32) {
    const __mmask32 mask = in - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (in - k)) - 1;
    __m512i av[NJ];
    for (int p = 0; p < NJ; ++p) av[p] = _mm512_maskz_loadu_epi16(mask, a + p * lda + k);
    for (int q = 0; q < NR; ++q) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, xr[q] + k);
      for (int p = 0; p < NJ; ++p) acc[q][p] = _mm512_dpbf16_ps(acc[q][p], (__m512bh)xv, (__m512bh)av[p]);
    }
  }
  for (int q = 0; q < NR; ++q)
    for (int p = 0; p < NJ; ++p) out[q * NJ + p] = _mm512_reduce_add_ps(acc[q][p]);
}
#endif

}  // namespace lora
}  // namespace orcaserve::ORCA_ISA
