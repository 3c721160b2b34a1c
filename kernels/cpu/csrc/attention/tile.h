// Prefill tiles (many query rows per KV head) for attention/paged_attention.cpp: the pieces of one block's
// work with the rows in vector lanes, so no key needs a horizontal sum.
//
// fp32 (and bf16 where the CPU has no vdpbf16ps): queries transposed to [D, Rp], K and V rows as
// fp32 (converted once per block and head), D fused multiply-adds per key and row vector.
// bf16 with vdpbf16ps: queries as bf16 pairs along D, [D / 2, Rp], multiplied with the cache's
// K pairs as stored; probabilities rounded to bf16 and paired along the keys for P @ V, as the
// decode path does; the output accumulates transposed, [D, Rp].
#pragma once

#include <cstring>

#include "attention/common.h"
#include "attention/decode.h"

namespace orcaserve::ORCA_ISA {
namespace {

// Transposed scores s[j * Rp + r] for RC row vectors x JB keys: per head-dim element, RC loads
// of the transposed queries, JB broadcast keys and RC x JB fused multiply-adds.
template <int D, int RC, int JB>
inline void qk_tile(const float* qt, int Rp, const float* kb, int64_t ldk, float* s, int rc, int j) {
  Vec acc[RC][JB];
  for (int c = 0; c < RC; ++c)
    for (int jj = 0; jj < JB; ++jj) acc[c][jj] = Vec(0.f);
  const float* k = kb + j * ldk;
  for (int d = 0; d < D; ++d) {
    Vec qd[RC];
    for (int c = 0; c < RC; ++c) qd[c] = Vec::loadu(qt + d * Rp + rc + c * kV);
    for (int jj = 0; jj < JB; ++jj) {
      const Vec kk(k[jj * ldk + d]);
      for (int c = 0; c < RC; ++c) acc[c][jj] = at::vec::fmadd(qd[c], kk, acc[c][jj]);
    }
  }
  for (int jj = 0; jj < JB; ++jj)
    for (int c = 0; c < RC; ++c) acc[c][jj].store(s + (j + jj) * Rp + rc + c * kV);
}

// K or V rows [nk, D] of one KV head of a block as fp32: in place for fp32 caches, otherwise
// converted into `buf` (one pass per block and head, shared by every row of that head).
template <typename T, int D>
inline const float* block_rows(const T* base, float* buf, int nk, int64_t stride, int64_t* ld) {
  if constexpr (std::is_same_v<T, float>) {
    *ld = stride;
    return base;
  } else {
    for (int j = 0; j < nk; ++j)
      for (int c = 0; c < D; c += kV) load_f(base + j * stride + c).store(buf + j * D + c);
    *ld = D;
    return buf;
  }
}

#ifdef ORCA_DPBF16
inline int32_t bf16_pair(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// scale * (scores of RC row vectors x JB keys), transposed as qk_tile's; qp[d2 * Rp + r] holds
// (q[r][2 d2], q[r][2 d2 + 1]), the keys are read as stored.
template <int D, int RC, int JB>
inline void qk_tile_dp(const int32_t* qp, int Rp, const at::BFloat16* kb, int64_t ldk, float* s, int rc, int j,
                       float scale) {
  __m512 acc[RC][JB];
  for (int c = 0; c < RC; ++c)
    for (int jj = 0; jj < JB; ++jj) acc[c][jj] = _mm512_setzero_ps();
  const at::BFloat16* k = kb + j * ldk;
  for (int d2 = 0; d2 < D / 2; ++d2) {
    __m512i qd[RC];
    for (int c = 0; c < RC; ++c) qd[c] = _mm512_loadu_si512(qp + d2 * Rp + rc + c * kV);
    for (int jj = 0; jj < JB; ++jj) {
      const __m512i kk = _mm512_set1_epi32(bf16_pair(k + jj * ldk + 2 * d2));
      for (int c = 0; c < RC; ++c) acc[c][jj] = dpbf16(acc[c][jj], qd[c], kk);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
  for (int jj = 0; jj < JB; ++jj)
    for (int c = 0; c < RC; ++c) _mm512_storeu_ps(s + (j + jj) * Rp + rc + c * kV, _mm512_mul_ps(acc[c][jj], vs));
}

// Every score of a block's nk keys: four keys at a time, then one.
template <int D>
inline void qk_block_dp(const int32_t* qp, int Rp, const at::BFloat16* kb, int64_t ldk, int nk, float* s,
                        float scale) {
  row_groups<4>(Rp / kV, [&](auto rc_n, int v0) {  // 4 row vectors at a time, then the rest
    constexpr int RC = decltype(rc_n)::value;
    const int rc = v0 * kV;
    int j = 0;
    for (; j + 4 <= nk; j += 4) qk_tile_dp<D, RC, 4>(qp, Rp, kb, ldk, s, rc, j, scale);
    for (; j < nk; ++j) qk_tile_dp<D, RC, 1>(qp, Rp, kb, ldk, s, rc, j, scale);
  });
}

// P @ V operands of one block, as bf16 pairs of keys (j, j + 1), an odd last key paired with zero:
// pp[(j / 2) * Rp + r] from the transposed probabilities s, and V rows unpacked as pv_dp_rows
// does, vp[(j / 2) * DP + dp_lane(d)].
template <int D>
inline void pv_operands_dp(const float* s, int Rp, const at::BFloat16* vb, int64_t ldv, int nk, int32_t* pp,
                           int32_t* vp) {
  using B = Bf16Row<D>;
  constexpr int DP = kPaddedDim<D>;
  for (int j = 0; j < nk; j += 2) {
    const bool pair = j + 1 < nk;
    for (int rc = 0; rc < Rp; rc += kV) {
      auto half = [&](int jj) {
        return _mm512_cvtepu16_epi32(to_bf16(_mm512_loadu_ps(s + jj * Rp + rc)));
      };
      const __m512i hi = pair ? _mm512_slli_epi32(half(j + 1), 16) : _mm512_setzero_si512();
      _mm512_storeu_si512(pp + (j / 2) * Rp + rc, _mm512_or_si512(half(j), hi));
    }
    for (int c = 0; c < B::NCH; ++c) {
      __m512i lo, hi;
      B::pair_rows(vb + j * ldv, ldv, pair, c, &lo, &hi);
      _mm512_storeu_si512(vp + (j / 2) * DP + 32 * c, lo);
      _mm512_storeu_si512(vp + (j / 2) * DP + 32 * c + 16, hi);
    }
  }
}

// oT[d][r] = oT[d][r] * alpha[r] + sum_j p(j, r) v(j, d) over a block's key pairs, for DB output
// columns from d0 and RC row vectors from rc in registers.
template <int D, int RC, int DB>
inline void pv_tile_dp(float* oT, int Rp, const float* alpha, const int32_t* pp, const int32_t* vp, int npairs,
                       int rc, int d0) {
  constexpr int DP = kPaddedDim<D>;
  __m512 acc[DB][RC];
  int lane[DB];
  for (int dd = 0; dd < DB; ++dd) lane[dd] = dp_lane(d0 + dd);
  for (int c = 0; c < RC; ++c) {
    const __m512 al = _mm512_loadu_ps(alpha + rc + c * kV);
    for (int dd = 0; dd < DB; ++dd) acc[dd][c] = _mm512_mul_ps(_mm512_loadu_ps(oT + (d0 + dd) * Rp + rc + c * kV), al);
  }
  for (int j2 = 0; j2 < npairs; ++j2) {
    __m512i p[RC];
    for (int c = 0; c < RC; ++c) p[c] = _mm512_loadu_si512(pp + j2 * Rp + rc + c * kV);
    for (int dd = 0; dd < DB; ++dd) {
      const __m512i v = _mm512_set1_epi32(vp[j2 * DP + lane[dd]]);
      for (int c = 0; c < RC; ++c) acc[dd][c] = dpbf16(acc[dd][c], p[c], v);
    }
  }
  for (int dd = 0; dd < DB; ++dd)
    for (int c = 0; c < RC; ++c) _mm512_storeu_ps(oT + (d0 + dd) * Rp + rc + c * kV, acc[dd][c]);
}

// P @ V of a block for every row and output column (D is a multiple of 4 for every compiled D).
template <int D>
inline void pv_block_dp(float* oT, int Rp, const float* alpha, const int32_t* pp, const int32_t* vp, int nk) {
  const int npairs = (nk + 1) / 2;
  row_groups<4>(Rp / kV, [&](auto rc_n, int v0) {
    constexpr int RC = decltype(rc_n)::value;
    const int rc = v0 * kV;
    for (int d0 = 0; d0 < D; d0 += 4) pv_tile_dp<D, RC, 4>(oT, Rp, alpha, pp, vp, npairs, rc, d0);
  });
}
#endif

}  // namespace
}  // namespace orcaserve::ORCA_ISA
