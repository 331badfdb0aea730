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
//           float32 scale and a 0..15 zero per `group_size` elements: w = (q - zero) * scale. The
//           codes are widened and the zero taken off in integer registers, converted to float32
//           and multiplied with float32 activations (FMA, float32 accumulation per group, one
//           scale multiply per group); AVX-512, AVX2 or portable code.
//
// Which instruction set is used is fixed at compile time by what -march=native (or a narrower
// cpu_kernels.PATHS build) enables, as in gemm.cpp. AMX-INT8 is not written: no CPU it could be
// tested on was at hand. Work is split over output rows (at::parallel_for).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvmesh_hfquant {
namespace {

constexpr int MT = 4;   // activation rows per inner tile: one weight load feeds MT dot products

// ------------------------------------------------------------------------------------- w8a8

// Row m of x to int8: q = round_half_even(x / scale), scale = max|x| / 127 (0 for a zero row).
void quantize_row(const float* x, int64_t K, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float s = amax / 127.f;
  *scale = s;
  for (int64_t k = 0; k < K; ++k) {
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

std::vector<torch::Tensor> quantize_rows_int8(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto s = torch::empty({M}, x.options());
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m)
      quantize_row(x.data_ptr<float>() + m * K, K, q.data_ptr<int8_t>() + m * K, s.data_ptr<float>() + m);
  });
  return {q, s};
}

torch::Tensor w8a8_gemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& w_scale,
                        const torch::Tensor& w_sum) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be contiguous float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kInt8 && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be contiguous int8 [N, K] with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w_scale.scalar_type() == torch::kFloat32 && w_scale.numel() == N && w_scale.is_contiguous(),
              "w_scale must be float32 [N]");
  TORCH_CHECK(w_sum.scalar_type() == torch::kInt32 && w_sum.numel() == N && w_sum.is_contiguous(),
              "w_sum must be int32 [N]");
  auto qs = quantize_rows_int8(x);
  auto xq = qs[0];
  const float* sx = qs[1].data_ptr<float>();
  if (kOffset) xq = xq.view(torch::kUInt8).add(128).contiguous();   // q + 128 wraps to the u8 value
  const uint8_t* xa = reinterpret_cast<const uint8_t*>(xq.data_ptr());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sw = w_scale.data_ptr<float>();
  const int32_t* ws = w_sum.data_ptr<int32_t>();
  auto y = torch::empty({M, N}, x.options());
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

// acc[r] = sum over one group (`G` elements from element k0) of (q - z) * x[r], float32.
template <int R>
inline void group_dot(const uint8_t* codes, int64_t k0, int64_t G, int32_t z, const float* const* x,
                      float* acc) {
  int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  const __m512i zv = _mm512_set1_epi32(z);
  for (; k + 16 <= G; k += 16) {
    const __m512 wv = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(nibbles16(codes + (k0 + k) / 2)), zv));
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[r] + k0 + k), a[r]);
  }
  for (int r = 0; r < R; ++r) acc[r] = _mm512_reduce_add_ps(a[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
  const __m256i zv = _mm256_set1_epi32(z);
  for (; k + 16 <= G; k += 16) {
    const __m128i q = nibbles16(codes + (k0 + k) / 2);
    const __m256 w0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(q), zv));
    const __m256 w1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)), zv));
    for (int r = 0; r < R; ++r) {
      a[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[r] + k0 + k), a[r]);
      a[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[r] + k0 + k + 8), a[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a[r]), _mm256_extractf128_ps(a[r], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    acc[r] = _mm_cvtss_f32(s);
  }
#else
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
#endif
  for (; k < G; ++k) {
    const int64_t e = k0 + k;
    const float wv = static_cast<float>(((codes[e / 2] >> (4 * (e & 1))) & 0x0F) - z);
    for (int r = 0; r < R; ++r) acc[r] += wv * x[r][e];
  }
}

// y[m, n] for R rows from m: per group a float32 dot of (q - z) with x, times the group's scale.
template <int R>
inline void w4_rows(const uint8_t* codes, const float* sc, const uint8_t* zr, int64_t K, int64_t G,
                    const float* xp, int64_t m, float* yp, int64_t N, int64_t n) {
  const float* x[R];
  float tot[R], acc[R];
  for (int r = 0; r < R; ++r) { x[r] = xp + (m + r) * K; tot[r] = 0.f; }
  for (int64_t g = 0; g < K / G; ++g) {
    group_dot<R>(codes, g * G, G, zr[g], x, acc);
    for (int r = 0; r < R; ++r) tot[r] += acc[r] * sc[g];
  }
  for (int r = 0; r < R; ++r) yp[(m + r) * N + n] = tot[r];
}

}  // namespace

torch::Tensor w4a16_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                         const torch::Tensor& zeros, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(group_size > 0 && group_size % 16 == 0 && K % group_size == 0,
              "group_size must be a multiple of 16 dividing K");
  const int64_t G = group_size, NG = K / G;
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == torch::kUInt8 && qweight.is_contiguous() &&
              qweight.size(1) == K / 2, "qweight must be contiguous uint8 [N, K / 2]");
  const int64_t N = qweight.size(0);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.size(0) == N &&
              scales.size(1) == NG, "scales must be contiguous float32 [N, K / group_size]");
  TORCH_CHECK(zeros.scalar_type() == torch::kUInt8 && zeros.is_contiguous() && zeros.size(0) == N &&
              zeros.size(1) == NG, "zeros must be contiguous uint8 [N, K / group_size]");
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const uint8_t* zp = zeros.data_ptr<uint8_t>();
  auto y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 4, [&](int64_t nb, int64_t ne) {
    for (int64_t n = nb; n < ne; ++n) {
      const uint8_t* codes = qp + n * (K / 2);
      int64_t m = 0;
      for (; m + MT <= M; m += MT) w4_rows<MT>(codes, sp + n * NG, zp + n * NG, K, G, xp, m, yp, N, n);
      for (; m < M; ++m) w4_rows<1>(codes, sp + n * NG, zp + n * NG, K, G, xp, m, yp, N, n);
    }
  });
  return y;
}

std::string w4a16_isa() {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace kvmesh_hfquant

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w8a8_gemm", &kvmesh_hfquant::w8a8_gemm,
        "y = x @ W^T: int8 weights (per-row scales) x int8 activations quantized per row");
  m.def("quantize_rows_int8", &kvmesh_hfquant::quantize_rows_int8,
        "x -> (int8 codes, float32 per-row scales): the activation quantization of w8a8_gemm");
  m.def("w8a8_isa", &kvmesh_hfquant::w8a8_isa, "the instruction set of the int8 dot product");
  m.def("w4a16_gemm", &kvmesh_hfquant::w4a16_gemm,
        "y = x @ W^T: 4-bit group weights (scales, zeros) x float32 activations");
  m.def("w4a16_isa", &kvmesh_hfquant::w4a16_isa, "the instruction set of the int4 GEMM");
}
