// Ternary weights (BitNet b1.58, {-1, 0, +1}) against int8 activations, int32 sums
// (docs/bitnet.md, "The kernel"). Integer sums are exact in any order, so the result is bit for
// bit kernels/ternary.py's twin (torch._int_mm over the same int8 values).
//
// dot(w, a) = dot(w + 1, a) - sum(a): the codes w + 1 in {0, 1, 2} are the unsigned operand of
// vpdpbusd (VNNI) or vpmaddubsw (|2 * 128 + 2 * 128| fits int16: never saturates). Without VNNI the
// int16 pairs are summed in int16 over kFlush groups (64 pairs, each in [-512, 508]: within
// [-32768, 32512]) and widened by one vpmaddwd, not one per vpmaddubsw (docs/bitnet.md, "The kernel").
//
// Packed layout, two bits a weight (a quarter of the int8 copy's bytes): panels of kL output
// columns, each a run of 16-k groups of kL * 4 bytes. Byte j * 4 + r of a group holds, in bits
// 2s..2s+1, the code of column j at k = 16 g + 4 s + r: a 16-bit shift right by 2s and a mask of
// 0x03 per byte turn a group into the 4 vectors vpdpbusd takes, column j's lane holding its 4
// consecutive k. K is padded to 16 (code 1: weight 0), N to kL (dropped from the output).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm/int8_vec.h"
#include "gemm/panels.h"
#include "ops.h"

namespace orcaserve::ORCA_ISA {
namespace {

constexpr int64_t kGroupK = 16;
// Rows of x per pass over a panel's codes: each unpacked code vector serves kRows rows. On AVX-512
// (32 registers) 8 rows: 8 independent vpdpbusd chains, or 8 int16 sums and their int32 widenings;
// AVX2's 16 registers hold 4 (docs/bitnet.md, "The kernel").
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kRows = 8;
#else
constexpr int kRows = 4;
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int S>
inline vi codes(vi packed) {
  return _mm512_and_si512(_mm512_srli_epi16(packed, 2 * S), _mm512_set1_epi8(0x03));
}
inline void istore(int32_t* p, vi v) { _mm512_storeu_si512(p, v); }
inline vi pairs16(vi u, vi s) { return _mm512_maddubs_epi16(u, s); }
inline vi add16(vi a, vi b) { return _mm512_add_epi16(a, b); }
inline vi widen16(vi acc, vi v) { return _mm512_add_epi32(acc, _mm512_madd_epi16(v, _mm512_set1_epi16(1))); }
#else
template <int S>
inline vi codes(vi packed) {
  return _mm256_and_si256(_mm256_srli_epi16(packed, 2 * S), _mm256_set1_epi8(0x03));
}
inline void istore(int32_t* p, vi v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline vi pairs16(vi u, vi s) { return _mm256_maddubs_epi16(u, s); }
inline vi add16(vi a, vi b) { return _mm256_add_epi16(a, b); }
inline vi widen16(vi acc, vi v) { return _mm256_add_epi32(acc, _mm256_madd_epi16(v, _mm256_set1_epi16(1))); }
#endif
constexpr int64_t kFlush = 16;  // groups summed in int16 before widening (without VNNI)

inline int64_t groups_of(int64_t k) { return (k + kGroupK - 1) / kGroupK; }

// acc[r] for rows [0, R) of one panel: x rows padded to groups * 16 bytes.
template <int R>
inline void panel_rows(const uint8_t* panel, int64_t groups, const int8_t* x, int64_t ldx, vi* acc) {
  for (int r = 0; r < R; ++r) acc[r] = izero();
  if constexpr (kVnni) {
    for (int64_t g = 0; g < groups; ++g) {
      const vi p = iload(panel + g * kL * 4);
      const vi c0 = codes<0>(p), c1 = codes<1>(p), c2 = codes<2>(p), c3 = codes<3>(p);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = x + r * ldx + g * kGroupK;
        acc[r] = dot(acc[r], c0, ibcast(a));
        acc[r] = dot(acc[r], c1, ibcast(a + 4));
        acc[r] = dot(acc[r], c2, ibcast(a + 8));
        acc[r] = dot(acc[r], c3, ibcast(a + 12));
      }
    }
    return;
  }
  for (int64_t g0 = 0; g0 < groups; g0 += kFlush) {
    vi sums[R];
    for (int r = 0; r < R; ++r) sums[r] = izero();
    for (int64_t g = g0; g < std::min(groups, g0 + kFlush); ++g) {
      const vi p = iload(panel + g * kL * 4);
      const vi c0 = codes<0>(p), c1 = codes<1>(p), c2 = codes<2>(p), c3 = codes<3>(p);
      for (int r = 0; r < R; ++r) {
        const int8_t* a = x + r * ldx + g * kGroupK;
        const vi lo = add16(pairs16(c0, ibcast(a)), pairs16(c1, ibcast(a + 4)));
        const vi hi = add16(pairs16(c2, ibcast(a + 8)), pairs16(c3, ibcast(a + 12)));
        sums[r] = add16(sums[r], add16(lo, hi));
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = widen16(acc[r], sums[r]);
  }
}

}  // namespace

at::Tensor pack_ternary_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "pack_ternary_weight: [N, K] int8");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), groups = groups_of(k), panels = (n + kL - 1) / kL;
  at::Tensor out = at::zeros({panels * groups * kL * 4}, w.options().dtype(at::kByte));
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t col = 0; col < panels * kL; ++col) {
    const int64_t p = col / kL, j = col % kL;
    for (int64_t kk = 0; kk < groups * kGroupK; ++kk) {
      int code = 1;  // pad: weight 0
      if (col < n && kk < k) {
        const int v = src[col * k + kk];
        TORCH_CHECK(v >= -1 && v <= 1, "pack_ternary_weight: a weight outside {-1, 0, 1}");
        code = v + 1;
      }
      const int64_t g = kk / kGroupK, s = (kk % kGroupK) / 4, r = kk % 4;
      dst[(p * groups + g) * kL * 4 + j * 4 + r] |= static_cast<uint8_t>(code << (2 * s));
    }
  }
  return out;
}

at::Tensor linear_ternary(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar, "linear_ternary: x is [T, K] int8");
  const int64_t t = x.size(0), k = x.size(1), groups = groups_of(k), kp = groups * kGroupK;
  const int64_t panels = (out_features + kL - 1) / kL;
  TORCH_CHECK(packed.numel() == panels * groups * kL * 4, "linear_ternary: packed weight of another shape");
  // x padded to whole groups (zeros add nothing to a dot product or to sum(a)), and sum(a) per row.
  at::Tensor xp = x.contiguous();
  if (kp != k) {
    xp = at::zeros({t, kp}, x.options());
    xp.narrow(1, 0, k).copy_(x);
  }
  const int8_t* xs = xp.data_ptr<int8_t>();
  std::vector<int32_t> sums(t);
  for (int64_t i = 0; i < t; ++i) {
    int32_t s = 0;
    for (int64_t kk = 0; kk < kp; ++kk) s += xs[i * kp + kk];
    sums[i] = s;
  }
  at::Tensor out = at::empty({t, out_features}, x.options().dtype(at::kInt));
  int32_t* o = out.data_ptr<int32_t>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const RowTiles<kRows> tiles(t);  // even tiles: 33 rows as 7, 7, 7, 6, 6, not 8, 8, 8, 8, 1
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t lanes[kRows][kL];
    vi acc[kRows];
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = w + p * groups * kL * 4;
      const int64_t col = p * kL, width = std::min<int64_t>(kL, out_features - col);
      tiles.each([&](int64_t, int64_t r0, auto tile) {
        constexpr int R = decltype(tile)::value;
        panel_rows<R>(panel, groups, xs + r0 * kp, kp, acc);
        for (int r = 0; r < R; ++r) {
          const vi v = isub(acc[r], ibcast32(sums[r0 + r]));
          if (width == kL) {
            istore(o + (r0 + r) * out_features + col, v);
          } else {
            istore(lanes[r], v);
            std::memcpy(o + (r0 + r) * out_features + col, lanes[r], width * sizeof(int32_t));
          }
        }
      });
    }
  });
  return out;
}

}  // namespace orcaserve::ORCA_ISA
