// Small SIMD helpers both GEMM paths (gemm.cpp, tiled.cpp) share.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

namespace kvmesh_quant {

// The sum of a float32 vector's 8 lanes.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace kvmesh_quant
#endif
