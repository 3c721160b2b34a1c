// Prefill tiles on AMX (Intel Sapphire Rapids and later) for attention/paged_attention.cpp, bf16 caches.
//
// The AVX-512 tile kernel (attention/tile.h) does Q K^T and P V with vdpbf16ps, 32
// multiply-adds per instruction; AMX's tile instruction does 8,192. Here both products go through
// ATen's brgemm (oneDNN's AMX micro-kernel, the one PyTorch's own CPU flash attention calls) and
// what is left is the online softmax and the re-layout of K and V into the pairs AMX multiplies.
// It roughly halves a prefill layer call against the AVX-512 kernel (docs/performance-log.md
// #2026-12-04-amx-prefill-attention-one-pass-element-wise-ops-first-tokens-first-sapphire-rapids).
//
// Per item (one KV head, up to kAmxRows query rows), keys in chunks of kAmxKeys gathered from
// their blocks:
//   S [R, np]  = Q [R, D] . K^T, K packed as [D / 2, np] bf16 pairs (AMX's "VNNI" layout);
//   softmax    row by row in fp32 (scale, causal limit, running max and sum, O rescaled);
//   O [R, D]  += P [R, np] . V, P rounded to bf16 (as the other kernels do), V packed as
//                [np / 2, D] pairs of keys.
// Same arithmetic as the vdpbf16ps tile kernel up to the order of fp32 sums: inside a product, and
// the online softmax's rescaling per 128-key chunk instead of per block.
#pragma once

#include <ATen/native/CPUBlas.h>

#include <cstring>

#include "attention/common.h"

namespace orcaserve::ORCA_ISA {
namespace {

constexpr int kAmxKeys = 128;  // keys per chunk: S and P of 128 rows stay in L2
constexpr int kAmxRows = 128;  // rows per item: 8 AMX tiles of 16, several items per long prompt
constexpr int kAmxPad = 32;    // a chunk's keys padded to AMX's bf16 K step

#ifdef ORCA_DPBF16  // every AMX CPU has AVX-512 BF16; the conversions below use it

// Whether bf16 prefill tiles take this path: in the amx variant only (ORCA_AMX, chosen by
// kernels/dispatch.py), and there where ATen's brgemm runs AMX (it packs B only there). The
// avx512_bf16 variant of the same source keeps the vdpbf16ps tile kernel, callable beside it.
inline bool amx_attention() {
#ifdef ORCA_AMX
  static const bool on = at::native::cpublas::could_pack(at::kBFloat16);
  return on;
#else
  return false;
#endif
}

struct AmxScratch {
  std::vector<at::BFloat16> q;  // [R, D] queries, contiguous
  std::vector<int32_t> k;       // [D / 2, np] key pairs
  std::vector<at::BFloat16> v;  // [np / 2, D, 2] value pairs
  std::vector<float> s;         // [R, np] scores
  std::vector<at::BFloat16> p;  // [R, np] probabilities
  std::vector<float> o;         // [R, D] unnormalised output
  std::vector<float> m, l;      // [R] running max and sum

  void reserve(int64_t rows, int64_t d) {
    auto grow = [](auto& x, int64_t n) {
      if (static_cast<int64_t>(x.size()) < n) x.resize(n);
    };
    grow(q, rows * d);
    grow(k, d / 2 * kAmxKeys);
    grow(v, kAmxKeys * d);
    grow(s, rows * kAmxKeys);
    grow(p, rows * kAmxKeys);
    grow(o, rows * d);
    grow(m, rows);
    grow(l, rows);
  }
};

// V rows j and j + 1 (nullptr: zeros) interleaved element by element: dst[2 d + t] = row_t[d].
template <int D>
inline void pair_rows(const at::BFloat16* a, const at::BFloat16* b, at::BFloat16* dst) {
  // Output lane i of the first permute takes a[i / 2] (even i) or b[i / 2] (odd i); the second
  // does the same 16 elements on.
  static const __m512i lo = [] {
    alignas(64) int16_t idx[32];
    for (int i = 0; i < 32; ++i) idx[i] = static_cast<int16_t>(i / 2 + (i & 1 ? 32 : 0));
    return _mm512_load_si512(idx);
  }();
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int c = 0; c < D; c += 32) {
    const __m512i x = a ? _mm512_loadu_si512(a + c) : _mm512_setzero_si512();
    const __m512i y = b ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512();
    _mm512_storeu_si512(dst + 2 * c, _mm512_permutex2var_epi16(x, lo, y));
    _mm512_storeu_si512(dst + 2 * c + 32, _mm512_permutex2var_epi16(x, hi, y));
  }
}

// One prefill item through AMX: rows r = (token i0 + r / G, query head h0 G + r % G).
template <int D>
void attend_tile_amx(const Args& a, const Item& it, AmxScratch& sc) {
  using T = at::BFloat16;
  static_assert(D % 32 == 0, "AMX tiles: whole 32-element rows");
  const int G = static_cast<int>(a.group);
  const int64_t bs = a.block_size;
  const Span sp(a, it, D);
  const int R = sp.R;
  const int64_t kmax = sp.kmax;
  const T* kc = static_cast<const T*>(a.k_cache) + it.h0 * D;
  const T* vc = static_cast<const T*>(a.v_cache) + it.h0 * D;
  auto token = [&](int r) { return it.i0 + r / G; };
  auto head = [&](int r) { return it.h0 * G + r % G; };
  auto key_row = [&](const T* cache, int64_t key) {
    return cache + (static_cast<int64_t>(sp.table[key / bs]) * bs + key % bs) * sp.row_stride;
  };

  T* q = sc.q.data();
  float* s = sc.s.data();
  T* p = sc.p.data();
  float* o = sc.o.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  for (int r = 0; r < R; ++r) {
    const T* src = static_cast<const T*>(a.q) + (sp.q_begin + token(r)) * a.sq_t + head(r) * a.sq_h;
    std::memcpy(q + r * D, src, D * sizeof(T));
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  const Vec vscale(a.scale);
  for (int64_t k0 = 0; k0 < kmax; k0 += kAmxKeys) {
    const int nk = static_cast<int>(std::min<int64_t>(kAmxKeys, kmax - k0));
    const int np = (nk + kAmxPad - 1) / kAmxPad * kAmxPad;
    // K^T as pairs along D: k[d2 * np + j] = (K[j][2 d2], K[j][2 d2 + 1]); padding keys are 0.
    int32_t* kp = sc.k.data();
    for (int j = 0; j < np; ++j) {
      if (j < nk) {
        int32_t row[D / 2];
        std::memcpy(row, key_row(kc, k0 + j), sizeof(row));
        for (int d2 = 0; d2 < D / 2; ++d2) kp[d2 * np + j] = row[d2];
      } else {
        for (int d2 = 0; d2 < D / 2; ++d2) kp[d2 * np + j] = 0;
      }
    }
    for (int j = 0; j < np; j += 2)
      pair_rows<D>(j < nk ? key_row(vc, k0 + j) : nullptr, j + 1 < nk ? key_row(vc, k0 + j + 1) : nullptr,
                   sc.v.data() + j * D);
    at::native::cpublas::brgemm(R, np, D, D, np, np, false, q, reinterpret_cast<const T*>(kp), s);

    for (int r = 0; r < R; ++r) {
      // Keys this row may see in the chunk: up to its own position (at least key 0 in chunk 0,
      // so m is finite from then on and no -inf - -inf arises).
      const int64_t pos = sp.first_pos + token(r);
      const int lim = static_cast<int>(std::clamp<int64_t>(pos - k0 + 1, 0, nk));
      float* sr = s + r * np;
      T* pr = p + r * np;
      Vec mv(kNegInf);
      for (int j = 0; j < lim; j += kV) {
        Vec x = Vec::loadu(sr + j) * vscale;
        if (j + kV > lim) x = Vec::set(Vec(kNegInf), x, lim - j);
        x.store(sr + j);
        mv = at::vec::maximum(mv, x);
      }
      const float m_new = std::max(m[r], hmax(mv));
      const float alpha = lim > 0 ? std::exp(m[r] - m_new) : 1.f;
      const Vec mn(m_new);
      Vec sum(0.f);
      for (int j = 0; j < np; j += kV) {
        Vec x(0.f);
        if (j < lim) {
          x = (Vec::loadu(sr + j) - mn).exp_u20();  // -inf past lim: 0
          sum = sum + x;
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), to_bf16(x));
      }
      l[r] = l[r] * alpha + hsum(sum);
      m[r] = m_new;
      if (k0 > 0 && alpha != 1.f) {
        const Vec av(alpha);
        for (int d = 0; d < D; d += kV) (Vec::loadu(o + r * D + d) * av).store(o + r * D + d);
      }
    }
    at::native::cpublas::brgemm(R, D, np, np, D, D, k0 > 0, p, sc.v.data(), o);
  }

  for (int r = 0; r < R; ++r) {
    const Vec inv(1.f / l[r]);
    T* dst = static_cast<T*>(a.out) + (sp.q_begin + token(r)) * a.so_t + head(r) * a.so_h;
    for (int d = 0; d < D; d += kV)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), to_bf16(Vec::loadu(o + r * D + d) * inv));
  }
}

#else
inline bool amx_attention() { return false; }
#endif

}  // namespace
}  // namespace orcaserve::ORCA_ISA
