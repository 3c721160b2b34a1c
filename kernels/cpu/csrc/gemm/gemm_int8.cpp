// GEMM over GGUF block codes with int8 activations (docs/int8-activations.md): each row of x is
// quantized per block of 32 to int8 with an fp32 scale, each block's integer dot product with the
// weight codes is exact in int32, and the scaled blocks are summed in fp32, in a fixed order:
//
//   acc = 0; for block b ascending, for span s ascending (q6_k: two spans of 16, else one of 32):
//     acc = acc + (sw[n, b, s] * sa[m, b]) * float(isum[m, n, b, s])      (three roundings)
//     (q4_1, q4_k, after the block's spans) acc = acc + mw[n, b] * msum[m, b]   (msum = sa * sum q)
//   y = acc (+ bias), rounded once to bf16 for bf16 x
//
// with sa, q the activations' scale and codes (quantize_rows_int8 below). That is the PyTorch twin's
// arithmetic op for op (kernels/pytorch/int8_activations.py), so results are bit for bit equal.
//
// Layout (pack_int8.cpp): panels of kPanel output columns (32 on AVX-512, 16 on AVX2), each a
// sequential stream of its K / 32 blocks; a block holds fp32 heads (scales per span, mins) and the
// codes as unsigned bytes u = q + shift in groups of 4 k per column, the shape vpdpbusd and
// vpmaddubsw consume. The shift is taken back exactly in int32: isum = dot(u, a) - shift * sum(a).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gemm/panels.h"
#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "gemm/int8_out.h"
#include "gemm/int8_rows.h"
#include "gemm/int8_tile.h"
#include "gemm/int8_vec.h"

namespace orcaserve::ORCA_ISA {
namespace {

// x's rows as fp32 or bf16 values with unit stride (rows may be strided): the op's checks.
at::Tensor rows_of(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) % kBlock == 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be an fp32 or bf16 [rows, K] CPU tensor, K a multiple of 32");
  return x.stride(1) == 1 ? x : x.contiguous();
}

void quantize_any(const at::Tensor& xc, int8_t* q, float* scale, int32_t* sums, const Int8Format* fmt, int32_t* corr,
                  float* msum) {
  const int64_t M = xc.size(0), K = xc.size(1), lda = xc.stride(0);
  if (xc.scalar_type() == at::kFloat)
    quantize_rows(xc.data_ptr<float>(), lda, M, K, q, scale, sums, fmt, corr, msum);
  else
    quantize_rows(xc.data_ptr<at::BFloat16>(), lda, M, K, q, scale, sums, fmt, corr, msum);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  const at::Tensor xc = rows_of(x, "quantize_rows_int8");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M, nb}, x.options().dtype(at::kFloat));
  at::Tensor sums = at::empty({M, 2 * nb}, x.options().dtype(at::kInt));
  quantize_any(xc, q.data_ptr<int8_t>(), scale.data_ptr<float>(), sums.data_ptr<int32_t>(), nullptr, nullptr, nullptr);
  return {q, scale, sums};
}

namespace {

// x [M, K]'s rows quantized and run against the packed codes, each tile row handed to emit (run).
template <typename Emit>
void gemm_int8(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t N,
               int64_t bits, bool has_offset, bool wide, const char* op, const Emit& emit,
               const PanelShare* share = nullptr) {
  TORCH_CHECK((bits == 8 && !has_offset) || (bits == 4 && !wide) || (bits == 4 && has_offset), op,
              ": q8_0 or q6_k (8 bits), q4_0, q4_1 or q4_k (4 bits)");
  const at::Tensor xc = rows_of(x, op);
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  const Int8Format fmt{static_cast<int>(bits), has_offset, wide && bits == 8};
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(0) == (N + kPanel - 1) / kPanel && packed.size(1) == nb &&
                  packed.size(2) == fmt.block_bytes(),
              op, ": packed must come from pack_int8_weight of an [out_features, in] weight in this format");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == N), op,
              ": bias must be fp32 [out_features]");
  TORCH_CHECK(share == nullptr || M <= kFewRows, op, ": a shared GEMM is GEMV-shaped");
  if (M == 0) return;
  // One allocation for the quantized rows: codes, then scales, msum, sums and corr (4-byte aligned).
  const int S = fmt.spans();
  const int64_t code_bytes = (M * K + 63) / 64 * 64;
  at::Tensor work = at::empty({code_bytes + M * nb * 4 * (2 + 2 + S)}, x.options().dtype(at::kByte));
  int8_t* qp = reinterpret_cast<int8_t*>(work.data_ptr<uint8_t>());
  float* sp = reinterpret_cast<float*>(work.data_ptr<uint8_t>() + code_bytes);
  float* mp = sp + M * nb;
  int32_t* up = reinterpret_cast<int32_t*>(mp + M * nb);
  int32_t* cp = up + M * nb * 2;
  quantize_any(xc, qp, sp, up, &fmt, cp, mp);
  const Rows a{qp, sp, cp, mp, K, nb};
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t P = packed.size(0);
  if (bits == 8 && wide)
    run<8, false, true>(a, w, bp, M, N, P, emit, share);
  else if (bits == 8)
    run<8, false, false>(a, w, bp, M, N, P, emit, share);
  else if (has_offset)
    run<4, true, false>(a, w, bp, M, N, P, emit, share);
  else
    run<4, false, false>(a, w, bp, M, N, P, emit, share);
}

// The GEMM's rows stored as Out (x's dtype) into y, or reduced to their argmax into out [M].
template <typename Out>
void store_or_argmax(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias, int64_t N,
                     int64_t bits, bool has_offset, bool wide, Out* y, int64_t* out) {
  if (y != nullptr) {
    gemm_int8(x, packed, bias, N, bits, has_offset, wide, "linear_int8",
              [&](int64_t m, int64_t p, const float* sums, const float* bias_p, int64_t ncols) {
                store_row(sums, bias_p, y + m * N + p * kPanel, ncols);
              });
    return;
  }
  const int64_t M = x.size(0), P = (N + kPanel - 1) / kPanel;
  std::vector<float> best(M * P);
  std::vector<int32_t> index(M * P);
  gemm_int8(x, packed, bias, N, bits, has_offset, wide, "linear_int8_argmax",
            [&](int64_t m, int64_t p, const float* sums, const float* bias_p, int64_t ncols) {
              alignas(64) Out row[kPanel];
              store_row(sums, bias_p, row, ncols);
              panel_argmax(row, static_cast<int>(ncols), &best[m * P + p], &index[m * P + p]);
            });
  reduce_panels(best, index, M, P, kPanel, out);
}

}  // namespace

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t out_features, int64_t bits, bool has_offset, bool wide) {
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (y.scalar_type() == at::kFloat)
    store_or_argmax(x, packed, bias, out_features, bits, has_offset, wide, y.data_ptr<float>(), nullptr);
  else
    store_or_argmax(x, packed, bias, out_features, bits, has_offset, wide, y.data_ptr<at::BFloat16>(), nullptr);
  return y;
}

void linear_int8_shared(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t bits, bool has_offset, bool wide, const at::Tensor& y,
                        const PanelShare& share) {
  TORCH_CHECK(y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.dim() == 2 && y.size(0) == x.size(0) &&
                  y.size(1) == out_features,
              "linear_int8_shared: y must be a contiguous [rows, out_features] tensor of x's dtype");
  auto gemm = [&](auto* out) {
    gemm_int8(
        x, packed, bias, out_features, bits, has_offset, wide, "linear_int8_shared",
        [&](int64_t m, int64_t p, const float* sums, const float* bias_p, int64_t ncols) {
          store_row(sums, bias_p, out + m * out_features + p * kPanel, ncols);
        },
        &share);
  };
  if (y.scalar_type() == at::kFloat)
    gemm(y.data_ptr<float>());
  else
    gemm(y.data_ptr<at::BFloat16>());
}

at::Tensor linear_int8_argmax(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                              int64_t out_features, int64_t bits, bool has_offset, bool wide) {
  TORCH_CHECK(out_features > 0, "linear_int8_argmax: no columns to take the argmax of");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kFloat)
    store_or_argmax<float>(x, packed, bias, out_features, bits, has_offset, wide, nullptr, op);
  else
    store_or_argmax<at::BFloat16>(x, packed, bias, out_features, bits, has_offset, wide, nullptr, op);
  return out;
}

}  // namespace orcaserve::ORCA_ISA

#else
#error "gemm_int8.cpp needs AVX2 and FMA: kernels/cpu/build.py builds it for the avx2 variants and up only"
#endif
