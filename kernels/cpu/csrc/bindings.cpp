// Every op of orcaserve's C++ CPU library, registered in one place.
//
// Each op exists once per ISA variant built into the library, as an overload named after the
// variant: torch.ops.orcaserve.paged_attention.avx2, .avx512, ... Which one the engine calls is
// decided once, in Python, by the table in kernels/dispatch.py; the tests call every variant the
// machine can execute. kernels/cpu/build.py compiles this file once, without ISA flags, and passes
// -DORCA_BUILT_<VARIANT> for each variant it built (only those the building CPU can execute).
//
// Families per variant (as build.py's VARIANTS): attention and the fused ops everywhere, the fp32
// GEMM, the quantized one (GGUF codes widened to fp32) and the int8-activation one from avx2 on, the vdpbf16ps GEMM on
// avx512_bf16 and amx.
#include <torch/library.h>

#include <string>

#include "fused/decoder_layer.h"
#include "ops_all.h"
#include "probe/read_sweep.h"

namespace {

struct Schema {
  const char* name;
  const char* signature;  // everything after the name
};

constexpr Schema kCommon[] = {
    {"paged_attention",
     "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_tables, "
     "float scale, Tensor(a!) out) -> ()"},
    {"add_rms_norm", "(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)"},
    {"silu_mul", "(Tensor gate_up) -> Tensor"},
    {"rope_store_kv",
     "(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, int num_heads, "
     "int num_kv_heads) -> Tensor"},
    {"argmax_rows", "(Tensor logits) -> Tensor"},
};
constexpr Schema kGemmFp32[] = {
    {"pack_linear_weight", "(Tensor weight) -> Tensor"},
    {"linear_packed", "(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor"},
    {"pack_quant_weight", "(Tensor q, Tensor scale, Tensor? offset, int bits, bool wide=False) -> Tensor"},
    {"linear_quant", "(Tensor x, Tensor packed, Tensor? bias, int out_features, int bits, bool has_offset, bool wide=False) -> Tensor"},
    {"lora_sgmv", "(Tensor(a!) y, Tensor x, Tensor rows, Tensor a, Tensor b, float scale) -> ()"},
    {"lora_batched", "(Tensor(a!) y, Tensor x, Tensor row_slot, Tensor scales, Tensor[] a, Tensor[] b, int[] cols, int rank) -> ()"},
};
constexpr Schema kGemmInt8[] = {
    {"pack_int8_weight", "(Tensor q, Tensor scale, Tensor? offset, int bits, bool wide=False) -> Tensor"},
    {"quantize_rows_int8", "(Tensor x) -> (Tensor, Tensor, Tensor)"},
    {"linear_int8", "(Tensor x, Tensor packed, Tensor? bias, int out_features, int bits, bool has_offset, bool wide=False) -> Tensor"},
    {"linear_int8_argmax", "(Tensor x, Tensor packed, Tensor? bias, int out_features, int bits, bool has_offset, bool wide=False) -> Tensor"},
    {"pack_ternary_weight", "(Tensor weight) -> Tensor"},
    {"linear_ternary", "(Tensor x, Tensor packed, int out_features) -> Tensor"},
    {"bitlinear_ternary", "(Tensor x, Tensor packed, int out_features, Tensor col_scale, Tensor? norm=None, float eps=0., bool relu2=False) -> Tensor"},
};
constexpr Schema kGemmBf16[] = {
    {"pack_linear_weight_bf16", "(Tensor weight) -> Tensor"},
    {"linear_packed_bf16", "(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor"},
};

template <size_t N>
void define(torch::Library& m, const Schema (&schemas)[N], const char* variant) {
  for (const Schema& s : schemas) m.def((std::string(s.name) + "." + variant + s.signature).c_str());
}

}  // namespace

#define ORCA_IMPL_COMMON(m, isa)                                              \
  m.impl("paged_attention." #isa, &orcaserve::isa::paged_attention);          \
  m.impl("add_rms_norm." #isa, &orcaserve::isa::add_rms_norm);                \
  m.impl("silu_mul." #isa, &orcaserve::isa::silu_mul);                        \
  m.impl("rope_store_kv." #isa, &orcaserve::isa::rope_store_kv);              \
  m.impl("argmax_rows." #isa, &orcaserve::isa::argmax_rows)
#define ORCA_IMPL_GEMM_FP32(m, isa)                                           \
  m.impl("pack_linear_weight." #isa, &orcaserve::isa::pack_linear_weight);    \
  m.impl("linear_packed." #isa, &orcaserve::isa::linear_packed);             \
  m.impl("pack_quant_weight." #isa, &orcaserve::isa::pack_quant_weight);     \
  m.impl("linear_quant." #isa, &orcaserve::isa::linear_quant);              \
  m.impl("lora_sgmv." #isa, &orcaserve::isa::lora_sgmv);                    \
  m.impl("lora_batched." #isa, &orcaserve::isa::lora_batched);              \
  m.impl("pack_int8_weight." #isa, &orcaserve::isa::pack_int8_weight);      \
  m.impl("quantize_rows_int8." #isa, &orcaserve::isa::quantize_rows_int8);  \
  m.impl("linear_int8." #isa, &orcaserve::isa::linear_int8);                \
  m.impl("linear_int8_argmax." #isa, &orcaserve::isa::linear_int8_argmax);  \
  m.impl("pack_ternary_weight." #isa, &orcaserve::isa::pack_ternary_weight); \
  m.impl("linear_ternary." #isa, &orcaserve::isa::linear_ternary);         \
  m.impl("bitlinear_ternary." #isa, &orcaserve::isa::bitlinear_ternary)
#define ORCA_IMPL_GEMM_BF16(m, isa)                                           \
  m.impl("pack_linear_weight_bf16." #isa, &orcaserve::isa::pack_linear_weight_bf16); \
  m.impl("linear_packed_bf16." #isa, &orcaserve::isa::linear_packed_bf16)

TORCH_LIBRARY(orcaserve, m) {
  // One for all variants: its `variants` name each op's (fused/decoder_layer.cpp).
  m.def(
      "decoder_layer(Tensor x, Tensor? delta, Tensor in_norm, Tensor post_norm, Tensor[] weights, Tensor?[] biases, "
      "int[] meta, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, Tensor cu_seqlens_q, "
      "Tensor seq_lens, Tensor block_tables, float scale, float eps, int num_heads, int num_kv_heads, int[] variants) "
      "-> (Tensor, Tensor)");
  m.def("final_norm(Tensor x, Tensor? delta, Tensor rows, Tensor weight, float eps) -> Tensor");
  m.def("read_sweep(Tensor buf, int chunk_bytes, int chunks) -> Tensor");
  m.def(
      "decoder_layers(Tensor x, Tensor[] in_norms, Tensor[] post_norms, Tensor[] weights, Tensor?[] biases, int[] meta, "
      "Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, Tensor cu_seqlens_q, "
      "Tensor seq_lens, Tensor block_tables, float scale, float eps, int num_heads, int num_kv_heads, int[] variants) "
      "-> (Tensor, Tensor)");
  m.def(
      "decoder_layers_lora(Tensor x, Tensor[] in_norms, Tensor[] post_norms, Tensor[] weights, Tensor?[] biases, "
      "int[] meta, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, "
      "Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_tables, float scale, float eps, int num_heads, "
      "int num_kv_heads, int[] variants, Tensor row_slot, Tensor slot_scale, int rank, Tensor[] lora_a, "
      "Tensor[] lora_b, int[] lora_cols, int[] lora_parts, int lora_variant) -> (Tensor, Tensor)");
  m.def(
      "decoder_layers_sgmv(Tensor x, Tensor[] in_norms, Tensor[] post_norms, Tensor[] weights, Tensor?[] biases, "
      "int[] meta, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slots, "
      "Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_tables, float scale, float eps, int num_heads, "
      "int num_kv_heads, int[] variants, Tensor rows, Tensor[] lora_a, Tensor[] lora_b, int[] lora_cols, "
      "float[] lora_scales, int[] lora_parts, int lora_variant) -> (Tensor, Tensor)");
#ifdef ORCA_BUILT_GENERIC
  define(m, kCommon, "generic");
#endif
#ifdef ORCA_BUILT_AVX2
  define(m, kCommon, "avx2");
  define(m, kGemmFp32, "avx2");
  define(m, kGemmInt8, "avx2");
#endif
#ifdef ORCA_BUILT_AVX512
  define(m, kCommon, "avx512");
  define(m, kGemmFp32, "avx512");
  define(m, kGemmInt8, "avx512");
#endif
#ifdef ORCA_BUILT_AVX512_BF16
  define(m, kCommon, "avx512_bf16");
  define(m, kGemmFp32, "avx512_bf16");
  define(m, kGemmInt8, "avx512_bf16");
  define(m, kGemmBf16, "avx512_bf16");
#endif
#ifdef ORCA_BUILT_AMX
  define(m, kCommon, "amx");
  define(m, kGemmFp32, "amx");
  define(m, kGemmInt8, "amx");
  define(m, kGemmBf16, "amx");
#endif
}

TORCH_LIBRARY_IMPL(orcaserve, CPU, m) {
  m.impl("decoder_layer", &orcaserve::decoder_layer);
  m.impl("decoder_layers", &orcaserve::decoder_layers);
  m.impl("decoder_layers_lora", &orcaserve::decoder_layers_lora);
  m.impl("decoder_layers_sgmv", &orcaserve::decoder_layers_sgmv);
  m.impl("final_norm", &orcaserve::final_norm);
  m.impl("read_sweep", &orcaserve::read_sweep);
#ifdef ORCA_BUILT_GENERIC
  ORCA_IMPL_COMMON(m, generic);
#endif
#ifdef ORCA_BUILT_AVX2
  ORCA_IMPL_COMMON(m, avx2);
  ORCA_IMPL_GEMM_FP32(m, avx2);
#endif
#ifdef ORCA_BUILT_AVX512
  ORCA_IMPL_COMMON(m, avx512);
  ORCA_IMPL_GEMM_FP32(m, avx512);
#endif
#ifdef ORCA_BUILT_AVX512_BF16
  ORCA_IMPL_COMMON(m, avx512_bf16);
  ORCA_IMPL_GEMM_FP32(m, avx512_bf16);
  ORCA_IMPL_GEMM_BF16(m, avx512_bf16);
#endif
#ifdef ORCA_BUILT_AMX
  ORCA_IMPL_COMMON(m, amx);
  ORCA_IMPL_GEMM_FP32(m, amx);
  ORCA_IMPL_GEMM_BF16(m, amx);
#endif
}
