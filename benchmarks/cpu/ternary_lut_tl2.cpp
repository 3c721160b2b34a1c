// bitnet.cpp's TL2 method and tl2v (ternary_lut.cpp describes it).
#include "ternary_lut.h"

namespace ternary_lut {

// ---- tl2 ----
constexpr int64_t kTl2Cols = 64, kTl2Pair = 80, kTl2K = 24;  // K padded to whole blocks of 4 pairs

// Where pair q of a panel keeps its index bytes (+ 0) and sign masks (+ sign_at).
inline int64_t pair_at(int64_t q) { return (q / 4) * 4 * kTl2Pair + 64 * (q % 4); }
inline int64_t sign_at(int64_t q) { return 256 - 64 * (q % 4) + 16 * (q % 4); }

// Lane i of vpunpcklbw's int16 result (a) and of vpunpckhbw's (b) is column tl2_col(i, b).
inline int tl2_col(int i, int half) { return 16 * (i / 8) + 8 * half + i % 8; }

at::Tensor pack_tl2(const at::Tensor& weight, bool column_signs) {
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), kp = up(k, kTl2K), pairs = kp / 6, panels = up(n, kTl2Cols) / kTl2Cols;
  at::Tensor out = at::zeros({panels * pairs * kTl2Pair}, w.options().dtype(at::kByte));
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t q = 0; q < pairs; ++q) {
      uint8_t* block = dst + p * pairs * kTl2Pair + pair_at(q);
      for (int64_t c = 0; c < kTl2Cols; ++c)
        for (int gi = 0; gi < 2; ++gi) {
          const int64_t col = p * kTl2Cols + c, k0 = (2 * q + gi) * 3;
          int v[3], s = 0;
          for (int j = 0; j < 3; ++j) {
            v[j] = code_at(src, n, k, col, k0 + j);
            if (s == 0) s = v[j];
          }
          const int code = 9 * (s * v[0] + 1) + 3 * (s * v[1] + 1) + (s * v[2] + 1);  // 13: all zero
          block[c] |= static_cast<uint8_t>((code - 13) << (4 * gi));
          if (s < 0) {  // mask gi * 2 + half, bit i for column tl2_col(i, half); or bit c of mask gi
            const int half = column_signs ? c / 32 : (c % 16) / 8, i = column_signs ? c % 32 : 8 * (c / 16) + c % 8;
            uint32_t m;
            std::memcpy(&m, block + sign_at(q) + 4 * (2 * gi + half), 4);
            m |= 1u << i;
            std::memcpy(block + sign_at(q) + 4 * (2 * gi + half), &m, 4);
          }
        }
    }
  return out;
}

// A row's tables: per group the 16 sums as int32 (entry e: the triple 9 c0 + 3 c1 + c2 = e + 13,
// weights c - 1), truncated to a low-byte and a high-byte table. 32 bytes a group.
template <bool V>
void tl2_tables(const int16_t* a, int64_t groups, uint8_t* lut) {
  alignas(64) int16_t c01[32], c2[32];
  for (int e = 0; e < 16; ++e) {
    const int code = e < 14 ? e + 13 : 13;  // entries 14, 15 unused: zero
    c01[2 * e] = static_cast<int16_t>(code / 9 - 1);
    c01[2 * e + 1] = static_cast<int16_t>(code / 3 % 3 - 1);
    c2[2 * e] = static_cast<int16_t>(code % 3 - 1);
    c2[2 * e + 1] = 0;
  }
  const __m512i k01 = _mm512_load_si512(c01), k2 = _mm512_load_si512(c2);
  for (int64_t g = 0; g < groups; ++g) {
    int32_t w01, w2;
    std::memcpy(&w01, a + 3 * g, 4);
    std::memcpy(&w2, a + 3 * g + 2, 4);
    const __m512i t = _mm512_add_epi32(_mm512_madd_epi16(_mm512_set1_epi32(w01), k01),
                                       _mm512_madd_epi16(_mm512_set1_epi32(w2), k2));
    if constexpr (V) {  // 64 bytes: low bytes of t, of -t, high bytes of t, of -t
      const __m512i neg = _mm512_sub_epi32(_mm512_setzero_si512(), t);
      uint8_t* d = lut + 64 * g;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm512_cvtepi32_epi8(t));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 16), _mm512_cvtepi32_epi8(neg));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 32), _mm512_cvtepi32_epi8(_mm512_srai_epi32(t, 8)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 48), _mm512_cvtepi32_epi8(_mm512_srai_epi32(neg, 8)));
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lut + 32 * g), _mm512_cvtepi32_epi8(t));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lut + 32 * g + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(t, 8)));
  }
}

// Sums of R rows over groups [g0, g1) of one panel into acc (int32, columns in lane order).
template <bool V, int R>
inline void tl2_block(const uint8_t* panel, int64_t g0, int64_t g1, const uint8_t* lut, int64_t ldl,
                      int32_t* acc /* [R][64] */) {
  const __m512i nib = _mm512_set1_epi8(0x0f), zero = _mm512_setzero_si512();
  for (int64_t f0 = g0; f0 < g1; f0 += kFlush) {
    __m512i s[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = zero;
    for (int64_t g = f0; g < std::min(g1, f0 + kFlush); g += 2) {
      const uint8_t* at = panel + pair_at(g / 2);
      _mm_prefetch(reinterpret_cast<const char*>(at + kAhead), _MM_HINT_T0);
      if (g % 8 == 6) _mm_prefetch(reinterpret_cast<const char*>(at + kAhead + 64), _MM_HINT_T0);  // the masks' line
      const __m512i idx = _mm512_loadu_si512(at);
      const __m512i ix[2] = {_mm512_and_si512(idx, nib), _mm512_and_si512(_mm512_srli_epi16(idx, 4), nib)};
      uint32_t m[4];
      std::memcpy(m, at + sign_at(g / 2), 16);
#pragma GCC unroll 2
      for (int gi = 0; gi < 2; ++gi) {
        if constexpr (V) {
          uint64_t bits;
          std::memcpy(&bits, m + 2 * gi, 8);
          const __m512i sx = _mm512_mask_add_epi8(ix[gi], _cvtu64_mask64(bits), ix[gi], _mm512_set1_epi8(16));
          const __m512i hx = _mm512_or_si512(sx, _mm512_set1_epi8(32));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m512i tab = _mm512_load_si512(lut + r * ldl + 64 * (g + gi));
            const __m512i lo = _mm512_permutexvar_epi8(sx, tab), hi = _mm512_permutexvar_epi8(hx, tab);
            s[r][0] = _mm512_add_epi16(s[r][0], _mm512_unpacklo_epi8(lo, hi));
            s[r][1] = _mm512_add_epi16(s[r][1], _mm512_unpackhi_epi8(lo, hi));
          }
          continue;
        }
        const __mmask32 ka = _cvtu32_mask32(m[2 * gi]), kb = _cvtu32_mask32(m[2 * gi + 1]);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const uint8_t* tab = lut + r * ldl + 32 * (g + gi);
          const __m512i lo = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)tab)), ix[gi]);
          const __m512i hi =
              _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(tab + 16))), ix[gi]);
          const __m512i va = _mm512_unpacklo_epi8(lo, hi), vb = _mm512_unpackhi_epi8(lo, hi);
          s[r][0] = _mm512_add_epi16(s[r][0], _mm512_mask_sub_epi16(va, ka, zero, va));
          s[r][1] = _mm512_add_epi16(s[r][1], _mm512_mask_sub_epi16(vb, kb, zero, vb));
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        for (int q = 0; q < 2; ++q) {
          int32_t* d = acc + r * 64 + h * 32 + q * 16;
          const __m512i w = _mm512_cvtepi16_epi32(q ? _mm512_extracti64x4_epi64(s[r][h], 1)
                                                    : _mm512_castsi512_si256(s[r][h]));
          _mm512_storeu_si512(d, _mm512_add_epi32(_mm512_loadu_si512(d), w));
        }
  }
}

template <bool V>
at::Tensor linear_tl2(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  const int64_t t = x.size(0), kp = up(x.size(1), kTl2K), groups = kp / 3, panels = up(n, kTl2Cols) / kTl2Cols;
  TORCH_CHECK(packed.numel() == panels * (groups / 2) * kTl2Pair, "linear_tl2: packed weight of another shape");
  const std::vector<int16_t> a = widen_rows(x.contiguous(), kp);
  const int64_t ldl = groups * (V ? 64 : 32);
  std::vector<uint8_t> buf(t * ldl + 64);
  uint8_t* lut = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  at::parallel_for(0, t, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) tl2_tables<V>(a.data() + i * (kp + 8), groups, lut + i * ldl);
  });
  at::Tensor out = at::empty({t, n}, x.options().dtype(at::kInt));
  int32_t* o = out.data_ptr<int32_t>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t block = block_for(t, groups, 128);
  int col_of[64];
  for (int i = 0; i < 64; ++i) col_of[i] = tl2_col(i % 32, i / 32);
  at::parallel_for(0, panels, 1, [&](int64_t pb, int64_t pe) {
    std::vector<int32_t> acc((pe - pb) * t * 64, 0);  // [panel][row][lane]
    for (int64_t g0 = 0; g0 < groups; g0 += block)
      for (int64_t p = pb; p < pe; ++p)
        tiles(t, [&](int64_t r0, int64_t rows) {
          dispatch_rows<kRows>(rows, [&](auto rc) {
            tl2_block<V, decltype(rc)::value>(w + p * (groups / 2) * kTl2Pair, g0, std::min(groups, g0 + block),
                                              lut + r0 * ldl, ldl, acc.data() + ((p - pb) * t + r0) * 64);
          });
        });
    for (int64_t p = pb; p < pe; ++p)
      for (int64_t r = 0; r < t; ++r)
        for (int i = 0; i < 64; ++i) {
          const int64_t col = p * kTl2Cols + col_of[i];
          if (col < n) o[r * n + col] = acc[((p - pb) * t + r) * 64 + i];
        }
  });
  return out;
}

template at::Tensor linear_tl2<false>(const at::Tensor&, const at::Tensor&, int64_t);
template at::Tensor linear_tl2<true>(const at::Tensor&, const at::Tensor&, int64_t);

}  // namespace ternary_lut
