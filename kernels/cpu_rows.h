// Helpers shared by the row-wise CPU ops (cpu_fused.cpp, cpu_rope_store.cpp).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>

namespace orcaserve {

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

}  // namespace orcaserve
