// Helpers shared by the row-wise CPU ops (fused/norm_silu.cpp, fused/rope_store.cpp) and the attention.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>

// bf16 in hardware (AVX-512 BF16: vdpbf16ps, vcvtneps2bf16), compiled in only when the building
// CPU has it.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define ORCA_DPBF16 1
#endif

namespace orcaserve::ORCA_ISA {

#ifdef ORCA_DPBF16
constexpr bool kHaveDpBf16 = true;

// 16 fp32 values rounded to bf16 (nearest even) in one instruction; fp32 denormals read as zero.
inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
#else
constexpr bool kHaveDpBf16 = false;
#endif

// Rows per task: a decode step's few rows run on one thread (the fork would cost more than the
// work), a prefill chunk's are split.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

// n values of T as fp32.
template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

}  // namespace orcaserve::ORCA_ISA
