// c10's float -> bf16 conversion on an AVX-512 vector (nearest even, denormals kept, a NaN to
// 0x7fc0): bit for bit `static_cast<at::BFloat16>(float)` lane by lane, without vcvtneps2bf16
// (which reads denormals as zero). The int8 GEMM's bf16 output (gemm/int8_out.h) and the LoRA
// update's roundings (gemm/lora_dp.h; gemm/lora_fma.h its integer rounding, round_bits) take it.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace orcaserve::ORCA_ISA {
namespace {

// u + 0x7fff + (bit 16 of u): bf16's nearest even in the high half (c10's integer rounding; the
// low half and a NaN left to the caller).
inline __m512i round_bits(__m512i u) {
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
}

// v rounded to bf16, back in fp32 (the low 16 bits of each lane zero).
inline __m512 bf16_round(__m512 v) {
  const __m512i r =
      _mm512_and_si512(round_bits(_mm512_castps_si512(v)), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000)));
}

// The same as 16 bf16 bit patterns, each in the low half of its 32-bit lane.
inline __m512i bf16_bits(__m512 v) { return _mm512_srli_epi32(_mm512_castps_si512(bf16_round(v)), 16); }

}  // namespace
}  // namespace orcaserve::ORCA_ISA
#endif
