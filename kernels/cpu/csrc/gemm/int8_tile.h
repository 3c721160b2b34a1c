// The int8-activation GEMM's tiles and its walk over the panels (gemm/gemm_int8.cpp) for one ISA
// variant: a tile of up to kTileRows rows against one panel of codes, and `run`, which hands each
// tile row's fp32 sums to its caller's emit (docs/int8-activations.md, "Kernels per ISA").
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "gemm/int8_rows.h"
#include "gemm/int8_vec.h"
#include "gemm/panels.h"
#include "ops.h"

namespace orcaserve::ORCA_ISA {
namespace {

// Bytes [p, p + Bytes) requested a cache line at a time, into L1 where `l1`, else into L2.
template <int64_t Bytes>
inline void prefetch_block(const uint8_t* p, bool l1) {
  for (int64_t l = 0; l < Bytes; l += 64)
    l1 ? _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T0)
       : _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T1);
}

constexpr int64_t kAhead = 8192;  // bytes a GEMV-shaped call prefetches ahead in its thread's stream

template <int Bits, bool Offset, bool Wide, int R>
__attribute__((noinline)) void tile(const Rows& a, int64_t m, const uint8_t* panel, float* out, const uint8_t* pf,
                                     bool l1) {
  constexpr Int8Format fmt{Bits, Offset, Wide};
  constexpr int S = fmt.spans(), G = 8 / S;
  // Up to kAccRows rows the fp32 sums live in registers; above, in `out` (L1), so that 5-8 rows are
  // one pass over the panel with the integer sums in registers (docs/int8-activations.md,
  // "Kernels per ISA"). A memory round trip of an fp32 value is exact: the same bits either way.
  constexpr bool kMem = R > kAccRows;
  vf acc[kMem ? 1 : R][kC];
  auto acc_add = [&](int r, int c, vf v) {
    if constexpr (kMem)
      fstore(out + r * kPanel + c * kL, fadd(fload(out + r * kPanel + c * kL), v));
    else
      acc[r][c] = fadd(acc[r][c], v);
  };
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kC; ++c) {
      if constexpr (kMem)
        fstore(out + r * kPanel + c * kL, fzero());
      else
        acc[r][c] = fzero();
    }
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* blk = panel + b * fmt.block_bytes();
    if (pf != nullptr) prefetch_block<fmt.block_bytes()>(pf + b * fmt.block_bytes(), l1);
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
          acc_add(r, c, fmul(fmul(sw[c], sa), fcvt(isum)));
        }
      }
    }
    if constexpr (Offset) {
      for (int c = 0; c < kC; ++c) {
        const vf mw = fload(heads + S * kPanel + c * kL);
        for (int r = 0; r < R; ++r) acc_add(r, c, fmul(mw, fbcast(a.msum[(m + r) * a.nb + b])));
      }
    }
  }
  if constexpr (!kMem)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kC; ++c) fstore(out + r * kPanel + c * kL, acc[r][c]);
}

// The GEMM's tiles, each tile row's ncols fp32 sums handed to emit(row, panel, sums, bias of the
// panel or null, ncols): stored into y (linear_int8) or reduced to an argmax (linear_int8_argmax).
// With `share` (GEMV-shaped calls only) the calling thread's panels of a region its caller opened.
template <int Bits, bool Offset, bool Wide, typename Emit>
void run(const Rows& a, const uint8_t* packed, const float* bias, int64_t M, int64_t N, int64_t P, const Emit& emit,
         const PanelShare* share) {
  constexpr Int8Format fmt{Bits, Offset, Wide};
  const int64_t panel_bytes = a.nb * fmt.block_bytes();
  // Up to kFewRows rows (a decode step's few streams, a verifying row's 1 + K) each thread walks its
  // contiguous share of the panels as one stream and prefetches kAhead bytes ahead in it (L1 at one
  // row, else L2): the weight's read is most of such a call, and pairs of panels from one counter
  // interleave two threads' reads (gemm/panels.h). More rows: the thread's next panel into L2
  // (docs/int8-activations.md, "The engine against the tile", "One row at the read rate").
  const bool streamed = M <= kFewRows;
  auto walk = [&](const auto& tiles) {
    auto body = [&](int64_t p, int64_t next) {
      alignas(64) float buf[kTileRows * kPanel];
      const uint8_t* panel = packed + p * panel_bytes;
      const int64_t ncols = std::min<int64_t>(kPanel, N - p * kPanel);
      const float* bias_p = bias ? bias + p * kPanel : nullptr;
      const uint8_t* pf = streamed ? panel + kAhead : next < P ? packed + next * panel_bytes : nullptr;
      tiles.each([&](int64_t t, int64_t m, auto rows) {
        constexpr int R = decltype(rows)::value;
        tile<Bits, Offset, Wide, R>(a, m, panel, buf, t == 0 ? pf : nullptr, streamed && R == 1);
        for (int r = 0; r < R; ++r) emit(m + r, p, buf + r * kPanel, bias_p, ncols);
      });
    };
    if (share != nullptr)
      for_each_panel_shared(P, *share, body);
    else if (streamed)
      for_each_panel_streamed(P, body);
    else
      for_each_panel(P, true, body);
  };
  // Few rows: the weight's read dominates, tiles of up to kTileRows read it once per 8 rows. More:
  // compute-bound, tiles of kAccRows keep every sum in registers (docs/int8-activations.md).
  if (M <= kFewRows)
    walk(RowTiles<kTileRows>(M));
  else
    walk(RowTiles<kAccRows>(M));
}

}  // namespace
}  // namespace orcaserve::ORCA_ISA
