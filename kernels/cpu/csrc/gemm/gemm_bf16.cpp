// bf16 GEMM for the lean decoder's linear layers on CPUs with AVX-512 BF16 but no AMX (AMD Zen 4):
// y = x W^T (+ b) with `vdpbf16ps`, which multiplies pairs of bf16 and adds both products to an
// fp32 sum in one instruction, reading x and W as stored (gemm/gemm_fp32.cpp widens them to fp32 first
// and runs half as many products per instruction).
//
// The weight is packed once into panels of 48 output columns with the K axis in pairs,
// [P, K / 2, 48, 2]: a panel's row k2 is the three zmm operands of one step, read as one stream.
// Micro-kernel: up to 8 rows x 48 columns of fp32 sums (24 zmm registers), one broadcast of a row's
// x pair against the panel's row k2, summed over k2 in order. As in gemm/gemm_fp32.cpp, every output
// element sums its products in the same order whatever the row count or the thread split (a
// request's results do not depend on its batch-mates), each sum is rounded once to bf16, and
// threads take panel pairs from a counter (gemm/panels.h).
//
// Calls of one row tile (up to kRows = 8 rows, not kStreamRows' 4: a speculative verifying row of
// 1 + K reads each panel once too) walk each thread's contiguous share of the panels as one stream
// and prefetch kStreamAhead bytes ahead in it: the same sums in the same order, so the same bits.
//
// `vdpbf16ps` treats subnormal inputs as zero and rounds to nearest even; the sums may differ from
// oneDNN's in the last bf16 place (other order), as oneDNN's differ from F.linear's.
#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>

#include "gemm/panels.h"
#include "ops.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace orcaserve::ORCA_ISA {
namespace {

constexpr int kCols = 48;  // output columns per panel: three zmm registers of fp32 sums
constexpr int kRows = 8;   // rows per micro-tile: 24 accumulators, 3 panel loads, 1 broadcast

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }  // same bits: GCC's vector cast

// C[r, :ncols] = bias + sum_k2 a[r, 2 k2 : 2 k2 + 2] . b[k2, :, :] for R rows; b is one panel
// [K2, 48, 2]. With Stream, the three lines kStreamAhead bytes past row k2 are prefetched at step k2.
template <int R, bool Stream>
inline void tile(const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t K2, const float* bias,
                 at::BFloat16* c, int64_t ldc, int ncols) {
  alignas(64) float init[kCols] = {};
  if (bias != nullptr) std::copy(bias, bias + ncols, init);
  // Named registers, not an array: GCC keeps an accumulator array in memory across the loop.
#define ORCA_ACC(r) __m512 c##r##0 = _mm512_load_ps(init), c##r##1 = _mm512_load_ps(init + 16), \
                           c##r##2 = _mm512_load_ps(init + 32);
  ORCA_ACC(0) ORCA_ACC(1) ORCA_ACC(2) ORCA_ACC(3) ORCA_ACC(4) ORCA_ACC(5) ORCA_ACC(6) ORCA_ACC(7)
#define ORCA_DOT(r)                                                       \
  if constexpr (R > r) {                                                            \
    int32_t pair;                                                         \
    std::memcpy(&pair, a + r * lda + 2 * k2, sizeof(pair));               \
    const __m512bh x = as_bh(_mm512_set1_epi32(pair));                    \
    c##r##0 = _mm512_dpbf16_ps(c##r##0, x, b0);                           \
    c##r##1 = _mm512_dpbf16_ps(c##r##1, x, b1);                           \
    c##r##2 = _mm512_dpbf16_ps(c##r##2, x, b2);                           \
  }
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const at::BFloat16* bk = b + k2 * 2 * kCols;
    if constexpr (Stream) {  // a hint: no fault past the tensor's end
      const char* ahead = reinterpret_cast<const char*>(bk) + kStreamAhead;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      _mm_prefetch(ahead + 128, _MM_HINT_T0);
    }
    const __m512bh b0 = as_bh(_mm512_loadu_si512(bk)), b1 = as_bh(_mm512_loadu_si512(bk + 32)),
                   b2 = as_bh(_mm512_loadu_si512(bk + 64));
    ORCA_DOT(0) ORCA_DOT(1) ORCA_DOT(2) ORCA_DOT(3) ORCA_DOT(4) ORCA_DOT(5) ORCA_DOT(6) ORCA_DOT(7)
  }
  // fp32 -> bf16 to nearest even (`vcvtneps2bf16`); a partial last panel goes through a buffer.
  alignas(64) at::BFloat16 buf[kCols];
#define ORCA_STORE(r)                                                                             \
  if constexpr (R > r) {                                                                          \
    at::BFloat16* dst = ncols == kCols ? c + r * ldc : buf;                                       \
    const __m256bh h0 = _mm512_cvtneps_pbh(c##r##0), h1 = _mm512_cvtneps_pbh(c##r##1),            \
                   h2 = _mm512_cvtneps_pbh(c##r##2);                                              \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)h0);                            \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), (__m256i)h1);                       \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), (__m256i)h2);                       \
    if (ncols != kCols) std::copy(buf, buf + ncols, c + r * ldc);                                 \
  }
  ORCA_STORE(0) ORCA_STORE(1) ORCA_STORE(2) ORCA_STORE(3) ORCA_STORE(4) ORCA_STORE(5) ORCA_STORE(6) ORCA_STORE(7)
#undef ORCA_ACC
#undef ORCA_DOT
#undef ORCA_STORE
}

}  // namespace

// The op, one instance per ISA variant, registered by bindings.cpp (declared in ops.h).
// [N, K] bf16 (K even) -> [ceil(N / 48), K / 2, 48, 2], the last panel's missing columns zero.
at::Tensor pack_linear_weight_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.size(1) % 2 == 0,
              "pack_linear_weight_bf16: a bf16 [out, in] CPU tensor with an even in");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), K2 = K / 2, P = (N + kCols - 1) / kCols;
  at::Tensor packed = at::zeros({P, K2, kCols, 2}, w.options());
  const at::BFloat16* src = w.data_ptr<at::BFloat16>();
  at::BFloat16* dst = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kCols && p * kCols + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[((p * K2 + k / 2) * kCols + j) * 2 + k % 2] = src[(p * kCols + j) * K + k];
  });
  return packed;
}

namespace {

// x [M, in] times the packed weight into y [M, out_features]: every panel, or with `share` (up to kRows
// rows) the calling thread's panels of a region its caller opened.
void gemm_bf16(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
               int64_t out_features, const at::Tensor& y, const PanelShare* share) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "linear_packed_bf16: x must be a bf16 [rows, in] CPU tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) * 2 == x.size(1) && packed.size(0) == (out_features + kCols - 1) / kCols,
              "linear_packed_bf16: packed must come from pack_linear_weight_bf16 of an [out_features, in] weight");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->numel() == out_features),
              "linear_packed_bf16: bias must be [out_features] in bf16");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();  // rows may be strided
  const int64_t M = xc.size(0), K2 = xc.size(1) / 2, N = out_features, P = packed.size(0), lda = xc.stride(0);
  const at::Tensor bc = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK(share == nullptr || M <= kRows, "linear_packed_bf16: a shared GEMM is GEMV-shaped");
  if (M == 0) return;
  const at::BFloat16* a = xc.data_ptr<at::BFloat16>();
  const at::BFloat16* b = packed.data_ptr<at::BFloat16>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  at::BFloat16* c = y.data_ptr<at::BFloat16>();

  const RowTiles<kRows> tiles(M);
  const int64_t panel_elems = K2 * kCols * 2;
  // No prefetch of the next panel into L2, unlike gemm/gemm_fp32.cpp: here (Zen 4, 30 layers' weights)
  // it made 9-16 rows (two tiles) about a fifth slower and 17-512 rows no faster.
  auto run = [&](auto stream) {
    return [&, stream](int64_t p, int64_t) {
      const at::BFloat16* panel = b + p * panel_elems;
      const int ncols = static_cast<int>(std::min<int64_t>(kCols, N - p * kCols));
      const float* bias_p = bp ? bp + p * kCols : nullptr;
      tiles.each([&](int64_t, int64_t m, auto rows) {
        tile<decltype(rows)::value, decltype(stream)::value>(a + m * lda, lda, panel, K2, bias_p, c + m * N + p * kCols,
                                                             N, ncols);
      });
    };
  };
  // One row tile reads each panel once: its weight's read is its cost (docs/speculative-decoding.md
  // "When it pays").
  if (share != nullptr)
    for_each_panel_shared(P, *share, run(std::true_type{}));
  else if (M <= kRows)
    for_each_panel_streamed(P, run(std::true_type{}));
  else
    for_each_panel(P, false, run(std::false_type{}));
}

}  // namespace

at::Tensor linear_packed_bf16(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                              int64_t out_features) {
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  gemm_bf16(x, packed, bias, out_features, y, nullptr);
  return y;
}

void linear_packed_bf16_shared(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                               int64_t out_features, const at::Tensor& y, const PanelShare& share) {
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == at::kBFloat16 && y.dim() == 2 && y.size(0) == x.size(0) &&
                  y.size(1) == out_features,
              "linear_packed_bf16_shared: y must be a contiguous bf16 [rows, out_features] tensor");
  gemm_bf16(x, packed, bias, out_features, y, &share);
}

}  // namespace orcaserve::ORCA_ISA

#else
#error "gemm_bf16.cpp needs AVX-512 BF16: kernels/cpu/build.py builds it for the avx512_bf16 and amx variants only"
#endif
