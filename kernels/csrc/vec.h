// Vector helpers shared by the C++ CPU kernels: one vector type `vf` of kW float32 lanes for the
// widest instruction set this build was compiled for, loads and stores of float32 and bfloat16
// (bf16 storage, float32 arithmetic), exp for non-positive arguments, horizontal sums.
//
// The path is picked at build time from the compiler's macros (the build is -march=native, or a
// narrower -mno-... variant for tests, see kernels/cpu_kernels.py):
//   AVX-512F + BW           kW = 16  (__m512)
//   + AVX512-BF16           bf16 dot products with vdpbf16ps, float32 -> bf16 with vcvtneps2bf16
//   + AMX-BF16 (and -INT8)  bf16 paged attention on tiles (attention_amx.cpp)
//   AVX2 + FMA              kW = 8   (__m256)
//   neither                 no vf: the kernels' plain loops, vectorised by the compiler
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVMESH_AVX2 1
#else
#define KVMESH_AVX2 0
#endif

#if KVMESH_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__)
#define KVMESH_AVX512 1
#else
#define KVMESH_AVX512 0
#endif

#if KVMESH_AVX512 && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define KVMESH_AVX512BF16 1
#else
#define KVMESH_AVX512BF16 0
#endif

// AMX-BF16 tiles (Sapphire Rapids and later): paged attention's products (attention_amx.cpp)
#if KVMESH_AVX512BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define KVMESH_AMX 1
#else
#define KVMESH_AMX 0
#endif

#define KVMESH_SIMD KVMESH_AVX2

// 8-bit float KV codes widened in vectors through float16 (vcvtph2ps: F16C, or AVX-512F)
#if KVMESH_AVX2 && defined(__F16C__)
#define KVMESH_FP8_VEC 1
#else
#define KVMESH_FP8_VEC 0
#endif

namespace kvmesh {

using bf16 = c10::BFloat16;
using fp8e4m3 = c10::Float8_e4m3fn;   // --kv-cache-dtype fp8 / fp8_e4m3
using fp8e5m2 = c10::Float8_e5m2;     // --kv-cache-dtype fp8_e5m2

// The instruction-set path this build runs (logged by kernels/cpu_kernels.py).
inline const char* isa_name() {
#if KVMESH_AMX
  return "amx";
#elif KVMESH_AVX512BF16
  return "avx512_bf16";
#elif KVMESH_AVX512
  return "avx512";
#elif KVMESH_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

inline float to_f(float x) { return x; }
inline float to_f(bf16 x) { return static_cast<float>(x); }
inline float to_f(fp8e4m3 x) { return static_cast<float>(x); }   // exact, c10's conversion
inline float to_f(fp8e5m2 x) { return static_cast<float>(x); }
template <typename T>
inline T from_f(float x) { return static_cast<T>(x); }   // bf16: round to nearest even (c10)

// exp(x) for x <= 0 (scores minus their max), Cephes' single-precision polynomial: within ~2 ulp
// of std::exp, branch-free so loops over it vectorize.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if KVMESH_AVX2
// 8-lane helpers, used by both vector paths (an AVX-512 sum folds to 8 lanes first).
inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// [sum(a0), ..., sum(a7)]
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                    __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

#if KVMESH_AVX512
constexpr int64_t kW = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
// float32 -> bf16, round to nearest even, NaN kept a (quiet) NaN: c10::BFloat16's rounding.
inline __m256i to_bf16_bits(vf x) {
#if KVMESH_AVX512BF16
  return (__m256i)_mm512_cvtneps_pbh(x);  // same bits, another vector type
#else
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}
inline void vstore(bf16* p, vf x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(x)); }
inline float vhsum(vf a) {
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(a),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
}
inline __m256 fold8(vf a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
inline vf vfloor(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline vf vexp2i(vf n) {  // 2^n for integral n in float range
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline vf vselect_ge0(vf v, vf if_ge, vf if_lt) {  // v >= 0 ? if_ge : if_lt
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ), if_lt, if_ge);
}
inline vf vneg_abs(vf v) { return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN))); }
#elif KVMESH_AVX2
constexpr int64_t kW = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline __m128i to_bf16_bits(vf x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  r = _mm256_srli_epi32(r, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void vstore(bf16* p, vf x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_bits(x)); }
inline float vhsum(vf a) { return hsum(a); }
inline __m256 fold8(vf a) { return a; }
inline vf vfloor(vf x) { return _mm256_floor_ps(x); }
inline vf vexp2i(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vf vselect_ge0(vf v, vf if_ge, vf if_lt) {
  return _mm256_blendv_ps(if_lt, if_ge, _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_GE_OQ));
}
inline vf vneg_abs(vf v) { return _mm256_or_ps(v, _mm256_set1_ps(-0.0f)); }
#endif

#if KVMESH_FP8_VEC
// kW 8-bit float codes widened exactly to float32, through float16 bits: an e5m2 code is the
// top byte of the float16 of its value; an e4m3 code's magnitude bits shifted into a float16's
// exponent and mantissa fields are its value times 2^-8 (both biases differ by 8, and float16's
// subnormals cover e4m3's), so the float is scaled back by 256 (exact). e4m3fn's NaN codes
// (0x7f, 0xff) read as +-480: the cache's writer saturates, it never stores them.
// e4m3: the code sign-extended to 16 bits and shifted left by 7 holds the sign in bit 15, a
// second copy of it in bit 14 (cleared: the top of float16's exponent field) and the exponent
// and mantissa in bits 13..7.
// kW float16 words (hw) from kW bytes, zero- or sign-extended; shifted, masked, widened to float
#if KVMESH_AVX512
using hw = __m256i;
inline __m128i fp8_bytes(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline hw hw_u8(const void* p) { return _mm256_cvtepu8_epi16(fp8_bytes(p)); }
inline hw hw_i8(const void* p) { return _mm256_cvtepi8_epi16(fp8_bytes(p)); }
inline hw hw_shl(hw x, int n) { return _mm256_slli_epi16(x, n); }
inline hw hw_and(hw x, int16_t m) { return _mm256_and_si256(x, _mm256_set1_epi16(m)); }
inline vf hw_to_f(hw x) { return _mm512_cvtph_ps(x); }
#else
using hw = __m128i;
inline __m128i fp8_bytes(const void* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline hw hw_u8(const void* p) { return _mm_cvtepu8_epi16(fp8_bytes(p)); }
inline hw hw_i8(const void* p) { return _mm_cvtepi8_epi16(fp8_bytes(p)); }
inline hw hw_shl(hw x, int n) { return _mm_slli_epi16(x, n); }
inline hw hw_and(hw x, int16_t m) { return _mm_and_si128(x, _mm_set1_epi16(m)); }
inline vf hw_to_f(hw x) { return _mm256_cvtph_ps(x); }
#endif
inline vf vload(const fp8e5m2* p) { return hw_to_f(hw_shl(hw_u8(p), 8)); }
inline vf vload(const fp8e4m3* p) {
  return vmul(hw_to_f(hw_and(hw_shl(hw_i8(p), 7), static_cast<int16_t>(0xbfff))), vset1(256.0f));
}
#elif KVMESH_SIMD
// (a vector build without F16C: the codes widened one by one)
template <typename C>
inline vf vload_codes(const C* p) {
  alignas(64) float f[kW];
  for (int64_t i = 0; i < kW; ++i) f[i] = to_f(p[i]);
  return vload(f);
}
inline vf vload(const fp8e5m2* p) { return vload_codes(p); }
inline vf vload(const fp8e4m3* p) { return vload_codes(p); }
#endif

#if KVMESH_SIMD
// x rounded to T and back (identity for float32): the rounding a torch op in T does.
inline vf vround(vf x, const float*) { return x; }
inline vf vround(vf x, const bf16*) {
#if KVMESH_AVX512
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(x)), 16));
#else
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16_bits(x)), 16));
#endif
}

// exp_nonpos on kW lanes, the same polynomial and rounding steps.
inline vf vexp_nonpos(vf x) {
  x = vmax(x, vset1(-87.0f));
  const vf n = vfloor(vadd(vmul(x, vset1(1.44269504088896341f)), vset1(0.5f)));
  vf r = vsub(x, vmul(n, vset1(0.693359375f)));
  r = vadd(r, vmul(n, vset1(2.12194440e-4f)));
  vf p = vset1(1.9875691500e-4f);
  p = vadd(vmul(p, r), vset1(1.3981999507e-3f));
  p = vadd(vmul(p, r), vset1(8.3334519073e-3f));
  p = vadd(vmul(p, r), vset1(4.1665795894e-2f));
  p = vadd(vmul(p, r), vset1(1.6666665459e-1f));
  p = vadd(vmul(p, r), vset1(5.0000001201e-1f));
  p = vadd(vadd(vmul(vmul(p, r), r), r), vset1(1.0f));
  return vmul(p, vexp2i(n));
}
#endif

}  // namespace kvmesh
