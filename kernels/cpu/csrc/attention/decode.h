// Decodes and short chunks (few query rows per KV head) for attention/paged_attention.cpp.
//
// One KV head at a time, its keys in segments of up to kSeg: first every score of the segment
// (per key one dot product per row, the horizontal sums of kV keys done together by one shuffle
// tree), then one softmax over the segment, then P @ V over it with the output rows in registers.
// A segment costs one online-softmax rescale, not one per block. The cache is read as stored,
// never copied: bf16 through vdpbf16ps where the CPU has it (queries as given, probabilities
// rounded to bf16 before P @ V, as FlashAttention does on GPUs), otherwise converted to fp32 in
// registers.
#pragma once

#include <cstring>

#include "attention/common.h"

namespace orcaserve::ORCA_ISA {
namespace {

constexpr int kSeg = 256;  // keys per softmax segment: its scores stay in L1

// Keys per segment (whole blocks) and the row stride of the segment's scores: room for a block
// size that does not divide kSeg and for the vector-wide stores past the last key.
inline int64_t segment_keys(int64_t bs) { return std::max<int64_t>(bs, kSeg / bs * bs); }
inline int64_t score_stride(int64_t bs) { return segment_keys(bs) + 2 * kV; }
// Row stride of the queries and outputs: whole 32-element bf16 chunks.
template <int D>
constexpr int kPaddedDim = (D + 31) / 32 * 32;
// Blocks ahead whose keys are prefetched. Measured with 30 layers' caches in DRAM (B = 32,
// context 256, bf16): prefetching V during the scores is worth 25 %; 1-16 blocks ahead for K
// made no difference beyond noise.
constexpr int kPrefetch = 2;
// Accumulator registers for the P @ V rows: 32 zmm (AVX-512) or 16 ymm otherwise.
constexpr int kAccRegs = kV == 16 ? 24 : 12;

// Scores s[r * ld_s + j] of R rows (fp32 queries, scaled, [R, D]) against the nk keys at kb (row
// stride ldk), the first being key k0; -inf past nk up to a whole vector and past each row's position.
template <typename T, int D>
inline void scores_fma(const float* qb, int R, const T* kb, int64_t ldk, int nk, int64_t k0, const float* qpos,
                       float* s, int64_t ld_s) {
  constexpr int NC = D / kV;
  for (int r = 0; r < R; ++r) {
    Vec qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = Vec::loadu(qb + r * D + c * kV);
    for (int j0 = 0; j0 < nk; j0 += kV) {
      Vec acc[kV];
#pragma GCC unroll 16
      for (int jj = 0; jj < kV; ++jj) {  // kV keys always (masked below): acc stays in registers
        const T* kj = kb + std::min(j0 + jj, nk - 1) * ldk;
        Vec a0 = qv[0] * load_f(kj), a1(0.f);  // two chains: FMA latency
        for (int c = 1; c < NC; ++c) {
          if (c & 1) a1 = at::vec::fmadd(qv[c], load_f(kj + c * kV), a1);
          else a0 = at::vec::fmadd(qv[c], load_f(kj + c * kV), a0);
        }
        acc[jj] = a0 + a1;
      }
      const Vec kpos = Vec::arange(static_cast<float>(k0 + j0), 1.f);
      const Vec limit(std::min(qpos[r], static_cast<float>(k0 + nk - 1)));
      Vec::blendv(hsum_lanes(acc), Vec(kNegInf), kpos > limit).store(s + r * ld_s + j0);
    }
  }
}

// Vectors of output columns per P @ V pass. All of D at once leaves room in an AVX2 register file
// for one row's accumulators (D = 64), so every row loads all of V again (from L2 for a decode
// segment); a slice of D per pass keeps three rows in registers and loads V a third as often
// (docs/performance-log.md#2026-12-01-attentions-p--v-in-column-slices-zen-3). On AVX-512 a slice
// is a whole row up to D = 128.
template <int D>
constexpr int pv_cols() {
  constexpr int nc = D / kV;
  for (int cn = std::min(nc, std::max(1, kAccRegs / 3)); cn > 1; --cn)
    if (nc % cn == 0) return cn;
  return 1;
}

// O[r] = O[r] * alpha[r] + sum_j p(r, j) V[j] for RB rows in registers, over a segment's blocks,
// output vectors [c0, c0 + CN) of D; p(r, j) = p[r * ldp + j * sj].
template <typename T, int D, int RB, int CN>
inline void pv_fma_rows(float* o, int64_t ldo, const float* alpha, const float* p, int64_t ldp, int64_t sj,
                        const T* v, const int64_t* blocks, int nb, int64_t bs, int64_t ldv, int n, int c0) {
  Vec acc[RB][CN];
  o += c0 * kV;
  v += c0 * kV;
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CN; ++c) acc[r][c] = Vec::loadu(o + r * ldo + c * kV) * Vec(alpha[r]);
  for (int bi = 0; bi < nb; ++bi) {
    const T* vb = v + blocks[bi];
    const int off = static_cast<int>(bi * bs), nk = static_cast<int>(std::min<int64_t>(bs, n - off));
    // The next block's slice into L1 while this one runs: the loads below otherwise wait on L2 or
    // DRAM (prefetched to L2 during the scores, or not yet there)
    // (docs/performance-log.md#2026-12-01-the-next-v-rows-prefetched-into-l1-during-p--v-zen-3).
    if (bi + 1 < nb)
      prefetch_rows<3>(v + blocks[bi + 1], static_cast<int>(std::min<int64_t>(bs, n - off - bs)), CN * kV, ldv);
    for (int j = 0; j < nk; ++j) {
      Vec pr[RB];
      for (int r = 0; r < RB; ++r) pr[r] = Vec(p[r * ldp + (off + j) * sj]);
      for (int c = 0; c < CN; ++c) {
        const Vec vc = load_f(vb + j * ldv + c * kV);
        for (int r = 0; r < RB; ++r) acc[r][c] = at::vec::fmadd(pr[r], vc, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < CN; ++c) acc[r][c].store(o + r * ldo + c * kV);
}

// Where pv_dp_rows leaves output element d: chunk d / 32, unpacklo (d % 8 < 4) or unpackhi, lane
// 4 * (128-bit lane) + position in it.
inline int dp_lane(int d) {
  const int w = d % 32, i = w % 8;
  return (2 * (d / 32) + (i >= 4)) * 16 + 4 * (w / 8) + (i & 3);
}

#ifdef ORCA_DPBF16
// A bf16 row as 32-element chunks; a last partial chunk (D = 16, 80) loads zero-filled.
template <int D>
struct Bf16Row {
  static constexpr int NCH = (D + 31) / 32;
  static inline __m512i load(const void* row, int c) {
    const char* p = static_cast<const char*>(row) + 64 * c;
    if constexpr (D % 32 != 0) {
      if (c == NCH - 1) return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << (D % 32)) - 1), p);
    }
    return _mm512_loadu_si512(p);
  }
  // Chunk c of rows j and j + 1 (zeros for j + 1 unless `pair`) interleaved for vdpbf16ps's pairs:
  // (v_j[d], v_j+1[d]) per 32-bit lane, in the lanes dp_lane maps d to.
  static inline void pair_rows(const at::BFloat16* vj, int64_t ld, bool pair, int c, __m512i* lo, __m512i* hi) {
    const __m512i a = load(vj, c);
    const __m512i b = pair ? load(vj + ld, c) : _mm512_setzero_si512();
    *lo = _mm512_unpacklo_epi16(a, b);
    *hi = _mm512_unpackhi_epi16(a, b);
  }
};

inline __m512 dpbf16(__m512 acc, __m512i a, __m512i b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }

// scores_fma's contract with bf16 queries as given ([R, NCH * 32], zero-padded) and the scale
// applied to the fp32 sums, so no query is rounded twice.
template <int D>
inline void scores_dp(const uint16_t* qh, int R, const at::BFloat16* kb, int64_t ldk, int nk, int64_t k0,
                      float scale, const float* qpos, float* s, int64_t ld_s) {
  using B = Bf16Row<D>;
  const Vec vscale(scale);
  for (int r = 0; r < R; ++r) {
    __m512i qv[B::NCH];
    for (int c = 0; c < B::NCH; ++c) qv[c] = _mm512_loadu_si512(qh + r * B::NCH * 32 + 32 * c);
    for (int j0 = 0; j0 < nk; j0 += kV) {
      Vec acc[kV];
#pragma GCC unroll 16
      for (int jj = 0; jj < kV; ++jj) {  // as in scores_fma
        const at::BFloat16* kj = kb + std::min(j0 + jj, nk - 1) * ldk;
        __m512 x = dpbf16(_mm512_setzero_ps(), qv[0], B::load(kj, 0));
        for (int c = 1; c < B::NCH; ++c) x = dpbf16(x, qv[c], B::load(kj, c));
        acc[jj] = x;
      }
      const Vec kpos = Vec::arange(static_cast<float>(k0 + j0), 1.f);
      const Vec limit(std::min(qpos[r], static_cast<float>(k0 + nk - 1)));
      Vec::blendv(hsum_lanes(acc) * vscale, Vec(kNegInf), kpos > limit).store(s + r * ld_s + j0);
    }
  }
}

// pv_fma_rows for bf16 V and bf16 probabilities. vdpbf16ps sums adjacent pairs, so keys go in
// pairs: unpacklo/hi_epi16 of rows j and j+1 put (v_j[d], v_j+1[d]) in one 32-bit lane, and the
// output's lanes come out permuted within each 32-element chunk (dp_lane maps them back).
template <int D, int RB>
inline void pv_dp_rows(float* o, int64_t ldo, const float* alpha, const uint16_t* p, int64_t ldp,
                       const at::BFloat16* v, const int64_t* blocks, int nb, int64_t bs, int64_t ldv, int n) {
  using B = Bf16Row<D>;
  constexpr int NA = 2 * B::NCH;
  __m512 acc[RB][NA];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NA; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ldo + 16 * c), _mm512_set1_ps(alpha[r]));
  for (int bi = 0; bi < nb; ++bi) {
    const at::BFloat16* vb = v + blocks[bi];
    const int off = static_cast<int>(bi * bs), nk = static_cast<int>(std::min<int64_t>(bs, n - off));
    for (int j = 0; j < nk; j += 2) {
      const bool pair = j + 1 < nk;  // an odd tail pairs with zeros, never with a slot past nk
      __m512i lo[B::NCH], hi[B::NCH];
      for (int c = 0; c < B::NCH; ++c) B::pair_rows(vb + j * ldv, ldv, pair, c, &lo[c], &hi[c]);
      for (int r = 0; r < RB; ++r) {
        uint32_t pp;
        std::memcpy(&pp, p + r * ldp + off + j, sizeof(pp));
        const __m512i pr = _mm512_set1_epi32(static_cast<int>(pair ? pp : pp & 0xFFFFu));
        for (int c = 0; c < B::NCH; ++c) {
          acc[r][2 * c] = dpbf16(acc[r][2 * c], pr, lo[c]);
          acc[r][2 * c + 1] = dpbf16(acc[r][2 * c + 1], pr, hi[c]);
        }
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NA; ++c) _mm512_storeu_ps(o + r * ldo + 16 * c, acc[r][c]);
}

#endif

// Runs Rows<RB>(first row) over R rows: groups of RB, then the rest in one pass (a row per pass
// would leave one FMA chain per accumulator).
template <int RB, typename F>
inline void row_groups(int R, F&& f) {
  int r = 0;
  for (; r + RB <= R; r += RB) f(std::integral_constant<int, RB>{}, r);
  switch (R - r) {
    case 3: if constexpr (RB > 3) f(std::integral_constant<int, 3>{}, r); break;
    case 2: if constexpr (RB > 2) f(std::integral_constant<int, 2>{}, r); break;
    case 1: if constexpr (RB > 1) f(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// pv_fma_rows over R rows (o row stride ldo, p as there): D in slices of pv_cols, rows in groups.
template <typename T, int D>
inline void pv_fma(float* o, int64_t ldo, int R, const float* alpha, const float* p, int64_t ldp, int64_t sj,
                   const T* v, const int64_t* blocks, int nb, int64_t bs, int64_t ldv, int n) {
  constexpr int CN = pv_cols<D>();
  constexpr int RB = std::max(1, std::min(4, kAccRegs / CN));
  for (int c0 = 0; c0 < D / kV; c0 += CN)
    row_groups<RB>(R, [&](auto rb, int r0) {
      pv_fma_rows<T, D, decltype(rb)::value, CN>(o + r0 * ldo, ldo, alpha + r0, p + r0 * ldp, ldp, sj, v, blocks, nb,
                                                 bs, ldv, n, c0);
    });
}

// An item of few rows per KV head: rows r = (token i0 + r / G, query head g = r % G) of each head.
template <typename T, int D>
void attend_rows(const Args& a, const Item& it, Scratch& sc) {
  constexpr bool dp = kHaveDpBf16 && std::is_same_v<T, at::BFloat16>;
  constexpr int DP = kPaddedDim<D>;
  constexpr int NC = D / kV;
  const int G = static_cast<int>(a.group);
  const int64_t bs = a.block_size;
  const int64_t seg = segment_keys(bs);
  const int64_t ld_s = score_stride(bs);
  const Span sp(a, it, D);
  const int64_t q_begin = sp.q_begin, first_pos = sp.first_pos, kmax = sp.kmax, row_stride = sp.row_stride;
  const int R = sp.R;
  const int32_t* table = sp.table;
  float* s = sc.s.data();
  float* o = sc.o.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  float* alpha = sc.alpha.data();
  float* qpos = sc.qpos.data();
  int64_t* blocks = sc.blocks.data();
  for (int r = 0; r < R; ++r) qpos[r] = static_cast<float>(first_pos + it.i0 + r / G);

  for (int h = it.h0; h < it.h1; ++h) {
    const T* kc = static_cast<const T*>(a.k_cache) + h * D;
    const T* vc = static_cast<const T*>(a.v_cache) + h * D;
    for (int r = 0; r < R; ++r) {
      const T* qr = static_cast<const T*>(a.q) + (q_begin + it.i0 + r / G) * a.sq_t + (h * G + r % G) * a.sq_h;
      if constexpr (dp) {
        std::memcpy(sc.qh.data() + r * DP, qr, D * sizeof(T));
        std::fill(sc.qh.data() + r * DP + D, sc.qh.data() + (r + 1) * DP, uint16_t{0});
      } else {
        for (int c = 0; c < NC; ++c) (load_f(qr + c * kV) * Vec(a.scale)).store(sc.q.data() + r * D + c * kV);
      }
      m[r] = kNegInf;
      l[r] = 0.f;
    }
    std::fill(o, o + R * DP, 0.f);

    for (int64_t s0 = 0; s0 < kmax; s0 += seg) {
      const int n = static_cast<int>(std::min(seg, kmax - s0));
      const int nb = static_cast<int>((n + bs - 1) / bs);
      for (int bi = 0; bi < nb; ++bi) blocks[bi] = static_cast<int64_t>(table[s0 / bs + bi]) * bs * row_stride;
      auto nk_of = [&](int bi) { return static_cast<int>(std::min<int64_t>(bs, kmax - s0 - bi * bs)); };
      if (s0 == 0 && h == it.h0)
        for (int bi = 0; bi < std::min(kPrefetch, nb); ++bi) prefetch_rows(kc + blocks[bi], nk_of(bi), D, row_stride);
      for (int bi = 0; bi < nb; ++bi) {
        const int64_t k0 = s0 + bi * bs;
        const int nk = static_cast<int>(std::min<int64_t>(bs, kmax - k0));
        if (bi + kPrefetch < nb) prefetch_rows(kc + blocks[bi + kPrefetch], nk_of(bi + kPrefetch), D, row_stride);
        prefetch_rows(vc + blocks[bi], nk, D, row_stride);  // for P @ V, after all the scores
#ifdef ORCA_DPBF16  // without it scores_dp is not declared, and a discarded branch must still name things
        if constexpr (dp) {
          scores_dp<D>(sc.qh.data(), R, kc + blocks[bi], row_stride, nk, k0, a.scale, qpos, s + bi * bs, ld_s);
          continue;
        }
#endif
        scores_fma<T, D>(sc.q.data(), R, kc + blocks[bi], row_stride, nk, k0, qpos, s + bi * bs, ld_s);
      }
      if (h + 1 < it.h1 && s0 + seg >= kmax)  // the next head's first keys, while P @ V runs
        for (int bi = 0; bi < std::min(kPrefetch, nb); ++bi) prefetch_rows(kc + D + blocks[bi], nk_of(bi), D, row_stride);
      const int n_pad = (n + kV - 1) / kV * kV;
      for (int r = 0; r < R; ++r) std::fill(s + r * ld_s + n, s + r * ld_s + n_pad, kNegInf);
      softmax_rows(s, ld_s, R, n, m, l, alpha);
      if constexpr (dp) {
#ifdef ORCA_DPBF16
        uint16_t* p = sc.p.data();
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < n_pad; j += kV)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + r * ld_s + j),
                                to_bf16(_mm512_loadu_ps(s + r * ld_s + j)));
        constexpr int RB = std::max(1, std::min(4, 20 / (2 * Bf16Row<D>::NCH)));
        row_groups<RB>(R, [&](auto rb, int r0) {
          pv_dp_rows<D, decltype(rb)::value>(o + r0 * DP, DP, alpha + r0, p + r0 * ld_s, ld_s, vc, blocks, nb, bs,
                                             row_stride, n);
        });
#endif
      } else {
        pv_fma<T, D>(o, DP, R, alpha, s, ld_s, 1, vc, blocks, nb, bs, row_stride, n);
      }
    }

    for (int r = 0; r < R; ++r) {
      alignas(64) float tmp[D];
      const float inv = 1.f / l[r];
      for (int d = 0; d < D; ++d) tmp[d] = o[r * DP + (dp ? dp_lane(d) : d)] * inv;
      T* dst = static_cast<T*>(a.out) + (q_begin + it.i0 + r / G) * a.so_t + (h * G + r % G) * a.so_h;
      at::vec::convert(tmp, dst, D);
    }
  }
}

}  // namespace
}  // namespace orcaserve::ORCA_ISA
