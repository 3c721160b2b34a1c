// fused/layer_region.cpp: the layers of a GEMV-shaped step in one OpenMP region, for
// fused/decoder_layer.cpp's decoder_layers (docs/one-stream.md, "One OpenMP region a step").
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "ops_all.h"

namespace orcaserve {

// The ops a layer calls, each in the variant the dispatch table picked; the GEMM is the family's
// form for a region's threads: linear_int8_shared (GGUF codes against int8 activations) or
// linear_packed_bf16_shared (dense bf16 on vdpbf16ps), the other null.
struct RegionOps {
  decltype(&generic::add_rms_norm) norm;
  decltype(&generic::rope_store_kv) rope;
  decltype(&generic::paged_attention) attend;
  decltype(&generic::silu_mul) silu;
  decltype(&generic::linear_int8_shared) int8;
  decltype(&generic::linear_packed_bf16_shared) bf16;
};

// Whether decoder_layers' step runs in one region: GGUF codes against int8 activations (`family`
// 0) or dense bf16 on vdpbf16ps (2), at most kRegionRows rows, every layer's projections of the same shapes, a
// context short enough that attention on one thread costs little (the region runs it on thread 0; the operator
// alone splits a long one over the threads), and ORCASERVE_LAYER_REGION not "0" (the A/B switch).
bool region_applies(const at::Tensor& x, int64_t family, at::IntArrayRef meta, const at::Tensor& seq_lens,
                    at::TensorList k_caches);

// decoder_layers' result, the first layer's norm `h0` given (its ATen rms_norm), bit for bit.
std::tuple<at::Tensor, at::Tensor> layers_in_region(
    const RegionOps& ops, const at::Tensor& x, const at::Tensor& h0, at::TensorList in_norms, at::TensorList post_norms,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta,
    const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& slots, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
    const at::Tensor& block_tables, double scale, double eps, int64_t num_heads, int64_t num_kv_heads);

}  // namespace orcaserve
