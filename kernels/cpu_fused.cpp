// The lean decoder's element-wise steps fused for the CPU: residual add + RMSNorm, and SiLU(gate) *
// up. Unfused, each is 3-8 ATen ops per layer; on a decode step's [32, 576] tensors every op costs
// its dispatch and OpenMP fork more than its arithmetic (about a fifth of a bf16 step).
//
// Same arithmetic as the unfused PyTorch (transformers' RMSNorm and SiLU MLP), including where it
// rounds to the tensor dtype between ops; only the order of the mean's sum differs, so results may
// differ in the last bit. bf16's SiLU takes ATen's fast exp (20 fp32 ulp, as the attention softmax
// does), which the rounding to bf16 that follows almost always hides. The decoder uses them for
// bf16 only: fp32 keeps the op-for-op path that the token-exact tests compare with transformers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_rows.h"

namespace orcaserve {
namespace {

using Vec = at::vec::Vectorized<float>;

// dst = src rounded to T and back: where the unfused ops store an intermediate tensor.
template <typename T>
void round_through(float* buf, T* tmp, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    at::vec::convert(buf, tmp, n);
    at::vec::convert(tmp, buf, n);
  }
}

// y = w * T(x * rsqrt(mean(x^2) + eps)) for one row already in fp32 (`xf`), written to `y`.
template <typename T>
void norm_row(float* xf, T* tmp, const float* wf, float eps, T* y, int64_t n) {
  const float ss = at::vec::map_reduce_all<float>([](Vec v) { return v * v; },
                                                  [](Vec a, Vec b) { return a + b; }, xf, n);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  at::vec::map([r](Vec v) { return v * Vec(r); }, xf, xf, n);
  round_through<T>(xf, tmp, n);
  at::vec::map2([](Vec a, Vec b) { return a * b; }, xf, xf, wf, n);
  at::vec::convert(xf, y, n);
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> add_rms_norm_impl(const at::Tensor& x, const at::Tensor& delta,
                                                     const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor sum = at::empty_like(x);
  at::Tensor y = at::empty_like(x);
  std::vector<float> wf(n);
  to_float(weight.data_ptr<T>(), wf.data(), n);
  const T* xp = x.data_ptr<T>();
  const T* dp = delta.data_ptr<T>();
  T* sp = sum.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    std::vector<float> xf(n), df(n);
    std::vector<T> tmp(n);
    for (int64_t r = r0; r < r1; ++r) {
      to_float(xp + r * n, xf.data(), n);
      to_float(dp + r * n, df.data(), n);
      at::vec::map2([](Vec a, Vec b) { return a + b; }, xf.data(), xf.data(), df.data(), n);
      at::vec::convert(xf.data(), sp + r * n, n);  // x + delta, rounded as the unfused add stores it
      if constexpr (!std::is_same_v<T, float>) to_float(sp + r * n, xf.data(), n);
      norm_row<T>(xf.data(), tmp.data(), wf.data(), static_cast<float>(eps), yp + r * n, n);
    }
  });
  return {sum, y};
}

template <typename T>
at::Tensor silu_mul_impl(const at::Tensor& gate_up) {
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t r0, int64_t r1) {
    std::vector<float> g(n), u(n);
    std::vector<T> tmp(n);
    for (int64_t r = r0; r < r1; ++r) {
      to_float(gp + r * 2 * n, g.data(), n);
      to_float(gp + r * 2 * n + n, u.data(), n);
      if constexpr (std::is_same_v<T, float>) {  // ATen's exp: fp32 stays bit for bit F.silu
        at::vec::map([](Vec v) { return v / (Vec(1.f) + v.neg().exp()); }, g.data(), g.data(), n);
      } else {  // bf16 rounds to 8 bits below: ATen's fast exp (20 fp32 ulp) changes almost nothing
        at::vec::map([](Vec v) { return v / (Vec(1.f) + v.neg().exp_u20()); }, g.data(), g.data(), n);
      }
      round_through<T>(g.data(), tmp.data(), n);  // silu's output tensor
      at::vec::map2([](Vec a, Vec b) { return a * b; }, g.data(), g.data(), u.data(), n);
      at::vec::convert(g.data(), op + r * n, n);
    }
  });
  return out;
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous(), what, ": a contiguous 2-D CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what, ": fp32 or bf16");
}

// (x + delta, rms_norm(x + delta)): the residual add and the next norm.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  check_rows(x, "add_rms_norm x");
  check_rows(delta, "add_rms_norm delta");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type(), "add_rms_norm: delta != x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be [hidden] in x's dtype");
  if (x.scalar_type() == at::kFloat) return add_rms_norm_impl<float>(x, delta, weight, eps);
  return add_rms_norm_impl<at::BFloat16>(x, delta, weight, eps);
}

// silu(gate_up[:, :I]) * gate_up[:, I:], as the fused gate/up GEMM leaves them.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: odd width");
  if (gate_up.scalar_type() == at::kFloat) return silu_mul_impl<float>(gate_up);
  return silu_mul_impl<at::BFloat16>(gate_up);
}

}  // namespace
}  // namespace orcaserve

TORCH_LIBRARY_FRAGMENT(orcaserve, m) {
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(orcaserve, CPU, m) {
  m.impl("add_rms_norm", &orcaserve::add_rms_norm);
  m.impl("silu_mul", &orcaserve::silu_mul);
}
