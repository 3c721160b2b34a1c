// The vector pieces of the int8-activation GEMM (gemm/gemm_int8.cpp, gemm/pack_int8.cpp) for one ISA
// variant: int32 lanes that each sum 4 products of an unsigned weight byte and a signed activation
// byte, fp32 lanes, and the packed layout's constants (docs/int8-activations.md, "Kernels per ISA").
// - AVX-512 VNNI (avx512_bf16 and amx variants, built with -mavx512vnni): vpdpbusd, 64 products
//   per instruction into int32, never saturating.
// - AVX-512 BW (avx512) and AVX2: vpmaddubsw (pairs into int16, saturating) then vpmaddwd by 1.
//   Exact while |u * s + u' * s'| <= 32767: weight bytes <= 63 (q4_*, q6_k + 32) with |s| <= 127;
//   q8_0 goes through `dot_signed` (|w| <= 128 unsigned, the sign moved onto the activation).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace orcaserve::ORCA_ISA {
namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
using vi = __m512i;
using vf = __m512;
constexpr int kL = 16;  // int32 / fp32 lanes: output columns per vector
// Rows per tile: up to 8 for calls of up to kFewRows rows, one pass over a panel for a speculative
// step's 1 + K; a tile of more than kAccRows rows keeps its fp32 sums in L1 (gemm_int8.cpp's tile). Calls of
// more rows take tiles of kAccRows, all in registers (2-4 % faster there, compute-bound).
constexpr int kTileRows = 8;
constexpr int kAccRows = 4;
inline vi izero() { return _mm512_setzero_si512(); }
inline vi iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline vi ibcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline vi ibcast32(int32_t v) { return _mm512_set1_epi32(v); }
inline vi lo4(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline vi hi4(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline vi isub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vi iadd(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vf fzero() { return _mm512_setzero_ps(); }
inline vf fload(const float* p) { return _mm512_loadu_ps(p); }
inline vf fbcast(float v) { return _mm512_set1_ps(v); }
inline vf fcvt(vi v) { return _mm512_cvtepi32_ps(v); }
inline vf fmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf fadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline void fstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
inline vi dot(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
constexpr bool kVnni = false;
inline vi dot(vi acc, vi u, vi s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
}
#endif
// acc += w * s for signed w (q8_0 without VNNI): |w| as the unsigned operand, w's sign onto s.
inline vi wabs(vi w) { return _mm512_abs_epi8(w); }
inline vi dot_signed(vi acc, vi w, vi absw, vi s) {
  return dot(acc, absw, _mm512_mask_sub_epi8(s, _mm512_movepi8_mask(w), _mm512_setzero_si512(), s));
}
#else
using vi = __m256i;
using vf = __m256;
constexpr int kL = 8;
constexpr int kTileRows = 2;
constexpr int kAccRows = 2;
constexpr bool kVnni = false;
inline vi izero() { return _mm256_setzero_si256(); }
inline vi iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi ibcast(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline vi ibcast32(int32_t v) { return _mm256_set1_epi32(v); }
inline vi lo4(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline vi hi4(vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline vi isub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
inline vi iadd(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vf fzero() { return _mm256_setzero_ps(); }
inline vf fload(const float* p) { return _mm256_loadu_ps(p); }
inline vf fbcast(float v) { return _mm256_set1_ps(v); }
inline vf fcvt(vi v) { return _mm256_cvtepi32_ps(v); }
inline vf fmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf fadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline void fstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vi dot(vi acc, vi u, vi s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline vi wabs(vi w) { return _mm256_abs_epi8(w); }
inline vi dot_signed(vi acc, vi w, vi absw, vi s) { return dot(acc, absw, _mm256_sign_epi8(s, w)); }
#endif

constexpr int kC = 2;  // column vectors per panel
constexpr int64_t kFewRows = 16;  // calls up to which row tiles take kTileRows (above kAccRows)
constexpr int kPanel = kC * kL;  // output columns per panel: 32 (AVX-512), 16 (AVX2)
constexpr int64_t kBlock = 32;  // k per block: one activation scale, one weight scale (q6_k: two)

// A packed weight's format: code width, mins (q4_1, q4_k), and for 8 bits whether scales are per
// 16 k (q6_k, "wide"). Blocks hold fp32 heads for every format: [spans][kPanel] scales, then
// [kPanel] mins, then the codes as 8 groups of 4 k: group g, column j at bytes (g * kPanel + j) * 4
// (8 bits), or 4 groups whose low nibbles hold k = 4g.. and high nibbles k = 16 + 4g.. (4 bits).
struct Int8Format {
  int bits;
  bool offset;
  bool wide;
  constexpr int spans() const { return bits == 8 && wide ? 2 : 1; }
  // What the stored unsigned byte adds to the signed code: u = q + shift.
  constexpr int shift() const {
    if (bits == 8) return wide ? 32 : (kVnni ? 128 : 0);  // q8_0 without VNNI: stored signed
    return offset ? 0 : 8;
  }
  constexpr bool signed_codes() const { return bits == 8 && !wide && !kVnni; }
  constexpr int64_t head_bytes() const { return (spans() + (offset ? 1 : 0)) * kPanel * 4; }
  constexpr int64_t block_bytes() const { return head_bytes() + kBlock * kPanel * bits / 8; }
};

}  // namespace
}  // namespace orcaserve::ORCA_ISA
