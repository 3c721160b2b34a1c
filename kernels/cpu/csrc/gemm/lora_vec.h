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
    const auto v = at::vec::convert_from_float<T>(lo, hi);
    m >= kOut ? v.store(p) : v.store(p, m);
  }
}

// Two vectors rounded to T (nearest even, as c10's scalar conversion), back in fp32.
template <typename T>
inline void round2(Vec& lo, Vec& hi) {
  if constexpr (!std::is_same_v<T, float>) std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(lo, hi));
}

// out[q * NJ + p] = x row q . a row p (fp32, `in` long; a's rows lda apart).
template <int NR, int NJ>
inline void dots(const float* const* xr, const float* a, int64_t lda, int64_t in, float* out) {
  Vec acc[NR][NJ];
  for (int q = 0; q < NR; ++q)
    for (int p = 0; p < NJ; ++p) acc[q][p] = Vec(0.f);
  for (int64_t k = 0; k < in; k += kW) {
    const int64_t m = std::min(kW, in - k);
    Vec av[NJ];
    for (int p = 0; p < NJ; ++p) av[p] = m == kW ? Vec::loadu(a + p * lda + k) : Vec::loadu(a + p * lda + k, m);
    for (int q = 0; q < NR; ++q) {
      const Vec xv = m == kW ? Vec::loadu(xr[q] + k) : Vec::loadu(xr[q] + k, m);
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
