// fused/decoder_layer.cpp: one lean-decoder layer in one call, compiled once for every variant (its
// `variants` pick, per op, the variant the dispatch table chose). Registered by bindings.cpp.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace orcaserve {

// (x + delta + o, down's output) of a layer at x [T, hidden] and the last layer's delta [T, hidden]:
// weights and biases of qkv, o, gate_up and down (pack_int8_weight's panels; fp32 biases or none),
// meta their (out_features, bits, has_offset, wide), variants the indices (kernels/dispatch.py's
// CAPABILITIES) of add_rms_norm, rope_store_kv, paged_attention, silu_mul and linear_int8.
std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& x, const at::Tensor& delta, const at::Tensor& in_norm, const at::Tensor& post_norm,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
    double eps, int64_t num_heads, int64_t num_kv_heads, at::IntArrayRef variants);

}  // namespace orcaserve
