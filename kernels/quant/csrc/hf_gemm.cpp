// y[M, N] = x[M, K] @ W^T for the Hugging Face quantized checkpoints' canonical weights
// (kernels/quant/hf_weight.py), two GEMMs:
//
//   w8a8:   W int8 [N, K] with one float32 scale per row. The activations are quantized per row
//           to int8 (scale max|x| / 127, round half to even) once per call; each dot product is
//           accumulated over the whole K in int32, then scaled once: y = acc * sx[m] * sw[n].
//           AVX-512 VNNI / AVX-VNNI: vpdpbusd takes unsigned x unsigned bytes, so the activations
//           go in as u8 = q + 128 and 128 * sum(w row) (precomputed, `w_sum`) is taken off after;
//           AVX2: pmaddubsw + pmaddwd with the sign moved onto the activations (|w| <= 128 keeps the
//           int16 pair sums in range); otherwise portable scalar code.
//   w4a16:  W as 4-bit codes [N, K / 2] (element k in byte k / 2, low nibble for even k) with a
//           float32 scale and a 0..15 zero per `group_size` elements: w = (q - zero) * scale, with
//           float32 activations. Few rows (decode): the codes are widened and the zero taken off
//           in integer registers, converted and multiplied (FMA) with MT rows at a time, float32
//           accumulation per group, one scale FMA per group. From ROWS_MIN rows on: each weight
//           row is rebuilt in float32 once (K floats, in L1) and dotted with every row. AVX-512,
//           AVX2 or portable code; the matrix is never dequantized whole.
//
// Which instruction set is used is fixed at compile time by what -march=native (or a narrower
// cpu_kernels.PATHS build) enables, as in gemm.cpp; where the CPU has AMX, W8A8 calls of many rows
// take the int8 tiles instead (hf_amx.cpp), and int4 calls with bf16 activations the bf16 tiles
// (amx_tiles.h's loop, from W4_AMX_MIN_ROWS). Work is split over output rows (at::parallel_for).
#include "../../csrc/aten.h"

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "amx_tiles.h"
#include "hf_amx.h"
#include "simd.h"
#include "hf_gemm.h"

namespace kvmesh_hfquant {
namespace {

constexpr int MT = 4;   // activation rows per inner tile: one weight load feeds MT dot products
// NOTE: from this many activation rows on, the int4 GEMM rebuilds each weight row in float32
// once and reuses it for every row (plain FMA dot products) instead of widening the codes again
// for every MT rows; picked from benchmarks/hf_quant_gemm.py on the machine this was written on.
constexpr int64_t ROWS_MIN = 12;
// NOTE: bf16 activations take the AMX tiles from this many rows where the CPU has them: with the
// rows rebuilt by lookup (dequant_row_bf16) the tiles took 0.4-0.7x the per-row kernel's time from
// 2 rows on (benchmarks/hf_quant_gemm.py's "w4a16 amx" column, docs/KERNELS.md); at one row the
// per-row kernel stays (0.8-1.1x the tiles' time)
constexpr int64_t W4_AMX_MIN_ROWS = 2;

// ------------------------------------------------------------------------------------- w8a8

// Row m of x to int8: q = round_half_even(x / scale), scale = max|x| / 127 (0 for a zero row).
void quantize_row(const float* x, int64_t K, int8_t* q, float* scale) {
  int64_t k = 0;
  float amax = 0.f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 mv = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) mv = _mm512_max_ps(mv, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  amax = _mm512_reduce_max_ps(mv);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float s = amax / 127.f;
  *scale = s;
  k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  // NOTE: the same IEEE division and round-half-even as the scalar loop, 16 lanes at a time
  // (a scalar division a weight was as long as the AMX GEMM it feeds)
  if (s > 0.f) {
    const __m512 sv = _mm512_set1_ps(s);
    for (; k + 16 <= K; k += 16) {
      const __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + k), sv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
    }
  }
#endif
  for (; k < K; ++k) {
    // NOTE: nearbyint rounds half to even in the default rounding mode, as torch.round does
    q[k] = s > 0.f ? static_cast<int8_t>(std::nearbyint(x[k] / s)) : 0;
  }
}

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(__AVXVNNI__)
constexpr bool kOffset = true;   // u8 activations (q + 128), corrected by 128 * w_sum
#else
constexpr bool kOffset = false;
#endif

// acc[r] = sum_k xa[r][k] * w[k] for R activation rows (xa: u8 = q + 128 with kOffset, else q).
template <int R>
inline void dot_i8(const uint8_t* const* xa, const int8_t* w, int64_t K, int32_t* acc) {
  int64_t k = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512i a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_si512();
  for (; k + 64 <= K; k += 64) {
    const __m512i wv = _mm512_loadu_si512(w + k);
    for (int r = 0; r < R; ++r) a[r] = _mm512_dpbusd_epi32(a[r], _mm512_loadu_si512(xa[r] + k), wv);
  }
  for (int r = 0; r < R; ++r) acc[r] = _mm512_reduce_add_epi32(a[r]);
#elif defined(__AVX2__)
  __m256i a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_si256();
#if !defined(__AVXVNNI__)
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (; k + 32 <= K; k += 32) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
#if !defined(__AVXVNNI__)
    const __m256i aw = _mm256_sign_epi8(wv, wv);   // |w| as u8 (-128 -> 128)
#endif
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xa[r] + k));
#if defined(__AVXVNNI__)
      a[r] = _mm256_dpbusd_avx_epi32(a[r], xv, wv);
#else
      // NOTE: |w| <= 128 and |x| <= 127: a pair of products stays within int16
      a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones));
#endif
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a[r]), _mm256_extracti128_si256(a[r], 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    acc[r] = _mm_cvtsi128_si32(s);
  }
#else
  for (int r = 0; r < R; ++r) acc[r] = 0;
#endif
  for (; k < K; ++k) {
    for (int r = 0; r < R; ++r) {
      const int32_t xv = kOffset ? static_cast<int32_t>(xa[r][k]) : static_cast<int8_t>(xa[r][k]);
      acc[r] += xv * static_cast<int32_t>(w[k]);
    }
  }
}

}  // namespace

std::vector<at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto s = at::empty({M}, x.options());
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      quantize_row(x.data_ptr<float>() + m * K, K, q.data_ptr<int8_t>() + m * K, s.data_ptr<float>() + m);
  });
  return {q, s};
}

void check_w8a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be contiguous float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be contiguous int8 [N, K] with x's K");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == w.size(0) && w_scale.is_contiguous(),
              "w_scale must be float32 [N]");
}

at::Tensor w8a8_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                     const at::Tensor& w_sum) {
  check_w8a8(x, w, w_scale);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w_sum.scalar_type() == at::kInt && w_sum.numel() == N && w_sum.is_contiguous(),
              "w_sum must be int32 [N]");
  auto qs = quantize_rows_int8(x);
  auto xq = qs[0];
  const float* sx = qs[1].data_ptr<float>();
  if (kOffset) xq = xq.view(at::kByte).add(128).contiguous();   // q + 128 wraps to the u8 value
  const uint8_t* xa = reinterpret_cast<const uint8_t*>(xq.data_ptr());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sw = w_scale.data_ptr<float>();
  const int32_t* ws = w_sum.data_ptr<int32_t>();
  auto y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 4, [&](int64_t nb, int64_t ne) {
    for (int64_t n = nb; n < ne; ++n) {
      const int8_t* wr = wp + n * K;
      const int32_t off = kOffset ? 128 * ws[n] : 0;
      int64_t m = 0;
      for (; m + MT <= M; m += MT) {
        const uint8_t* rows[MT];
        int32_t acc[MT];
        for (int r = 0; r < MT; ++r) rows[r] = xa + (m + r) * K;
        dot_i8<MT>(rows, wr, K, acc);
        for (int r = 0; r < MT; ++r) yp[(m + r) * N + n] = static_cast<float>(acc[r] - off) * sx[m + r] * sw[n];
      }
      for (; m < M; ++m) {
        const uint8_t* rows[1] = {xa + m * K};
        int32_t acc[1];
        dot_i8<1>(rows, wr, K, acc);
        yp[m * N + n] = static_cast<float>(acc[0] - off) * sx[m] * sw[n];
      }
    }
  });
  return y;
}

std::string w8a8_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "avx512vnni";
#elif defined(__AVXVNNI__)
  return "avxvnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

// ------------------------------------------------------------------------------------ w4a16

namespace {

#if defined(__AVX2__)
// 16 codes (8 bytes) of a row, in element order, as 16 bytes 0..15.
inline __m128i nibbles16(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// One weight row rebuilt straight in bf16 into `out` (K bf16, G a multiple of 32): the AMX path's
// operand. Per group the 16 values bf16((k - zero) * scale), k = 0..15, are computed once, with
// dequant_row's arithmetic and the bf16 tiles' rounding (so the same bits as rebuilding in float32
// and rounding), and each element is picked from them by its code (vpermw), 32 at a time.
inline void dequant_row_bf16(const uint8_t* codes, const float* sc, const uint8_t* zr, int64_t K, int64_t G,
                             uint16_t* out) {
  const __m512 kv = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < K / G; ++g) {
    const __m512 w = _mm512_mul_ps(_mm512_set1_ps(sc[g]),
                                   _mm512_sub_ps(kv, _mm512_set1_ps(static_cast<float>(zr[g]))));
    const __m256bh half = _mm512_cvtneps_pbh(w);
    const __m512i table = _mm512_castsi256_si512(reinterpret_cast<const __m256i&>(half));
    for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
      // 16 bytes: element 2i in the low nibble of byte i, 2i + 1 in its high nibble
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k / 2));
      const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
      const __m256i q = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
      _mm512_storeu_si512(out + k, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table));
    }
  }
}
#endif

// One weight row rebuilt in float32 into `out` (K floats): w = (q - zero) * scale, a group at a time.
inline void dequant_row(const uint8_t* codes, const float* sc, const uint8_t* zr, int64_t K, int64_t G,
                        float* out) {
  for (int64_t g = 0; g < K / G; ++g) {
    const int32_t z = zr[g];
    const float s = sc[g];
    int64_t k = g * G;
    const int64_t end = k + G;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512i zv = _mm512_set1_epi32(z);
    const __m512 sv = _mm512_set1_ps(s);
    for (; k + 16 <= end; k += 16)
      _mm512_storeu_ps(out + k, _mm512_mul_ps(sv, _mm512_cvtepi32_ps(
                                    _mm512_sub_epi32(_mm512_cvtepu8_epi32(nibbles16(codes + k / 2)), zv))));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256i zv = _mm256_set1_epi32(z);
    const __m256 sv = _mm256_set1_ps(s);
    for (; k + 16 <= end; k += 16) {
      const __m128i q = nibbles16(codes + k / 2);
      _mm256_storeu_ps(out + k, _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q), zv))));
      _mm256_storeu_ps(out + k + 8, _mm256_mul_ps(sv, _mm256_cvtepi32_ps(
                                        _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)), zv))));
    }
#endif
    for (; k < end; ++k) out[k] = static_cast<float>(((codes[k / 2] >> (4 * (k & 1))) & 0x0F) - z) * s;
  }
}

// y[m..m+R, n..n+NR] with weight rows n.. already rebuilt in float32 (`w`, NR rows of K): a
// register tile of NR x R float32 dot products, each load of w or x feeding R or NR FMAs (one
// x row per weight row would read every x row from L2 again for every weight row).
template <int NR, int R>
inline void fdot_tile(const float* w, int64_t K, const float* xp, int64_t m, float* yp, int64_t N, int64_t n) {
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = xp + (m + r) * K;
  float acc[NR][R];
  int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 a[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) a[i][r] = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    __m512 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = _mm512_loadu_ps(w + i * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x[r] + k);
      for (int i = 0; i < NR; ++i) a[i][r] = _mm512_fmadd_ps(wv[i], xv, a[i][r]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_reduce_add_ps(a[i][r]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a[NR][R];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) a[i][r] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
    for (int i = 0; i < NR; ++i) wv[i] = _mm256_loadu_ps(w + i * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x[r] + k);
      for (int i = 0; i < NR; ++i) a[i][r] = _mm256_fmadd_ps(wv[i], xv, a[i][r]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = kvmesh_quant::hsum8(a[i][r]);
#else
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = 0.f;
#endif
  for (; k < K; ++k)
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) acc[i][r] += w[i * K + k] * x[r][k];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < R; ++r) yp[(m + r) * N + n + i] = acc[i][r];
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int TR = 6;   // activation rows of a 4 x TR register tile (24 of 32 zmm accumulate)
#else
constexpr int TR = 2;   // 4 x 2 of 16 ymm registers
#endif

// Weight rows n..n+NR rebuilt in `scratch` [NR, K], then every activation row against them.
template <int NR>
inline void w4_tile(const uint8_t* qp, const float* sp, const uint8_t* zp, int64_t K, int64_t G, int64_t NG,
                    const float* xp, int64_t M, float* yp, int64_t N, int64_t n, float* scratch) {
  for (int i = 0; i < NR; ++i)
    dequant_row(qp + (n + i) * (K / 2), sp + (n + i) * NG, zp + (n + i) * NG, K, G, scratch + i * K);
  int64_t m = 0;
  for (; m + TR <= M; m += TR) fdot_tile<NR, TR>(scratch, K, xp, m, yp, N, n);
  for (; m < M; ++m) fdot_tile<NR, 1>(scratch, K, xp, m, yp, N, n);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 activations (a bf16 model), many rows: weight rows n..n+NR rebuilt in float32 and rounded
// to bf16 (round to nearest even, as torch's .bfloat16()) into `wb` [NR, K], then vdpbf16ps (two
// products a float32 lane, float32 accumulation) over an NR x 6 register tile.
template <int NR>
inline void w4_tile_bf16(const uint8_t* qp, const float* sp, const uint8_t* zp, int64_t K, int64_t G,
                         int64_t NG, const uint16_t* xb, int64_t M, float* yp, int64_t N, int64_t n,
                         float* scratch, uint16_t* wb) {
  constexpr int R = 6;
  for (int i = 0; i < NR; ++i) {
    dequant_row(qp + (n + i) * (K / 2), sp + (n + i) * NG, zp + (n + i) * NG, K, G, scratch);
    for (int64_t k = 0; k < K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wb + i * K + k),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scratch + k)));
  }
  int64_t m = 0;
  for (; m < M; m += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, M - m));
    __m512 a[NR][R];
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < R; ++r) a[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      __m512i wv[NR];
      for (int i = 0; i < NR; ++i) wv[i] = _mm512_loadu_si512(wb + i * K + k);
      for (int r = 0; r < rows; ++r) {
        const __m512i xv = _mm512_loadu_si512(xb + (m + r) * K + k);
        for (int i = 0; i < NR; ++i) a[i][r] = _mm512_dpbf16_ps(a[i][r], (__m512bh)wv[i], (__m512bh)xv);
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < rows; ++r) yp[(m + r) * N + n + i] = _mm512_reduce_add_ps(a[i][r]);
  }
}
#endif

// Few rows (decode): y[m, n] for R rows from m, the codes widened in registers for every R rows;
// per group a float32 vector dot of (q - z) with x, times the group's scale, one reduction a row.
template <int R>
inline void w4_rows(const uint8_t* codes, const float* sc, const uint8_t* zr, int64_t K, int64_t G,
                    const float* xp, int64_t m, float* yp, int64_t N, int64_t n) {
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = xp + (m + r) * K;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 tot[R];
  for (int r = 0; r < R; ++r) tot[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / G; ++g) {
    const __m512i zv = _mm512_set1_epi32(zr[g]);
    __m512 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      const __m512 wv = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(nibbles16(codes + k / 2)), zv));
      for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[r] + k), a[r]);
    }
    const __m512 sv = _mm512_set1_ps(sc[g]);
    for (int r = 0; r < R; ++r) tot[r] = _mm512_fmadd_ps(a[r], sv, tot[r]);
  }
  for (int r = 0; r < R; ++r) yp[(m + r) * N + n] = _mm512_reduce_add_ps(tot[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 tot[R];
  for (int r = 0; r < R; ++r) tot[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / G; ++g) {
    const __m256i zv = _mm256_set1_epi32(zr[g]);
    __m256 a[R];
    for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      const __m128i q = nibbles16(codes + k / 2);
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q), zv));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)), zv));
      for (int r = 0; r < R; ++r) {
        a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[r] + k), a[r]);
        a[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[r] + k + 8), a[r]);
      }
    }
    const __m256 sv = _mm256_set1_ps(sc[g]);
    for (int r = 0; r < R; ++r) tot[r] = _mm256_fmadd_ps(a[r], sv, tot[r]);
  }
  for (int r = 0; r < R; ++r) yp[(m + r) * N + n] = kvmesh_quant::hsum8(tot[r]);
#else
  for (int r = 0; r < R; ++r) {
    float t = 0.f;
    for (int64_t g = 0; g < K / G; ++g) {
      float a = 0.f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k)
        a += static_cast<float>(((codes[k / 2] >> (4 * (k & 1))) & 0x0F) - zr[g]) * x[r][k];
      t += a * sc[g];
    }
    yp[(m + r) * N + n] = t;
  }
#endif
}

}  // namespace

namespace {

at::Tensor w4a16_impl(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& zeros, int64_t group_size, bool amx_only, bool out_bf16) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be contiguous float32 or bfloat16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0,
              "group_size must be a multiple of 32 dividing K");
  const int64_t G = group_size, NG = K / G;
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
              qweight.size(1) == K / 2, "qweight must be contiguous uint8 [N, K / 2]");
  const int64_t N = qweight.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == N &&
              scales.size(1) == NG, "scales must be contiguous float32 [N, K / group_size]");
  TORCH_CHECK(zeros.scalar_type() == at::kByte && zeros.is_contiguous() && zeros.size(0) == N &&
              zeros.size(1) == NG, "zeros must be contiguous uint8 [N, K / group_size]");
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const uint8_t* zp = zeros.data_ptr<uint8_t>();
  TORCH_CHECK(!amx_only || (x.scalar_type() == at::kBFloat16 && !w4a16_amx_isa().empty()),
              "w4a16_gemm_amx: bfloat16 x and AMX bf16 tiles (this build or process has none)");
#if KQ_AMX_TILES && defined(__AVX512BF16__) && defined(__AVX512BW__)
  // NOTE: bf16 activations from W4_AMX_MIN_ROWS rows on AMX: each weight row rebuilt in bf16 by
  // lookup, with the bits the bf16 tiles below round it to, 32 rows at a time, multiplied on the
  // tiles; with out_bf16 the accumulators go to y rounded to bf16 (no float32 [M, N], no copy)
  if (x.scalar_type() == at::kBFloat16 && M > 0 && N > 0 && (amx_only || M >= W4_AMX_MIN_ROWS) &&
      kvmesh_amx::tiles_permitted()) {
    const auto rebuild = [&](int64_t row, int64_t count, uint16_t* out) {
      for (int64_t i = 0; i < count; ++i)
        dequant_row_bf16(qp + (row + i) * (K / 2), sp + (row + i) * NG, zp + (row + i) * NG, K, G, out + i * K);
    };
    const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
    auto y = at::empty({M, N}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
    if (out_bf16)
      kvmesh_amx::bf16_rebuilt_gemm(xb, M, N, K, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), rebuild);
    else
      kvmesh_amx::bf16_rebuilt_gemm(xb, M, N, K, y.data_ptr<float>(), rebuild);
    return y;
  }
#endif
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16 && M >= ROWS_MIN) {
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
    at::parallel_for(0, N, 4, [&](int64_t nb, int64_t ne) {
      std::vector<float> scratch(K);
      std::vector<uint16_t> wb(4 * K);
      int64_t n = nb;
      for (; n + 4 <= ne; n += 4) w4_tile_bf16<4>(qp, sp, zp, K, G, NG, xb, M, yp, N, n, scratch.data(), wb.data());
      for (; n < ne; ++n) w4_tile_bf16<1>(qp, sp, zp, K, G, NG, xb, M, yp, N, n, scratch.data(), wb.data());
    });
    return y;
  }
#endif
  const auto xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, N, 4, [&](int64_t nb, int64_t ne) {
    if (M >= ROWS_MIN) {
      // NOTE: many rows: rebuild 4 weight rows at a time once (4 K floats, in L1/L2) and reuse them
      std::vector<float> scratch(4 * K);
      int64_t n = nb;
      for (; n + 4 <= ne; n += 4) w4_tile<4>(qp, sp, zp, K, G, NG, xp, M, yp, N, n, scratch.data());
      for (; n < ne; ++n) w4_tile<1>(qp, sp, zp, K, G, NG, xp, M, yp, N, n, scratch.data());
      return;
    }
    for (int64_t n = nb; n < ne; ++n) {
      const uint8_t* codes = qp + n * (K / 2);
      const float* sc = sp + n * NG;
      const uint8_t* zr = zp + n * NG;
      int64_t m = 0;
      for (; m + MT <= M; m += MT) w4_rows<MT>(codes, sc, zr, K, G, xp, m, yp, N, n);
      for (; m < M; ++m) w4_rows<1>(codes, sc, zr, K, G, xp, m, yp, N, n);
    }
  });
  return y;
}

}  // namespace

at::Tensor w4a16_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& zeros, int64_t group_size, bool out_bf16) {
  return w4a16_impl(x, qweight, scales, zeros, group_size, false, out_bf16);
}

at::Tensor w4a16_gemm_amx(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const at::Tensor& zeros, int64_t group_size, bool out_bf16) {
  return w4a16_impl(x, qweight, scales, zeros, group_size, true, out_bf16);
}

std::string w4a16_amx_isa() {
#if KQ_AMX_TILES && defined(__AVX512BF16__) && defined(__AVX512BW__)
  return kvmesh_amx::tiles_permitted() ? "amx_bf16" : "";
#else
  return "";
#endif
}

std::string w4a16_isa() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return "avx512_bf16";
#elif defined(__AVX512F__) && defined(__AVX512BW__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace kvmesh_hfquant
