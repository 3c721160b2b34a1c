// GEMM over GGUF block-quantized weights (Q8_0, Q4_0, Q4_1; kernels/quant.py) on AVX2 and AVX-512
// CPUs: y = x W^T (+ b) with W kept as 8- or 4-bit codes, 4-5x fewer bytes than fp32 to stream per
// decode step (docs/kernels.md, "Quantized GEMM on the CPU").
//
// Layout: panels of kCols output columns as the fp32 GEMM's (24 on AVX2, 48 on AVX-512), each one
// sequential stream of its K / 32 blocks, [P, K / 32, block bytes]. A block holds, for its kCols
// columns: the scales d (fp16, as the file has them: exact), the mins m (q4_1), then the codes,
// k-major: 32 rows of kCols int8 (q8_0), or 16 rows of kCols bytes, k = 2i in the low nibble and
// 2i + 1 in the high (q4_0 stores q + 8, q4_1 q). Per weight that is GGUF's own size: 8.5 bits for
// q8_0, 4.5 for q4_0, 5 for q4_1.
//
// Arithmetic: each thread widens a chunk of its panel's blocks to fp32 weights in a buffer that
// stays in L1, d * q then + m as two roundings (the build passes -ffp-contract=off, so the mul
// and add are never fused): exactly gguf-py's dequantized values. The chunk then runs the fp32
// GEMM's micro-kernel (gemm_fp32.cpp: a row's x[k] broadcast against the panel's row k, FMA into
// 3 vectors per row, k ascending from the bias), its sums carried in an fp32 buffer from chunk to
// chunk. An fp32 value stored and reloaded is unchanged, so every output element is the same FMA
// chain, in the same order, as linear_packed's on dequantize(codes): bit for bit its result, for
// any row count or thread split (tests/test_quant_gemm.py). bf16 x is widened first, the sum
// rounded once to bf16. Up to kFusedRows rows (2 on AVX2, 4 on AVX-512) the widening pass would
// dominate: there each code is widened in a register and fed straight to the FMAs, in the same
// order, nothing stored.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
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
// from codes and scales read from L1, so that a tile's sums stay in registers.
template <int Bits, bool Offset, typename F>
inline void each_k(const uint8_t* block, int64_t k0, F&& for_k) {
  const at::Half* heads = reinterpret_cast<const at::Half*>(block);
  const uint8_t* c = block + (Offset ? 2 : 1) * kCols * sizeof(at::Half);
  alignas(64) float dm[2][kCols];  // the block's scales (and mins) in fp32, exact
  for (int j = 0; j < 3; ++j) {
    vstore(dm[0] + j * kLanes, vhalf(heads + j * kLanes));
    if constexpr (Offset) vstore(dm[1] + j * kLanes, vhalf(heads + kCols + j * kLanes));
  }
  const float* scales = dm[0];
  auto value = [&](int j, vint q) {
    const vfloat w = vmul(vload(scales + j * kLanes), vcvt(q));
    if constexpr (Offset) return vadd(w, vload(scales + kCols + j * kLanes));
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
  if constexpr (Bits == 8) {
    for (int k = 0; k < kGroup; ++k) {
      opaque();
      for_k(k0 + k, [&](int j) { return value(j, vload_s8(c + k * kCols + j * kLanes)); });
    }
  } else {  // k = 2i in the low nibbles of row i, 2i + 1 in the high; q4_0 stores q + 8
    auto code = [](vint u) { return Offset ? u : vminus8(u); };
    for (int k = 0; k < kGroup; k += 2) {
      const uint8_t* row = c + k / 2 * kCols;
      opaque();
      for_k(k0 + k, [&](int j) { return value(j, code(vlow4(vload_u8(row + j * kLanes)))); });
      opaque();
      for_k(k0 + k + 1, [&](int j) { return value(j, code(vhigh4(vload_u8(row + j * kLanes)))); });
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
template <int Bits, bool Offset, typename Out>
void run_panels(const float* a, const uint8_t* packed, const float* bp, Out* c, int64_t M, int64_t K, int64_t N,
                int64_t P) {
  constexpr Format fmt{Bits, Offset};
  const int64_t nb = K / kGroup, chunk = std::min<int64_t>(K, kChunk);
  const RowTiles<kRows> tiles(M);
  for_each_panel(P, false, [&](int64_t p, int64_t) {
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
          for (int64_t b = 0; b < nb; ++b) each_k<Bits, Offset>(panel + b * fmt.block_bytes(), b * kGroup, for_k);
        });
      });
    } else {  // a chunk widened into L1 once, for every row tile
      for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        const int64_t kc = std::min(chunk, K - k0);
        float* w = wide.data();
        for (int64_t b = 0; b < kc / kGroup; ++b)
          each_k<Bits, Offset>(panel + (k0 / kGroup + b) * fmt.block_bytes(), b * kGroup,
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

template <int Bits, bool Offset>
void run_format(const float* a, const at::Tensor& packed, const float* bp, at::Tensor& y, int64_t M, int64_t K,
                int64_t N) {
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (y.scalar_type() == at::kFloat)
    run_panels<Bits, Offset>(a, w, bp, y.data_ptr<float>(), M, K, N, packed.size(0));
  else
    run_panels<Bits, Offset>(a, w, bp, y.data_ptr<at::BFloat16>(), M, K, N, packed.size(0));
}

}  // namespace

at::Tensor pack_quant_weight(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                             int64_t bits) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.scalar_type() == at::kChar && q.size(1) % kGroup == 0,
              "pack_quant_weight: codes must be an int8 [out, in] CPU tensor, in a multiple of 32");
  TORCH_CHECK(bits == 8 || bits == 4, "pack_quant_weight: bits must be 8 or 4");
  const int64_t N = q.size(0), K = q.size(1), nb = K / kGroup, P = (N + kCols - 1) / kCols;
  const bool has_offset = offset.has_value();
  TORCH_CHECK(!has_offset || bits == 4, "pack_quant_weight: mins (q4_1) need 4-bit codes");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.size(0) == N && scale.size(1) == nb,
              "pack_quant_weight: scale must be fp32 [out, in / 32]");
  TORCH_CHECK(!has_offset || (offset->scalar_type() == at::kFloat && offset->sizes() == scale.sizes()),
              "pack_quant_weight: offset must be fp32 shaped as scale");
  const Format fmt{static_cast<int>(bits), has_offset};
  // Codes must lie in the format's range, and scales (mins) be fp16 values: they are stored so.
  const int lo = bits == 8 ? -128 : (has_offset ? 0 : -8), shift = bits == 8 ? 0 : (has_offset ? 0 : 8);
  const at::Tensor qc = q.contiguous(), sc = scale.contiguous();
  const at::Tensor oc = has_offset ? offset->contiguous() : at::Tensor();
  at::Tensor packed = at::zeros({P, nb, fmt.block_bytes()}, q.options().dtype(at::kByte));
  const int8_t* qs = qc.data_ptr<int8_t>();
  const float* ss = sc.data_ptr<float>();
  const float* os = has_offset ? oc.data_ptr<float>() : nullptr;
  uint8_t* dst = packed.data_ptr<uint8_t>();
  std::atomic<bool> bad_code{false}, bad_scale{false};
  at::parallel_for(0, P * nb, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / nb, b = i % nb;
      uint8_t* block = dst + i * fmt.block_bytes();
      at::Half* heads = reinterpret_cast<at::Half*>(block);
      uint8_t* codes = block + fmt.scale_bytes();
      for (int64_t j = 0; j < kCols && p * kCols + j < N; ++j) {
        const int64_t n = p * kCols + j;
        const float s = ss[n * nb + b];
        heads[j] = static_cast<at::Half>(s);
        if (static_cast<float>(heads[j]) != s && !(s != s)) bad_scale = true;
        if (has_offset) {
          heads[kCols + j] = static_cast<at::Half>(os[n * nb + b]);
          if (static_cast<float>(heads[kCols + j]) != os[n * nb + b]) bad_scale = true;
        }
        for (int64_t k = 0; k < kGroup; ++k) {
          const int v = qs[n * K + b * kGroup + k];
          if (v < lo || v > lo + (1 << bits) - 1) bad_code = true;
          const uint8_t u = static_cast<uint8_t>(v + shift);
          if (bits == 8)
            codes[k * kCols + j] = u;
          else
            codes[(k / 2) * kCols + j] |= static_cast<uint8_t>((u & 0xF) << (4 * (k % 2)));
        }
      }
    }
  });
  TORCH_CHECK(!bad_code, "pack_quant_weight: codes outside the format's range");
  TORCH_CHECK(!bad_scale, "pack_quant_weight: scales and mins must be fp16 values (GGUF stores them so)");
  return packed;
}

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t bits, bool has_offset) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "linear_quant: x must be an fp32 or bf16 [rows, in] CPU tensor");
  TORCH_CHECK((bits == 8 && !has_offset) || bits == 4, "linear_quant: q8_0 (8 bits), q4_0 or q4_1 (4 bits)");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const Format fmt{static_cast<int>(bits), has_offset};
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
  if (bits == 8)
    run_format<8, false>(a, packed, bp, y, M, K, N);
  else if (has_offset)
    run_format<4, true>(a, packed, bp, y, M, K, N);
  else
    run_format<4, false>(a, packed, bp, y, M, K, N);
  return y;
}

}  // namespace orcaserve::ORCA_ISA

#else
#error "gemm_quant.cpp needs AVX2 and FMA: kernels/cpu/build.py builds it for the avx2 variants and up only"
#endif
