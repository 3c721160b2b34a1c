// The lean decoder's rotary embedding and K/V write as one pass over the fused q/k/v GEMM's output:
// q and k rotated, q written out, k and v stored straight into their paged-cache slots. Unfused,
// this is a roll, two multiplications, an add, a split and two index_copy_ per layer (with the
// cache writes' checks and casts), each an ATen dispatch and OpenMP fork on a decode step's few
// rows, and each a pass over memory on a prefill chunk's many.
//
// Same arithmetic as the PyTorch it replaces (decoder.py: qk * cos + roll(qk, D/2) * sin, each
// product and the sum rounded to the tensor dtype as the unfused ops store them), so the results
// are the same bit for bit, fp32 included, which the token-exact tests hold to transformers. That
// needs the products and the sum kept apart: the library is built with -ffp-contract=off, so the
// compiler does not contract them into FMAs (the fp32 test sees it if it does).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "rows.h"
#include "ops.h"

namespace orcaserve::ORCA_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;

// v rounded to T and back: where an unfused op stores its result as a T tensor.
template <typename T>
Vec rounded(Vec v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    auto pair = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v));
    return std::get<0>(pair);
  }
}

// out[i] = T(T(x[i] * c[i]) + T(x[i +- D/2] * s[i])) for one head of D values in fp32; `s` carries
// rotate_half's sign (decoder.py folds it into the sin table).
template <typename T>
void rotate(const float* x, const float* c, const float* s, float* out, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t lo = 0; lo < half; lo += Vec::size()) {
    const int64_t n = std::min<int64_t>(Vec::size(), half - lo), hi = lo + half;
    const Vec x_lo = Vec::loadu(x + lo, n), x_hi = Vec::loadu(x + hi, n);
    const Vec r_lo = rounded<T>(x_lo * Vec::loadu(c + lo, n)) + rounded<T>(x_hi * Vec::loadu(s + lo, n));
    const Vec r_hi = rounded<T>(x_hi * Vec::loadu(c + hi, n)) + rounded<T>(x_lo * Vec::loadu(s + hi, n));
    r_lo.store(out + lo, n);
    r_hi.store(out + hi, n);
  }
}

template <typename T>
at::Tensor rope_store_kv_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                              at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, int64_t h,
                              int64_t hk) {
  const int64_t tokens = qkv.size(0), d = cos.size(1), width = qkv.size(1);
  const int64_t rotated = (h + hk) * d;  // q and k heads, rotated alike
  at::Tensor q = at::empty({tokens, h, d}, qkv.options());
  const T* xp = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* qp = q.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  at::parallel_for(0, tokens, grain(width), [&](int64_t t0, int64_t t1) {
    std::vector<float> xf(rotated), cf(d), sf(d), rf(d);
    for (int64_t t = t0; t < t1; ++t) {
      const T* row = xp + t * width;
      to_float(row, xf.data(), rotated);
      to_float(cp + t * d, cf.data(), d);
      to_float(sp + t * d, sf.data(), d);
      const int64_t s = slot[t];
      for (int64_t j = 0; j < h + hk; ++j) {
        rotate<T>(xf.data() + j * d, cf.data(), sf.data(), rf.data(), d);
        T* dst = j < h ? qp + (t * h + j) * d : (s >= 0 ? kc + (s * hk + j - h) * d : nullptr);
        if (dst != nullptr) at::vec::convert(rf.data(), dst, d);
      }
      if (s >= 0) std::memcpy(vc + s * hk * d, row + rotated, hk * d * sizeof(T));
    }
  });
  return q;
}

}  // namespace

// The op, one instance per ISA variant, registered by bindings.cpp (declared in ops.h).
// q [T, H, D] of the fused projection `qkv` [T, (H + 2 H_kv) D], rotated; k (rotated) and v written
// into `k_cache` / `v_cache` [num_blocks, block_size, H_kv, D] at `slots` [T] (-1: not stored).
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads) {
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rope_store_kv: fp32 or bf16");
  for (const at::Tensor& t : {qkv, cos, sin, k_cache, v_cache}) {  // handles: no copies of the data
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype,
                "rope_store_kv: contiguous CPU tensors of one dtype");
  }
  TORCH_CHECK(qkv.dim() == 2 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0),
              "rope_store_kv: qkv [T, W], cos and sin [T, D]");
  const int64_t d = cos.size(1);
  TORCH_CHECK(d % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * d, "rope_store_kv: qkv width");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == num_kv_heads &&
                  k_cache.size(3) == d,
              "rope_store_kv: caches [num_blocks, block_size, H_kv, D]");
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.numel() == qkv.size(0),
              "rope_store_kv: slots [T] int64");
  const at::Tensor s = slots.contiguous();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = s.data_ptr<int64_t>();
  for (int64_t t = 0; t < s.numel(); ++t) TORCH_CHECK(sp[t] < num_slots, "rope_store_kv: slot out of range");
  const int64_t h = num_heads, hk = num_kv_heads;
  if (dtype == at::kFloat) return rope_store_kv_impl<float>(qkv, cos, sin, k_cache, v_cache, s, h, hk);
  return rope_store_kv_impl<at::BFloat16>(qkv, cos, sin, k_cache, v_cache, s, h, hk);
}

}  // namespace orcaserve::ORCA_ISA

