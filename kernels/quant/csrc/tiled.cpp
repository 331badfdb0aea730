// y[M, N] = x[M, K] @ W^T for many activation rows, W as GGUF blocks: the tiled path.
//
// The per-row paths (gemm.cpp) rebuild each weight for every 4 activation rows; at 8+ rows that
// arithmetic, not the weight bytes, is the cost. Here a task takes NT = 16 weight rows and a K slab
// (the whole K when the tile fits kTileBytes), dequantizes them once into a row-major scratch tile
// that stays in L1/L2, and runs a register-blocked micro-kernel over every activation row against
// it: MR activation rows x NR weight rows of accumulators, each a vector of partial dot products
// along K, summed across lanes once at the end of the slab.
//
//   bf16 activations, AVX512-BF16:   bf16 tile, `vdpbf16ps` (32 products a step), MR 4 x NR 4.
//                                    The weights are rounded to bf16 as a bf16 model holds them:
//                                    the result is a bf16 GEMM of the dequantized weights.
//   otherwise:                       float32 tile (bf16 activations widened once per call), FMA
//                                    on 16 (AVX-512) or 8 (AVX2) lanes, or plain loops: the
//                                    float32 matmul of the dequantized weights to float32 rounding.
//
// The tile is per task and transient: the matrix is never dequantized as a whole. Work is split
// over tiles of N (at::parallel_for); a slab after the first adds into y.
#include "tiled.h"


#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "blocks.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KQ_AVX2 1
#else
#define KQ_AVX2 0
#endif
#if KQ_AVX2 && defined(__AVX512F__)
#define KQ_AVX512 1
#else
#define KQ_AVX512 0
#endif
#if KQ_AVX512 && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KQ_BF16 1
#else
#define KQ_BF16 0
#endif

namespace kvmesh_quant {
namespace {

constexpr int64_t NT = 16;                 // weight rows per tile (one task)
constexpr int64_t kTileBytes = 48 * 1024;  // the tile's budget: L1 on recent cores, L2 on any

#if KQ_AVX512
constexpr int MR = 4, NR = 4;              // 16 zmm accumulators of 32
#elif KQ_AVX2
constexpr int MR = 2, NR = 4;              // 8 ymm accumulators of 16
#else
constexpr int MR = 4, NR = 4;
#endif
static_assert(NT % NR == 0, "a tile is whole NR groups");
static_assert(NR == 4 && (MR == 4 || MR == 2), "micro_rc dispatches these");

// ------------------------------------------------------------------------ dequantize a slab

using bf16_t = uint16_t;                   // bf16 storage: the high half of a float32

#if KQ_AVX2
// 32 elements a * q + c into out (float32 or bf16): q as 32 bytes (SIGNED: int8, else uint8),
// (a0, c0) for elements 0-15 and (a1, c1) for 16-31. One FMA per element, one rounding.
template <typename T, bool SIGNED>
inline void emit32(__m256i q, float a0, float c0, float a1, float c1, T* out) {
#if KQ_AVX512
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m512i l = SIGNED ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo);
  const __m512i h = SIGNED ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi);
  const __m512 f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), _mm512_set1_ps(a0), _mm512_set1_ps(c0));
  const __m512 f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h), _mm512_set1_ps(a1), _mm512_set1_ps(c1));
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(out, f0);
    _mm512_storeu_ps(out + 16, f1);
  } else {
#if KQ_BF16
    const __m512bh v = _mm512_cvtne2ps_pbh(f1, f0);
    _mm512_storeu_si512(out, reinterpret_cast<const __m512i&>(v));
#else
    static_assert(!std::is_same_v<T, bf16_t>, "no bf16 tiles without AVX512-BF16");
#endif
  }
#else
  static_assert(std::is_same_v<T, float>, "no bf16 tiles without AVX512-BF16");
  const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int i = 0; i < 4; ++i) {
    const __m128i part = i & 1 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
    const __m256i qi = SIGNED ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
    const float a = i < 2 ? a0 : a1, c = i < 2 ? c0 : c1;
    _mm256_storeu_ps(out + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi), _mm256_set1_ps(a), _mm256_set1_ps(c)));
  }
#endif
}

#if KQ_BF16
// 32 elements a * q + c as bf16 for 4-bit q (0-15, one per byte), one (a, c) for all: the 16
// values a * k + c (k = 0..15) are computed once, with emit32's FMA and rounding, and each
// element picked from them by its q (vpermw): the same bits as emit32 at a third of its work.
inline void emit32_lut4(__m256i q, float a, float c, bf16_t* out) {
  const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256bh values = _mm512_cvtneps_pbh(_mm512_fmadd_ps(k, _mm512_set1_ps(a), _mm512_set1_ps(c)));
  const __m512i table = _mm512_castsi256_si512(reinterpret_cast<const __m256i&>(values));
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table));
}
#endif

// emit32 of 4-bit q with one (a, c): by lookup where the output is bf16.
template <typename T>
inline void emit32_4bit(__m256i q, float a, float c, T* out) {
#if KQ_BF16
  if constexpr (std::is_same_v<T, bf16_t>) {
    emit32_lut4(q, a, c, out);
    return;
  }
#endif
  emit32<T, false>(q, a, c, a, c, out);
}

// fp16 -> float32 by F16C's vcvtph2ps (blocks.h's half_to_float is portable bit arithmetic).
inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Block `blk` of format F (block_elems(F) elements) dequantized in registers into out.
template <int F, typename T>
inline void dequantize_block(const uint8_t* blk, T* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (F == Q8_0) {
    const float d = h2f(blk);
    emit32<T, true>(load32(blk + 2), d, 0.f, d, 0.f, out);
  } else if constexpr (F == Q4_0 || F == Q4_1) {
    const float d = h2f(blk);
    const float c = F == Q4_0 ? -8.f * d : h2f(blk + 2);
    emit32_4bit<T>(nibbles32(blk + (F == Q4_0 ? 2 : 4)), d, c, out);
  } else if constexpr (F == Q5_0 || F == Q5_1) {
    const float d = h2f(blk);
    const float c = F == Q5_0 ? -16.f * d : h2f(blk + 2);
    emit32<T, false>(codes_q5<F>(blk), d, c, d, c, out);
  } else if constexpr (F == Q2_K || F == Q3_K) {
    // blocks.h's layout: sub-block s = 4 h + j takes bits 2j of qs[32 h ..] (Q3_K: and bit s of
    // hmask as the third); its halves have their own scales
    const __m256i low2 = _mm256_set1_epi8(0x03);
    const uint8_t* qs = blk + (F == Q2_K ? 16 : 32);
    [[maybe_unused]] const __m256i hmask = load32(blk);
    const float d = h2f(blk + (F == Q2_K ? 80 : 108));
    [[maybe_unused]] const float dmin = F == Q2_K ? h2f(blk + 82) : 0.f;
    for (int s = 0; s < 8; ++s) {
      __m256i q = _mm256_and_si256(_mm256_srli_epi16(load32(qs + (s / 4) * 32), 2 * (s % 4)), low2);
      float a[2], c[2];
      if constexpr (F == Q2_K) {
        for (int i = 0; i < 2; ++i) {
          a[i] = d * (blk[2 * s + i] & 0x0F);
          c[i] = -(dmin * (blk[2 * s + i] >> 4));
        }
      } else {
        q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hmask, s),
                                                                   _mm256_set1_epi8(0x01)), 2));
        for (int i = 0; i < 2; ++i) {
          a[i] = d * scale_k3(2 * s + i, blk + 96);
          c[i] = -4.f * a[i];
        }
      }
      emit32<T, false>(q, a[0], c[0], a[1], c[1], out + s * 32);
    }
  } else if constexpr (F == IQ4_NL || F == IQ4_XS) {
    const float d = h2f(blk);
    constexpr int G = F == IQ4_NL ? 1 : 8;
    for (int g = 0; g < G; ++g) {
      float a = d;
      if constexpr (F == IQ4_XS) a = d * iq4xs_scale(g, blk);
      emit32<T, true>(values_iq4(blk + (F == IQ4_NL ? 2 : 8) + g * 16), a, 0.f, a, 0.f, out + g * 32);
    }
  } else if constexpr (F == Q4_K || F == Q5_K) {
    const float d = h2f(blk), dmin = h2f(blk + 2);
    const uint8_t* qs = blk + (F == Q4_K ? 16 : 48);
    [[maybe_unused]] const __m256i qh = load32(blk + 16);   // Q5_K: bit s of each byte is sub-block s's
    for (int s = 0; s < 8; ++s) {
      int sc, m;
      scale_min_k4(s, blk + 4, sc, m);
      __m256i q = _mm256_and_si256(_mm256_srli_epi16(load32(qs + (s / 2) * 32), 4 * (s & 1)), low4);
      if constexpr (F == Q5_K)
        q = _mm256_or_si256(q, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, s), 4),
                                                _mm256_set1_epi8(0x10)));
      const float a = d * sc, c = -(dmin * m);
      if constexpr (F == Q4_K) {
        emit32_4bit<T>(q, a, c, out + s * 32);
      } else {
        emit32<T, false>(q, a, c, a, c, out + s * 32);
      }
    }
  } else {
    static_assert(F == Q6_K, "a format without a dequantizer");
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = h2f(blk + 208);
    for (int h = 0; h < 2; ++h) {                       // two halves of 128 elements
      for (int g = 0; g < 4; ++g) {                     // 32 elements each, scales 16 apiece
        const int s = h * 4 + g;                        // sub-block: scales 2s, 2s + 1
        const float a0 = d * scales[2 * s], a1 = d * scales[2 * s + 1];
        emit32<T, false>(codes_q6k(blk, h, g), a0, -32.f * a0, a1, -32.f * a1, out + s * 32);
      }
    }
  }
}
#endif

// Elements [k0, k0 + kc) of one weight row, dequantized into out[kc] (w = a * q + c, the values
// of blocks.h's dequantize_unpacked). k0 and kc are multiples of the block size.
template <int F, typename T>
void dequantize_slab(const uint8_t* row, int64_t k0, int64_t kc, T* out) {
  constexpr int QK = kQK<F>;
  const int bytes = block_bytes(F);
  const uint8_t* p = row + (k0 / QK) * bytes;
#if KQ_AVX2
  for (int64_t b = 0; b < kc / QK; ++b) dequantize_block<F, T>(p + b * bytes, out + b * QK);
#else
  static_assert(std::is_same_v<T, float>, "no bf16 tiles without AVX512-BF16");
  uint8_t q[256];
  Sub sub[8];
  for (int64_t b = 0; b < kc / QK; ++b) {
    unpack_block<F>(p + b * bytes, q, sub);
    dequantize_unpacked<F>(q, sub, QK, out + b * QK);
  }
#endif
}

// ------------------------------------------------------------------------------ micro-kernels

#if KQ_AVX512
// [sum(a), sum(b), sum(c), sum(d)]
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: ab = [a02, b02, a13, b13], cd = [c02, d02, c13, d13]
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

template <int R, int C>
inline void store_sums(__m512 (&acc)[MR][NR], float* y, int64_t ldy, bool add) {
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    if constexpr (C == 4) {
      __m128 s = reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      if (add) s = _mm_add_ps(s, _mm_loadu_ps(yr));
      _mm_storeu_ps(yr, s);
    } else {
      for (int c = 0; c < C; ++c) {
        const float s = _mm512_reduce_add_ps(acc[r][c]);
        yr[c] = add ? yr[c] + s : s;
      }
    }
  }
}
#endif

// y[r, c] (+)= sum_k x[r, k] * t[c, k] for R <= MR activation rows and C <= NR tile rows over kc.
// x: [R rows, stride ldx]; t: [C rows, stride kc]; y: [R rows, stride ldy].
template <typename T, int R, int C>
void micro(const T* x, int64_t ldx, const T* t, int64_t kc, float* y, int64_t ldy, bool add) {
#if KQ_AVX512
  __m512 acc[MR][NR];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<T, bf16_t>) {
#if !KQ_BF16
    static_assert(!std::is_same_v<T, bf16_t>, "no bf16 tiles without AVX512-BF16");
#else
    for (int64_t k = 0; k < kc; k += 32) {
      __m512bh wv[NR];
      for (int c = 0; c < C; ++c) {
        const __m512i raw = _mm512_loadu_si512(t + c * kc + k);
        wv[c] = reinterpret_cast<const __m512bh&>(raw);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i raw = _mm512_loadu_si512(x + r * ldx + k);
        const __m512bh xv = reinterpret_cast<const __m512bh&>(raw);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
      }
    }
#endif
  } else {
    for (int64_t k = 0; k < kc; k += 16) {
      __m512 wv[NR];
      for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_ps(t + c * kc + k);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
  }
  store_sums<R, C>(acc, y, ldy, add);
#elif KQ_AVX2
  static_assert(std::is_same_v<T, float>, "no bf16 tiles without AVX512-BF16");
  __m256 acc[MR][NR];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; k += 8) {
    __m256 wv[NR];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(t + c * kc + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const float s = hsum8(acc[r][c]);
      y[r * ldy + c] = add ? y[r * ldy + c] + s : s;
    }
#else
  static_assert(std::is_same_v<T, float>, "no bf16 tiles without AVX512-BF16");
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = 0.f;
      for (int64_t k = 0; k < kc; ++k) s += x[r * ldx + k] * t[c * kc + k];
      y[r * ldy + c] = add ? y[r * ldy + c] + s : s;
    }
#endif
}

// The micro-kernel for a block of r <= MR rows and c <= NR columns (the edges of M and N).
template <typename T, int R>
void micro_c(int c, const T* x, int64_t ldx, const T* t, int64_t kc, float* y, int64_t ldy, bool add) {
  switch (c) {
    case 4: micro<T, R, 4>(x, ldx, t, kc, y, ldy, add); break;
    case 3: micro<T, R, 3>(x, ldx, t, kc, y, ldy, add); break;
    case 2: micro<T, R, 2>(x, ldx, t, kc, y, ldy, add); break;
    default: micro<T, R, 1>(x, ldx, t, kc, y, ldy, add); break;
  }
}

template <typename T>
void micro_rc(int r, int c, const T* x, int64_t ldx, const T* t, int64_t kc, float* y, int64_t ldy,
              bool add) {
  if constexpr (MR == 4) {
    switch (r) {
      case 4: micro_c<T, 4>(c, x, ldx, t, kc, y, ldy, add); break;
      case 3: micro_c<T, 3>(c, x, ldx, t, kc, y, ldy, add); break;
      case 2: micro_c<T, 2>(c, x, ldx, t, kc, y, ldy, add); break;
      default: micro_c<T, 1>(c, x, ldx, t, kc, y, ldy, add); break;
    }
  } else {
    if (r == 2) micro_c<T, 2>(c, x, ldx, t, kc, y, ldy, add);
    else micro_c<T, 1>(c, x, ldx, t, kc, y, ldy, add);
  }
}

// ------------------------------------------------------------------------------------- driver

template <int F, typename T>
void gemm_tiled(const T* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int64_t row_bytes) {
  constexpr int64_t QK = kQK<F>;
  // NOTE: the K slab: the whole K when NT rows of it fit kTileBytes, else the fewest equal slabs
  // (whole blocks) that do; each slab after the first adds its partial sums into y.
  const int64_t fit = std::max<int64_t>(QK, kTileBytes / (NT * int64_t(sizeof(T))) / QK * QK);
  const int64_t slabs = (K + fit - 1) / fit;
  const int64_t step = (K / QK + slabs - 1) / slabs * QK;
  at::parallel_for(0, (N + NT - 1) / NT, 1, [&](int64_t t0, int64_t t1) {
    std::vector<T> tile(NT * step);
    for (int64_t ti = t0; ti < t1; ++ti) {
      const int64_t n0 = ti * NT, nt = std::min(NT, N - n0);
      for (int64_t k0 = 0; k0 < K; k0 += step) {
        const int64_t kc = std::min(step, K - k0);
        for (int64_t j = 0; j < nt; ++j)
          dequantize_slab<F, T>(w + (n0 + j) * row_bytes, k0, kc, tile.data() + j * kc);
        for (int64_t m = 0; m < M; m += MR) {
          const int r = static_cast<int>(std::min<int64_t>(MR, M - m));
          for (int64_t c = 0; c < nt; c += NR) {
            micro_rc<T>(r, static_cast<int>(std::min<int64_t>(NR, nt - c)), x + m * K + k0, K,
                        tile.data() + c * kc, kc, y + m * N + n0 + c, N, k0 > 0);
          }
        }
      }
    }
  });
}

template <typename T>
void dispatch_tiled(int64_t fmt, const T* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
                    int64_t row_bytes) {
  dispatch(fmt, [&](auto f) { gemm_tiled<decltype(f)::value, T>(x, w, y, M, N, K, row_bytes); });
}

template <typename T>
void dequantize_range(int64_t fmt, const uint8_t* w, int64_t n0, int64_t rows, int64_t K, int64_t row_bytes,
                      T* out) {
  dispatch(fmt, [&](auto f) {
    constexpr int F = decltype(f)::value;
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) dequantize_slab<F, T>(w + (n0 + r) * row_bytes, 0, K, out + r * K);
    });
  });
}

}  // namespace

at::Tensor quant_gemm_tiled(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K) {
  TORCH_CHECK((x.dtype() == at::kFloat || x.dtype() == at::kBFloat16) && x.dim() == 2 &&
                  x.size(1) == K && x.device().is_cpu(),
              "quant_gemm_tiled: x must be a CPU float32 or bfloat16 [M, K] tensor");
  const int64_t row_bytes = check_weight(w, fmt, K);
  const int64_t M = x.size(0), N = w.size(0);
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  // NOTE: bf16 tiles only for bf16 activations on AVX512-BF16: float32 activations keep float32's
  // rounding, and without vdpbf16ps a bf16 product is a float32 one plus conversions.
#if KQ_BF16
  if (x.dtype() == at::kBFloat16) {
    const auto xc = x.contiguous();
    dispatch_tiled<bf16_t>(fmt, reinterpret_cast<const bf16_t*>(xc.data_ptr<at::BFloat16>()),
                           w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K, row_bytes);
    return y;
  }
#endif
  {
    const auto xf = x.to(at::kFloat).contiguous();
    dispatch_tiled<float>(fmt, xf.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K,
                          row_bytes);
  }
  return y;
}

void dequantize_into(const at::Tensor& w, int64_t n0, const at::Tensor& out, int64_t fmt, int64_t K) {
  const int64_t row_bytes = check_weight(w, fmt, K);
  TORCH_CHECK(out.dim() == 2 && out.size(1) == K && out.is_contiguous() && out.device().is_cpu(),
              "dequantize_into: out must be a contiguous CPU [rows, K] tensor");
  const int64_t rows = out.size(0);
  TORCH_CHECK(n0 >= 0 && n0 + rows <= w.size(0), "dequantize_into: rows [", n0, ", ", n0 + rows,
              ") out of range [0, ", w.size(0), ")");
#if KQ_BF16
  if (out.dtype() == at::kBFloat16) {
    dequantize_range<bf16_t>(fmt, w.data_ptr<uint8_t>(), n0, rows, K, row_bytes,
                             reinterpret_cast<bf16_t*>(out.data_ptr<at::BFloat16>()));
    return;
  }
#endif
  TORCH_CHECK(out.dtype() == at::kFloat, "dequantize_into: out must be float32",
              KQ_BF16 ? " or bfloat16" : " (this build has no bf16 tiles)");
  dequantize_range<float>(fmt, w.data_ptr<uint8_t>(), n0, rows, K, row_bytes, out.data_ptr<float>());
}

void dequantize_rows_bf16(int64_t fmt, const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K,
                          uint16_t* out) {
#if KQ_BF16
  dispatch(fmt, [&](auto f) {
    constexpr int F = decltype(f)::value;
    for (int64_t r = 0; r < rows; ++r) dequantize_slab<F, bf16_t>(w + r * row_bytes, 0, K, out + r * K);
  });
#else
  (void)fmt, (void)w, (void)row_bytes, (void)rows, (void)K, (void)out;
  TORCH_CHECK(false, "dequantize_rows_bf16: this build has no bf16 tiles");
#endif
}

void dequantize_rows_f32(int64_t fmt, const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K,
                         float* out) {
  dispatch(fmt, [&](auto f) {
    constexpr int F = decltype(f)::value;
    for (int64_t r = 0; r < rows; ++r) dequantize_slab<F, float>(w + r * row_bytes, 0, K, out + r * K);
  });
}

std::string tiled_isa() {
#if KQ_BF16
  return "avx512_bf16";
#elif KQ_AVX512
  return "avx512";
#elif KQ_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace kvmesh_quant
