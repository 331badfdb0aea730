// Small SIMD helpers both GEMM paths (gemm.cpp, tiled.cpp) share.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

#include <cstdint>

namespace kvmesh_quant {

// The sum of a float32 vector's 8 lanes.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Q5_0 / Q5_1 (blocks.h): the 32 bits of qh as 32 bytes, byte i 0x10 where bit i is set (the
// fifth bit of code i): each byte takes qh's byte i / 8, keeps bit i % 8, and a compare makes
// that a mask.
inline __m256i fifth_bits(uint32_t qh) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

}  // namespace kvmesh_quant
#endif
