// y[M, N] = x[M, K] @ W^T for W held as GGUF blocks ([N, K / QK * bytes] uint8), two paths:
//
//   float:  each weight row is unpacked and rebuilt in float32 into a K-float buffer (L1) once,
//           then dotted with every activation row, float32 accumulation.
//   int8:   the activations are quantized per row and per 32-block to int8 (scale max|x| / 127,
//           round to nearest even) once per call; each weight row is unpacked to bytes once and
//           dotted with every activation row by integer dot products, one float FMA per block:
//           AVX-512 VNNI / AVX-VNNI `dpbusd`, AVX2 `maddubs` + `madd`, or scalar code, chosen at
//           compile time from what -march=native enables.
//
// Neither path holds more than a chunk of rows of W unpacked (NB rows per task); the matrix is
// never dequantized. Many activation rows go through tiled.cpp instead (ops.py picks). Work is split over output rows (at::parallel_for, ATen's thread pool).
#include "../../csrc/aten.h"

#include <vector>

#include "blocks.h"
#include "simd.h"
#include "amx.h"
#include "tiled.h"
#include "gemm.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvmesh_quant {
namespace {

constexpr int64_t NB = 8;   // weight rows unpacked per task (8 x K bytes stays in L1 for K <= 4096)
constexpr int MT = 4;       // activation rows per inner tile

// ------------------------------------------------------------------------------- float path

#if defined(__AVX2__)
// 8 int32 lanes: lane l = sum of products of bytes 4l..4l+3 (lanes 0-3: elements 0-15).
// SIGNED: w holds int8 (blocks.h's kSigned formats), moved to the unsigned operand by the sign trick.
template <bool SIGNED>
inline __m256i dot32(__m256i w, __m256i x) {
  if constexpr (SIGNED) {
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
  // NOTE: no int16 overflow: |w| <= 128 (sign trick) or 63 (Q6_K), |x| <= 127, two products a pair.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
#endif
}

#endif

#if defined(__AVX2__) && defined(__F16C__)
// The float path of the one-scale-per-32 formats (Q8_0 / Q4_0 / Q4_1), dequantized in
// registers: each block becomes 4 x 8 floats (w = d * q + c, one FMA) and meets R activation rows.
template <int F, int R>
inline void fdot_rows_direct(const uint8_t* row, int64_t nblk, const float* x, int64_t K, float* out) {
  constexpr int BYTES = F == Q8_0 ? 34 : F == Q4_0 ? 18 : 20;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblk; ++b) {
    const uint8_t* blk = row + b * BYTES;
    uint16_t dh;
    std::memcpy(&dh, blk, 2);
    const __m256 dv = _mm256_set1_ps(_cvtsh_ss(dh));
    __m256 cv = _mm256_setzero_ps();
    __m128i q0, q1;   // elements 0-15, 16-31 (bytes)
    if constexpr (F == Q8_0) {
      q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
      q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    } else {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (F == Q4_0 ? 2 : 4)));
      q0 = _mm_and_si128(raw, low4);
      q1 = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
      if constexpr (F == Q4_0) {
        cv = _mm256_mul_ps(dv, _mm256_set1_ps(-8.f));
      } else {
        uint16_t mh;
        std::memcpy(&mh, blk + 2, 2);
        cv = _mm256_set1_ps(_cvtsh_ss(mh));
      }
    }
    __m256 wv[4];
    const __m128i parts[4] = {q0, _mm_srli_si128(q0, 8), q1, _mm_srli_si128(q1, 8)};
    for (int i = 0; i < 4; ++i) {
      const __m256i wi = F == Q8_0 ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]);
      wv[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wi), dv, cv);
    }
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + b * 32;
      for (int i = 0; i < 4; ++i) acc[r] = _mm256_fmadd_ps(wv[i], _mm256_loadu_ps(xb + 8 * i), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]);
}
template <int F>
constexpr bool kDirect = F == Q8_0 || F == Q4_0 || F == Q4_1;
#else
template <int F>
constexpr bool kDirect = false;
template <int F, int R>
inline void fdot_rows_direct(const uint8_t*, int64_t, const float*, int64_t, float*) {}
#endif


template <int F>
void gemm_float(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
                int64_t row_bytes) {
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> wf(NB * K);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * NB, nb = std::min(NB, N - n0);
      if constexpr (kDirect<F>) {
        float out[MT];
        const uint8_t* wc = w + n0 * row_bytes;
        int64_t m = 0;
        for (; m + MT <= M; m += MT)
          for (int64_t j = 0; j < nb; ++j) {
            fdot_rows_direct<F, MT>(wc + j * row_bytes, K / 32, x + m * K, K, out);
            for (int r = 0; r < MT; ++r) y[(m + r) * N + n0 + j] = out[r];
          }
        for (; m < M; ++m)
          for (int64_t j = 0; j < nb; ++j) {
            fdot_rows_direct<F, 1>(wc + j * row_bytes, K / 32, x + m * K, K, out);
            y[m * N + n0 + j] = out[0];
          }
        continue;
      }
      // NOTE: the tiles' vectorized rebuild (tiled.cpp), not unpack_row + dequantize_unpacked:
      // for Q4_K at one activation row that took 3.4x as long a call (benchmarks/quant_gemm.py)
      dequantize_rows_f32(F, w + n0 * row_bytes, row_bytes, nb, K, wf.data());
      int64_t m = 0;
      for (; m + MT <= M; m += MT) {
        const float* x0 = x + m * K;
        const float* x1 = x0 + K;
        const float* x2 = x1 + K;
        const float* x3 = x2 + K;
        for (int64_t j = 0; j < nb; ++j) {
          const float* wr = wf.data() + j * K;
          float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
          for (int64_t k = 0; k < K; ++k) {
            a0 += x0[k] * wr[k];
            a1 += x1[k] * wr[k];
            a2 += x2[k] * wr[k];
            a3 += x3[k] * wr[k];
          }
          y[m * N + n0 + j] = a0;
          y[(m + 1) * N + n0 + j] = a1;
          y[(m + 2) * N + n0 + j] = a2;
          y[(m + 3) * N + n0 + j] = a3;
        }
      }
      for (; m < M; ++m) {
        const float* xr = x + m * K;
        for (int64_t j = 0; j < nb; ++j) {
          const float* wr = wf.data() + j * K;
          float a = 0.f;
#pragma omp simd reduction(+ : a)
          for (int64_t k = 0; k < K; ++k) a += xr[k] * wr[k];
          y[m * N + n0 + j] = a;
        }
      }
    }
  });
}

// -------------------------------------------------------------------------------- int8 path

// One activation row, quantized: int8 q[K]; per 32-block its scale and the sums of each half.
struct QRow {
  const int8_t* q;
  const float* d;          // [K / 32]
  const float* s;          // [K / 32][2]: d * (sum of q) over each 16-element half
  const float* t;          // [K / 32]: d * (sum of q) over the block (the grouped kernel's c term)
};

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* s, float* t) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t b = 0; b < K / 32; ++b) {
        const float* xb = x + m * K + b * 32;
        float amax = 0.f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(xb[i]));
        const float db = amax / 127.f;
        const float id = db != 0.f ? 1.f / db : 0.f;
        int8_t* qb = q + m * K + b * 32;
        int32_t s0 = 0, s1 = 0;
        for (int i = 0; i < 32; ++i) {
          const int v = static_cast<int>(std::nearbyint(xb[i] * id));
          qb[i] = static_cast<int8_t>(v);
          (i < 16 ? s0 : s1) += v;
        }
        d[m * (K / 32) + b] = db;
        s[(m * (K / 32) + b) * 2] = db * static_cast<float>(s0);
        s[(m * (K / 32) + b) * 2 + 1] = db * static_cast<float>(s1);
        t[m * (K / 32) + b] = db * static_cast<float>(s0 + s1);
      }
    }
  });
}


// sum over the row of value(w) * xhat for one unpacked weight row and MT (or fewer) activation rows.
template <int F, int R>
inline void dot_rows(const uint8_t* q, const Sub* sub, const float* a8, const QRow* xr, int64_t K,
                     float* out) {
  constexpr bool SIGNED = kSigned<F>;
  const int64_t nblk = K / 32;
  float cacc[R] = {};
#if defined(__AVX2__)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblk; ++b) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 32));
    const __m256 av = _mm256_loadu_ps(a8 + b * 8);
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r].q + b * 32));
      const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(dot32<SIGNED>(wv, xv)), av);
      const float dx = xr[r].d[b];
      acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(dx), acc[r]);
      if constexpr (!SIGNED)
        cacc[r] += sub[b].c[0] * xr[r].s[2 * b] + sub[b].c[1] * xr[r].s[2 * b + 1];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]) + cacc[r];
#else
  (void)a8;
  float acc[R] = {};
  for (int64_t b = 0; b < nblk; ++b) {
    for (int r = 0; r < R; ++r) {
      int32_t i0 = 0, i1 = 0;
      for (int i = 0; i < 16; ++i) {
        const int wa = SIGNED ? static_cast<int8_t>(q[b * 32 + i]) : q[b * 32 + i];
        const int wb = SIGNED ? static_cast<int8_t>(q[b * 32 + 16 + i]) : q[b * 32 + 16 + i];
        i0 += wa * xr[r].q[b * 32 + i];
        i1 += wb * xr[r].q[b * 32 + 16 + i];
      }
      const float dx = xr[r].d[b];
      acc[r] += dx * (sub[b].a[0] * i0 + sub[b].a[1] * i1);
      if constexpr (!SIGNED)
        cacc[r] += sub[b].c[0] * xr[r].s[2 * b] + sub[b].c[1] * xr[r].s[2 * b + 1];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r] + cacc[r];
#endif
}

#if defined(__AVX2__) && defined(__F16C__)
// One Q8_0 / Q4_0 / Q4_1 block: its scale d, its constant term c (Q4_0: -8 d; Q4_1: the min;
// Q8_0: 0) and its 32 codes as bytes (the nibbles unpacked, low halves first).
template <int F>
inline __m256i load_block(const uint8_t* blk, float& d, float& c) {
  uint16_t dh;
  std::memcpy(&dh, blk, 2);
  d = _cvtsh_ss(dh);
  c = 0.f;
  if constexpr (F == Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
  } else {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (F == Q4_0 ? 2 : 4)));
    if constexpr (F == Q4_0) {
      c = -8.f * d;
    } else {
      uint16_t mh;
      std::memcpy(&mh, blk + 2, 2);
      c = _cvtsh_ss(mh);
    }
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
  }
}

// Q8_0 / Q4_0 / Q4_1 straight from the blocks, dequantized in registers (no unpacked row): the
// formats whose every 32 elements share one scale, so each block is one integer dot product
// and one FMA per activation row.
template <int F, int R>
inline void dot_rows_direct(const uint8_t* row, int64_t nblk, const QRow* xr, float* out) {
  constexpr int BYTES = F == Q8_0 ? 34 : F == Q4_0 ? 18 : 20;
  __m256 acc[R];
  float cacc[R] = {};
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nblk; ++b) {
    float d, c;
    const __m256i wv = load_block<F>(row + b * BYTES, d, c);
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r].q + b * 32));
      const float dx = xr[r].d[b];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32<F == Q8_0>(wv, xv)), _mm256_set1_ps(d * dx), acc[r]);
      if constexpr (F != Q8_0) cacc[r] += c * (xr[r].s[2 * b] + xr[r].s[2 * b + 1]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]) + cacc[r];
}

// 8 fp16 values, the low (HIGH = false) or high 16 bits of each 32-bit lane of v, as 8 floats.
template <bool HIGH>
inline __m256 halves_to_float(__m256i v) {
  constexpr char o = HIGH ? 2 : 0;
  const __m256i pick = _mm256_setr_epi8(o, o + 1, o + 4, o + 5, o + 8, o + 9, o + 12, o + 13,
                                        -1, -1, -1, -1, -1, -1, -1, -1,
                                        o, o + 1, o + 4, o + 5, o + 8, o + 9, o + 12, o + 13,
                                        -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0x08);  // qwords 0, 2
  return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}

// Eight vectors of 8 int32 lanes -> one vector whose lane i is the sum of p[i]'s lanes.
inline __m256i sum_lanes8(const __m256i* p) {
  const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
  const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
  // a = [sums of lanes 0-3 of p0..p3 | of lanes 4-7 of p0..p3], b the same for p4..p7
  const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// The one-scale-per-32 formats eight blocks at a time, R activation rows per loaded group: the
// 8 weight scales (and Q4_1 mins) come in by one gather and become one vector, each row's 8
// integer block sums are gathered into one vector by a lane-sum tree, and the float work is 2
// vector FMAs per row per 8 blocks where dot_rows_direct spends 2 scalar ones per block.
template <int F>
constexpr int kBytes = F == Q8_0 ? 34 : F == Q4_0 ? 18 : 20;

// acc[r] += blocks b .. b+7 of the weight row (`blk`: block b) against activation row r.
template <int F, int R>
inline void dot_group8(const uint8_t* blk, int64_t b, const QRow* xr, __m256* acc) {
  constexpr int BYTES = kBytes<F>;
  const __m256i offsets = _mm256_setr_epi32(0, BYTES, 2 * BYTES, 3 * BYTES, 4 * BYTES, 5 * BYTES,
                                            6 * BYTES, 7 * BYTES);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  alignas(32) uint8_t wq[8 * 32];   // the group's weights as bytes (L1; stored once, read R times)
  // each block's first 4 bytes: d (fp16), then Q4_1's m (fp16)
  const __m256i head = _mm256_i32gather_epi32(reinterpret_cast<const int*>(blk), offsets, 1);
  const __m256 d = halves_to_float<false>(head);
  __m256 c = _mm256_setzero_ps();   // per block: the weight of the block's sum of x (Q4_1 m, Q4_0 -8d)
  if constexpr (F == Q4_1) c = halves_to_float<true>(head);
  if constexpr (F == Q4_0) c = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
  for (int i = 0; i < 8; ++i) {
    const uint8_t* bi = blk + i * BYTES;
    __m256i wv;
    if constexpr (F == Q8_0) {
      wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bi + 2));
    } else {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bi + (F == Q4_0 ? 2 : 4)));
      wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(wq + 32 * i), wv);
  }
  for (int r = 0; r < R; ++r) {
    const int8_t* xq = xr[r].q + b * 32;
    __m256i p[8];
    for (int i = 0; i < 8; ++i)
      p[i] = dot32<F == Q8_0>(_mm256_load_si256(reinterpret_cast<const __m256i*>(wq + 32 * i)),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * i)));
    const __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(xr[r].d + b));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_lanes8(p)), scale, acc[r]);
    if constexpr (F != Q8_0) acc[r] = _mm256_fmadd_ps(c, _mm256_loadu_ps(xr[r].t + b), acc[r]);
  }
}

// acc[r] += block b of the weight row (`blk`) against activation row r: a leftover block (K / 32
// not a multiple of 8), each product in its own lanes, every float operation an intrinsic so
// that a row's result does not depend on R (the compiler contracts no scalar expression here).
template <int F, int R>
inline void dot_block1(const uint8_t* blk, int64_t b, const QRow* xr, __m256* acc) {
  float d, c;
  const __m256i wv = load_block<F>(blk, d, c);
  for (int r = 0; r < R; ++r) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r].q + b * 32));
    const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(d), _mm256_set1_ps(xr[r].d[b]));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32<F == Q8_0>(wv, xv)), scale, acc[r]);
    if constexpr (F != Q8_0)   // the min term in lane 0 only
      acc[r] = _mm256_fmadd_ps(_mm256_setr_ps(c, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f),
                               _mm256_set1_ps(xr[r].t[b]), acc[r]);
  }
}

// One weight row against R activation rows: whole groups of 8 blocks, then the blocks left over
// one at a time (NOTE: not as a zero-padded group: at K = 576, 18 blocks, that costs a third more
// work than the row has; measured 0.8x of the per-block kernel).
template <int F, int R>
inline void dot_rows_grouped(const uint8_t* row, int64_t nblk, const QRow* xr, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nblk; b += 8) dot_group8<F, R>(row + b * kBytes<F>, b, xr, acc);
  for (; b < nblk; ++b) dot_block1<F, R>(row + b * kBytes<F>, b, xr, acc);
  for (int r = 0; r < R; ++r) out[r] = hsum8(acc[r]);
}
#else
template <int F, int R>
inline void dot_rows_direct(const uint8_t*, int64_t, const QRow*, float*) {}
template <int F, int R>
inline void dot_rows_grouped(const uint8_t*, int64_t, const QRow*, float*) {}
#endif

template <int F>
void gemm_int8(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K,
               int64_t row_bytes) {
  const int64_t nblk = K / 32;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nblk);
  std::vector<float> xs(M * nblk * 2);
  std::vector<float> xt(M * nblk);
  quantize_rows(x, M, K, xq.data(), xd.data(), xs.data(), xt.data());
  std::vector<QRow> rows(M);
  for (int64_t m = 0; m < M; ++m)
    rows[m] = {xq.data() + m * K, xd.data() + m * nblk, xs.data() + m * nblk * 2, xt.data() + m * nblk};

  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t c0, int64_t c1) {
    std::vector<uint8_t> q(NB * K);
    std::vector<Sub> sub(NB * nblk);
    std::vector<float> a8(NB * nblk * 8);   // per block: a[0] in lanes 0-3, a[1] in lanes 4-7
    float out[MT];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * NB, nb = std::min(NB, N - n0);
      if constexpr (kDirect<F>) {
        const uint8_t* wc = w + n0 * row_bytes;
        int64_t m = 0;
        for (; m + MT <= M; m += MT)
          for (int64_t j = 0; j < nb; ++j) {
            dot_rows_grouped<F, MT>(wc + j * row_bytes, nblk, rows.data() + m, out);
            for (int r = 0; r < MT; ++r) y[(m + r) * N + n0 + j] = out[r];
          }
        // the 1-3 rows left share each loaded group too (2 rows cost ~1.2x one, not 2x)
        const int64_t left = M - m;
        for (int64_t j = 0; left > 0 && j < nb; ++j) {
          const uint8_t* wr = wc + j * row_bytes;
          if (left == 3) dot_rows_grouped<F, 3>(wr, nblk, rows.data() + m, out);
          else if (left == 2) dot_rows_grouped<F, 2>(wr, nblk, rows.data() + m, out);
          else dot_rows_grouped<F, 1>(wr, nblk, rows.data() + m, out);
          for (int64_t r = 0; r < left; ++r) y[(m + r) * N + n0 + j] = out[r];
        }
        continue;
      }
      for (int64_t j = 0; j < nb; ++j) {
        Sub* sj = sub.data() + j * nblk;
        unpack_row<F>(w + (n0 + j) * row_bytes, K, q.data() + j * K, sj);
        for (int64_t b = 0; b < nblk; ++b)
          for (int l = 0; l < 8; ++l) a8[(j * nblk + b) * 8 + l] = sj[b].a[l / 4];
      }
      int64_t m = 0;
      for (; m + MT <= M; m += MT) {
        for (int64_t j = 0; j < nb; ++j) {
          dot_rows<F, MT>(q.data() + j * K, sub.data() + j * nblk, a8.data() + j * nblk * 8,
                          rows.data() + m, K, out);
          for (int r = 0; r < MT; ++r) y[(m + r) * N + n0 + j] = out[r];
        }
      }
      for (; m < M; ++m) {
        for (int64_t j = 0; j < nb; ++j) {
          dot_rows<F, 1>(q.data() + j * K, sub.data() + j * nblk, a8.data() + j * nblk * 8,
                         rows.data() + m, K, out);
          y[m * N + n0 + j] = out[0];
        }
      }
    }
  });
}

template <int F>
void dequantize_rows_impl(const uint8_t* w, const int64_t* ids, float* out, int64_t T, int64_t K,
                          int64_t row_bytes) {
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> q(K);
    std::vector<Sub> sub(K / 32);
    for (int64_t t = t0; t < t1; ++t) {
      unpack_row<F>(w + ids[t] * row_bytes, K, q.data(), sub.data());
      dequantize_unpacked<F>(q.data(), sub.data(), K, out + t * K);
    }
  });
}

}  // namespace

// K from the byte width of a row; checks what the Python side already promised.
int64_t check_weight(const at::Tensor& w, int64_t fmt, int64_t K) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(),
              "quantized weight: expected a contiguous CPU uint8 [N, row_bytes] tensor");
  TORCH_CHECK(block_bytes(fmt) > 0, "unsupported GGUF quantization type ", fmt);
  TORCH_CHECK(K % block_elems(fmt) == 0, "K=", K, " is not a multiple of the block size ",
              block_elems(fmt));
  const int64_t row_bytes = K / block_elems(fmt) * block_bytes(fmt);
  TORCH_CHECK(w.size(1) == row_bytes, "quantized weight: ", w.size(1), " bytes a row, K=", K,
              " needs ", row_bytes);
  return row_bytes;
}

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K,
                      bool int8_activations) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == K && x.device().is_cpu(),
              "quant_gemm: x must be a CPU float32 [M, K] tensor");
  const int64_t row_bytes = check_weight(w, fmt, K);
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), N = w.size(0);
  auto y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  dispatch(fmt, [&](auto f) {
    constexpr int F = decltype(f)::value;
    if (int8_activations)
      gemm_int8<F>(xc.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K, row_bytes);
    else
      gemm_float<F>(xc.data_ptr<float>(), w.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K, row_bytes);
  });
  return y;
}

at::Tensor dequantize_rows(const at::Tensor& w, const at::Tensor& ids, int64_t fmt, int64_t K) {
  const int64_t row_bytes = check_weight(w, fmt, K);
  TORCH_CHECK(ids.dtype() == at::kLong && ids.dim() == 1, "dequantize_rows: ids must be int64 [T]");
  const auto idc = ids.contiguous();
  const int64_t T = idc.size(0), N = w.size(0);
  const int64_t* p = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(p[t] >= 0 && p[t] < N, "row id ", p[t], " out of range [0, ", N, ")");
  auto out = at::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  dispatch(fmt, [&](auto f) {
    constexpr int F = decltype(f)::value;
    dequantize_rows_impl<F>(w.data_ptr<uint8_t>(), p, out.data_ptr<float>(), T, K, row_bytes);
  });
  return out;
}

// The SIMD path this build's int8 dot product took (for tests and logs).
std::string int8_isa() {
#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return "avx512vnni";
#elif defined(__AVX2__) && defined(__AVXVNNI__)
  return "avxvnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace kvmesh_quant
