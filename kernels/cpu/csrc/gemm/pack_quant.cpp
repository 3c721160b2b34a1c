// Packing of GGUF block-quantized weights (kernels/quant.py's BlockCodes) into the panels the
// quantized GEMM streams (gemm/gemm_quant.cpp; layout in docs/kernels.md, "Quantized GEMM on the
// CPU"): per panel of kCols columns and block of 32 k, the heads (scales, then mins or q6_k's
// second scales), then the codes, k-major. Heads are fp16 as the file stores them for q8_0, q4_0
// and q4_1 (checked: they must be fp16 values), fp32 for the K-quants ("wide": their per-32 scale
// fp32(d) * sc is an exact fp32 product, not an fp16 value).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "gemm/quant_vec.h"

namespace orcaserve::ORCA_ISA {

at::Tensor pack_quant_weight(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                             int64_t bits, bool wide) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.scalar_type() == at::kChar && q.size(1) % kGroup == 0,
              "pack_quant_weight: codes must be an int8 [out, in] CPU tensor, in a multiple of 32");
  TORCH_CHECK(bits == 8 || bits == 4, "pack_quant_weight: bits must be 8 or 4");
  const int64_t N = q.size(0), K = q.size(1), nb = K / kGroup, P = (N + kCols - 1) / kCols;
  const bool has_offset = offset.has_value();
  TORCH_CHECK(!has_offset || bits == 4, "pack_quant_weight: mins (q4_1, q4_k) need 4-bit codes");
  TORCH_CHECK(!wide || bits == 8 || has_offset, "pack_quant_weight: wide heads are q4_k's (with mins) or q6_k's");
  const Format fmt{static_cast<int>(bits), has_offset, wide};
  // Scales per block: q6_k has one per 16 k (two rows of heads), the others one per 32.
  const int64_t per_block = wide && bits == 8 ? 2 : 1;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.size(0) == N &&
                  scale.size(1) == nb * per_block,
              "pack_quant_weight: scale must be fp32 [out, in / 32] (q6_k: [out, in / 16])");
  TORCH_CHECK(!has_offset || (offset->scalar_type() == at::kFloat && offset->sizes() == scale.sizes()),
              "pack_quant_weight: offset must be fp32 shaped as scale");
  // Codes must lie in the format's range, and fp16 heads be fp16 values: they are stored so.
  const int lo = bits == 8 ? (wide ? -32 : -128) : (has_offset ? 0 : -8);
  const int span = bits == 8 ? (wide ? 64 : 256) : 16, shift = bits == 4 && !has_offset ? 8 : 0;
  const at::Tensor qc = q.contiguous(), sc = scale.contiguous();
  const at::Tensor oc = has_offset ? offset->contiguous() : at::Tensor();
  at::Tensor packed = at::zeros({P, nb, fmt.block_bytes()}, q.options().dtype(at::kByte));
  const int8_t* qs = qc.data_ptr<int8_t>();
  const float* ss = sc.data_ptr<float>();
  const float* os = has_offset ? oc.data_ptr<float>() : nullptr;
  uint8_t* dst = packed.data_ptr<uint8_t>();
  std::atomic<bool> bad_code{false}, bad_scale{false};
  // Head h of column j: heads[h * kCols + j], fp16 or fp32 (memcpy: the bytes are a uint8 tensor).
  auto put = [&](uint8_t* block, int64_t h, int64_t j, float v) {
    if (wide) {
      std::memcpy(block + (h * kCols + j) * sizeof(float), &v, sizeof(float));
      return;
    }
    const at::Half half = static_cast<at::Half>(v);
    std::memcpy(block + (h * kCols + j) * sizeof(at::Half), &half, sizeof(at::Half));
    if (static_cast<float>(half) != v && !(v != v)) bad_scale = true;
  };
  at::parallel_for(0, P * nb, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / nb, b = i % nb;
      uint8_t* block = dst + i * fmt.block_bytes();
      uint8_t* codes = block + fmt.scale_bytes();
      for (int64_t j = 0; j < kCols && p * kCols + j < N; ++j) {
        const int64_t n = p * kCols + j;
        for (int64_t h = 0; h < per_block; ++h) put(block, h, j, ss[(n * nb + b) * per_block + h]);
        if (has_offset) put(block, 1, j, os[n * nb + b]);
        for (int64_t k = 0; k < kGroup; ++k) {
          const int v = qs[n * K + b * kGroup + k];
          if (v < lo || v >= lo + span) bad_code = true;
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

}  // namespace orcaserve::ORCA_ISA

#else
#error "pack_quant.cpp needs AVX2 and FMA: kernels/cpu/build.py builds it for the avx2 variants and up only"
#endif
