// The C++ signature of every op of the CPU library, in the namespace of one ISA variant.
//
// Each family source (attention/, gemm/, fused/) is compiled once per variant that
// kernels/cpu/build.py builds, with ORCA_ISA naming the variant (generic, avx2, avx512,
// avx512_bf16, amx), and defines its ops in orcaserve::ORCA_ISA: every variant's code, the ATen
// vector types it instantiates included (CPU_CAPABILITY is set per variant too), has names of its
// own, so no variant's copy of a function can stand in for another's at link time.
// bindings.cpp includes this file once per variant to register them all; a family source includes
// it so that a definition that drifts from its declaration fails to compile.
//
// No include guard: bindings.cpp includes it several times, with ORCA_ISA set each time.
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "gemm/panel_share.h"

#ifndef ORCA_ISA
#error "ORCA_ISA names the variant being compiled (kernels/cpu/build.py sets it)"
#endif

namespace orcaserve::ORCA_ISA {

// attention/paged_attention.cpp: ragged paged attention, prefill chunks and decodes in one call.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     double scale, const at::Tensor& out);

// fused/norm_silu.cpp: the decoder's residual add + RMSNorm, and SiLU(gate) * up.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);

// fused/rope_store.cpp: rotary embedding of q and k, and the K/V write into the paged cache.
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads);

// fused/argmax.cpp: the sampler's per-row argmax (first index of the maximum, as torch.argmax).
at::Tensor argmax_rows(const at::Tensor& logits);

// gemm/gemm_fp32.cpp (avx2 and up): fp32 or bf16 weights packed in panels, fp32 arithmetic.
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features);

// gemm/pack_quant.cpp and gemm/gemm_quant.cpp (avx2 and up): GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K
// codes packed in panels, widened to fp32. `wide`: fp32 heads, the K-quants' (bits 4 with mins:
// q4_k; bits 8: q6_k, a scale per 16 k).
at::Tensor pack_quant_weight(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                             int64_t bits, bool wide);
at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t bits, bool has_offset, bool wide);

// gemm/pack_int8.cpp and gemm/gemm_int8.cpp (avx2 and up): the same codes against int8 activations,
// integer dot products (vpdpbusd with VNNI, vpmaddubsw without), fp32 sums of the scaled blocks.
at::Tensor pack_int8_weight(const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                            int64_t bits, bool wide);
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x);
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t out_features, int64_t bits, bool has_offset, bool wide);
// linear_int8 by one thread of a parallel region its caller opened, into y [rows, out_features] (x's
// dtype), which the region's threads share with `share`'s counters (fused/layer_region.cpp): the
// calling thread's panels, each bit for bit linear_int8's. Up to 16 rows (GEMV-shaped).
void linear_int8_shared(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t bits, bool has_offset, bool wide, const at::Tensor& y,
                        const PanelShare& share);
// linear_int8's output rows reduced to their argmax [rows] int64 as it computes them, no logits written
// (a greedy lm_head; docs/one-stream.md, "The argmax inside the lm_head").
at::Tensor linear_int8_argmax(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                              int64_t out_features, int64_t bits, bool has_offset, bool wide);

// gemm/gemm_ternary.cpp (avx2 and up): BitNet's ternary weights packed two bits a weight, against
// int8 activations: the int32 sums (the caller applies the scales), or BitNet's BitLinear whole in
// x's dtype (float, bf16: activations quantized, sums scaled; gemm/ternary_act.h), optionally after
// BitNet's sub-layer norm of x (or of relu(gate)^2 * up; gemm/ternary_norm.h).
at::Tensor pack_ternary_weight(const at::Tensor& weight);
at::Tensor linear_ternary(const at::Tensor& x, const at::Tensor& packed, int64_t out_features);
at::Tensor bitlinear_ternary(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const at::Tensor& col_scale, const std::optional<at::Tensor>& norm, double eps,
                             bool relu2);

// gemm/lora.cpp (avx2 and up): LoRA adapters' update of a step's rows, in place (docs/lora.md): one
// adapter's rows by index, or every row against its own slot of the stacked weights, for one or several
// projections of y (a fused q/k/v or gate/up output: each a's and b's outputs at its first column).
void lora_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& a,
               const at::Tensor& b, double scale);
void lora_batched(const at::Tensor& y, const at::Tensor& x, const at::Tensor& row_slot, const at::Tensor& scales,
                  at::TensorList a, at::TensorList b, at::IntArrayRef cols, int64_t rank);

// gemm/gemm_bf16.cpp (avx512_bf16 and amx): bf16 weights packed in pairs for vdpbf16ps.
at::Tensor pack_linear_weight_bf16(const at::Tensor& weight);
at::Tensor linear_packed_bf16(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                              int64_t out_features);
// linear_packed_bf16 by one thread of a region its caller opened (as linear_int8_shared): up to 4 rows.
void linear_packed_bf16_shared(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                               int64_t out_features, const at::Tensor& y, const PanelShare& share);

}  // namespace orcaserve::ORCA_ISA
