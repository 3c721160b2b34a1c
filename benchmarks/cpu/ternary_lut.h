// Shared by the lookup-table ternary GEMMs measured beside the vpdpbusd kernel (ternary_lut.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace ternary_lut {

constexpr int64_t kFlush = 64;  // groups summed in int16 before widening
constexpr int64_t kAhead = 8192;  // prefetch distance in the weight stream (as gemm_ternary.cpp)
constexpr int kRows = 8;          // rows per pass over a panel

inline int64_t up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// A row's int8 codes as int16, padded with zeros to kp + 8 (the tables read a few past a group).
inline std::vector<int16_t> widen_rows(const at::Tensor& x, int64_t kp) {
  const int64_t t = x.size(0), k = x.size(1), ld = kp + 8;
  std::vector<int16_t> out(t * ld, 0);
  const int8_t* src = x.data_ptr<int8_t>();
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < k; ++j) out[i * ld + j] = src[i * k + j];
  return out;
}

inline int code_at(const int8_t* w, int64_t n, int64_t k, int64_t col, int64_t kk) {
  return col < n && kk < k ? w[col * k + kk] : 0;
}

// Row tiles of at most kRows rows, spread evenly (as rows.h's RowTiles), called as f(r0, R).
template <typename F>
void tiles(int64_t t, F&& f) {
  const int64_t n = (t + kRows - 1) / kRows;
  for (int64_t i = 0, r0 = 0; i < n; ++i) {
    const int64_t rows = t / n + (i < t % n ? 1 : 0);
    f(r0, rows);
    r0 += rows;
  }
}

template <int R, typename F>
void dispatch_rows(int64_t rows, F&& f) {
  if constexpr (R >= 1) {
    if (rows == R) return f(std::integral_constant<int, R>{});
    dispatch_rows<R - 1>(rows, f);
  }
}

// Group blocks: one block where the tables of a row tile stay in cache, else blocks of `block`
// groups with the int32 sums kept in the output between them.
inline int64_t block_for(int64_t t, int64_t groups, int64_t block) { return t <= kRows ? groups : block; }

at::Tensor pack_tl2(const at::Tensor& weight, bool column_signs);
template <bool V>
at::Tensor linear_tl2(const at::Tensor& x, const at::Tensor& packed, int64_t n);
at::Tensor pack_perm27(const at::Tensor& weight);
at::Tensor linear_perm27(const at::Tensor& x, const at::Tensor& packed, int64_t n);

}  // namespace ternary_lut
