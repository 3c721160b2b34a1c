// Ragged paged attention on the CPU, reading the paged KV cache in place.
//
// Same semantics as orcaserve.kernels.reference.unified_attention: request b owns the queries
// cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1, which are the last q_len positions of its seq_lens[b]
// tokens; each attends causally to the keys at or before its position, found through
// block_tables[b]. Prefill chunks and decodes share one call.
//
// Work item = (request, tile of its queries, KV heads). Its rows are the tile's tokens times the
// G query heads of each KV head, so each K/V block row is read once per item and used by all of
// them. A prefill tile covers one KV head; a decode covers all of them when there are enough
// decodes to keep the threads busy, so each block is streamed from memory as one run. Items are
// drained from an atomic counter (largest first) by at::parallel_for's threads: a static split
// would leave one thread alone with a long prefill.
//
// Two score kernels, picked by the rows per KV head:
//  * few (decodes, short chunks): per key, one dot product per row vectorised along D, the
//    horizontal sums of kV keys done together by one shuffle tree;
//  * many (prefill tiles): queries transposed to [D, rows], so each key costs D fused
//    multiply-adds vectorised over rows and no horizontal sum; softmax is vectorised over rows.
// Both use an fp32 online softmax per K/V block and the same register-blocked P @ V update.
// Only slots before each item's last query position are read: the rest may hold anything.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace orcaserve {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kV = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Tunables (measured on a 2-core AVX-512 VM, SmolLM2 heads): an item with at most kDotRows rows
// per KV head uses the dot kernel; a prefill tile holds about kTileRows rows; below kSerialWork
// row-keys per call the OpenMP fork costs more than it saves.
constexpr int kDotRows = 8;
constexpr int kTileRows = 64;
constexpr int64_t kSerialWork = 4096;
// Accumulator registers for the P @ V block: 32 zmm (AVX-512) or 16 ymm otherwise.
constexpr int kAccRegs = kV == 16 ? 24 : 12;

template <typename T>
inline Vec load_f(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec v;
    at::vec::load_to_float<T>(p, v);
    return v;
  }
}

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Lane j of the result = sum of the lanes of acc[j], for kV vectors at once. A shuffle-add tree
// shares its shuffles between vectors: about 2 shuffles per sum instead of log2(kV) each.
inline Vec hsum_lanes(const Vec* acc) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i) {  // 128-bit lane L: [a(2i) L0+L2, a(2i+1) L0+L2, a(2i) L1+L3, ...]
    __m512 a = acc[2 * i], b = acc[2 * i + 1];
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane L of u[i]: partial sums of a(4i) .. a(4i+3)
    __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i) {
    __m256 a = acc[2 * i], b = acc[2 * i + 1];
    t[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 2; ++i) {
    __m256d a = _mm256_castps_pd(t[2 * i]), b = _mm256_castps_pd(t[2 * i + 1]);
    u[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
#else
  alignas(64) float out[kV];
  for (int j = 0; j < kV; ++j) out[j] = hsum(acc[j]);
  return Vec::loadu(out);
#endif
}

inline float hmax(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
}

struct Item {
  int32_t b;       // request
  int32_t i0, i1;  // query tile [i0, i1) within the request's q_len new tokens
  int32_t h0, h1;  // KV heads [h0, h1); several only for single-token tiles (decodes)
  int64_t cost;    // rows x keys, for largest-first scheduling
};

struct Args {
  const void* q;
  int64_t sq_t, sq_h;
  void* out;
  int64_t so_t, so_h;
  const void* k_cache;
  const void* v_cache;
  int64_t block_size, n_kv, group;
  const int32_t* cu;
  const int32_t* seq_lens;
  const int32_t* tables;
  int64_t table_stride;
  float scale;
};

// Per-thread scratch, grown to the largest item seen and kept: torch's OpenMP threads persist,
// so a step's 30-odd layer calls allocate nothing.
struct Scratch {
  std::vector<float> q;       // [R, D] scaled queries (dot) or [D, Rp] transposed (tiles)
  std::vector<float> o;       // [R, D] unnormalised output
  std::vector<float> s;       // [R, ld_s] scores (dot) or [block_size, Rp] (tiles)
  std::vector<float> kf, vf;  // [block_size, D] fp32 copies of one head of a block (16-bit caches)
  std::vector<float> m, l, alpha, qpos;  // [Rp]

  void reserve(int64_t rp, int64_t d, int64_t bs, int64_t ld_s) {
    auto grow = [](std::vector<float>& v, int64_t n) {
      if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    };
    grow(q, rp * d);
    grow(o, rp * d);
    grow(s, std::max(rp * ld_s, bs * rp));
    grow(kf, bs * d);
    grow(vf, bs * d);
    for (auto* v : {&m, &l, &alpha, &qpos}) grow(*v, rp);
  }
};

// O[r] = O[r] * alpha[r] + sum_j P(r, j) V[j] for RB consecutive rows kept in registers.
template <int D, int RB>
inline void pv_rows(float* o, const float* alpha, const float* p, int64_t sr, int64_t sj,
                    const float* v, int64_t ldv, int nk) {
  constexpr int NC = D / kV;
  Vec acc[RB][NC];
  for (int r = 0; r < RB; ++r) {
    Vec a(alpha[r]);
    for (int c = 0; c < NC; ++c) acc[r][c] = Vec::loadu(o + r * D + c * kV) * a;
  }
  for (int j = 0; j < nk; ++j) {
    Vec pr[RB];
    for (int r = 0; r < RB; ++r) pr[r] = Vec(p[r * sr + j * sj]);
    const float* vj = v + j * ldv;
    for (int c = 0; c < NC; ++c) {
      Vec vc = Vec::loadu(vj + c * kV);
      for (int r = 0; r < RB; ++r) acc[r][c] = at::vec::fmadd(pr[r], vc, acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c].store(o + r * D + c * kV);
}

template <int D>
void pv_update(float* o, int R, const float* alpha, const float* p, int64_t sr, int64_t sj,
               const float* v, int64_t ldv, int nk) {
  constexpr int NC = D / kV;
  constexpr int RB = std::max(1, std::min(4, kAccRegs / NC));
  int r = 0;
  for (; r + RB <= R; r += RB) pv_rows<D, RB>(o + r * D, alpha + r, p + r * sr, sr, sj, v, ldv, nk);
  // The rest in one pass too: a row per pass would leave one FMA chain per accumulator.
  switch (R - r) {
    case 3: if constexpr (RB > 3) pv_rows<D, 3>(o + r * D, alpha + r, p + r * sr, sr, sj, v, ldv, nk); break;
    case 2: if constexpr (RB > 2) pv_rows<D, 2>(o + r * D, alpha + r, p + r * sr, sr, sj, v, ldv, nk); break;
    case 1: if constexpr (RB > 1) pv_rows<D, 1>(o + r * D, alpha + r, p + r * sr, sr, sj, v, ldv, nk); break;
    default: break;
  }
}

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

// The next block sits at an arbitrary address, which no hardware prefetcher can guess. Into L2
// only: in L1 it would evict the block being worked on.
template <typename T>
inline void prefetch_rows(const T* base, int nk, int W, int64_t stride) {
  for (int j = 0; j < nk; ++j) {
    const char* row = reinterpret_cast<const char*>(base + j * stride);
    for (int c = 0; c < W * static_cast<int>(sizeof(T)); c += 64) __builtin_prefetch(row + c, 0, 2);
  }
}

// Scores s[r * ld_s + j] of R query rows (fp32, scaled, [R, D]) against nk keys of one block,
// -inf past nk (up to a whole vector) and past each row's position.
template <int D>
inline void dot_scores(const float* qb, int R, const float* kb, int64_t ldk, int nk, int64_t k0,
                       const float* qpos, float* s, int64_t ld_s) {
  constexpr int NC = D / kV;
  for (int r = 0; r < R; ++r) {
    Vec qv[NC];
    for (int c = 0; c < NC; ++c) qv[c] = Vec::loadu(qb + r * D + c * kV);
    for (int j0 = 0; j0 < nk; j0 += kV) {
      Vec acc[kV];
      const int n = std::min(kV, nk - j0);
      for (int jj = 0; jj < n; ++jj) {
        const float* kj = kb + (j0 + jj) * ldk;
        Vec a0 = qv[0] * Vec::loadu(kj), a1(0.f);
        for (int c = 1; c < NC; ++c) {
          if (c & 1) a1 = at::vec::fmadd(qv[c], Vec::loadu(kj + c * kV), a1);
          else a0 = at::vec::fmadd(qv[c], Vec::loadu(kj + c * kV), a0);
        }
        acc[jj] = a0 + a1;
      }
      for (int jj = n; jj < kV; ++jj) acc[jj] = Vec(0.f);
      const Vec kpos = Vec::arange(static_cast<float>(k0 + j0), 1.f);
      const Vec limit(std::min(qpos[r], static_cast<float>(k0 + nk - 1)));
      Vec::blendv(hsum_lanes(acc), Vec(kNegInf), kpos > limit).store(s + r * ld_s + j0);
    }
  }
}

// Online softmax over one block for rows s[r * ld_s + j]: scores become p = exp(s - m_new),
// alpha[r] rescales what the earlier blocks accumulated.
inline void softmax_rows(float* s, int64_t ld_s, int R, int nk, float* m, float* l, float* alpha) {
  const int nk_pad = (nk + kV - 1) / kV * kV;
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * ld_s;
    Vec mv(kNegInf);
    for (int j = 0; j < nk_pad; j += kV) mv = at::vec::maximum(mv, Vec::loadu(sr + j));
    // Every row sees key 0 in block 0, so m is finite from then on: no -inf - -inf.
    const float m_new = std::max(m[r], hmax(mv));
    alpha[r] = std::exp(m[r] - m_new);
    const Vec mn(m_new);
    Vec sum(0.f);
    for (int j = 0; j < nk_pad; j += kV) {
      Vec p = (Vec::loadu(sr + j) - mn).exp_u20();
      p.store(sr + j);
      sum = sum + p;
    }
    l[r] = l[r] * alpha[r] + hsum(sum);
    m[r] = m_new;
  }
}

// Rows of an item: r = (head - h0, token - i0, g) flattened; tiles of one token may span heads.
template <typename T, int D>
void attend_item(const Args& a, const Item& it, Scratch& sc) {
  constexpr int NC = D / kV;
  const int G = static_cast<int>(a.group);
  const int64_t bs = a.block_size;
  const int64_t q_begin = a.cu[it.b];
  const int64_t ctx = a.seq_lens[it.b];
  const int64_t first_pos = ctx - (a.cu[it.b + 1] - q_begin);  // position of the first new token
  const int tl = it.i1 - it.i0, nh = it.h1 - it.h0;
  const int rows_h = tl * G;  // rows per KV head
  const int R = rows_h * nh;
  const int Rp = (R + kV - 1) / kV * kV;
  const int W = nh * D;                    // cache elements per slot this item reads
  const int64_t kmax = first_pos + it.i1;  // keys this tile may see: [0, kmax)
  const int64_t diag = first_pos + it.i0;  // keys past this are masked for some rows
  const bool dot = rows_h <= kDotRows;
  const int32_t* table = a.tables + it.b * a.table_stride;
  const int64_t row_stride = a.n_kv * D;  // between slots of one block
  const T* kc = static_cast<const T*>(a.k_cache) + it.h0 * D;
  const T* vc = static_cast<const T*>(a.v_cache) + it.h0 * D;

  float* qb = sc.q.data();
  float* o = sc.o.data();
  float* s = sc.s.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  float* alpha = sc.alpha.data();
  float* qpos = sc.qpos.data();
  auto token = [&](int r) { return it.i0 + (r % rows_h) / G; };
  auto head = [&](int r) { return (it.h0 + r / rows_h) * G + r % G; };
  for (int r = 0; r < Rp; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
    // Padding rows (tiles only) see every key, so they never produce -inf - -inf.
    qpos[r] = r < R ? static_cast<float>(first_pos + token(r)) : 3e38f;
  }
  std::fill(o, o + R * D, 0.f);
  const Vec vscale(a.scale);
  for (int r = 0; r < R; ++r) {
    const T* qr = static_cast<const T*>(a.q) + (q_begin + token(r)) * a.sq_t + head(r) * a.sq_h;
    if (dot) {
      for (int c = 0; c < NC; ++c) (load_f(qr + c * kV) * vscale).store(qb + r * D + c * kV);
    } else {
      alignas(64) float tmp[D];
      for (int c = 0; c < NC; ++c) (load_f(qr + c * kV) * vscale).store(tmp + c * kV);
      for (int d = 0; d < D; ++d) qb[d * Rp + r] = tmp[d];
    }
  }
  if (!dot)
    for (int d = 0; d < D; ++d) std::fill(qb + d * Rp + R, qb + (d + 1) * Rp, 0.f);

  const int64_t ld_s = (bs + kV - 1) / kV * kV;  // dot kernel: scores row stride
  const int64_t num_blocks = (kmax + bs - 1) / bs;
  for (int64_t bi = 0; bi < num_blocks; ++bi) {
    const int64_t k0 = bi * bs;
    const int nk = static_cast<int>(std::min<int64_t>(bs, kmax - k0));
    const int64_t slot0 = static_cast<int64_t>(table[bi]) * bs * row_stride;
    if (bi + 1 < num_blocks) {
      const int64_t next0 = static_cast<int64_t>(table[bi + 1]) * bs * row_stride;
      const int nk_next = static_cast<int>(std::min<int64_t>(bs, kmax - k0 - bs));
      prefetch_rows(kc + next0, nk_next, W, row_stride);
      prefetch_rows(vc + next0, nk_next, W, row_stride);
    }
    if (dot) {
      // Head by head: the fp32 copies of a block stay one head wide, small enough for L1.
      for (int h = 0; h < nh; ++h) {
        int64_t ldk, ldv;
        const float* kb = block_rows<T, D>(kc + slot0 + h * D, sc.kf.data(), nk, row_stride, &ldk);
        const float* vb = block_rows<T, D>(vc + slot0 + h * D, sc.vf.data(), nk, row_stride, &ldv);
        const int r0 = h * rows_h;
        dot_scores<D>(qb + r0 * D, rows_h, kb, ldk, nk, k0, qpos + r0, s + r0 * ld_s, ld_s);
        softmax_rows(s + r0 * ld_s, ld_s, rows_h, nk, m + r0, l + r0, alpha + r0);
        pv_update<D>(o + r0 * D, rows_h, alpha + r0, s + r0 * ld_s, ld_s, 1, vb, ldv, nk);
      }
    } else {
      // One KV head. Scores transposed, s[j * Rp + r]; eight accumulators hide the FMA latency.
      int64_t ldk, ldv;
      const float* kb = block_rows<T, D>(kc + slot0, sc.kf.data(), nk, row_stride, &ldk);
      const float* vb = block_rows<T, D>(vc + slot0, sc.vf.data(), nk, row_stride, &ldv);
      int rc = 0;
      for (; rc + 2 * kV <= Rp; rc += 2 * kV) {
        int j = 0;
        for (; j + 4 <= nk; j += 4) qk_tile<D, 2, 4>(qb, Rp, kb, ldk, s, rc, j);
        for (; j < nk; ++j) qk_tile<D, 2, 1>(qb, Rp, kb, ldk, s, rc, j);
      }
      if (rc < Rp) {
        int j = 0;
        for (; j + 8 <= nk; j += 8) qk_tile<D, 1, 8>(qb, Rp, kb, ldk, s, rc, j);
        for (; j < nk; ++j) qk_tile<D, 1, 1>(qb, Rp, kb, ldk, s, rc, j);
      }
      const bool masked = k0 + nk - 1 > diag;
      const Vec ninf(kNegInf);
      for (rc = 0; rc < Rp; rc += kV) {
        const Vec qp = Vec::loadu(qpos + rc);
        const Vec m_old = Vec::loadu(m + rc);
        Vec mv = m_old;
        for (int j = 0; j < nk; ++j) {
          Vec sj = Vec::loadu(s + j * Rp + rc);
          if (masked) {
            sj = Vec::blendv(sj, ninf, Vec(static_cast<float>(k0 + j)) > qp);
            sj.store(s + j * Rp + rc);
          }
          mv = at::vec::maximum(mv, sj);
        }
        const Vec al = (m_old - mv).exp_u20();
        Vec sum(0.f);
        for (int j = 0; j < nk; ++j) {
          Vec p = (Vec::loadu(s + j * Rp + rc) - mv).exp_u20();
          p.store(s + j * Rp + rc);
          sum = sum + p;
        }
        (Vec::loadu(l + rc) * al + sum).store(l + rc);
        mv.store(m + rc);
        al.store(alpha + rc);
      }
      pv_update<D>(o, R, alpha, s, 1, Rp, vb, ldv, nk);
    }
  }

  for (int r = 0; r < R; ++r) {
    alignas(64) float tmp[D];
    const Vec inv(1.f / l[r]);
    for (int c = 0; c < NC; ++c) (Vec::loadu(o + r * D + c * kV) * inv).store(tmp + c * kV);
    at::vec::convert(tmp, static_cast<T*>(a.out) + (q_begin + token(r)) * a.so_t + head(r) * a.so_h, D);
  }
}

template <typename T, int D>
void run(const Args& a, int64_t batch) {
  const int64_t G = a.group, n_kv = a.n_kv;
  const int64_t tile = std::max<int64_t>(1, kTileRows / G);
  const int64_t threads = at::get_num_threads();
  // Decodes take all KV heads per item (each block read as one contiguous run) unless that
  // leaves too few items to keep every thread busy.
  int64_t decodes = 0;
  for (int64_t b = 0; b < batch; ++b) decodes += a.cu[b + 1] - a.cu[b] == 1;
  const int64_t heads_per_decode = decodes >= 4 * threads ? n_kv : 1;
  std::vector<Item> items;
  int64_t total = 0, max_rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = a.cu[b + 1] - a.cu[b];
    const int64_t ctx = a.seq_lens[b];
    TORCH_CHECK(n >= 0 && n <= ctx, "paged_attention: request ", b, " has ", n,
                " new tokens but a context of ", ctx);
    const int64_t nh = n == 1 ? heads_per_decode : 1;
    for (int64_t i0 = 0; i0 < n; i0 += tile) {
      const int64_t i1 = std::min(n, i0 + tile);
      const int64_t cost = (i1 - i0) * G * nh * (ctx - n + i1);
      for (int64_t h = 0; h < n_kv; h += nh)
        items.push_back({(int32_t)b, (int32_t)i0, (int32_t)i1, (int32_t)h, (int32_t)(h + nh), cost});
      total += cost * (n_kv / nh);
      max_rows = std::max(max_rows, (i1 - i0) * G * nh);
    }
  }
  if (items.empty()) return;
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });

  const int64_t bs = a.block_size;
  const int64_t rp = (max_rows + kV - 1) / kV * kV;
  const int64_t ld_s = (bs + kV - 1) / kV * kV;
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = total < kSerialWork ? 1 : std::min(threads, n_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local Scratch sc;
    sc.reserve(rp, D, bs, ld_s);
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) attend_item<T, D>(a, items[i], sc);
  });
}

template <typename T>
void dispatch_dim(const Args& a, int64_t batch, int64_t d) {
  switch (d) {
    case 16: return run<T, 16>(a, batch);
    case 32: return run<T, 32>(a, batch);
    case 64: return run<T, 64>(a, batch);
    case 80: return run<T, 80>(a, batch);
    case 96: return run<T, 96>(a, batch);
    case 128: return run<T, 128>(a, batch);
    case 256: return run<T, 256>(a, batch);
    default: TORCH_CHECK(false, "paged_attention: head dim ", d, " not compiled (16, 32, 64, 80, 96, 128, 256)");
  }
}

void paged_attention(const at::Tensor& q,             // [T, H, D]
                     const at::Tensor& k_cache,       // [num_blocks, block_size, H_kv, D]
                     const at::Tensor& v_cache,       // [num_blocks, block_size, H_kv, D]
                     const at::Tensor& cu_seqlens_q,  // [B + 1] int32
                     const at::Tensor& seq_lens,      // [B] int32
                     const at::Tensor& block_tables,  // [B, max_blocks] int32
                     double scale, const at::Tensor& out) {  // [T, H, D]
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4, "paged_attention: bad ranks");
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.sizes() == out.sizes(), "paged_attention: out must have q's shape");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_attention: K/V caches differ in shape");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_attention: q, caches and out must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_attention: head dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  for (const auto* t : {&cu_seqlens_q, &seq_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "paged_attention: metadata must be contiguous int32 CPU tensors");
  const int64_t h = q.size(1), d = q.size(2), n_kv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && h % n_kv == 0, "paged_attention: head layout mismatch");
  const int64_t batch = seq_lens.size(0);
  TORCH_CHECK(cu_seqlens_q.size(0) == batch + 1 && block_tables.dim() == 2 && block_tables.size(0) == batch,
              "paged_attention: metadata shapes mismatch");
  TORCH_CHECK(cu_seqlens_q.data_ptr<int32_t>()[0] >= 0 && cu_seqlens_q.data_ptr<int32_t>()[batch] <= q.size(0),
              "paged_attention: cu_seqlens_q outside [0, T]");
  if (batch == 0 || q.size(0) == 0) return;
  // The kernel trusts block_tables for the blocks a request's context covers: check them once.
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bs = k_cache.size(1), width = block_tables.size(1), num_blocks = k_cache.size(0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t nb = (sl[b] + bs - 1) / bs;
    TORCH_CHECK(sl[b] >= 0 && nb <= width, "paged_attention: request ", b, " needs ", nb, " blocks, table has ", width);
    for (int64_t i = 0; i < nb; ++i)
      TORCH_CHECK(bt[b * width + i] >= 0 && bt[b * width + i] < num_blocks, "paged_attention: block id out of range");
  }

  Args a{q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
         k_cache.data_ptr(), v_cache.data_ptr(), bs, n_kv, h / n_kv,
         cu_seqlens_q.data_ptr<int32_t>(), sl, bt, width, static_cast<float>(scale)};
  switch (dtype) {
    case at::kFloat: return dispatch_dim<float>(a, batch, d);
    case at::kBFloat16: return dispatch_dim<at::BFloat16>(a, batch, d);
    case at::kHalf: return dispatch_dim<at::Half>(a, batch, d);
    default: TORCH_CHECK(false, "paged_attention: dtype ", dtype, " not supported");
  }
}

}  // namespace
}  // namespace orcaserve

TORCH_LIBRARY_FRAGMENT(orcaserve, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor seq_lens, "
      "Tensor block_tables, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(orcaserve, CPU, m) { m.impl("paged_attention", &orcaserve::paged_attention); }
