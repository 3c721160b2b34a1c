// Packing of GGUF block codes (kernels/quant.py's BlockCodes) for the int8-activation GEMM
// (gemm/gemm_int8.cpp; layout in gemm/int8_vec.h's Int8Format and docs/int8-activations.md): per
// panel of kPanel columns and block of 32 k, fp32 scales per span, fp32 mins, then the codes as
// unsigned bytes u = q + shift, 4 consecutive k of a column side by side.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "gemm/int8_vec.h"

namespace orcaserve::ORCA_ISA {

at::Tensor pack_int8_weight(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                            int64_t bits, bool wide) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 2 && q.scalar_type() == at::kChar && q.size(1) % kBlock == 0,
              "pack_int8_weight: codes must be an int8 [out, in] CPU tensor, in a multiple of 32");
  TORCH_CHECK(bits == 8 || bits == 4, "pack_int8_weight: bits must be 8 or 4");
  const bool has_offset = offset.has_value();
  TORCH_CHECK(!has_offset || bits == 4, "pack_int8_weight: mins (q4_1, q4_k) need 4-bit codes");
  const Int8Format fmt{static_cast<int>(bits), has_offset, wide && bits == 8};
  const int64_t N = q.size(0), K = q.size(1), nb = K / kBlock, P = (N + kPanel - 1) / kPanel, S = fmt.spans();
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 2 && scale.size(0) == N && scale.size(1) == nb * S,
              "pack_int8_weight: scale must be fp32 [out, in / 32] (q6_k: [out, in / 16])");
  TORCH_CHECK(!has_offset || (offset->scalar_type() == at::kFloat && offset->size(0) == N && offset->size(1) == nb),
              "pack_int8_weight: offset must be fp32 [out, in / 32]");
  // The format's code range: u = q + shift must be a byte (and <= 63 where vpmaddubsw sums pairs).
  const int lo = bits == 8 ? (fmt.wide ? -32 : -128) : (has_offset ? 0 : -8);
  const int span = bits == 8 ? (fmt.wide ? 64 : 256) : 16;
  const at::Tensor qc = q.contiguous(), sc = scale.contiguous();
  const at::Tensor oc = has_offset ? offset->contiguous() : at::Tensor();
  at::Tensor packed = at::zeros({P, nb, fmt.block_bytes()}, q.options().dtype(at::kByte));
  const int8_t* qs = qc.data_ptr<int8_t>();
  const float* ss = sc.data_ptr<float>();
  const float* os = has_offset ? oc.data_ptr<float>() : nullptr;
  uint8_t* dst = packed.data_ptr<uint8_t>();
  std::atomic<bool> bad{false};
  at::parallel_for(0, P * nb, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / nb, b = i % nb;
      uint8_t* block = dst + i * fmt.block_bytes();
      float* heads = reinterpret_cast<float*>(block);  // at::zeros' storage is aligned; blocks are 4-byte multiples
      uint8_t* codes = block + fmt.head_bytes();
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const int64_t n = p * kPanel + j;
        for (int64_t s = 0; s < S; ++s) heads[s * kPanel + j] = ss[(n * nb + b) * S + s];
        if (has_offset) heads[S * kPanel + j] = os[n * nb + b];
        for (int64_t k = 0; k < kBlock; ++k) {
          const int v = qs[n * K + b * kBlock + k];
          if (v < lo || v >= lo + span) bad = true;
          const uint8_t u = static_cast<uint8_t>(v + fmt.shift());
          if (bits == 8) {
            codes[((k / 4) * kPanel + j) * 4 + k % 4] = u;
          } else {  // k < 16 in the low nibbles of groups 0..3, k >= 16 in the high
            const int64_t g = (k % 16) / 4;
            codes[(g * kPanel + j) * 4 + k % 4] |= static_cast<uint8_t>((u & 0xF) << (k < 16 ? 0 : 4));
          }
        }
      }
    }
  });
  TORCH_CHECK(!bad, "pack_int8_weight: codes outside the format's range");
  return packed;
}

}  // namespace orcaserve::ORCA_ISA

#else
#error "pack_int8.cpp needs AVX2 and FMA: kernels/cpu/build.py builds it for the avx2 variants and up only"
#endif
