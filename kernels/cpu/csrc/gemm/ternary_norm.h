// BitNet's sub-layer norm in the call of the BitLinear after it (gemm/gemm_ternary.cpp,
// `bitlinear_ternary`'s `norm` and `relu2`): the row the quantization reads is
//
//   v = relu(gate)^2 * up                     where relu2 (x = [gate | up]): each op rounded to T
//   v = w * (v32 * rsqrt(mean(v32^2) + eps))  kernels/pytorch/fused.py's rms_norm: fp32, the
//                                             product rounded to T, then times w rounded to T
//
// bit for bit what those PyTorch ops compute (docs/bitnet.md, "The sub-layer norms in the call"):
// the mean's sum is taken in ATen's own order (SumKernel.cpp's cascade sum over vectors of 8 floats:
// ATen runs its sum kernel at AVX2 at most, on AVX-512 CPUs too, whatever variant of this library
// runs), then divided by the width; the rsqrt is 1 / sqrt; each an IEEE fp32 operation (the library
// builds with -ffp-contract=off).
// Finite activations only.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "gemm/ternary_act.h"
#include "rows.h"

namespace orcaserve::ORCA_ISA {
namespace {

// The norm's weight [K] in x's dtype (none: no norm), eps, and whether x is [T, 2 K], gate then up.
struct SubNorm {
  const at::Tensor* weight;
  float eps;
  bool relu2;
};

// ATen's row_sum of v^2 over `size` items of L lanes (item i at v + i L), lane by lane:
// multi_row_sum over 4 interleaved rows of size / 4 items in 4 levels of chunks, then the items
// left over, then the 4 partial sums in order.
template <int L>
void cascade_sum_sq(const float* v, int64_t size, float* out) {
  constexpr int kLevels = 4, kIlp = 4;
  const int64_t n = size / kIlp;
  int64_t log2 = 1;  // ATen's CeilLog2(n)
  while (n > 2 && (int64_t{1} << log2) < n) ++log2;
  const int64_t power = std::max<int64_t>(4, log2 / kLevels), step = int64_t{1} << power, mask = step - 1;
  float acc[kLevels][kIlp][L] = {};
  auto add = [&](float* a, int64_t item) {
    for (int l = 0; l < L; ++l) a[l] += v[item * L + l] * v[item * L + l];
  };
  int64_t i = 0;
  while (i + step <= n) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int r = 0; r < kIlp; ++r) add(acc[0][r], i * kIlp + r);
    for (int j = 1; j < kLevels; ++j) {
      for (int r = 0; r < kIlp; ++r)
        for (int l = 0; l < L; ++l) {
          acc[j][r][l] += acc[j - 1][r][l];
          acc[j - 1][r][l] = 0.0f;
        }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < n; ++i)
    for (int r = 0; r < kIlp; ++r) add(acc[0][r], i * kIlp + r);
  for (int j = 1; j < kLevels; ++j)
    for (int r = 0; r < kIlp; ++r)
      for (int l = 0; l < L; ++l) acc[0][r][l] += acc[j][r][l];
  for (int64_t item = n * kIlp; item < size; ++item) add(acc[0][0], item);
  for (int r = 1; r < kIlp; ++r)
    for (int l = 0; l < L; ++l) acc[0][0][l] += acc[0][r][l];
  std::copy(acc[0][0], acc[0][0] + L, out);
}

// sum(v^2) over a row of k, as ATen sums the fp32 tensor v.pow(2) along it: vectors of L lanes,
// then the tail's scalars, then the lanes in order; a row narrower than a vector as scalars.
constexpr int kAtenSumLanes = 8;

template <int L = kAtenSumLanes>
float aten_sum_sq(const float* v, int64_t k) {
  float lanes[L];
  if (k < L) {
    cascade_sum_sq<1>(v, k, lanes);
    return lanes[0];
  }
  const int64_t whole = k / L;
  cascade_sum_sq<L>(v, whole, lanes);
  float total = 0.0f;
  for (int64_t i = whole * L; i < k; ++i) total += v[i] * v[i];
  for (int l = 0; l < L; ++l) total += lanes[l];
  return total;
}

// v[0, k): the row src (k values of T; where relu2, 2 k: gate then up, taken to relu(gate)^2 * up),
// normed by w (k values of T) where w is given. up: scratch of k floats.
template <typename T>
void sub_norm_row(const T* src, int64_t k, bool relu2, const float* w, float eps, float* v, float* up) {
  to_float(src, v, k);
  int64_t i = 0;
  if (relu2) {
    to_float(src + k, up, k);
    for (; i + kL <= k; i += kL) {
      const vf g = fmaxv(fload(v + i), fzero());
      fstore(v + i, vround_to<T>(fmul(vround_to<T>(fmul(g, g)), fload(up + i))));
    }
    for (; i < k; ++i) {
      const float g = std::max(v[i], 0.0f);
      v[i] = round_to<T>(round_to<T>(g * g) * up[i]);
    }
  }
  if (w == nullptr) return;
  const float sum = aten_sum_sq(v, k);
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(k) + eps);
  const vf vr = fbcast(r);
  for (i = 0; i + kL <= k; i += kL) fstore(v + i, vround_to<T>(fmul(fload(w + i), vround_to<T>(fmul(fload(v + i), vr)))));
  for (; i < k; ++i) v[i] = round_to<T>(w[i] * round_to<T>(v[i] * r));
}

}  // namespace
}  // namespace orcaserve::ORCA_ISA
