// fp32 GEMM for the lean decoder's linear layers on AVX2 CPUs: y = x W^T (+ b) over a weight packed
// once into panels of 24 output columns, [P, K, 24], so that a panel is read as one sequential
// stream. On an AMD Zen 3, SmolLM2's layer GEMMs at 32 rows over 30 layers' weights: oneDNN's
// pre-packed inner product 111 GFLOP/s on two threads, this 145 (`python benchmarks/gemm.py --dtype
// float32 --layers 30`; docs/engine.md, "Eighth round").
//
// Micro-kernel: 4 rows x 24 columns of accumulators (12 ymm registers), a broadcast of each row's
// x[k] against the panel's row k, summed over k in order with FMA. Every output element therefore
// sums its K products in the same order whatever the row count or the thread split: a request's
// results do not depend on its batch-mates. Threads take panels from an atomic counter, so one
// that is preempted does not hold the other up at a barrier with half the work.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace orcaserve {
namespace {

constexpr int kCols = 24;  // output columns per panel: three ymm registers
constexpr int kRows = 4;   // rows per micro-tile: 12 accumulators, 3 panel loads, 1 broadcast

// C[r, :ncols] = bias[:ncols] + sum_k a[r * lda + k] * b[k, :] for R rows; b is one panel [K, 24].
template <int R>
inline void tile(const float* a, int64_t lda, const float* b, int64_t K, const float* bias, float* c,
                 int64_t ldc, int ncols) {
  alignas(32) float init[kCols] = {};
  if (bias != nullptr) std::copy(bias, bias + ncols, init);
  // Named registers, not an array: GCC keeps an accumulator array in memory across the loop.
#define ORCA_ACC(r) __m256 c##r##0 = _mm256_load_ps(init), c##r##1 = _mm256_load_ps(init + 8), \
                           c##r##2 = _mm256_load_ps(init + 16);
  ORCA_ACC(0) ORCA_ACC(1) ORCA_ACC(2) ORCA_ACC(3)
#define ORCA_FMA(r)                                                  \
  if (R > r) {                                                       \
    const __m256 x = _mm256_broadcast_ss(a + r * lda + k);           \
    c##r##0 = _mm256_fmadd_ps(x, b0, c##r##0);                       \
    c##r##1 = _mm256_fmadd_ps(x, b1, c##r##1);                       \
    c##r##2 = _mm256_fmadd_ps(x, b2, c##r##2);                       \
  }
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    const float* bk = b + k * kCols;
    const __m256 b0 = _mm256_loadu_ps(bk), b1 = _mm256_loadu_ps(bk + 8), b2 = _mm256_loadu_ps(bk + 16);
    ORCA_FMA(0) ORCA_FMA(1) ORCA_FMA(2) ORCA_FMA(3)
  }
  alignas(32) float out[kRows][kCols];
#define ORCA_STORE(r)                          \
  _mm256_store_ps(out[r], c##r##0);            \
  _mm256_store_ps(out[r] + 8, c##r##1);        \
  _mm256_store_ps(out[r] + 16, c##r##2);
  ORCA_STORE(0) ORCA_STORE(1) ORCA_STORE(2) ORCA_STORE(3)
#undef ORCA_ACC
#undef ORCA_FMA
#undef ORCA_STORE
  for (int r = 0; r < R; ++r) std::copy(out[r], out[r] + ncols, c + r * ldc);
}

// [N, K] -> [ceil(N / 24), K, 24], the last panel's missing columns zero.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_linear_weight: an fp32 [out, in] CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kCols - 1) / kCols;
  at::Tensor packed = at::zeros({P, K, kCols}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kCols && p * kCols + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kCols + j] = src[(p * kCols + j) * K + k];
  });
  return packed;
}

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat,
              "linear_packed: x must be an fp32 [rows, in] CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous() && packed.size(1) == x.size(1) &&
                  packed.size(0) == (out_features + kCols - 1) / kCols,
              "linear_packed: packed must come from pack_linear_weight of an [out_features, in] weight");
  const at::Tensor xc = x.contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!bc.defined() || (bc.scalar_type() == at::kFloat && bc.numel() == out_features),
              "linear_packed: bias must be fp32 [out_features]");
  const int64_t M = xc.size(0), K = xc.size(1), N = out_features, P = packed.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0) return y;
  const float* a = xc.data_ptr<float>();
  const float* b = packed.data_ptr<float>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  float* c = y.data_ptr<float>();
  constexpr int64_t kChunk = 2;  // panels per grab: 1-4 measured alike
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (P + kChunk - 1) / kChunk);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t p0 = next.fetch_add(kChunk); p0 < P; p0 = next.fetch_add(kChunk)) {
      for (int64_t p = p0; p < std::min(P, p0 + kChunk); ++p) {
        const float* panel = b + p * K * kCols;
        const int ncols = static_cast<int>(std::min<int64_t>(kCols, N - p * kCols));
        const float* bias_p = bp ? bp + p * kCols : nullptr;
        for (int64_t m = 0; m < M; m += kRows) {
          const float* am = a + m * K;
          float* cm = c + m * N + p * kCols;
          switch (std::min<int64_t>(kRows, M - m)) {
            case 4: tile<4>(am, K, panel, K, bias_p, cm, N, ncols); break;
            case 3: tile<3>(am, K, panel, K, bias_p, cm, N, ncols); break;
            case 2: tile<2>(am, K, panel, K, bias_p, cm, N, ncols); break;
            default: tile<1>(am, K, panel, K, bias_p, cm, N, ncols); break;
          }
        }
      }
    }
  });
  return y;
}

}  // namespace
}  // namespace orcaserve

TORCH_LIBRARY_FRAGMENT(orcaserve, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("linear_packed(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(orcaserve, CPU, m) {
  m.impl("pack_linear_weight", &orcaserve::pack_linear_weight);
  m.impl("linear_packed", &orcaserve::linear_packed);
}
#endif  // AVX2 and FMA: elsewhere the ops are not registered and the decoder keeps oneDNN / MKL
