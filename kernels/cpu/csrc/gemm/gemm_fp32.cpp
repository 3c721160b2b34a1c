// GEMM for the lean decoder's linear layers on AVX2 and AVX-512 CPUs: y = x W^T (+ b) over a weight
// packed once into panels of 24 output columns (48 on AVX-512), [P, K, 24 or 48], so that a panel
// is read as one sequential stream. On an AMD Zen 3, SmolLM2's fp32 layer GEMMs at 32 rows over 30
// layers' weights: oneDNN's pre-packed inner product 111 GFLOP/s on two threads, this 145 (`python
// benchmarks/gemm.py --dtype float32 --layers 30`; docs/performance-log.md, "2026-12-01: the
// project's own fp32 GEMM on AVX2 CPUs (Zen 3)").
//
// Each row tile also prefetches a share of the thread's next panel into L2, so that panel's DRAM
// read overlaps this one's arithmetic: fp32 GEMMs of 8-64 rows about a fifth faster, the offline
// fp32 workload 9-13 % (docs/performance-log.md, "2026-12-02: engine limits re-tuned, the next
// panel prefetched into L2 (Zen 3)").
//
// bf16 weights too, which oneDNN cannot pack without AVX-512: each thread widens the bf16 panel it
// takes to fp32 in its own buffer (exact) and runs the same fp32 micro-kernel, each sum rounded
// once to bf16. There F.linear ran them at 14-19 GFLOP/s, this at 109 at 32 rows, within 1-6 % of
// itself in fp32 (`python benchmarks/gemm.py --dtype bfloat16 --layers 30`;
// docs/performance-log.md, "2026-12-01: bf16 on the project's GEMM where the CPU has no bf16 (Zen
// 3)").
//
// Micro-kernel: a broadcast of each row's x[k] against the panel's row k, summed over k in order
// with FMA; on AVX2 4 rows x 24 columns of accumulators (12 ymm registers), on AVX-512 8 rows x 48
// columns (24 of its 32 zmm registers), whose panels are packed 48 wide. On an AMD Zen 4 (AVX-512
// on 256-bit units) the wider tile ran 32-512 rows about 10-20 % faster, 1-16 level
// (docs/performance-log.md, "2026-12-02: the fp32 GEMM in zmm registers, one panel loop (Zen 4)").
// GEMV-shaped calls (up to kStreamRows rows, gemm/panels.h) walk each thread's contiguous share of
// the panels as one stream, prefetch kStreamAhead bytes ahead in it, and read bf16 panels as they
// are, widened in registers (exact) instead of through the buffer: the same sums, the same bits.
// Every output element sums its K products in the same order whatever the row count or the thread
// split: a request's results do not depend on its batch-mates. Threads take panels from a counter
// (gemm/panels.h).
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "gemm/panels.h"
#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace orcaserve::ORCA_ISA {
namespace {

// One vector of fp32 lanes: a zmm register where the library is built for AVX-512, else a ymm.
#if defined(__AVX512F__)
using vfloat = __m512;
constexpr int kLanes = 16;
constexpr int kRows = 8;  // rows per micro-tile: 24 accumulators, 3 panel loads, 1 broadcast
// Prefetching the next panel at two tiles (9-16 rows) made those GEMMs 1.15-1.25x slower with
// 48-wide panels (4-row tiles at 6-8 rows 1.6x; the vdpbf16ps GEMM's a fifth), so from three.
constexpr int64_t kMinPrefetchTiles = 3;
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vload(const at::BFloat16* p) {  // 16 bf16 widened: the fp32 with the same top 16 bits
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline vfloat vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
#else
using vfloat = __m256;
constexpr int kLanes = 8;
constexpr int kRows = 4;  // rows per micro-tile: 12 accumulators, 3 panel loads, 1 broadcast
constexpr int64_t kMinPrefetchTiles = 2;
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vload(const at::BFloat16* p) {  // 8 bf16 widened: the fp32 with the same top 16 bits
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline vfloat vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int kCols = 3 * kLanes;  // output columns per panel: three registers per row

inline void store_row(const float* src, float* dst, int n) { std::copy(src, src + n, dst); }

// fp32 -> bf16 rounded to nearest even, NaN kept quiet: c10::BFloat16's rounding, 8 lanes at a time.
// Not at::vec::convert: its 16 lanes leave an AVX2 row's last 8 of 24 to a scalar loop; with it
// the bf16 GEMMs at 32 rows took 1.9x the fp32 op's time, 1.05x with this (one by one: 74 against
// 109 GFLOP/s).
inline void store_row(const float* src, at::BFloat16* dst, int n) {
  if (n < kCols) {
    for (int j = 0; j < n; ++j) dst[j] = static_cast<at::BFloat16>(src[j]);
    return;
  }
  const __m256i odd = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), qnan = _mm256_set1_epi32(0x7fc00000);
  for (int j = 0; j < kCols; j += 8) {
    const __m256 v = _mm256_loadu_ps(src + j);
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), odd);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, bias));
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    r = _mm256_srli_epi32(r, 16);                                              // [8 x u32], each < 2^16
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);  // lanes 0, 2 first
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), _mm256_castsi256_si128(packed));
  }
}

// C[r, :ncols] = bias[:ncols] + sum_k a[r * lda + k] * b[k, :] for R rows; b is one panel
// [K, kCols] of W (fp32, or bf16 widened as loaded). The sum is rounded once, into C's type. With
// Prefetch, pf + k * pf_step is fetched into L2 at step k: the caller's share of the panel it
// computes next. With Stream, the lines kStreamAhead bytes past row k, at step k.
template <int R, bool Prefetch, bool Stream = false, typename W = float, typename Out>
inline void tile(const float* a, int64_t lda, const W* b, int64_t K, const float* bias, Out* c,
                 int64_t ldc, int ncols, const char* pf, int64_t pf_step) {
  alignas(64) float init[kCols] = {};
  if (bias != nullptr) std::copy(bias, bias + ncols, init);
  // Named registers, not an array: GCC keeps an accumulator array in memory across the loop.
  // Rows past R (and past kRows) are never used; the compiler drops them.
#define ORCA_ACC(r) vfloat c##r##0 = vload(init), c##r##1 = vload(init + kLanes), c##r##2 = vload(init + 2 * kLanes);
  ORCA_ACC(0) ORCA_ACC(1) ORCA_ACC(2) ORCA_ACC(3) ORCA_ACC(4) ORCA_ACC(5) ORCA_ACC(6) ORCA_ACC(7)
#define ORCA_FMA(r)                                \
  if constexpr (R > r) {                           \
    const vfloat x = vbroadcast(a + r * lda + k);  \
    c##r##0 = vfma(x, b0, c##r##0);                \
    c##r##1 = vfma(x, b1, c##r##1);                \
    c##r##2 = vfma(x, b2, c##r##2);                \
  }
#pragma GCC unroll 2
  for (int64_t k = 0; k < K; ++k) {
    const W* bk = b + k * kCols;
    if constexpr (Prefetch) _mm_prefetch(pf + k * pf_step, _MM_HINT_T1);
    if constexpr (Stream) {  // a hint: no fault past the tensor's end
      const char* ahead = reinterpret_cast<const char*>(bk) + kStreamAhead;
      for (int l = 0; l < kCols * static_cast<int>(sizeof(W)); l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
    }
    const vfloat b0 = vload(bk), b1 = vload(bk + kLanes), b2 = vload(bk + 2 * kLanes);
    ORCA_FMA(0) ORCA_FMA(1) ORCA_FMA(2) ORCA_FMA(3) ORCA_FMA(4) ORCA_FMA(5) ORCA_FMA(6) ORCA_FMA(7)
  }
  alignas(64) float out[R][kCols];
#define ORCA_STORE(r)                     \
  if constexpr (R > r) {                  \
    vstore(out[r], c##r##0);              \
    vstore(out[r] + kLanes, c##r##1);     \
    vstore(out[r] + 2 * kLanes, c##r##2); \
  }
  ORCA_STORE(0) ORCA_STORE(1) ORCA_STORE(2) ORCA_STORE(3) ORCA_STORE(4) ORCA_STORE(5) ORCA_STORE(6) ORCA_STORE(7)
#undef ORCA_ACC
#undef ORCA_FMA
#undef ORCA_STORE
  for (int r = 0; r < R; ++r) store_row(out[r], c + r * ldc, ncols);
}

// [N, K] -> [ceil(N / kCols), K, kCols] in the weight's dtype (fp32 or bf16), the last panel's
// missing columns zero.
template <typename T>
void pack_into(const at::Tensor& w, at::Tensor& packed) {
  const int64_t N = w.size(0), K = w.size(1), P = packed.size(0);
  const T* src = w.data_ptr<T>();
  T* dst = packed.data_ptr<T>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kCols && p * kCols + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kCols + j] = src[(p * kCols + j) * K + k];
  });
}

}  // namespace

// The op, one instance per ISA variant, registered by bindings.cpp (declared in ops.h).
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "pack_linear_weight: an fp32 or bf16 [out, in] CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kCols - 1) / kCols;
  at::Tensor packed = at::zeros({P, K, kCols}, w.options());
  if (w.scalar_type() == at::kFloat)
    pack_into<float>(w, packed);
  else
    pack_into<at::BFloat16>(w, packed);
  return packed;
}

// The threads' loop: fp32 activations a [M, K], panels b of W (type W), output c [M, N] (type Out).
//
// A panel's first row tile reads it from DRAM (30 layers' weights do not stay in cache) at 16 bytes
// a cycle where fp32 FMAs run, more than a core gets: at 32 rows on the Zen 3 that tile ran at DRAM
// speed and the panel's other 7 from L2. So each tile also prefetches its share of the panel the
// thread takes next.
template <typename W, typename Out>
void run_panels(const float* a, const W* b, const float* bp, Out* c, int64_t M, int64_t K, int64_t N,
                int64_t P) {
  const RowTiles<kRows> tiles(M);
  // fp32 panels up to 16 row tiles. Under kMinPrefetchTiles a panel is read once, streamed by the
  // hardware prefetcher; beyond 16 its DRAM read is a small part of its time (prefetched, 512 rows
  // were slower in 3 of 4 alternated runs). bf16 panels are streamed by the widening pass, and 32
  // rows were slower in 4 of 4 with the prefetch. The first 8 tiles share the work: at most one
  // prefetch per 12 bytes (24 on AVX-512).
  const bool prefetch = std::is_same_v<W, float> && tiles.count() >= kMinPrefetchTiles && tiles.count() <= 16;
  const int64_t pf_tiles = std::min<int64_t>(tiles.count(), 8);
  // Bytes per k and tile, rounded down so that no address lies past the panel (at most a few lines
  // of it are left to the hardware).
  const int64_t pf_step = kCols * static_cast<int64_t>(sizeof(W)) / pf_tiles;
  if (M <= kStreamRows) {  // GEMV-shaped: one tile, each thread's panels one stream
    for_each_panel_streamed(P, [&](int64_t p, int64_t) {
      const int ncols = static_cast<int>(std::min<int64_t>(kCols, N - p * kCols));
      tiles.each([&](int64_t, int64_t m, auto rows) {
        tile<decltype(rows)::value, false, true>(a + m * K, K, b + p * K * kCols, K, bp ? bp + p * kCols : nullptr,
                                                 c + m * N + p * kCols, N, ncols, nullptr, 0);
      });
    });
    return;
  }
  for_each_panel(P, prefetch, [&](int64_t p, int64_t q) {
    const float* panel;
    if constexpr (std::is_same_v<W, float>) {
      panel = b + p * K * kCols;
    } else {
      thread_local std::vector<float> wide;  // one widened panel per thread
      wide.resize(K * kCols);
      at::vec::convert(b + p * K * kCols, wide.data(), K * kCols);  // exact
      panel = wide.data();
    }
    const bool pf_next = prefetch && q < P;  // a thread's last panel has none to fetch
    const char* pf = pf_next ? reinterpret_cast<const char*>(b + q * K * kCols) : nullptr;
    const int ncols = static_cast<int>(std::min<int64_t>(kCols, N - p * kCols));
    const float* bias_p = bp ? bp + p * kCols : nullptr;
    tiles.each([&](int64_t t, int64_t m, auto rows) {
      constexpr int R = decltype(rows)::value;
      const float* am = a + m * K;
      Out* cm = c + m * N + p * kCols;
      if (pf_next && t < pf_tiles)
        tile<R, true>(am, K, panel, K, bias_p, cm, N, ncols, pf + t * K * pf_step, pf_step);
      else
        tile<R, false>(am, K, panel, K, bias_p, cm, N, ncols, nullptr, 0);
    });
  });
}

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  const auto dtype = packed.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == dtype,
              "linear_packed: x must be a [rows, in] CPU tensor of the packed weight's dtype");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && (dtype == at::kFloat || dtype == at::kBFloat16) &&
                  packed.is_contiguous() && packed.size(1) == x.size(1) &&
                  packed.size(0) == (out_features + kCols - 1) / kCols,
              "linear_packed: packed must come from pack_linear_weight of an [out_features, in] weight");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == dtype && bias->numel() == out_features),
              "linear_packed: bias must be [out_features] in the weight's dtype");
  // bf16 activations and bias are widened once per call; the sums run in fp32 either way. Row by
  // row here: ATen's converting copy took 16 us for a decode step's 32 x 576 (3 % of the step).
  const int64_t M = x.size(0), K = x.size(1), N = out_features, P = packed.size(0);
  at::Tensor xc;
  if (dtype == at::kFloat) {
    xc = x.contiguous();
  } else {
    const at::Tensor rows = x.stride(1) == 1 ? x : x.contiguous();
    xc = at::empty({M, K}, x.options().dtype(at::kFloat));
    const at::BFloat16* src = rows.data_ptr<at::BFloat16>();
    for (int64_t m = 0; m < M; ++m) at::vec::convert(src + m * rows.stride(0), xc.data_ptr<float>() + m * K, K);
  }
  const at::Tensor bc = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options().dtype(dtype));
  if (M == 0) return y;
  const float* a = xc.data_ptr<float>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  if (dtype == at::kFloat)
    run_panels(a, packed.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, N, P);
  else
    run_panels(a, packed.data_ptr<at::BFloat16>(), bp, y.data_ptr<at::BFloat16>(), M, K, N, P);
  return y;
}

}  // namespace orcaserve::ORCA_ISA

#else
#error "gemm_fp32.cpp needs AVX2 and FMA: kernels/cpu/build.py builds it for the avx2 variants and up only"
#endif
