// Elementwise CPU kernels of the decoder layer (float32), one pass each, no temporaries:
// RMSNorm with the fused residual add, NeoX RoPE of q and k, and SiLU(gate) * up.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels.h"
#include "vec.h"

using kvmesh::exp_nonpos;
#if KVMESH_AVX2
using kvmesh::exp_nonpos8;
#endif

// ---- RMSNorm (+ residual) and RoPE: one pass each, no temporaries ----------------------------
// Small batches (a decode step) run inline on the calling thread: a parallel region per op costs
// more than the op there, and far more when other processes hold the cores.

// (norm(x [+ residual]), x [+ residual]): y = w * (v * (1 / sqrt(mean(v^2) + eps))), float32.
std::vector<torch::Tensor> rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                                    const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "rms_norm: x must be contiguous float32 [T, H]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == torch::kFloat &&
                  weight.is_contiguous(),
              "rms_norm: weight must be contiguous float32 [H]");
  const int64_t T = x.size(0), H = x.size(1);
  const bool has_res = residual.has_value();
  if (has_res) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == torch::kFloat &&
                    residual->is_contiguous(),
                "rms_norm: residual must be contiguous float32 shaped like x");
  }
  torch::Tensor out = torch::empty_like(x);
  torch::Tensor sum = has_res ? torch::empty_like(x) : x;
  const float* xp = x.data_ptr<float>();
  const float* rp = has_res ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* sp = has_res ? sum.data_ptr<float>() : nullptr;
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* v = xp + t * H;
      if (has_res) {
        float* s = sp + t * H;
        const float* r = rp + t * H;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) s[i] = v[i] + r[i];
        v = s;
      }
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += v[i] * v[i];
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + feps);
      float* o = op + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] = wp[i] * (v[i] * inv);
    }
  });
  return {out, sum};
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// NeoX RoPE of one [T, heads, D] tensor (unit stride along D) into a new contiguous one:
// x1 * cos - x2 * sin | x2 * cos + x1 * sin, rounded as torch's separate ops round (no FMA).
static torch::Tensor rope_one(const torch::Tensor& x, const torch::Tensor& positions,
                              const torch::Tensor& cos_sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.stride(2) == 1,
              "rotary_embedding: q / k must be float32 [T, heads, D] with unit stride along D");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos_sin.size(1) == D, "rotary_embedding: head_dim does not match the table");
  torch::Tensor out = torch::empty({T, NH, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), P = cos_sin.size(0);
  at::parallel_for(0, T, 128, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pos = pp[t];
      TORCH_CHECK(pos >= 0 && pos < P, "rotary_embedding: position out of the table's range");
      const float* c = cs + pos * D;
      const float* sn = c + half;
      for (int64_t h = 0; h < NH; ++h) {
        const float* a = xp + t * s0 + h * s1;
        float* o = op + (t * NH + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = a[i], x2 = a[i + half];
          const float p1 = x1 * c[i], p2 = x2 * sn[i], p3 = x2 * c[i], p4 = x1 * sn[i];
          o[i] = p1 - p2;
          o[i + half] = p3 + p4;
        }
      }
    }
  });
  return out;
}
#pragma GCC pop_options

std::vector<torch::Tensor> rotary_embedding(const torch::Tensor& positions, const torch::Tensor& q,
                                            const torch::Tensor& k, const torch::Tensor& cos_sin) {
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == torch::kLong && positions.is_contiguous() &&
                  positions.size(0) == q.size(0) && k.size(0) == q.size(0),
              "rotary_embedding: positions must be contiguous int64 [T] matching q and k");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.scalar_type() == torch::kFloat && cos_sin.is_contiguous(),
              "rotary_embedding: cos_sin must be contiguous float32 [positions, D]");
  return {rope_one(q, positions, cos_sin), rope_one(k, positions, cos_sin)};
}

// ---- SiLU(gate) * up of a fused [T, 2I] gate|up projection, in one pass --------------------------
// sigmoid(x) from e = exp(-|x|) <= 1 (exp_nonpos): 1 / (1 + e) for x >= 0, e / (1 + e) below.
torch::Tensor silu_and_mul(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be float32 [T, 2I] with unit stride along the last dim");
  const int64_t T = x.size(0), I = x.size(1) / 2, stride = x.stride(0);
  torch::Tensor out = torch::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * stride;
      const float* u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
#if KVMESH_AVX2
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      const __m256 sign = _mm256_set1_ps(-0.0f);
      for (; i + 8 <= I; i += 8) {
        const __m256 v = _mm256_loadu_ps(g + i);
        const __m256 e = exp_nonpos8(_mm256_or_ps(v, sign));            // exp(-|v|)
        const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(v, zero, _CMP_GE_OQ));
        const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(v, sig), _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) {
        const float v = g[i], e = exp_nonpos(-std::fabs(v));
        o[i] = v * ((v >= 0.0f ? 1.0f : e) / (1.0f + e)) * u[i];
      }
    }
  });
  return out;
}
