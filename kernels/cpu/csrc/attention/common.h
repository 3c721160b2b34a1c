// Shared pieces of the CPU paged attention (attention/paged_attention.cpp): vector helpers, the work item,
// the call's arguments and the per-thread scratch.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "rows.h"

namespace orcaserve::ORCA_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kV = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ORCA_DPBF16 / kHaveDpBf16 (rows.h): both attention kernels then multiply the bf16 cache as
// stored through vdpbf16ps, with no conversion to fp32.

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

inline float hmax(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
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

// Where an item's rows and keys are: rows r = (token i0 + r / G, query head g = r % G) of a KV head.
struct Span {
  int64_t q_begin;    // the request's first query row in q
  int64_t first_pos;  // position of the request's first new token
  int64_t kmax;       // keys the item may see: [0, kmax)
  int R;              // rows per KV head
  const int32_t* table;
  int64_t row_stride;  // cache elements between slots of one block

  Span(const Args& a, const Item& it, int64_t d)
      : q_begin(a.cu[it.b]),
        first_pos(a.seq_lens[it.b] - (a.cu[it.b + 1] - a.cu[it.b])),
        kmax(first_pos + it.i1),
        R((it.i1 - it.i0) * static_cast<int>(a.group)),
        table(a.tables + it.b * a.table_stride),
        row_stride(a.n_kv * d) {}
};

// Per-thread scratch, grown to the largest item seen and kept: torch's OpenMP threads persist,
// so a step's 30-odd layer calls allocate nothing.
struct Scratch {
  std::vector<float> q;       // [R, D] scaled fp32 queries, or [D, Rp] transposed (prefill tiles)
  std::vector<uint16_t> qh;   // [R, DP] bf16 queries, zero-padded to whole 32-element chunks
  std::vector<float> o;       // [R, DP] unnormalised output
  std::vector<float> s;       // [R, ld_s] scores (decodes) or [block_size, Rp] (prefill tiles)
  std::vector<uint16_t> p;    // [R, ld_s] bf16 probabilities (decodes on the bf16 dot path)
  std::vector<float> kf, vf;  // [block_size, D] fp32 copies of one head of a block (prefill tiles)
  std::vector<float> m, l, alpha, qpos;  // [Rp]
  std::vector<int64_t> blocks;           // element offsets of one segment's blocks (decodes)
  std::vector<int32_t> pairs;            // bf16 pairs of a prefill tile: queries, P and V of a block

  void reserve(int64_t rp, int64_t dp, int64_t bs, int64_t ld_s) {
    auto grow = [](auto& v, int64_t n) {
      if (static_cast<int64_t>(v.size()) < n) v.resize(n);
    };
    grow(q, rp * dp);
    grow(qh, rp * dp);
    grow(o, rp * dp);
    grow(s, std::max(rp * ld_s, bs * rp));
    grow(p, rp * ld_s);
    grow(kf, bs * dp);
    grow(vf, bs * dp);
    for (auto* v : {&m, &l, &alpha, &qpos}) grow(*v, rp);
    grow(blocks, ld_s / std::max<int64_t>(bs, 1) + 2);
    grow(pairs, rp * dp / 2 + (bs + 1) / 2 * (rp + dp));
  }
};

// The next block sits at an arbitrary address, which no hardware prefetcher can guess. Into L2
// by default: a whole block in L1 would evict the one being worked on. Locality 3 (L1) is for a
// few lines needed within a block's time.
template <int Locality = 2, typename T>
inline void prefetch_rows(const T* base, int nk, int W, int64_t stride) {
  for (int j = 0; j < nk; ++j) {
    const char* row = reinterpret_cast<const char*>(base + j * stride);
    for (int c = 0; c < W * static_cast<int>(sizeof(T)); c += 64) __builtin_prefetch(row + c, 0, Locality);
  }
}

// Online softmax over nk keys for rows s[r * ld_s + j], -inf from nk up to a whole vector: scores
// become p = exp(s - m_new), alpha[r] rescales what the earlier keys accumulated.
inline void softmax_rows(float* s, int64_t ld_s, int R, int nk, float* m, float* l, float* alpha) {
  const int nk_pad = (nk + kV - 1) / kV * kV;
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * ld_s;
    Vec mv(kNegInf);
    for (int j = 0; j < nk_pad; j += kV) mv = at::vec::maximum(mv, Vec::loadu(sr + j));
    // Every row sees key 0 in the first keys, so m is finite from then on: no -inf - -inf.
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

}  // namespace
}  // namespace orcaserve::ORCA_ISA
