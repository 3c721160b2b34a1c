// Ternary weights (BitNet b1.58, {-1, 0, +1}) against int8 activations, int32 sums
// (docs/bitnet.md, "The kernel"). Integer sums are exact in any order, so the result is bit for
// bit kernels/ternary.py's twin (torch._int_mm over the same int8 values).
//
// dot(w, a) = dot(w + 1, a) - sum(a): the codes w + 1 in {0, 1, 2} are the unsigned operand of
// vpdpbusd (VNNI) or vpmaddubsw (|2 * 128 + 2 * 128| fits int16: never saturates). Without VNNI the
// int16 pairs are summed in int16 over kFlush groups (64 pairs, each in [-512, 508]: within
// [-32768, 32512]) and widened by one vpmaddwd, not one per vpmaddubsw (docs/bitnet.md, "The kernel").
//
// Packed layout, two bits a weight (a quarter of the int8 copy's bytes): panels of kCols = 2 kL output
// columns, each a run of 16-k groups of two vectors (kL * 4 bytes each, the panel's two column halves
// side by side: one stream). Byte j * 4 + r of half h holds, in bits 2s..2s+1, the code of column
// h kL + j at k = 16 g + 4 s + r: a 16-bit shift right by 2s and a mask of 0x03 per byte turn a
// vector into the 4 vectors vpdpbusd takes, column j's lane holding its 4 consecutive k. K is padded
// to 16 (code 1: weight 0), N to kCols (dropped from the output).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gemm/int8_vec.h"
#include "gemm/panels.h"
#include "gemm/ternary_act.h"
#include "gemm/ternary_norm.h"
#include "ops.h"
#include "rows.h"

namespace orcaserve::ORCA_ISA {
namespace {

constexpr int64_t kGroupK = 16;
constexpr int kHalves = 2;                       // column vectors per panel (docs/bitnet.md, "The kernel")
constexpr int64_t kCols = kHalves * kL;          // output columns per panel: 32 (AVX-512), 16 (AVX2)
constexpr int64_t kGroupBytes = kHalves * kL * 4;  // one 16-k group of a panel
// How far ahead in its panels a thread prefetches: one or a few rows read the codes as fast as
// DRAM gives them (docs/bitnet.md, "The kernel").
constexpr int64_t kAhead = 8192;
// Rows of x per pass over a panel's codes: each unpacked code vector serves kRows rows. On AVX-512
// (32 registers) 8 rows: 16 vpdpbusd chains (8 rows x 2 halves), or 16 int16 sums; AVX2's 16
// registers hold 4 rows' 8 int16 sums.
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
inline vi widen16(vi v) { return _mm512_madd_epi16(v, _mm512_set1_epi16(1)); }
#else
template <int S>
inline vi codes(vi packed) {
  return _mm256_and_si256(_mm256_srli_epi16(packed, 2 * S), _mm256_set1_epi8(0x03));
}
inline void istore(int32_t* p, vi v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline vi pairs16(vi u, vi s) { return _mm256_maddubs_epi16(u, s); }
inline vi add16(vi a, vi b) { return _mm256_add_epi16(a, b); }
inline vi widen16(vi v) { return _mm256_madd_epi16(v, _mm256_set1_epi16(1)); }
#endif
constexpr int64_t kFlush = 16;  // groups summed in int16 before widening (without VNNI)

inline int64_t groups_of(int64_t k) { return (k + kGroupK - 1) / kGroupK; }

// Chains per row and half with VNNI: vpdpbusd's latency is 4 cycles and two issue a cycle, so 8
// chains keep it busy; 1 row alone had one chain and read its codes at under half DRAM's rate.
template <int R>
constexpr int kChains = R == 1 ? 4 : R <= 3 ? 2 : 1;

// Step S (k = 16 g + 4 S .. + 3) of one group for rows [0, R): the halves' codes, each broadcast
// activation word against both.
template <int R, int S>
inline void vnni_step(const vi (&p)[kHalves], const int8_t* x, int64_t ldx, vi (&part)[R][kHalves][kChains<R>]) {
  vi c[kHalves];
#pragma GCC unroll 2
  for (int h = 0; h < kHalves; ++h) c[h] = codes<S>(p[h]);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const vi b = ibcast(x + r * ldx + 4 * S);
#pragma GCC unroll 2
    for (int h = 0; h < kHalves; ++h) part[r][h][S % kChains<R>] = dot(part[r][h][S % kChains<R>], c[h], b);
  }
}

// acc[r][h] = dot(codes, x row r) for rows [0, R) of one panel: x rows padded to groups * 16 bytes.
// The GCC unroll pragmas keep the sums in registers (without them GCC 12 copies each accumulator
// twice a step).
template <int R>
inline void panel_rows(const uint8_t* panel, int64_t groups, const int8_t* x, int64_t ldx, vi (&acc)[R][kHalves]) {
  auto prefetch = [](const uint8_t* group) {
#pragma GCC unroll 2
    for (int64_t line = 0; line < kGroupBytes; line += 64)  // a hint: no fault past the tensor's end
      _mm_prefetch(reinterpret_cast<const char*>(group + kAhead + line), _MM_HINT_T0);
  };
  if constexpr (kVnni) {
    constexpr int C = kChains<R>;
    vi part[R][kHalves][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int h = 0; h < kHalves; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) part[r][h][c] = izero();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* at = panel + g * kGroupBytes;
      prefetch(at);
      vi p[kHalves];
#pragma GCC unroll 2
      for (int h = 0; h < kHalves; ++h) p[h] = iload(at + h * kL * 4);
      const int8_t* xg = x + g * kGroupK;
      vnni_step<R, 0>(p, xg, ldx, part);
      vnni_step<R, 1>(p, xg, ldx, part);
      vnni_step<R, 2>(p, xg, ldx, part);
      vnni_step<R, 3>(p, xg, ldx, part);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int h = 0; h < kHalves; ++h) {
        acc[r][h] = part[r][h][0];
#pragma GCC unroll 4
        for (int c = 1; c < C; ++c) acc[r][h] = iadd(acc[r][h], part[r][h][c]);
      }
    return;
  }
  // Without VNNI: one half at a time, each group's 4 steps paired in int16 before they are summed
  // over kFlush groups (both halves at once, or the steps one by one, spilled a third of a step's
  // instructions: GCC hoists the pairs of the 4 steps).
#pragma GCC unroll 2
  for (int h = 0; h < kHalves; ++h) {
    vi wide[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wide[r] = izero();
    for (int64_t g0 = 0; g0 < groups; g0 += kFlush) {
      vi sums[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) sums[r] = izero();
      for (int64_t g = g0; g < std::min(groups, g0 + kFlush); ++g) {
        const uint8_t* at = panel + g * kGroupBytes;
        if (h == 0) prefetch(at);
        const vi p = iload(at + h * kL * 4);
        const vi c0 = codes<0>(p), c1 = codes<1>(p), c2 = codes<2>(p), c3 = codes<3>(p);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* a = x + r * ldx + g * kGroupK;
          const vi lo = add16(pairs16(c0, ibcast(a)), pairs16(c1, ibcast(a + 4)));
          const vi hi = add16(pairs16(c2, ibcast(a + 8)), pairs16(c3, ibcast(a + 12)));
          sums[r] = add16(sums[r], add16(lo, hi));
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) wide[r] = iadd(wide[r], widen16(sums[r]));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][h] = wide[r];
  }
}

}  // namespace

at::Tensor pack_ternary_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "pack_ternary_weight: [N, K] int8");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), groups = groups_of(k), panels = (n + kCols - 1) / kCols;
  at::Tensor out = at::zeros({panels * groups * kGroupBytes}, w.options().dtype(at::kByte));
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t col = 0; col < panels * kCols; ++col) {
    const int64_t p = col / kCols, j = col % kCols;  // half j / kL, lane j % kL
    for (int64_t kk = 0; kk < groups * kGroupK; ++kk) {
      int code = 1;  // pad: weight 0
      if (col < n && kk < k) {
        const int v = src[col * k + kk];
        TORCH_CHECK(v >= -1 && v <= 1, "pack_ternary_weight: a weight outside {-1, 0, 1}");
        code = v + 1;
      }
      const int64_t g = kk / kGroupK, s = (kk % kGroupK) / 4, r = kk % 4;
      dst[(p * groups + g) * kGroupBytes + j * 4 + r] |= static_cast<uint8_t>(code << (2 * s));
    }
  }
  return out;
}

namespace {

// x's rows as int8 codes padded to whole groups (zeros add nothing to a dot product or to sum(a)),
// their sums, and the rows' scales where the caller quantizes (bitlinear_ternary).
struct Rows {
  std::vector<int8_t> codes;
  std::vector<int32_t> sums;
  std::vector<float> scales;
  int64_t kp;
};

// dot(w, a) for every row of x and column of the weight: store(row, column, width, sums) for each
// tile's kL columns (width of them real).
template <typename Store>
void ternary_gemm(const Rows& x, int64_t t, const at::Tensor& packed, int64_t out_features, Store&& store) {
  const int64_t groups = x.kp / kGroupK, panels = (out_features + kCols - 1) / kCols;
  TORCH_CHECK(packed.numel() == panels * groups * kGroupBytes, "linear_ternary: packed weight of another shape");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const RowTiles<kRows> tiles(t);  // even tiles: 33 rows as 7, 7, 7, 6, 6, not 8, 8, 8, 8, 1
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = w + p * groups * kGroupBytes;
      tiles.each([&](int64_t, int64_t r0, auto tile) {
        constexpr int R = decltype(tile)::value;
        vi acc[R][kHalves];
        panel_rows<R>(panel, groups, x.codes.data() + r0 * x.kp, x.kp, acc);
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < kHalves; ++h) {
            const int64_t c = p * kCols + h * kL, width = std::min<int64_t>(kL, out_features - c);
            if (width > 0) store(r0 + r, c, width, isub(acc[r][h], ibcast32(x.sums[r0 + r])));
          }
      });
    }
  });
}

template <typename T>
at::Tensor bitlinear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, const at::Tensor& col_scale,
                     const SubNorm& sub) {
  const int64_t t = x.size(0), in = x.size(1), k = sub.relu2 ? in / 2 : in, kp = groups_of(k) * kGroupK;
  const int64_t cols = (out_features + kCols - 1) / kCols * kCols;
  Rows rows{std::vector<int8_t>(t * kp), std::vector<int32_t>(t), std::vector<float>(t), kp};
  std::vector<float> cs(cols, 1.0f), norm(sub.weight != nullptr ? k : 0);  // cs: padded to whole panels
  if (!norm.empty()) to_float(sub.weight->data_ptr<T>(), norm.data(), k);
  const T* xs = x.data_ptr<T>();
  at::parallel_for(0, t, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> row(2 * k);  // the row, then up's scratch where relu2
    for (int64_t i = begin; i < end; ++i) {
      sub_norm_row<T>(xs + i * in, k, sub.relu2, norm.empty() ? nullptr : norm.data(), sub.eps, row.data(),
                      row.data() + k);
      rows.scales[i] = quantize_row<T>(row.data(), k, rows.codes.data() + i * kp, kp, &rows.sums[i]);
    }
  });
  to_float(col_scale.data_ptr<T>(), cs.data(), out_features);
  at::Tensor out = at::empty({t, out_features}, x.options());
  T* o = out.data_ptr<T>();
  ternary_gemm(rows, t, packed, out_features, [&](int64_t r, int64_t c, int64_t width, vi v) {
    scale_store<T>(v, cs.data() + c, rows.scales[r], o + r * out_features + c, width);
  });
  return out;
}

}  // namespace

at::Tensor linear_ternary(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kChar, "linear_ternary: x is [T, K] int8");
  const int64_t t = x.size(0), k = x.size(1), kp = groups_of(k) * kGroupK;
  Rows rows{std::vector<int8_t>(t * kp, 0), std::vector<int32_t>(t), {}, kp};
  const at::Tensor xc = x.contiguous();
  for (int64_t i = 0; i < t; ++i) {
    const int8_t* src = xc.data_ptr<int8_t>() + i * k;
    std::copy(src, src + k, rows.codes.data() + i * kp);
    int32_t s = 0;
    for (int64_t kk = 0; kk < k; ++kk) s += src[kk];
    rows.sums[i] = s;
  }
  at::Tensor out = at::empty({t, out_features}, x.options().dtype(at::kInt));
  int32_t* o = out.data_ptr<int32_t>();
  ternary_gemm(rows, t, packed, out_features, [&](int64_t r, int64_t c, int64_t width, vi v) {
    int32_t* dst = o + r * out_features + c;
    if (width == kL) {
      istore(dst, v);
    } else {
      alignas(64) int32_t lanes[kL];
      istore(lanes, v);
      std::memcpy(dst, lanes, width * sizeof(int32_t));
    }
  });
  return out;
}

at::Tensor bitlinear_ternary(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const at::Tensor& col_scale, const std::optional<at::Tensor>& norm, double eps,
                             bool relu2) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "bitlinear_ternary: x is [T, K] float or bfloat16");
  TORCH_CHECK(col_scale.scalar_type() == x.scalar_type() && col_scale.numel() == out_features,
              "bitlinear_ternary: col_scale is [N] in x's dtype");
  TORCH_CHECK(!relu2 || x.size(1) % 2 == 0, "bitlinear_ternary: relu2 takes x as [T, 2 K], gate then up");
  const int64_t k = relu2 ? x.size(1) / 2 : x.size(1);
  const at::Tensor xc = x.contiguous(), cs = col_scale.contiguous();
  const at::Tensor w = norm.has_value() ? norm->contiguous() : at::Tensor();
  TORCH_CHECK(!w.defined() || (w.scalar_type() == x.scalar_type() && w.numel() == k),
              "bitlinear_ternary: norm is [K] in x's dtype");
  const SubNorm sub{w.defined() ? &w : nullptr, static_cast<float>(eps), relu2};
  if (x.scalar_type() == at::kFloat) return bitlinear<float>(xc, packed, out_features, cs, sub);
  return bitlinear<at::BFloat16>(xc, packed, out_features, cs, sub);
}

}  // namespace orcaserve::ORCA_ISA
