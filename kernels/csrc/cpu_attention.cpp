// Paged attention on the CPU, reading K/V in place from the block cache (no gathered copy).
//
// One work item per (query row, KV head): the row's query heads of that KV head's group
// (GQA) score every key of the row's context once, softmax in float32 (max-subtracted, two
// passes over a per-thread score buffer), then sum the values. Work items run on ATen's thread
// pool (at::parallel_for), so torch.set_num_threads governs them like any other op.
//
// Layouts (float32):
//   query   [T, H, D]   any token / head strides, unit stride along D
//   k_cache [num_blocks, block_size, KVH, D] contiguous (same for v_cache)
//   tables  [S, max_blocks] int32; seq_lens [S] int32 (context incl. this step's tokens)
//   rows    [R, 3] int64: (token index in query/out, sequence index, context length the row
//           sees: seq_len for a decode, its own position + 1 for a prefill token)
//   out     [T, H, D] contiguous; only the rows named are written
// window W > 0: a row of context length n sees positions n - W .. n - 1.
// softcap c > 0: score = c * tanh(score / c) (Gemma 2), before the softmax.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

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

inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

void check(bool ok, const char* msg) { TORCH_CHECK(ok, "paged_attention_rows: ", msg); }

}  // namespace

void paged_attention_rows(const torch::Tensor& query, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                          const torch::Tensor& rows, torch::Tensor& out, double scale,
                          int64_t window, double softcap) {
  check(query.dim() == 3 && query.scalar_type() == torch::kFloat && query.stride(2) == 1,
        "query must be float32 [T, H, D] with unit stride along D");
  check(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
            k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == torch::kFloat &&
            v_cache.scalar_type() == torch::kFloat,
        "k_cache / v_cache must be contiguous float32 [num_blocks, block_size, KVH, D]");
  check(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt &&
            block_tables.is_contiguous(),
        "block_tables must be contiguous int32 [S, max_blocks]");
  check(rows.dim() == 2 && rows.size(1) == 3 && rows.scalar_type() == torch::kLong &&
            rows.is_contiguous(),
        "rows must be contiguous int64 [R, 3]");
  check(out.sizes() == query.sizes() && out.is_contiguous() && out.scalar_type() == torch::kFloat,
        "out must be contiguous float32 shaped like query");
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  check(k_cache.size(3) == D && KVH > 0 && H % KVH == 0, "heads / head_dim do not match the cache");
  const int64_t G = H / KVH;
  const int64_t R = rows.size(0), max_blocks = block_tables.size(1), S = block_tables.size(0);
  const int64_t T = query.size(0), num_blocks = k_cache.size(0);
  const int64_t* rw = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {  // O(R): validated once, so the kernel reads no bad address
    check(rw[3 * r] >= 0 && rw[3 * r] < T, "row token index out of range");
    check(rw[3 * r + 1] >= 0 && rw[3 * r + 1] < S, "row sequence index out of range");
    check(rw[3 * r + 2] >= 1 && rw[3 * r + 2] <= max_blocks * block_size,
          "row context length exceeds its block table");
  }
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t tok_stride = KVH * D, blk_stride = block_size * KVH * D;
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  at::parallel_for(0, R * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / KVH, kvh = item % KVH;
      const int64_t tok = rw[3 * r], seq = rw[3 * r + 1], ctx = rw[3 * r + 2];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t n = ctx - lo;
      scores.resize(G * n);
      const int32_t* table = bt + seq * max_blocks;
      const float* qh = q + tok * qs0 + kvh * G * qs1;
      for (int64_t t = lo; t < ctx; ++t) {
        const int64_t blk = table[t / block_size];
        TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_attention_rows: block id out of range");
        const float* kp = kc + blk * blk_stride + (t % block_size) * tok_stride + kvh * D;
        for (int64_t g = 0; g < G; ++g) scores[g * n + (t - lo)] = dot(qh + g * qs1, kp, D) * fscale;
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        if (cap > 0.0f) {
          for (int64_t i = 0; i < n; ++i) sg[i] = cap * std::tanh(sg[i] / cap);
        }
        float m = sg[0];
        for (int64_t i = 1; i < n; ++i) m = std::max(m, sg[i]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = exp_nonpos(sg[i] - m);
          sum += sg[i];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = lo; t < ctx; ++t) {
        const int64_t blk = table[t / block_size];
        const float* vp = vc + blk * blk_stride + (t % block_size) * tok_stride + kvh * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * n + (t - lo)];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * vp[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        std::memcpy(o + tok * H * D + (kvh * G + g) * D, acc.data() + g * D, D * sizeof(float));
      }
    }
  });
}

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_rows", &paged_attention_rows,
        "Paged attention of the given rows over the block cache, in place (float32, CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm with an optional fused residual add (float32, CPU)");
  m.def("rotary_embedding", &rotary_embedding, "NeoX RoPE of q and k (float32, CPU)");
}
