// GEMM over GGUF block codes with int8 activations (docs/int8-activations.md): each row of x is
// quantized per block of 32 to int8 with an fp32 scale, each block's integer dot product with the
// weight codes is exact in int32, and the scaled blocks are summed in fp32, in a fixed order:
//
//   acc = 0; for block b ascending, for span s ascending (q6_k: two spans of 16, else one of 32):
//     acc = acc + (sw[n, b, s] * sa[m, b]) * float(isum[m, n, b, s])      (three roundings)
//     (q4_1, q4_k, after the block's spans) acc = acc + mw[n, b] * msum[m, b]   (msum = sa * sum q)
//   y = acc (+ bias), rounded once to bf16 for bf16 x
//
// with sa, q the activations' scale and codes (quantize_rows_int8 below). That is the PyTorch twin's
// arithmetic op for op (kernels/pytorch/int8_activations.py), so results are bit for bit equal.
//
// Layout (pack_int8.cpp): panels of kPanel output columns (32 on AVX-512, 16 on AVX2), each a
// sequential stream of its K / 32 blocks; a block holds fp32 heads (scales per span, mins) and the
// codes as unsigned bytes u = q + shift in groups of 4 k per column, the shape vpdpbusd and
// vpmaddubsw consume. The shift is taken back exactly in int32: isum = dot(u, a) - shift * sum(a).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "gemm/panels.h"
#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "gemm/int8_vec.h"

namespace orcaserve::ORCA_ISA {
namespace {

// One row's activations: per block of 32, d = max|x| / 127 (IEEE division), q = x * (1 / d)
// rounded to nearest even and clamped to [-127, 127] (0 where d is 0); the codes' sums per 16.
// On AVX-512 each half block is one vector: the same operations lane by lane (max|x| is exact in any
// order; a NaN x is skipped by the max and clamped to -127, as std::max/std::min do), 5-10x faster
// than the scalar loop, which cost a sixth of a down projection at 32 rows.
void quantize_row(const float* x, int8_t* q, float* scale, int32_t* sums, int64_t K) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
#if defined(__AVX512F__)
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    // max(|x|, m): the second operand where the first is NaN, as std::max(m, |x|) keeps m.
    const __m512 m = _mm512_max_ps(_mm512_abs_ps(v1), _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps()));
    const float amax = _mm512_reduce_max_ps(m);
#else
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
#endif
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
#if defined(__AVX512F__)
    int32_t s[2];
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f), vid = _mm512_set1_ps(id);
    for (int h = 0; h < 2; ++h) {
      const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(h ? v1 : v0, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i c = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));  // NaN -> -127
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + 16 * h), _mm512_cvtepi32_epi8(c));
      s[h] = _mm512_reduce_add_epi32(c);
    }
#else
    int32_t s[2] = {0, 0};
    for (int i = 0; i < kBlock; ++i) {
      const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[i] * id)));
      q[b * kBlock + i] = static_cast<int8_t>(v);
      s[i / 16] += static_cast<int32_t>(v);
    }
#endif
    scale[b] = d;
    sums[2 * b] = s[0];
    sums[2 * b + 1] = s[1];
  }
}

// The quantized rows as the tiles read them: codes [M, K], scales [M, nb], the shift's correction
// shift * sum(q) per row, block and span [M, nb, spans], and msum = sa * sum(q) [M, nb] (mins).
struct Rows {
  const int8_t* q;
  const float* scale;
  const int32_t* corr;
  const float* msum;
  int64_t K, nb;
};

template <int Bits, bool Offset, bool Wide, int R>
__attribute__((noinline)) void tile(const Rows& a, int64_t m, const uint8_t* panel, float* out) {
  constexpr Int8Format fmt{Bits, Offset, Wide};
  constexpr int S = fmt.spans(), G = 8 / S;
  vf acc[R][kC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kC; ++c) acc[r][c] = fzero();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = panel + b * fmt.block_bytes();
    const float* heads = reinterpret_cast<const float*>(blk);
    const uint8_t* codes = blk + fmt.head_bytes();
    const int8_t* x = a.q + m * a.K + b * kBlock;
#pragma GCC unroll 2
    for (int s = 0; s < S; ++s) {
      // Up to 2 rows, odd groups (4-bit: the high nibbles) sum into a second accumulator: two
      // dependency chains instead of one per vector (integer sums: the order changes no bit).
      constexpr bool kSplit = R <= 2;
      vi sum[R][kC], sum2[R][kC];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kC; ++c) sum[r][c] = sum2[r][c] = izero();
      if constexpr (Bits == 8) {
        auto group = [&](int g, vi(&into)[R][kC]) {
          vi w[kC], aw[kC];
          for (int c = 0; c < kC; ++c) {
            w[c] = iload(codes + (g * kPanel + c * kL) * 4);
            if constexpr (fmt.signed_codes()) aw[c] = wabs(w[c]);
          }
          for (int r = 0; r < R; ++r) {
            const vi xr = ibcast(x + r * a.K + 4 * g);
            for (int c = 0; c < kC; ++c) {
              if constexpr (fmt.signed_codes())
                into[r][c] = dot_signed(into[r][c], w[c], aw[c], xr);
              else
                into[r][c] = dot(into[r][c], w[c], xr);
            }
          }
        };
#pragma GCC unroll 4
        for (int g = s * G; g < (s + 1) * G; g += 2) {
          group(g, sum);
          group(g + 1, kSplit ? sum2 : sum);
        }
      } else {
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          vi lo[kC], hi[kC];
          for (int c = 0; c < kC; ++c) {
            const vi v = iload(codes + (g * kPanel + c * kL) * 4);
            lo[c] = lo4(v);
            hi[c] = hi4(v);
          }
          for (int r = 0; r < R; ++r) {
            const vi x0 = ibcast(x + r * a.K + 4 * g), x1 = ibcast(x + r * a.K + 16 + 4 * g);
            for (int c = 0; c < kC; ++c) {
              sum[r][c] = dot(sum[r][c], lo[c], x0);
              if constexpr (kSplit)
                sum2[r][c] = dot(sum2[r][c], hi[c], x1);
              else
                sum[r][c] = dot(sum[r][c], hi[c], x1);
            }
          }
        }
      }
      if constexpr (kSplit)
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < kC; ++c) sum[r][c] = iadd(sum[r][c], sum2[r][c]);
      vf sw[kC];
      for (int c = 0; c < kC; ++c) sw[c] = fload(heads + s * kPanel + c * kL);
      for (int r = 0; r < R; ++r) {
        const vf sa = fbcast(a.scale[(m + r) * a.nb + b]);
        const vi corr = ibcast32(fmt.shift() ? a.corr[((m + r) * a.nb + b) * S + s] : 0);
        for (int c = 0; c < kC; ++c) {
          const vi isum = fmt.shift() ? isub(sum[r][c], corr) : sum[r][c];
          acc[r][c] = fadd(acc[r][c], fmul(fmul(sw[c], sa), fcvt(isum)));
        }
      }
    }
    if constexpr (Offset) {
      for (int c = 0; c < kC; ++c) {
        const vf mw = fload(heads + S * kPanel + c * kL);
        for (int r = 0; r < R; ++r) acc[r][c] = fadd(acc[r][c], fmul(mw, fbcast(a.msum[(m + r) * a.nb + b])));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kC; ++c) fstore(out + r * kPanel + c * kL, acc[r][c]);
}

inline void put(float v, float* dst) { *dst = v; }
inline void put(float v, at::BFloat16* dst) { *dst = static_cast<at::BFloat16>(v); }  // to nearest even

template <int Bits, bool Offset, bool Wide, typename Out>
void run(const Rows& a, const uint8_t* packed, const float* bias, Out* y, int64_t M, int64_t N, int64_t P) {
  constexpr Int8Format fmt{Bits, Offset, Wide};
  const RowTiles<kTileRows> tiles(M);
  for_each_panel(P, false, [&](int64_t p, int64_t) {
    alignas(64) float buf[kTileRows * kPanel];
    const uint8_t* panel = packed + p * a.nb * fmt.block_bytes();
    const int64_t ncols = std::min<int64_t>(kPanel, N - p * kPanel);
    tiles.each([&](int64_t, int64_t m, auto rows) {
      constexpr int R = decltype(rows)::value;
      tile<Bits, Offset, Wide, R>(a, m, panel, buf);
      for (int r = 0; r < R; ++r) {
        Out* dst = y + (m + r) * N + p * kPanel;
        for (int64_t j = 0; j < ncols; ++j) put(bias ? buf[r * kPanel + j] + bias[p * kPanel + j] : buf[r * kPanel + j], dst + j);
      }
    });
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) % kBlock == 0 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quantize_rows_int8: x must be an fp32 or bf16 [rows, K] CPU tensor, K a multiple of 32");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M, nb}, x.options().dtype(at::kFloat));
  at::Tensor sums = at::empty({M, 2 * nb}, x.options().dtype(at::kInt));
  const float* xp = xf.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  int32_t* up = sums.data_ptr<int32_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * K, qp + m * K, sp + m * nb, up + m * 2 * nb, K);
  });
  return {q, scale, sums};
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t out_features, int64_t bits, bool has_offset, bool wide) {
  TORCH_CHECK((bits == 8 && !has_offset) || (bits == 4 && !wide) || (bits == 4 && has_offset),
              "linear_int8: q8_0 or q6_k (8 bits), q4_0, q4_1 or q4_k (4 bits)");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, nb = K / kBlock;
  const Int8Format fmt{static_cast<int>(bits), has_offset, wide && bits == 8};
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(0) == (N + kPanel - 1) / kPanel && packed.size(1) == nb &&
                  packed.size(2) == fmt.block_bytes(),
              "linear_int8: packed must come from pack_int8_weight of an [out_features, in] weight in this format");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == N),
              "linear_int8: bias must be fp32 [out_features]");
  auto [q, scale, sums] = quantize_rows_int8(x);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int S = fmt.spans(), shift = fmt.shift();
  at::Tensor corr = at::empty({M, nb, S}, sums.options());
  at::Tensor msum = at::empty({M, nb}, scale.options());
  const int32_t* up = sums.data_ptr<int32_t>();
  const float* sp = scale.data_ptr<float>();
  int32_t* cp = corr.data_ptr<int32_t>();
  float* mp = msum.data_ptr<float>();
  for (int64_t i = 0; i < M * nb; ++i) {
    const int32_t total = up[2 * i] + up[2 * i + 1];
    if (S == 2) {
      cp[2 * i] = shift * up[2 * i];
      cp[2 * i + 1] = shift * up[2 * i + 1];
    } else {
      cp[i] = shift * total;
    }
    mp[i] = sp[i] * static_cast<float>(total);
  }
  const Rows a{q.data_ptr<int8_t>(), sp, cp, mp, K, nb};
  const at::Tensor bc = bias.has_value() ? bias->contiguous() : at::Tensor();
  const float* bp = bc.defined() ? bc.data_ptr<float>() : nullptr;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t P = packed.size(0);
  auto go = [&](auto* out) {
    if (bits == 8 && wide)
      run<8, false, true>(a, w, bp, out, M, N, P);
    else if (bits == 8)
      run<8, false, false>(a, w, bp, out, M, N, P);
    else if (has_offset)
      run<4, true, false>(a, w, bp, out, M, N, P);
    else
      run<4, false, false>(a, w, bp, out, M, N, P);
  };
  if (y.scalar_type() == at::kFloat)
    go(y.data_ptr<float>());
  else
    go(y.data_ptr<at::BFloat16>());
  return y;
}

}  // namespace orcaserve::ORCA_ISA

#else
#error "gemm_int8.cpp needs AVX2 and FMA: kernels/cpu/build.py builds it for the avx2 variants and up only"
#endif
