// One decoder layer of the lean decoder (scheduler/model/decoder.py) in one op call: residual add +
// RMSNorm, the fused q/k/v GEMM, rotary + K/V write, paged attention, o, add + RMSNorm, gate/up,
// SiLU * up and down, each through the very C++ function the decoder calls one by one, with the
// variant the dispatch table picked for it (kernels/dispatch.py), so the result is bit for bit the
// op-by-op path's. What it saves is the glue: at one row a layer's nine ops cost about 4 us each in
// Python, torch's argument parsing and its dispatcher (their work is a few us too), so a decode
// step of 30 layers spent about a millisecond between its kernels (docs/one-stream.md, "The layer
// as one call").
//
// The projections are one GEMM family for the whole layer (the last of `variants`): the GGUF codes
// against int8 activations (gemm/gemm_int8.cpp), the defaults of a GGUF file; or dense fp32/bf16
// weights through the project's fp32 GEMM (gemm/gemm_fp32.cpp) or its vdpbf16ps GEMM
// (gemm/gemm_bf16.cpp), the dense path of a safetensors checkpoint. Compiled once, without ISA
// flags, like bindings.cpp: it holds no vector code of its own, only the calls, and may call any
// variant the library was built with.
#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <tuple>
#include <vector>

#include "fused/decoder_layer.h"
#include "fused/layer_region.h"
#include "ops_all.h"

namespace orcaserve {
namespace {

// A variant by its index in kernels/dispatch.py's CAPABILITIES: a case for each variant built.
#ifdef ORCA_BUILT_GENERIC
#define ORCA_CASE_GENERIC(op) \
  case 0:                     \
    return &generic::op;
#else
#define ORCA_CASE_GENERIC(op)
#endif
#ifdef ORCA_BUILT_AVX2
#define ORCA_CASE_AVX2(op) \
  case 1:                  \
    return &avx2::op;
#else
#define ORCA_CASE_AVX2(op)
#endif
#ifdef ORCA_BUILT_AVX512
#define ORCA_CASE_AVX512(op) \
  case 2:                    \
    return &avx512::op;
#else
#define ORCA_CASE_AVX512(op)
#endif
#ifdef ORCA_BUILT_AVX512_BF16
#define ORCA_CASE_AVX512_BF16(op) \
  case 3:                         \
    return &avx512_bf16::op;
#else
#define ORCA_CASE_AVX512_BF16(op)
#endif
#ifdef ORCA_BUILT_AMX
#define ORCA_CASE_AMX(op) \
  case 4:                 \
    return &amx::op;
#else
#define ORCA_CASE_AMX(op)
#endif
// The GEMMs exist from avx2 on (the vdpbf16ps one from avx512_bf16 on), the row-wise ops and the
// attention in every variant.
#define ORCA_BF16_CASES(op) ORCA_CASE_AVX512_BF16(op) ORCA_CASE_AMX(op)
#define ORCA_GEMM_CASES(op) ORCA_CASE_AVX2(op) ORCA_CASE_AVX512(op) ORCA_BF16_CASES(op)
#define ORCA_ALL_CASES(op) ORCA_CASE_GENERIC(op) ORCA_GEMM_CASES(op)
#define ORCA_PICK(op, cases)                                                        \
  decltype(&generic::op) pick_##op(int64_t v) {                                     \
    switch (v) { cases(op) }                                                        \
    TORCH_CHECK(false, "decoder_layer: " #op " has no variant ", v, " in this build"); \
  }

ORCA_PICK(add_rms_norm, ORCA_ALL_CASES)
ORCA_PICK(rope_store_kv, ORCA_ALL_CASES)
ORCA_PICK(paged_attention, ORCA_ALL_CASES)
ORCA_PICK(silu_mul, ORCA_ALL_CASES)
ORCA_PICK(linear_int8, ORCA_GEMM_CASES)
ORCA_PICK(linear_int8_shared, ORCA_GEMM_CASES)
ORCA_PICK(linear_packed_bf16_shared, ORCA_BF16_CASES)
ORCA_PICK(linear_packed, ORCA_GEMM_CASES)
ORCA_PICK(linear_packed_bf16, ORCA_BF16_CASES)
ORCA_PICK(lora_batched, ORCA_GEMM_CASES)
ORCA_PICK(lora_sgmv, ORCA_GEMM_CASES)

// The layer's GEMM families, the last of `variants` (scheduler/model/layer_call.py's GEMMS).
enum Gemm : int64_t { kInt8 = 0, kPacked = 1, kPackedBf16 = 2 };

// Projection i (qkv, o, gate_up, down) of a [T, in] input: [T, out].
using Proj = std::function<at::Tensor(int, const at::Tensor&)>;

Proj projection(at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta,
                int64_t variant, int64_t family) {
  if (family == kInt8) {
    const auto gemm = pick_linear_int8(variant);
    return [=](int i, const at::Tensor& in) {  // meta: out_features, bits, has_offset, wide
      const int64_t* m = meta.data() + 4 * i;
      return gemm(in, weights[i], biases.get(i), m[0], m[1], m[2] != 0, m[3] != 0);
    };
  }
  TORCH_CHECK(family == kPacked || family == kPackedBf16, "decoder_layer: no GEMM family ", family);
  const auto gemm = family == kPacked ? pick_linear_packed(variant) : pick_linear_packed_bf16(variant);
  return [=](int i, const at::Tensor& in) { return gemm(in, weights[i], biases.get(i), meta[4 * i]); };
}

// The first layer's norm, with no residual to add yet: kernels/pytorch/fused.py's rms_norm, what the
// decoder runs there, op for op through ATen's own ops, so bit for bit its result (the C++ norm sums
// its mean in another order).
at::Tensor aten_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor x32 = x.to(at::kFloat);
  x32 = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * x32.to(x.scalar_type());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decoder_layer_with(
    const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& in_norm, const at::Tensor& post_norm,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
    double eps, int64_t num_heads, int64_t num_kv_heads, at::IntArrayRef variants, const LoraUpdate& lora) {
  TORCH_CHECK(weights.size() == 4 && biases.size() == 4 && meta.size() == 16 && variants.size() == 6,
              "decoder_layer: 4 projections (qkv, o, gate_up, down), 4 ints of meta each, 5 variants and a GEMM");
  const auto norm = pick_add_rms_norm(variants[0]);
  const auto rope = pick_rope_store_kv(variants[1]);
  const auto attend = pick_paged_attention(variants[2]);
  const auto silu = pick_silu_mul(variants[3]);
  const Proj gemm = projection(weights, biases, meta, variants[4], variants[5]);
  const Proj proj = !lora ? gemm : Proj([&](int i, const at::Tensor& in) {  // the step's LoRA update after each
    at::Tensor y = gemm(i, in);
    lora(i, in, y);
    return y;
  });
  auto [x1, h1] = delta.has_value() ? norm(x, *delta, in_norm, eps)
                                    : std::make_tuple(x, aten_rms_norm(x, in_norm, eps));  // [T, hidden]
  const at::Tensor q = rope(proj(0, h1), cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads);  // [T, H, D]
  const at::Tensor attn = at::empty(q.sizes(), q.options());                                       // [T, H, D]
  attend(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, attn);
  auto [x2, h2] = norm(x1, proj(1, attn.view({attn.size(0), -1})), post_norm, eps);  // [T, hidden]
  return {x2, proj(3, silu(proj(2, h2)))};                                           // down: [T, hidden]
}

std::tuple<at::Tensor, at::Tensor> decoder_layer(
    const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& in_norm, const at::Tensor& post_norm,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots,
    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale,
    double eps, int64_t num_heads, int64_t num_kv_heads, at::IntArrayRef variants) {
  return decoder_layer_with(x, delta, in_norm, post_norm, weights, biases, meta, cos, sin, k_cache, v_cache, slots,
                            cu_seqlens_q, seq_lens, block_tables, scale, eps, num_heads, num_kv_heads, variants, {});
}

namespace {

// Layer i's LoRA update after its projection p (decoder_layer_with's `lora`, per layer).
using StackLora = std::function<void(int64_t i, int p, const at::Tensor& in, const at::Tensor& y)>;

std::tuple<at::Tensor, at::Tensor> layers_with(
    const at::Tensor& x, at::TensorList in_norms, at::TensorList post_norms, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale, double eps, int64_t num_heads,
    int64_t num_kv_heads, at::IntArrayRef variants, const StackLora& lora) {
  const int64_t n = static_cast<int64_t>(in_norms.size());
  TORCH_CHECK(n > 0 && post_norms.size() == n && weights.size() == 4 * n && biases.size() == 4 * n &&
                  meta.size() == 16 * n && k_caches.size() == n && v_caches.size() == n,
              "decoder_layers: per layer two norms, 4 weights and biases, 16 ints of meta, a K and a V cache");
  // A GEMV-shaped step with no LoRA update in one OpenMP region, bit for bit this loop.
  if (!lora && region_applies(x, variants[5], meta, seq_lens, k_caches))
    return layers_in_region({pick_add_rms_norm(variants[0]), pick_rope_store_kv(variants[1]),
                             pick_paged_attention(variants[2]), pick_silu_mul(variants[3]),
                             variants[5] == kInt8 ? pick_linear_int8_shared(variants[4]) : nullptr,
                             variants[5] == kPackedBf16 ? pick_linear_packed_bf16_shared(variants[4]) : nullptr},
                            x, aten_rms_norm(x, in_norms[0], eps), in_norms, post_norms, weights, biases, meta, cos,
                            sin, k_caches, v_caches, slots, cu_seqlens_q, seq_lens, block_tables, scale, eps,
                            num_heads, num_kv_heads);
  at::Tensor h = x;
  std::optional<at::Tensor> delta;
  for (int64_t i = 0; i < n; ++i) {
    c10::List<std::optional<at::Tensor>> b;
    for (int64_t j = 4 * i; j < 4 * i + 4; ++j) b.push_back(biases.get(j));
    const LoraUpdate layer_lora =
        !lora ? LoraUpdate{} : LoraUpdate([&, i](int p, const at::Tensor& in, const at::Tensor& y) { lora(i, p, in, y); });
    std::tie(h, delta) = decoder_layer_with(h, delta, in_norms[i], post_norms[i], weights.slice(4 * i, 4), b,
                                            meta.slice(16 * i, 16), cos, sin, k_caches[i], v_caches[i], slots,
                                            cu_seqlens_q, seq_lens, block_tables, scale, eps, num_heads, num_kv_heads,
                                            variants, layer_lora);
  }
  return {h, *delta};
}

// Each (layer, projection)'s first part in the flat lists (lora_parts[4 i + p] parts each), checked
// against the lists' lengths: an a, a b and a first and last column a part.
std::vector<int64_t> part_starts(at::IntArrayRef lora_parts, int64_t layers, size_t a, size_t b, size_t cols) {
  TORCH_CHECK(static_cast<int64_t>(lora_parts.size()) == 4 * layers, "decoder_layers_lora: 4 part counts a layer");
  std::vector<int64_t> first(4 * layers + 1, 0);
  for (int64_t k = 0; k < 4 * layers; ++k) first[k + 1] = first[k] + lora_parts[k];
  const auto parts = static_cast<size_t>(first.back());
  TORCH_CHECK(a == parts && b == parts && cols == 2 * parts,
              "decoder_layers_lora: an a, a b and a first and last column for each part");
  return first;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x, at::TensorList in_norms, at::TensorList post_norms, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale, double eps, int64_t num_heads,
    int64_t num_kv_heads, at::IntArrayRef variants) {
  return layers_with(x, in_norms, post_norms, weights, biases, meta, cos, sin, k_caches, v_caches, slots, cu_seqlens_q,
                     seq_lens, block_tables, scale, eps, num_heads, num_kv_heads, variants, {});
}

std::tuple<at::Tensor, at::Tensor> decoder_layers_lora(
    const at::Tensor& x, at::TensorList in_norms, at::TensorList post_norms, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale, double eps, int64_t num_heads,
    int64_t num_kv_heads, at::IntArrayRef variants, const at::Tensor& row_slot, const at::Tensor& slot_scale,
    int64_t rank, at::TensorList lora_a, at::TensorList lora_b, at::IntArrayRef lora_cols, at::IntArrayRef lora_parts,
    int64_t lora_variant) {
  const std::vector<int64_t> first =
      part_starts(lora_parts, static_cast<int64_t>(in_norms.size()), lora_a.size(), lora_b.size(), lora_cols.size());
  const auto update = pick_lora_batched(lora_variant);
  const StackLora lora = [&](int64_t i, int p, const at::Tensor& in, const at::Tensor& y) {
    const int64_t b = first[4 * i + p], m = first[4 * i + p + 1] - b;
    if (m > 0)  // the projection's parts in one call, as LoraStep.apply's (kernels/cpu/lora.py's parts_cell)
      update(y, in.contiguous(), row_slot, slot_scale, lora_a.slice(b, m), lora_b.slice(b, m),
             lora_cols.slice(2 * b, 2 * m), rank);
  };
  return layers_with(x, in_norms, post_norms, weights, biases, meta, cos, sin, k_caches, v_caches, slots, cu_seqlens_q,
                     seq_lens, block_tables, scale, eps, num_heads, num_kv_heads, variants, lora);
}

std::tuple<at::Tensor, at::Tensor> decoder_layers_sgmv(
    const at::Tensor& x, at::TensorList in_norms, at::TensorList post_norms, at::TensorList weights,
    const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slots, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_tables, double scale, double eps, int64_t num_heads,
    int64_t num_kv_heads, at::IntArrayRef variants, const at::Tensor& rows, at::TensorList lora_a,
    at::TensorList lora_b, at::IntArrayRef lora_cols, at::ArrayRef<double> lora_scales, at::IntArrayRef lora_parts,
    int64_t lora_variant) {
  const std::vector<int64_t> first =
      part_starts(lora_parts, static_cast<int64_t>(in_norms.size()), lora_a.size(), lora_b.size(), lora_cols.size());
  TORCH_CHECK(lora_scales.size() == lora_a.size(), "decoder_layers_sgmv: a scale for each part");
  const auto update = pick_lora_sgmv(lora_variant);
  const StackLora lora = [&](int64_t i, int p, const at::Tensor& in, const at::Tensor& y) {
    const at::Tensor xc = in.contiguous();  // each module of the projection at its columns, as LoraStep.apply
    for (int64_t k = first[4 * i + p]; k < first[4 * i + p + 1]; ++k)
      update(y.slice(1, lora_cols[2 * k], lora_cols[2 * k + 1]), xc, rows, lora_a[k], lora_b[k], lora_scales[k]);
  };
  return layers_with(x, in_norms, post_norms, weights, biases, meta, cos, sin, k_caches, v_caches, slots, cu_seqlens_q,
                     seq_lens, block_tables, scale, eps, num_heads, num_kv_heads, variants, lora);
}

at::Tensor final_norm(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& rows,
                      const at::Tensor& weight, double eps) {
  const at::Tensor h = delta.has_value() ? x + *delta : x;
  return aten_rms_norm(h.index_select(0, rows), weight, eps);
}

}  // namespace orcaserve
