// The vector pieces of the quantized GEMM (gemm/gemm_quant.cpp) for one ISA variant: fp32 lanes,
// code loads widened to int32 lanes, and the packed layout's constants (docs/kernels.md,
// "Quantized GEMM on the CPU"). Included by that one source, compiled once per variant.
#pragma once

#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

namespace orcaserve::ORCA_ISA {
namespace {

#if defined(__AVX512F__)
using vfloat = __m512;
using vint = __m512i;
constexpr int kLanes = 16;
constexpr int kRows = 8;
// Codes per chunk: the widened chunk, 128 x 48 x 4 bytes = 24 KB, stays in L1.
constexpr int64_t kChunk = 128;
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline vfloat vhalf(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vint vload_s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vint vload_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vint vlow4(vint v) { return _mm512_and_si512(v, _mm512_set1_epi32(0xF)); }
inline vint vhigh4(vint v) { return _mm512_srli_epi32(v, 4); }
inline vint vminus8(vint v) { return _mm512_sub_epi32(v, _mm512_set1_epi32(8)); }
inline vfloat vcvt(vint v) { return _mm512_cvtepi32_ps(v); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
#else
using vfloat = __m256;
using vint = __m256i;
constexpr int kLanes = 8;
constexpr int kRows = 4;
constexpr int64_t kChunk = 256;  // 256 x 24 x 4 bytes = 24 KB
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v); }
inline vfloat vhalf(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vint vload_s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline vint vload_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline vint vlow4(vint v) { return _mm256_and_si256(v, _mm256_set1_epi32(0xF)); }
inline vint vhigh4(vint v) { return _mm256_srli_epi32(v, 4); }
inline vint vminus8(vint v) { return _mm256_sub_epi32(v, _mm256_set1_epi32(8)); }
inline vfloat vcvt(vint v) { return _mm256_cvtepi32_ps(v); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
#endif
constexpr int kCols = 3 * kLanes;
constexpr int64_t kGroup = 32;
// Up to this many rows the codes are widened in registers straight into the FMAs, rows * 3 sums
// beside them; from 3 rows on AVX2 GCC kept several sums on the stack, and a chunk widened once
// into L1 for all rows is the better trade.
constexpr int64_t kFusedRows = kRows / 2;

// The format of a packed weight: code width, whether blocks carry mins (q4_1, q4_k), and whether
// their heads are fp32 (wide: the K-quants, whose per-block scale fp32(d) * sc is no fp16 value).
// Wide 8-bit blocks (q6_k) carry two scale rows, one per 16 k.
struct Format {
  int bits;
  bool offset;
  bool wide;
  constexpr int heads() const { return offset || (wide && bits == 8) ? 2 : 1; }
  constexpr int64_t head_bytes() const { return wide ? sizeof(float) : sizeof(at::Half); }
  constexpr int64_t scale_bytes() const { return heads() * kCols * head_bytes(); }
  constexpr int64_t block_bytes() const { return scale_bytes() + kGroup * kCols * bits / 8; }
};

}  // namespace
}  // namespace orcaserve::ORCA_ISA
