// perm27 (ternary_lut.cpp describes it).
#include "ternary_lut.h"

namespace ternary_lut {

// ---- perm27 ----
constexpr int64_t kPermCols = 32, kPermTriple = 64;

at::Tensor pack_perm27(const at::Tensor& weight) {
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), kp = up(k, 9), triples = kp / 9, panels = up(n, kPermCols) / kPermCols;
  at::Tensor out = at::zeros({panels * triples * kPermTriple}, w.options().dtype(at::kByte));
  const int8_t* src = w.data_ptr<int8_t>();
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<uint8_t>());
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t q = 0; q < triples; ++q)
      for (int64_t c = 0; c < kPermCols; ++c) {
        uint16_t word = 0;
        for (int gi = 0; gi < 3; ++gi) {
          const int64_t col = p * kPermCols + c, k0 = (3 * q + gi) * 3;
          int code = 0;
          for (int j = 0; j < 3; ++j) code = 3 * code + code_at(src, n, k, col, k0 + j) + 1;
          word |= static_cast<uint16_t>(code << (5 * gi));
        }
        dst[(p * triples + q) * kPermCols + c] = word;
      }
  return out;
}

// A row's tables: per group the 27 sums as int16 (entry 9 c0 + 3 c1 + c2, weights c - 1), 64 bytes.
void perm27_tables(const int16_t* a, int64_t groups, int16_t* lut) {
  alignas(64) int16_t c[3][32];
  for (int e = 0; e < 32; ++e)
    for (int j = 0; j < 3; ++j) c[j][e] = static_cast<int16_t>(e < 27 ? (j == 0 ? e / 9 : j == 1 ? e / 3 % 3 : e % 3) - 1 : 0);
  const __m512i k0 = _mm512_load_si512(c[0]), k1 = _mm512_load_si512(c[1]), k2 = _mm512_load_si512(c[2]);
  for (int64_t g = 0; g < groups; ++g) {
    const int16_t* v = a + 3 * g;
    const __m512i t = _mm512_add_epi16(_mm512_add_epi16(_mm512_mullo_epi16(_mm512_set1_epi16(v[0]), k0),
                                                        _mm512_mullo_epi16(_mm512_set1_epi16(v[1]), k1)),
                                       _mm512_mullo_epi16(_mm512_set1_epi16(v[2]), k2));
    _mm512_storeu_si512(lut + 32 * g, t);
  }
}

template <int R>
inline void perm27_block(const uint8_t* panel, int64_t g0, int64_t g1, const int16_t* lut, int64_t ldl,
                         int32_t* acc /* [R][32] */) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t f0 = g0; f0 < g1; f0 += kFlush - 1) {  // kFlush - 1: whole triples (63 groups)
    __m512i s[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) s[r] = zero;
    for (int64_t g = f0; g < std::min(g1, f0 + kFlush - 1); g += 3) {
      const uint8_t* at = panel + (g / 3) * kPermTriple;
      _mm_prefetch(reinterpret_cast<const char*>(at + kAhead), _MM_HINT_T0);
      const __m512i i0 = _mm512_loadu_si512(at);
      const __m512i ix[3] = {i0, _mm512_srli_epi16(i0, 5), _mm512_srli_epi16(i0, 10)};
#pragma GCC unroll 3
      for (int gi = 0; gi < 3; ++gi)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          s[r] = _mm512_add_epi16(s[r], _mm512_permutexvar_epi16(ix[gi], _mm512_load_si512(lut + r * ldl + 32 * (g + gi))));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < 2; ++q) {
        int32_t* d = acc + r * 32 + q * 16;
        const __m512i w = _mm512_cvtepi16_epi32(q ? _mm512_extracti64x4_epi64(s[r], 1) : _mm512_castsi512_si256(s[r]));
        _mm512_storeu_si512(d, _mm512_add_epi32(_mm512_loadu_si512(d), w));
      }
  }
}

at::Tensor linear_perm27(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  const int64_t t = x.size(0), kp = up(x.size(1), 9), groups = kp / 3, panels = up(n, kPermCols) / kPermCols;
  TORCH_CHECK(packed.numel() == panels * (groups / 3) * kPermTriple, "linear_perm27: packed weight of another shape");
  const std::vector<int16_t> a = widen_rows(x.contiguous(), kp);
  const int64_t ldl = groups * 32;  // int16 entries: 64 bytes a group, each table on its own cache line
  std::vector<int16_t> buf(t * ldl + 32);
  int16_t* lut = reinterpret_cast<int16_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  at::parallel_for(0, t, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) perm27_tables(a.data() + i * (kp + 8), groups, lut + i * ldl);
  });
  at::Tensor out = at::empty({t, n}, x.options().dtype(at::kInt));
  int32_t* o = out.data_ptr<int32_t>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t block = block_for(t, groups, 63);
  at::parallel_for(0, panels, 1, [&](int64_t pb, int64_t pe) {
    std::vector<int32_t> acc((pe - pb) * t * 32, 0);
    for (int64_t g0 = 0; g0 < groups; g0 += block)
      for (int64_t p = pb; p < pe; ++p)
        tiles(t, [&](int64_t r0, int64_t rows) {
          dispatch_rows<kRows>(rows, [&](auto rc) {
            perm27_block<decltype(rc)::value>(w + p * (groups / 3) * kPermTriple, g0, std::min(groups, g0 + block),
                                              lut + r0 * ldl, ldl, acc.data() + ((p - pb) * t + r0) * 32);
          });
        });
    for (int64_t p = pb; p < pe; ++p)
      for (int64_t r = 0; r < t; ++r)
        for (int i = 0; i < 32; ++i) {
          const int64_t col = p * kPermCols + i;
          if (col < n) o[r * n + col] = acc[((p - pb) * t + r) * 32 + i];
        }
  });
  return out;
}


}  // namespace ternary_lut
