// GGUF block layouts, unpacked one weight row at a time: the one place that knows where each bit
// of a Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K block lives.
//
// Every format is read as 32-element sub-blocks, each split in two halves of 16 elements, with
//   value[i] = a[h] * q[i] + c[h]        (h = i / 16; q unsigned, except Q8_0: signed int8, c = 0)
// so the float path rebuilds a weight as a * q + c and the int8 path computes
//   sum_i value[i] * x[i] ~ dx * (a[h] * sum_i q[i] * xq[i] + c[h] * sum_i xq[i])  per half.
// (Q6_K's scales cover 16 elements, hence the halves; the other formats have a[0] == a[1].)
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvmesh_quant {

// The ggml type numbers (gguf.GGMLQuantizationType).
enum Format : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// fn(std::integral_constant<int, F>{}) for the runtime format `fmt`: the one switch every path
// instantiates its per-format template through; an unknown type is a clear error.
template <typename Fn>
void dispatch(int64_t fmt, Fn&& fn) {
  switch (fmt) {
    case Q4_0: fn(std::integral_constant<int, Q4_0>{}); break;
    case Q4_1: fn(std::integral_constant<int, Q4_1>{}); break;
    case Q8_0: fn(std::integral_constant<int, Q8_0>{}); break;
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
inline int block_elems(int fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q6_K ? 256 : 32; }
inline int block_bytes(int fmt) {
  switch (fmt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
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
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = half_to_float(blk + 208);
    for (int h = 0; h < 2; ++h) {                      // two halves of 128 elements
      for (int e = 0; e < 128; ++e) {
        const int lo = (ql[h * 64 + (e % 64)] >> (4 * (e / 64))) & 0x0F;
        const int hi = (qh[h * 32 + (e % 32)] >> (2 * (e / 32))) & 0x03;
        q[h * 128 + e] = static_cast<uint8_t>(lo | (hi << 4));
      }
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
  constexpr int QK = F == Q4_K || F == Q5_K || F == Q6_K ? 256 : 32;
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
      if constexpr (F == Q8_0) {
        for (int i = 0; i < 16; ++i) w[base + i] = a * static_cast<float>(static_cast<int8_t>(q[base + i]));
      } else {
        for (int i = 0; i < 16; ++i) w[base + i] = a * static_cast<float>(q[base + i]) + c;
      }
    }
  }
}

}  // namespace kvmesh_quant
