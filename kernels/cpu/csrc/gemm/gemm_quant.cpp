// GEMM over GGUF block-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K; kernels/quant.py) on AVX2
// and AVX-512 CPUs: y = x W^T (+ b) with W kept as 8- or 4-bit codes, 3-5x fewer bytes than fp32
// to stream per decode step (docs/kernels.md, "Quantized GEMM on the CPU").
//
// Layout (packed by gemm/pack_quant.cpp): panels of kCols output columns as the fp32 GEMM's (24 on
// AVX2, 48 on AVX-512), each one sequential stream of its K / 32 blocks, [P, K / 32, block bytes].
// A block holds, for its kCols columns: the scales d (fp16, as the file has them: exact), the mins
// m (q4_1), then the codes, k-major: 32 rows of kCols int8 (q8_0), or 16 rows of kCols bytes, k =
// 2i in the low nibble and 2i + 1 in the high (q4_0 stores q + 8, q4_1 q). Per weight that is
// GGUF's own size: 8.5 bits for q8_0, 4.5 for q4_0, 5 for q4_1. The K-quants' blocks are "wide":
// fp32 heads, their per-32 (q6_k: per-16) scale fp32(d) * sc being no fp16 value. q4_k is q4_1's
// block with fp32 D = d * sc and M = -(dmin * m) (6 bits a weight; the file's 4.5), q6_k q8_0's
// with codes in [-32, 31] and two scale rows, k < 16 and k >= 16 (10 bits a weight; the file's 6.56).
//
// Arithmetic: each thread widens a chunk of its panel's blocks to fp32 weights in a buffer that
// stays in L1, d * q then + m as two roundings (the build passes -ffp-contract=off, so the mul
// and add are never fused): exactly gguf-py's dequantized values. The chunk then runs the fp32
// GEMM's micro-kernel (gemm_fp32.cpp: a row's x[k] broadcast against the panel's row k, FMA into
// 3 vectors per row, k ascending from the bias), its sums carried in an fp32 buffer from chunk to
// chunk. An fp32 value stored and reloaded is unchanged, so every output element is the same FMA
// chain, in the same order, as linear_packed's on dequantize(codes): bit for bit its result, for
// any row count or thread split (tests/kernels/test_quant_gemm.py). bf16 x is widened first, the sum
// rounded once to bf16. Up to kFusedRows rows (2 on AVX2, 4 on AVX-512) the widening pass would
// dominate: there each code is widened in a register and fed straight to the FMAs, in the same
// order, nothing stored.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "gemm/panels.h"
#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "gemm/quant_vec.h"

namespace orcaserve::ORCA_ISA {
namespace {

// for_k(k, weights) for the 32 k of one block in order, weights(j) the fp32 weights of the block's
// columns j * kLanes.. at k: d * q (+ m), as gguf-py computes them (two roundings: the build's
// -ffp-contract=off keeps the mul and add apart). Computed on demand, a column group at a time,
// from codes and scales read from L1, so that a tile's sums stay in registers. Wide blocks (the
// K-quants) hold their scales and mins in fp32; q6_k's second scale row serves k = 16..31.
template <int Bits, bool Offset, bool Wide, typename F>
inline void each_k(const uint8_t* block, int64_t k0, F&& for_k) {
  constexpr Format fmt{Bits, Offset, Wide};
  const uint8_t* c = block + fmt.scale_bytes();
  alignas(64) float dm[2][kCols];  // the block's scales (and mins, or q6_k's second scales) in fp32
  for (int h = 0; h < fmt.heads(); ++h)
    for (int j = 0; j < 3; ++j) {
      if constexpr (Wide)
        vstore(dm[h] + j * kLanes, vload(reinterpret_cast<const float*>(block) + h * kCols + j * kLanes));
      else
        vstore(dm[h] + j * kLanes, vhalf(reinterpret_cast<const at::Half*>(block) + h * kCols + j * kLanes));
    }
  const float* scales = dm[0];
  auto value = [&](const float* s, int j, vint q) {
    const vfloat w = vmul(vload(s + j * kLanes), vcvt(q));
    if constexpr (Offset) return vadd(w, vload(s + kCols + j * kLanes));
    return w;
  };
  // q4_1: hides the scales' address from the optimizer at each k, so that scales and mins are read
  // from L1 by the mul and add instead of hoisted into 6 registers: hoisted, they pushed 2-row
  // tiles' sums onto the stack, a store-to-load round trip in an FMA chain at every k (q4_1 at 2
  // rows took 1.5x q4_0's time; with this, as q4_0's). For q8_0 and q4_0 the 3 scales fit, and
  // reading them at every k was slower (loads, Zen 2): they stay hoisted.
  auto opaque = [&] {
    if constexpr (Offset) asm volatile("" : "+r"(scales));
  };
  if constexpr (Bits == 8) {  // q6_k: 16 k per scale row, each row's 3 scales hoisted in turn
    constexpr int kSpan = fmt.heads() == 2 ? kGroup / 2 : kGroup;
    for (int h = 0; h * kSpan < kGroup; ++h) {
      const float* s = dm[h];
      for (int k = h * kSpan; k < (h + 1) * kSpan; ++k)
        for_k(k0 + k, [&](int j) { return value(s, j, vload_s8(c + k * kCols + j * kLanes)); });
    }
  } else {  // k = 2i in the low nibbles of row i, 2i + 1 in the high; q4_0 stores q + 8
    auto code = [](vint u) { return Offset ? u : vminus8(u); };
    for (int k = 0; k < kGroup; k += 2) {
      const uint8_t* row = c + k / 2 * kCols;
      opaque();
      for_k(k0 + k, [&](int j) { return value(scales, j, code(vlow4(vload_u8(row + j * kLanes)))); });
      opaque();
      for_k(k0 + k + 1, [&](int j) { return value(scales, j, code(vhigh4(vload_u8(row + j * kLanes)))); });
    }
  }
}

// acc[r, :] += sum over k of a[r * lda + k] * w[k, :] for R rows: one FMA per k, k ascending as
// each_weight(for_k) hands the weights over, exactly gemm_fp32.cpp's tile, with the sums read from
// and written back to acc [R, kCols] (an fp32 value stored and reloaded is unchanged).
// A chunk of weights widened into a buffer, [k][kCols].
struct Widened {
  const float* w;
  int64_t k;
};

template <int R, typename Weights>
__attribute__((noinline)) void tile(const float* a, int64_t lda, float* acc, Weights&& each_weight) {
  // Named registers, as gemm_fp32.cpp's: with an array GCC kept an accumulator on the stack across
  // the loop at 4 rows. Rows past R are never used; the compiler drops them.
#define ORCA_Q_ROW(r, op) op(r, 0) op(r, 1) op(r, 2)
#define ORCA_Q_ROWS(op) ORCA_Q_ROW(0, op) ORCA_Q_ROW(1, op) ORCA_Q_ROW(2, op) ORCA_Q_ROW(3, op) \
  ORCA_Q_ROW(4, op) ORCA_Q_ROW(5, op) ORCA_Q_ROW(6, op) ORCA_Q_ROW(7, op)
#define ORCA_Q_LOAD(r, j) vfloat c##r##j = R > r ? vload(acc + r * kCols + j * kLanes) : vfloat{};
#define ORCA_Q_FMA(r)                         \
  if constexpr (R > r) {                      \
    const vfloat x = vbroadcast(a + r * lda + k); \
    c##r##0 = vfma(x, b0, c##r##0);           \
    c##r##1 = vfma(x, b1, c##r##1);           \
    c##r##2 = vfma(x, b2, c##r##2);           \
  }
#define ORCA_Q_FMA1(r, j) \
  if constexpr (R > r) c##r##j = vfma(vbroadcast(a + r * lda + k), b, c##r##j);
#define ORCA_Q_COL(j)                                                                                 \
  {                                                                                                  \
    const vfloat b = weights(j);                                                                     \
    ORCA_Q_FMA1(0, j) ORCA_Q_FMA1(1, j) ORCA_Q_FMA1(2, j) ORCA_Q_FMA1(3, j) ORCA_Q_FMA1(4, j) \
    ORCA_Q_FMA1(5, j) ORCA_Q_FMA1(6, j) ORCA_Q_FMA1(7, j)                                         \
  }
#define ORCA_Q_FMAS ORCA_Q_FMA(0) ORCA_Q_FMA(1) ORCA_Q_FMA(2) ORCA_Q_FMA(3) ORCA_Q_FMA(4) ORCA_Q_FMA(5) \
  ORCA_Q_FMA(6) ORCA_Q_FMA(7)
#define ORCA_Q_STORE(r, j) if constexpr (R > r) vstore(acc + r * kCols + j * kLanes, c##r##j);
  ORCA_Q_ROWS(ORCA_Q_LOAD)
  if constexpr (std::is_same_v<std::decay_t<Weights>, Widened>) {  // a plain loop: no spill at 4 rows
#pragma GCC unroll 2
    for (int64_t k = 0; k < each_weight.k; ++k) {
      const float* bk = each_weight.w + k * kCols;
      const vfloat b0 = vload(bk), b1 = vload(bk + kLanes), b2 = vload(bk + 2 * kLanes);
      ORCA_Q_FMAS
    }
  } else {  // a column group at a time: its weights live in one register
    each_weight([&](int64_t k, auto&& weights) { ORCA_Q_COL(0) ORCA_Q_COL(1) ORCA_Q_COL(2) });
  }
  ORCA_Q_ROWS(ORCA_Q_STORE)
#undef ORCA_Q_ROW
#undef ORCA_Q_ROWS
#undef ORCA_Q_LOAD
#undef ORCA_Q_FMA
#undef ORCA_Q_FMAS
#undef ORCA_Q_FMA1
#undef ORCA_Q_COL
#undef ORCA_Q_STORE
}

inline void store_row(const float* src, float* dst, int n) { std::copy(src, src + n, dst); }
inline void store_row(const float* src, at::BFloat16* dst, int n) {
  for (int j = 0; j < n; ++j) dst[j] = static_cast<at::BFloat16>(src[j]);  // to nearest even
}

// The threads' loop: fp32 activations a [M, K], packed panels, output c [M, N] (type Out).
template <int Bits, bool Offset, bool Wide, typename Out>
void run_panels(const float* a, const uint8_t* packed, const float* bp, Out* c, int64_t M, int64_t K, int64_t N,
                int64_t P) {
  constexpr Format fmt{Bits, Offset, Wide};
  const int64_t nb = K / kGroup, chunk = std::min<int64_t>(K, kChunk);
  const RowTiles<kRows> tiles(M);
  for_each_panel_of(M, P, false, [&](int64_t p, int64_t) {
    thread_local std::vector<float> wide, acc;  // per thread: one widened chunk, the panel's sums
    wide.resize(chunk * kCols);
    acc.resize(M * kCols);
    const int ncols = static_cast<int>(std::min<int64_t>(kCols, N - p * kCols));
    for (int64_t m = 0; m < M; ++m) {
      float* row = acc.data() + m * kCols;
      std::fill(row, row + kCols, 0.0f);
      if (bp != nullptr) std::copy(bp + p * kCols, bp + p * kCols + ncols, row);
    }
    const uint8_t* panel = packed + p * nb * fmt.block_bytes();
    if (M <= kFusedRows) {  // one short row tile: widen in registers, nothing stored in between
      tiles.each([&](int64_t, int64_t, auto rows) {
        tile<decltype(rows)::value>(a, K, acc.data(), [&](auto&& for_k) {
          for (int64_t b = 0; b < nb; ++b) each_k<Bits, Offset, Wide>(panel + b * fmt.block_bytes(), b * kGroup, for_k);
        });
      });
    } else {  // a chunk widened into L1 once, for every row tile
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t kc = std::min(chunk, K - k0);
        float* w = wide.data();
        for (int64_t b = 0; b < kc / kGroup; ++b)
          each_k<Bits, Offset, Wide>(panel + (k0 / kGroup + b) * fmt.block_bytes(), b * kGroup,
                               [&](int64_t k, auto&& weights) {
                                 for (int j = 0; j < 3; ++j) vstore(w + k * kCols + j * kLanes, weights(j));
                               });
        tiles.each([&](int64_t, int64_t m, auto rows) {
          tile<decltype(rows)::value>(a + m * K + k0, K, acc.data() + m * kCols, Widened{w, kc});
        });
      }
    }
    for (int64_t m = 0; m < M; ++m) store_row(acc.data() + m * kCols, c + m * N + p * kCols, ncols);
  });
}

template <int Bits, bool Offset, bool Wide>
void run_format(const float* a, const at::Tensor& packed, const float* bp, at::Tensor& y, int64_t M, int64_t K,
                int64_t N) {
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (y.scalar_type() == at::kFloat)
    run_panels<Bits, Offset, Wide>(a, w, bp, y.data_ptr<float>(), M, K, N, packed.size(0));
  else
    run_panels<Bits, Offset, Wide>(a, w, bp, y.data_ptr<at::BFloat16>(), M, K, N, packed.size(0));
}

}  // namespace

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t bits, bool has_offset, bool wide) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "linear_quant: x must be an fp32 or bf16 [rows, in] CPU tensor");
  TORCH_CHECK((bits == 8 && !has_offset) || (bits == 4 && (has_offset || !wide)),
              "linear_quant: q8_0 or q6_k (8 bits), q4_0, q4_1 or q4_k (4 bits)");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const Format fmt{static_cast<int>(bits), has_offset, wide};
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(0) == (N + kCols - 1) / kCols && packed.size(1) * kGroup == K &&
                  packed.size(2) == fmt.block_bytes(),
              "linear_quant: packed must come from pack_quant_weight of an [out_features, in] weight in this format");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == N),
              "linear_quant: bias must be fp32 [out_features]");
  at::Tensor xc = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* a = xc.data_ptr<float>();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  if (bits == 8 && wide)
    run_format<8, false, true>(a, packed, bp, y, M, K, N);
  else if (bits == 8)
    run_format<8, false, false>(a, packed, bp, y, M, K, N);
  else if (wide)
    run_format<4, true, true>(a, packed, bp, y, M, K, N);
  else if (has_offset)
    run_format<4, true, false>(a, packed, bp, y, M, K, N);
  else
    run_format<4, false, false>(a, packed, bp, y, M, K, N);
  return y;
}

}  // namespace orcaserve::ORCA_ISA

#else
#error "gemm_quant.cpp needs AVX2 and FMA: kernels/cpu/build.py builds it for the avx2 variants and up only"
#endif
