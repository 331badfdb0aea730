// Paged attention on the CPU, reading K/V in place from the block cache (no gathered copy).
//
// One work item per query row (all its heads): the row's context is walked a block at a time,
// so a block's keys (then values) come from memory once and are reused from L1 by every query
// head of every KV head (GQA); softmax in float32 (max-subtracted, over a per-thread score
// buffer), then the weighted sum of the values. Work items run on ATen's thread pool
// (at::parallel_for), so torch.set_num_threads governs them like any other op. With AVX2 and
// FMA (and head_dim a multiple of 8) the inner loops are explicit vector code, see row_avx2;
// otherwise plain loops the compiler vectorizes (row_portable).
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
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace {

using namespace kvmesh;

void check(bool ok, const char* msg) { TORCH_CHECK(ok, "paged_attention_rows: ", msg); }

// Everything one row's computation reads, resolved once per call.
struct Geometry {
  const float* q;
  const float* kc;
  const float* vc;
  const int32_t* bt;
  const int64_t* rows;
  float* out;
  int64_t qs0, qs1;              // query strides (token, head)
  int64_t H, KVH, G, D;          // query heads, KV heads, heads per KV head, head_dim
  int64_t block_size, max_blocks, num_blocks;
  int64_t tok_stride, blk_stride;
  int64_t window;
  float scale, cap;
};

// Softmax of each head's n scores in place (max-subtracted, float32), soft-capped first if asked.
void softmax_rows(float* scores, int64_t heads, int64_t n, float cap) {
  for (int64_t h = 0; h < heads; ++h) {
    float* sg = scores + h * n;
    if (cap > 0.0f) {
      for (int64_t i = 0; i < n; ++i) sg[i] = cap * std::tanh(sg[i] / cap);
    }
    float m = sg[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, sg[i]);
    float sum = 0.0f;
    int64_t i = 0;
#if KVMESH_AVX2
    const __m256 vm = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vm));
      _mm256_storeu_ps(sg + i, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    sum = hsum(vsum);
#endif
    for (; i < n; ++i) {
      sg[i] = exp_nonpos(sg[i] - m);
      sum += sg[i];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
}

// The row's context [lo, ctx) and its block-table entries, checked before any key is read.
inline void row_span(const Geometry& g, int64_t r, int64_t& tok, const int32_t*& table, int64_t& lo,
                     int64_t& ctx) {
  tok = g.rows[3 * r];
  const int64_t seq = g.rows[3 * r + 1];
  ctx = g.rows[3 * r + 2];
  lo = g.window > 0 ? std::max<int64_t>(0, ctx - g.window) : 0;
  table = g.bt + seq * g.max_blocks;
  for (int64_t b = lo / g.block_size; b <= (ctx - 1) / g.block_size; ++b) {
    TORCH_CHECK(table[b] >= 0 && table[b] < g.num_blocks, "paged_attention_rows: block id out of range");
  }
}

// Portable path: plain loops the compiler vectorizes (any head_dim, any ISA).
void row_portable(const Geometry& g, int64_t r, std::vector<float>& scores, std::vector<float>& acc) {
  int64_t tok, lo, ctx;
  const int32_t* table;
  row_span(g, r, tok, table, lo, ctx);
  const int64_t n = ctx - lo, D = g.D;
  scores.resize(g.H * n);
  acc.assign(g.H * D, 0.0f);
  for (int64_t t = lo; t < ctx; ++t) {
    const float* kt = g.kc + table[t / g.block_size] * g.blk_stride + (t % g.block_size) * g.tok_stride;
    for (int64_t h = 0; h < g.H; ++h) {
      const float* qh = g.q + tok * g.qs0 + h * g.qs1;
      const float* kp = kt + (h / g.G) * D;
      float dotv = 0.0f;
#pragma omp simd reduction(+ : dotv)
      for (int64_t i = 0; i < D; ++i) dotv += qh[i] * kp[i];
      scores[h * n + (t - lo)] = dotv * g.scale;
    }
  }
  softmax_rows(scores.data(), g.H, n, g.cap);
  for (int64_t t = lo; t < ctx; ++t) {
    const float* vt = g.vc + table[t / g.block_size] * g.blk_stride + (t % g.block_size) * g.tok_stride;
    for (int64_t h = 0; h < g.H; ++h) {
      const float w = scores[h * n + (t - lo)];
      const float* vp = vt + (h / g.G) * D;
      float* a = acc.data() + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += w * vp[d];
    }
  }
  std::memcpy(g.out + tok * g.H * D, acc.data(), g.H * D * sizeof(float));
}

#if KVMESH_AVX2
// AVX2 path (head_dim a multiple of 8). The context is walked block by block, so a block's
// keys (and later values) are loaded from memory once and reused from L1 by every head.
//   scores: 8 keys at a time per query head, 8 independent FMA chains (the FMA latency is
//           hidden), folded into one vector of 8 dot products by a horizontal-add tree.
//   values: a head's output kept in registers 64 dims at a time across the block's tokens.

// [sum(a0), ..., sum(a7)]
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                    __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Scores of `count` consecutive keys (stride tok_stride) for one query head.
inline void qk_keys(const float* qh, const float* k0, int64_t tok_stride, int64_t D, int64_t count,
                    float scale, float* dst) {
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const float* k = k0 + j * tok_stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t c = 0; c < D; c += 8) {
      const __m256 qv = _mm256_loadu_ps(qh + c);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + c), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + tok_stride + c), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * tok_stride + c), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * tok_stride + c), a3);
      a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 4 * tok_stride + c), a4);
      a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 5 * tok_stride + c), a5);
      a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 6 * tok_stride + c), a6);
      a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 7 * tok_stride + c), a7);
    }
    _mm256_storeu_ps(dst + j, _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), vscale));
  }
  for (; j < count; ++j) {
    const float* k = k0 + j * tok_stride;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t c = 0;
    for (; c + 16 <= D; c += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + c), _mm256_loadu_ps(k + c), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + c + 8), _mm256_loadu_ps(k + c + 8), a1);
    }
    if (c < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + c), _mm256_loadu_ps(k + c), a0);
    dst[j] = hsum(_mm256_add_ps(a0, a1)) * scale;
  }
}

// acc[0:D] += sum_j w[j] * v_j for `count` consecutive values (stride tok_stride).
inline void pv_values(const float* w, const float* v0, int64_t tok_stride, int64_t D, int64_t count,
                      float* acc) {
  int64_t c = 0;
  for (; c + 64 <= D; c += 64) {
    __m256 a0 = _mm256_loadu_ps(acc + c), a1 = _mm256_loadu_ps(acc + c + 8);
    __m256 a2 = _mm256_loadu_ps(acc + c + 16), a3 = _mm256_loadu_ps(acc + c + 24);
    __m256 a4 = _mm256_loadu_ps(acc + c + 32), a5 = _mm256_loadu_ps(acc + c + 40);
    __m256 a6 = _mm256_loadu_ps(acc + c + 48), a7 = _mm256_loadu_ps(acc + c + 56);
    for (int64_t j = 0; j < count; ++j) {
      const __m256 p = _mm256_set1_ps(w[j]);
      const float* v = v0 + j * tok_stride + c;
      a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v), a0);
      a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8), a1);
      a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 16), a2);
      a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 24), a3);
      a4 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 32), a4);
      a5 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 40), a5);
      a6 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 48), a6);
      a7 = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 56), a7);
    }
    _mm256_storeu_ps(acc + c, a0);
    _mm256_storeu_ps(acc + c + 8, a1);
    _mm256_storeu_ps(acc + c + 16, a2);
    _mm256_storeu_ps(acc + c + 24, a3);
    _mm256_storeu_ps(acc + c + 32, a4);
    _mm256_storeu_ps(acc + c + 40, a5);
    _mm256_storeu_ps(acc + c + 48, a6);
    _mm256_storeu_ps(acc + c + 56, a7);
  }
  for (; c < D; c += 8) {
    __m256 a = _mm256_loadu_ps(acc + c);
    for (int64_t j = 0; j < count; ++j) {
      a = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(v0 + j * tok_stride + c), a);
    }
    _mm256_storeu_ps(acc + c, a);
  }
}

// The blocks of a context lie anywhere in the cache, so the hardware prefetchers cannot follow
// from one to the next: the next block's bytes are requested while this one is computed.
inline void prefetch_span(const float* p, int64_t floats) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < floats * 4; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// Calls per_head(h, that head's K/V rows of the block, count, index in the span) for each block
// of the span [lo, ctx) (the part of a block in it) and each query head, the next block of the
// table requested from memory a share per head, so that the requests overlap the compute.
template <typename PerHead>
inline void walk_blocks(const Geometry& g, const int32_t* table, const float* cache, int64_t lo,
                        int64_t ctx, PerHead per_head) {
  const int64_t bs = g.block_size;
  for (int64_t t = lo; t < ctx;) {
    const int64_t count = std::min(bs - t % bs, ctx - t);
    const float* base = cache + table[t / bs] * g.blk_stride + (t % bs) * g.tok_stride;
    const float* next = t + count < ctx ? cache + table[(t + count) / bs] * g.blk_stride : nullptr;
    const int64_t share = next ? (std::min(bs, ctx - t - count) * g.tok_stride + g.H - 1) / g.H : 0;
    for (int64_t h = 0; h < g.H; ++h) {
      if (next) prefetch_span(next + h * share, share);
      per_head(h, base + (h / g.G) * g.D, count, t - lo);
    }
    t += count;
  }
}

void row_avx2(const Geometry& g, int64_t r, std::vector<float>& scores) {
  int64_t tok, lo, ctx;
  const int32_t* table;
  row_span(g, r, tok, table, lo, ctx);
  const int64_t n = ctx - lo, D = g.D;
  scores.resize(g.H * n);
  float* out = g.out + tok * g.H * D;  // the row's output doubles as the accumulator
  std::fill(out, out + g.H * D, 0.0f);
  const float* qrow = g.q + tok * g.qs0;
  walk_blocks(g, table, g.kc, lo, ctx, [&](int64_t h, const float* keys, int64_t count, int64_t i) {
    qk_keys(qrow + h * g.qs1, keys, g.tok_stride, D, count, g.scale, scores.data() + h * n + i);
  });
  softmax_rows(scores.data(), g.H, n, g.cap);
  walk_blocks(g, table, g.vc, lo, ctx, [&](int64_t h, const float* values, int64_t count, int64_t i) {
    pv_values(scores.data() + h * n + i, values, g.tok_stride, D, count, out + h * D);
  });
}
#endif

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
  Geometry g{};
  g.H = query.size(1);
  g.D = query.size(2);
  g.block_size = k_cache.size(1);
  g.KVH = k_cache.size(2);
  check(k_cache.size(3) == g.D && g.KVH > 0 && g.H % g.KVH == 0, "heads / head_dim do not match the cache");
  g.G = g.H / g.KVH;
  const int64_t R = rows.size(0), S = block_tables.size(0), T = query.size(0);
  g.max_blocks = block_tables.size(1);
  g.num_blocks = k_cache.size(0);
  g.rows = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {  // O(R): validated once, so the kernel reads no bad address
    check(g.rows[3 * r] >= 0 && g.rows[3 * r] < T, "row token index out of range");
    check(g.rows[3 * r + 1] >= 0 && g.rows[3 * r + 1] < S, "row sequence index out of range");
    check(g.rows[3 * r + 2] >= 1 && g.rows[3 * r + 2] <= g.max_blocks * g.block_size,
          "row context length exceeds its block table");
  }
  g.q = query.data_ptr<float>();
  g.kc = k_cache.data_ptr<float>();
  g.vc = v_cache.data_ptr<float>();
  g.bt = block_tables.data_ptr<int32_t>();
  g.out = out.data_ptr<float>();
  g.qs0 = query.stride(0);
  g.qs1 = query.stride(1);
  g.tok_stride = g.KVH * g.D;
  g.blk_stride = g.block_size * g.KVH * g.D;
  g.window = window;
  g.scale = static_cast<float>(scale);
  g.cap = static_cast<float>(softcap);
  const bool vectorized = KVMESH_AVX2 && g.D % 8 == 0;
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    for (int64_t r = begin; r < end; ++r) {
#if KVMESH_AVX2
      if (vectorized) {
        row_avx2(g, r, scores);
        continue;
      }
#endif
      row_portable(g, r, scores, acc);
    }
  });
  (void)vectorized;
}
