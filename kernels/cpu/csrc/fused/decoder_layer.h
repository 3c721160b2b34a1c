// fused/decoder_layer.cpp: one lean-decoder layer in one call, compiled once for every variant (its
// `variants` pick, per op, the variant the dispatch table chose). Registered by bindings.cpp.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <tuple>

namespace orcaserve {

// (x + delta + o, down's output) of a layer at x [T, hidden] and the last layer's delta [T, hidden]
// (none at the first layer: x itself is normed, as the PyTorch rms_norm does):
// weights and biases of qkv, o, gate_up and down, meta 4 ints for each, variants the indices
// (kernels/dispatch.py's CAPABILITIES) of add_rms_norm, rope_store_kv, paged_attention, silu_mul and
// the GEMM, then the GEMM's family: 0, linear_int8 (pack_int8_weight's panels, fp32 biases or none,
// meta (out_features, bits, has_offset, wide)); 1, linear_packed (pack_linear_weight's fp32 or bf16
// panels); 2, linear_packed_bf16 (pack_linear_weight_bf16's pairs); for 1 and 2 the biases in the
// activations' dtype or none, meta (out_features, 0, 0, 0).
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& in_norm, const at::Tensor& post_norm,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
    double eps, int64_t num_heads, int64_t num_kv_heads, at::IntArrayRef variants);

// A step's LoRA update of projection p (0 qkv, 1 o, 2 gate_up, 3 down) from its input `in` into its
// output y, in place, right after the projection's GEMM (docs/lora.md "The layer call with adapters").
using LoraUpdate = std::function<void(int p, const at::Tensor& in, const at::Tensor& y)>;

// decoder_layer with `lora` (none: nothing) after each projection.
std::tuple<at::Tensor, at::Tensor> decoder_layer_with(
    const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& in_norm, const at::Tensor& post_norm,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
    double eps, int64_t num_heads, int64_t num_kv_heads, at::IntArrayRef variants, const LoraUpdate& lora);

// Every layer in turn, as decoder_layer (the first with no delta): (x + the last delta, the last layer's
// delta), the lists holding each layer's tensors in order (4 weights, biases and 16 ints of meta a
// layer). One call a step instead of one a layer: the per-call argument passing and dispatch once.
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x, at::TensorList in_norms, at::TensorList post_norms, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale, double eps, int64_t num_heads,
    int64_t num_kv_heads, at::IntArrayRef variants);

// decoder_layers with a step's LoRA update of several adapters after each projection: gemm/lora.cpp's
// lora_batched in variant `lora_variant` (an index of CAPABILITIES, the dispatch table's), called as
// LoraStep.apply calls it (scheduler/lora/resident.py): row_slot [T] each row's slot (-1: none),
// slot_scale [S] fp32, the stacks' rank; per layer and projection, lora_parts[4 i + p] parts (0: the
// adapters do not target it), each an a and a b (in order over the layers) and its first and last
// column of the projection's output in lora_cols. Bit for bit the op-by-op loop's.
std::tuple<at::Tensor, at::Tensor> decoder_layers_lora(
    const at::Tensor& x, at::TensorList in_norms, at::TensorList post_norms, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale, double eps, int64_t num_heads,
    int64_t num_kv_heads, at::IntArrayRef variants, const at::Tensor& row_slot, const at::Tensor& slot_scale,
    int64_t rank, at::TensorList lora_a, at::TensorList lora_b, at::IntArrayRef lora_cols, at::IntArrayRef lora_parts,
    int64_t lora_variant);

// The same with one adapter's update (lora_sgmv in variant `lora_variant`, as LoraStep.apply calls it):
// its rows [N] int64; per part its A [r, in] and B [out, r] (PEFT's), its columns of the projection's
// output and its scale.
std::tuple<at::Tensor, at::Tensor> decoder_layers_sgmv(
    const at::Tensor& x, at::TensorList in_norms, at::TensorList post_norms, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale, double eps, int64_t num_heads,
    int64_t num_kv_heads, at::IntArrayRef variants, const at::Tensor& rows, at::TensorList lora_a,
    at::TensorList lora_b, at::IntArrayRef lora_cols, at::ArrayRef<double> lora_scales, at::IntArrayRef lora_parts,
    int64_t lora_variant);

// After the last layer: rms_norm((x + delta)[rows]) as the decoder's PyTorch ops compute it (the add,
// index_select and kernels/pytorch/fused.py's rms_norm, through ATen's own ops): bit for bit, one call.
at::Tensor final_norm(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& rows,
                      const at::Tensor& weight, double eps);

}  // namespace orcaserve
