// The lean decoder's element-wise steps fused for the CPU: residual add + RMSNorm, and SiLU(gate) *
// up. Unfused, each is 3-8 ATen ops per layer; on a decode step's [32, 576] tensors every op costs
// its dispatch and OpenMP fork more than its arithmetic (about a fifth of a bf16 step).
//
// Same arithmetic as the unfused PyTorch (transformers' RMSNorm and SiLU MLP), including where it
// rounds to the tensor dtype between ops; only the order of the mean's sum differs, so results may
// differ in the last bit. bf16's SiLU takes ATen's fast exp (20 fp32 ulp, as the attention softmax
// does) and a reciprocal estimate refined to about 1 ulp instead of a division, which the rounding
// to bf16 that follows almost always hides. The decoder uses them for bf16 (and the fp32 SiLU,
// bit for bit F.silu's); fp32 keeps the op-for-op norm that the token-exact tests compare with
// transformers.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <tuple>
#include <type_traits>
#include <vector>

#include "rows.h"
#include "ops.h"

namespace orcaserve::ORCA_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kV = Vec::size();

// 2 kV elements of T as two fp32 vectors and back: one bf16 vector holds twice a float one's lanes.
// Where the building CPU has AVX-512 BF16 (ORCA_DPBF16), bf16 is rounded by `to_bf16`
// (vcvtneps2bf16): ATen's conversion takes about eight integer ops per vector, a third of a bf16
// SiLU's work. Same round-to-nearest-even, except that it reads fp32 denormals (below 1.2e-38) as
// zero.
template <typename T>
struct Chunk {
  static constexpr int N = 2 * kV;
  static_assert(std::is_same_v<T, float> || at::vec::Vectorized<T>::size() == N, "bf16 vector != 2 float ones");
  static void load(const T* p, Vec& a, Vec& b) {
    if constexpr (std::is_same_v<T, float>) {
      a = Vec::loadu(p);
      b = Vec::loadu(p + kV);
    } else {
      std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
    }
  }
  static void store(T* p, const Vec& a, const Vec& b) {
    if constexpr (std::is_same_v<T, float>) {
      a.store(p);
      b.store(p + kV);
    } else if constexpr (kHaveDpBf16 && std::is_same_v<T, at::BFloat16>) {
#ifdef ORCA_DPBF16
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(a));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + kV), to_bf16(b));
#endif
    } else {
      at::vec::convert_from_float<T>(a, b).store(p);
    }
  }
  // (a, b) rounded to T and back: where the unfused ops store an intermediate tensor.
  static void round(Vec& a, Vec& b) {
    if constexpr (kHaveDpBf16 && std::is_same_v<T, at::BFloat16>) {
#ifdef ORCA_DPBF16
      auto rt = [](__m512 v) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
      };
      a = rt(a);
      b = rt(b);
#endif
    } else if constexpr (!std::is_same_v<T, float>) {
      std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
    }
  }
};

// Calls f(inputs, outputs) with the pointers advanced to every whole chunk of a row of n, then
// once more for the tail through zero-padded copies (written back to the outputs), so f sees only
// whole chunks.
template <typename T, int NIn, int NOut, typename F>
void chunked(int64_t n, const T* const (&in)[NIn], T* const (&out)[NOut], F f) {
  constexpr int N = Chunk<T>::N;
  const int64_t whole = n / N * N;
  for (int64_t c = 0; c < whole; c += N) {
    const T* i[NIn];
    T* o[NOut];
    for (int k = 0; k < NIn; ++k) i[k] = in[k] + c;
    for (int k = 0; k < NOut; ++k) o[k] = out[k] + c;
    f(i, o);
  }
  if (whole == n) return;
  alignas(64) T ib[NIn][N] = {}, ob[NOut][N] = {};
  const T* i[NIn];
  T* o[NOut];
  for (int k = 0; k < NIn; ++k) {
    std::copy(in[k] + whole, in[k] + n, ib[k]);
    i[k] = ib[k];
  }
  for (int k = 0; k < NOut; ++k) o[k] = ob[k];
  f(i, o);
  for (int k = 0; k < NOut; ++k) std::copy(ob[k], ob[k] + (n - whole), out[k] + whole);
}

// 1 / x for x >= 1 (or inf, NaN) to about 1 fp32 ulp: the hardware estimate and one Newton step,
// a few cycles against a division's 10-16 per 512-bit vector, which made SiLU's division the
// bottleneck of a prefill step's element-wise work. bf16 only: fp32 keeps F.silu's division.
inline Vec recip(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 xv = x;
  __m512 r = _mm512_rcp14_ps(xv);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(xv, r, _mm512_set1_ps(2.f)));
  // 1 / inf: the estimate is 0 and the Newton step inf * 0 = NaN.
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(xv, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ), _mm512_setzero_ps());
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 xv = x;
  __m256 r = _mm256_rcp_ps(xv);
  r = _mm256_mul_ps(r, _mm256_fnmadd_ps(xv, r, _mm256_set1_ps(2.f)));
  return _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(xv, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ));
#else
  return Vec(1.f) / x;
#endif
}

template <typename T>
inline Vec silu(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {  // ATen's exp and division: fp32 stays bit for bit F.silu
    return v / (Vec(1.f) + v.neg().exp());
  } else {  // bf16 rounds to 8 bits below: ATen's fast exp (20 fp32 ulp) and recip change almost nothing
    return v * recip(Vec(1.f) + v.neg().exp_u20());
  }
}

// One pass over each row: every element is loaded, computed and stored once, in registers (the
// earlier whole-row passes through scratch buffers cost 3x the time at a prefill step's 512 rows).
template <typename T>
std::tuple<at::Tensor, at::Tensor> add_rms_norm_impl(const at::Tensor& x, const at::Tensor& delta,
                                                     const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor sum = at::empty_like(x);
  at::Tensor y = at::empty_like(x);
  const T* xp = x.data_ptr<T>();
  const T* dp = delta.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* sp = sum.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      Vec ss0(0.f), ss1(0.f);
      // x + delta, rounded as the unfused add stores it, and the sum of its squares.
      chunked<T, 2, 1>(n, {xp + r * n, dp + r * n}, {sp + r * n}, [&](const T* const* i, T* const* o) {
        Vec a0, a1, b0, b1;
        Chunk<T>::load(i[0], a0, a1);
        Chunk<T>::load(i[1], b0, b1);
        a0 = a0 + b0;
        a1 = a1 + b1;
        Chunk<T>::round(a0, a1);
        Chunk<T>::store(o[0], a0, a1);
        ss0 = ss0 + a0 * a0;
        ss1 = ss1 + a1 * a1;
      });
      const float ss = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, ss0 + ss1);
      const Vec rv(1.f / std::sqrt(ss / static_cast<float>(n) + feps));
      // y = w * T(s * rsqrt(mean(s^2) + eps)), the normalised value rounded before the weight.
      chunked<T, 2, 1>(n, {sp + r * n, wp}, {yp + r * n}, [&](const T* const* i, T* const* o) {
        Vec s0, s1, w0, w1;
        Chunk<T>::load(i[0], s0, s1);
        Chunk<T>::load(i[1], w0, w1);
        s0 = s0 * rv;
        s1 = s1 * rv;
        Chunk<T>::round(s0, s1);
        Chunk<T>::store(o[0], s0 * w0, s1 * w1);
      });
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
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gp + r * 2 * n;
      chunked<T, 2, 1>(n, {g, g + n}, {op + r * n}, [](const T* const* i, T* const* o) {
        Vec g0, g1, u0, u1;
        Chunk<T>::load(i[0], g0, g1);
        Chunk<T>::load(i[1], u0, u1);
        g0 = silu<T>(g0);
        g1 = silu<T>(g1);
        Chunk<T>::round(g0, g1);  // silu's output tensor
        Chunk<T>::store(o[0], g0 * u0, g1 * u1);
      });
    }
  });
  return out;
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.is_contiguous(), what, ": a contiguous 2-D CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what, ": fp32 or bf16");
}

}  // namespace

// The op, one instance per ISA variant, registered by bindings.cpp (declared in ops.h).
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

}  // namespace orcaserve::ORCA_ISA

