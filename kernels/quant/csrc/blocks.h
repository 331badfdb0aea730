// GGUF block layouts, unpacked one weight row at a time: the one place that knows where each bit
// of a Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_NL / IQ4_XS block
// lives.
//
// Every format is read as 32-element sub-blocks, each split in two halves of 16 elements, with
//   value[i] = a[h] * q[i] + c[h]        (h = i / 16; q unsigned, except the kSigned formats:
//                                          int8, c = 0: Q8_0's bytes, IQ4's codes through its table)
// so the float path rebuilds a weight as a * q + c and the int8 path computes
//   sum_i value[i] * x[i] ~ dx * (a[h] * sum_i q[i] * xq[i] + c[h] * sum_i xq[i])  per half.
// (Q2_K / Q3_K / Q6_K scales cover 16 elements, hence the halves; the others have a[0] == a[1].)
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace kvmesh_quant {

// The ggml type numbers (gguf.GGMLQuantizationType).
enum Format : int {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23
};

// Elements per block: the K formats and IQ4_XS hold 256, the others 32.
template <int F>
constexpr int kQK = F == Q2_K || F == Q3_K || F == Q4_K || F == Q5_K || F == Q6_K || F == IQ4_XS ? 256 : 32;

// Formats whose codes are signed bytes with no constant term (value = a * q).
template <int F>
constexpr bool kSigned = F == Q8_0 || F == IQ4_NL || F == IQ4_XS;

// IQ4_NL / IQ4_XS: the 16 values a 4-bit code stands for (a non-uniform grid, times the scale).
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// fn(std::integral_constant<int, F>{}) for the runtime format `fmt`: the one switch every path
// instantiates its per-format template through; an unknown type is a clear error.
template <typename Fn>
void dispatch(int64_t fmt, Fn&& fn) {
  switch (fmt) {
    case Q4_0: fn(std::integral_constant<int, Q4_0>{}); break;
    case Q4_1: fn(std::integral_constant<int, Q4_1>{}); break;
    case Q5_0: fn(std::integral_constant<int, Q5_0>{}); break;
    case Q5_1: fn(std::integral_constant<int, Q5_1>{}); break;
    case Q8_0: fn(std::integral_constant<int, Q8_0>{}); break;
    case Q2_K: fn(std::integral_constant<int, Q2_K>{}); break;
    case Q3_K: fn(std::integral_constant<int, Q3_K>{}); break;
    case IQ4_NL: fn(std::integral_constant<int, IQ4_NL>{}); break;
    case IQ4_XS: fn(std::integral_constant<int, IQ4_XS>{}); break;
    case Q4_K: fn(std::integral_constant<int, Q4_K>{}); break;
    case Q5_K: fn(std::integral_constant<int, Q5_K>{}); break;
    case Q6_K: fn(std::integral_constant<int, Q6_K>{}); break;
    default: TORCH_CHECK(false, "unsupported GGUF quantization type ", fmt);
  }
}

struct Sub {          // one 32-element sub-block's affine map, per 16-element half
  float a[2];
  float c[2];
};

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// elements per block and bytes per block of each format
inline int block_elems(int fmt) {
  int qk = 0;
  dispatch(fmt, [&](auto f) { qk = kQK<decltype(f)::value>; });
  return qk;
}
inline int block_bytes(int fmt) {
  switch (fmt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case IQ4_NL: return 18;
    case IQ4_XS: return 136;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q3_K: the 6-bit scale of 16-element group j (0..15) from the 12 packed bytes (low 4 bits in
// bytes 0-7, two high bits in bytes 8-11), as a signed value (stored + 32).
inline int scale_k3(int j, const uint8_t* s) {
  const int low = j < 8 ? s[j] & 0x0F : s[j - 8] >> 4;
  const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
  return (low | (high << 4)) - 32;
}

// IQ4_XS: the scale of 32-element group g (0..7): 4 low bits in bytes 4-7, 2 high bits in the
// 16-bit word at byte 2, stored + 32.
inline int iq4xs_scale(int g, const uint8_t* blk) {
  const int low = (blk[4 + g / 2] >> (4 * (g % 2))) & 0x0F;
  const int high = (blk[2 + g / 4] >> (2 * (g % 4))) & 3;
  return (low | (high << 4)) - 32;
}

// Q5_0 / Q5_1: the fifth bit of element i (0..31) is bit i of the little-endian 32-bit qh.
inline uint32_t load_qh(const uint8_t* p) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  return qh;
}

#if defined(__AVX2__)
// The codes of the formats whose scalar unpacking does not vectorize, 32 at a time (unpack_block
// stores them; tiled.cpp's dequantizer rebuilds weights from them).

// 16 bytes of 4-bit codes as 32 bytes: the low nibbles (elements 0..15), then the high ones.
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

// Q5_0 / Q5_1: the block's 32 five-bit codes.
template <int F>
inline __m256i codes_q5(const uint8_t* blk) {
  return _mm256_or_si256(nibbles32(blk + (F == Q5_0 ? 6 : 8)), fifth_bits(load_qh(blk + (F == Q5_0 ? 2 : 4))));
}

// Q6_K: the 32 six-bit codes of sub-block 4 h + g (low 4 bits from ql, high 2 from qh).
inline __m256i codes_q6k(const uint8_t* blk, int h, int g) {
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + h * 64 + (g % 2) * 32));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + h * 32));
  return _mm256_or_si256(
      _mm256_and_si256(_mm256_srli_epi16(lo, 4 * (g / 2)), _mm256_set1_epi8(0x0F)),
      _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 2 * g), _mm256_set1_epi8(0x03)), 4));
}

// IQ4_NL / IQ4_XS: 16 bytes of codes as their 32 values in kIQ4Values (signed bytes), by vpshufb.
inline __m256i values_iq4(const uint8_t* qs) {
  const __m128i grid = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values));
  return _mm256_shuffle_epi8(_mm256_set_m128i(grid, grid), nibbles32(qs));
}
#endif

// Unpack block `blk` of format F: q[0 .. block_elems) and one Sub per 32 elements.
template <int F>
inline void unpack_block(const uint8_t* blk, uint8_t* q, Sub* sub) {
  if constexpr (F == Q8_0) {
    const float d = half_to_float(blk);
    std::memcpy(q, blk + 2, 32);                       // int8 bit patterns
    sub[0] = {{d, d}, {0.f, 0.f}};
  } else if constexpr (F == Q4_0 || F == Q4_1) {
    const float d = half_to_float(blk);
    const float c = F == Q4_0 ? -8.f * d : half_to_float(blk + 2);
    const uint8_t* qs = blk + (F == Q4_0 ? 2 : 4);
    for (int i = 0; i < 16; ++i) {                     // low nibbles: 0..15, high: 16..31
      q[i] = qs[i] & 0x0F;
      q[i + 16] = qs[i] >> 4;
    }
    sub[0] = {{d, d}, {c, c}};
  } else if constexpr (F == Q5_0 || F == Q5_1) {
    const float d = half_to_float(blk);
    const float c = F == Q5_0 ? -16.f * d : half_to_float(blk + 2);
#if defined(__AVX2__)
    // NOTE: the loop below does not vectorize (a shift by each element's index)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), codes_q5<F>(blk));
#else
    const uint32_t qh = load_qh(blk + (F == Q5_0 ? 2 : 4));
    const uint8_t* qs = blk + (F == Q5_0 ? 6 : 8);
    for (int i = 0; i < 16; ++i) {                     // low nibbles: 0..15, high: 16..31
      q[i] = static_cast<uint8_t>((qs[i] & 0x0F) | (((qh >> i) & 1) << 4));
      q[i + 16] = static_cast<uint8_t>((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4));
    }
#endif
    sub[0] = {{d, d}, {c, c}};
  } else if constexpr (F == Q2_K || F == Q3_K) {
    // Sub-block s = 4 h + j (h: which 128 elements, j: which 2-bit plane) takes its codes from
    // bits 2j of qs[32 h .. 32 h + 32); Q3_K adds bit s of hmask[e] as the code's third bit.
    const uint8_t* qs = blk + (F == Q2_K ? 16 : 32);
    for (int s = 0; s < 8; ++s) {
      const int h = s / 4, shift = 2 * (s % 4);
      for (int e = 0; e < 32; ++e) {
        uint8_t v = (qs[h * 32 + e] >> shift) & 3;
        if constexpr (F == Q3_K) v |= ((blk[e] >> s) & 1) << 2;
        q[s * 32 + e] = v;
      }
    }
    if constexpr (F == Q2_K) {                         // value = d (sc & 15) q - dmin (sc >> 4)
      const float d = half_to_float(blk + 80), dmin = half_to_float(blk + 82);
      for (int s = 0; s < 8; ++s) {
        const uint8_t s0 = blk[2 * s], s1 = blk[2 * s + 1];
        sub[s] = {{d * (s0 & 0x0F), d * (s1 & 0x0F)}, {-(dmin * (s0 >> 4)), -(dmin * (s1 >> 4))}};
      }
    } else {                                           // value = d scale (q - 4)
      const float d = half_to_float(blk + 108);
      for (int s = 0; s < 8; ++s) {
        const float a0 = d * scale_k3(2 * s, blk + 96), a1 = d * scale_k3(2 * s + 1, blk + 96);
        sub[s] = {{a0, a1}, {-4.f * a0, -4.f * a1}};
      }
    }
  } else if constexpr (F == IQ4_NL || F == IQ4_XS) {
    // 32-element groups of 16 bytes (low nibbles: elements 0..15, high: 16..31), each code an
    // index into kIQ4Values; IQ4_XS: 8 groups, each with a 6-bit scale (stored + 32)
    const float d = half_to_float(blk);
    constexpr int G = F == IQ4_NL ? 1 : 8;
    const uint8_t* qs = blk + (F == IQ4_NL ? 2 : 8);
    for (int g = 0; g < G; ++g) {
#if defined(__AVX2__)
      // NOTE: a table lookup per byte in the loop below; vpshufb looks up 32 at once
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + g * 32), values_iq4(qs + g * 16));
#else
      for (int i = 0; i < 16; ++i) {
        q[g * 32 + i] = static_cast<uint8_t>(kIQ4Values[qs[g * 16 + i] & 0x0F]);
        q[g * 32 + i + 16] = static_cast<uint8_t>(kIQ4Values[qs[g * 16 + i] >> 4]);
      }
#endif
      float a = d;
      if constexpr (F == IQ4_XS) a = d * iq4xs_scale(g, blk);
      sub[g] = {{a, a}, {0.f, 0.f}};
    }
  } else if constexpr (F == Q4_K || F == Q5_K) {
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    const uint8_t* scales = blk + 4;
    const uint8_t* qh = blk + 16;                      // Q5_K only: bit s of qh[l] is sub-block s's
    const uint8_t* qs = blk + (F == Q4_K ? 16 : 48);
    for (int s = 0; s < 8; ++s) {
      int sc, m;
      scale_min_k4(s, scales, sc, m);
      const float a = d * sc, c = -(dmin * m);
      sub[s] = {{a, a}, {c, c}};
      const uint8_t* src = qs + (s / 2) * 32;
      const int shift = 4 * (s & 1);
      for (int l = 0; l < 32; ++l) {
        uint8_t v = (src[l] >> shift) & 0x0F;
        if constexpr (F == Q5_K) v |= ((qh[l] >> s) & 1) << 4;
        q[s * 32 + l] = v;
      }
    }
  } else if constexpr (F == Q6_K) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_to_float(blk + 208);
    for (int h = 0; h < 2; ++h) {                      // two halves of 128 elements
#if defined(__AVX2__)
      // NOTE: the loop below does not vectorize (its index arithmetic): 32 elements a step here
      for (int g = 0; g < 4; ++g)                      // elements 32 g .. 32 g + 32 of the half
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + h * 128 + g * 32), codes_q6k(blk, h, g));
#else
      const uint8_t* ql = blk;
      const uint8_t* qh = blk + 128;
      for (int e = 0; e < 128; ++e) {
        const int lo = (ql[h * 64 + (e % 64)] >> (4 * (e / 64))) & 0x0F;
        const int hi = (qh[h * 32 + (e % 32)] >> (2 * (e / 32))) & 0x03;
        q[h * 128 + e] = static_cast<uint8_t>(lo | (hi << 4));
      }
#endif
    }
    for (int s = 0; s < 8; ++s) {
      const float a0 = d * scales[2 * s], a1 = d * scales[2 * s + 1];
      sub[s] = {{a0, a1}, {-32.f * a0, -32.f * a1}};
    }
  }
}

// One weight row of K elements: q[K] and K / 32 Subs.
template <int F>
inline void unpack_row(const uint8_t* row, int64_t K, uint8_t* q, Sub* sub) {
  constexpr int QK = kQK<F>;
  const int bytes = block_bytes(F);
  for (int64_t b = 0; b < K / QK; ++b) unpack_block<F>(row + b * bytes, q + b * QK, sub + b * (QK / 32));
}

// The float weights of an unpacked row (w = a * q + c).
template <int F>
inline void dequantize_unpacked(const uint8_t* q, const Sub* sub, int64_t K, float* w) {
  for (int64_t b = 0; b < K / 32; ++b) {
    for (int h = 0; h < 2; ++h) {
      const float a = sub[b].a[h], c = sub[b].c[h];
      const int64_t base = b * 32 + h * 16;
      if constexpr (kSigned<F>) {
        for (int i = 0; i < 16; ++i) w[base + i] = a * static_cast<float>(static_cast<int8_t>(q[base + i]));
      } else {
        for (int i = 0; i < 16; ++i) w[base + i] = a * static_cast<float>(q[base + i]) + c;
      }
    }
  }
}

}  // namespace kvmesh_quant
