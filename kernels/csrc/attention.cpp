// Paged attention on the CPU, reading K/V in place from the block cache (no gathered copy).
//
// One work item per query row (all its heads): the row's context is walked a block at a time,
// so a block's keys (then values) come from memory once and are reused from L1 by every query
// head of every KV head (GQA); softmax in float32 (max-subtracted, over a per-thread score
// buffer), then the weighted sum of the values, accumulated in float32. Work items run on ATen's
// thread pool (at::parallel_for), so torch.set_num_threads governs them like any other op.
//
// Element type T: float32 or bfloat16 (query, cache and output share it; bf16 is widened to
// float32 as it is loaded, every sum is float32, the output is rounded once). With a vector path
// (vec.h: AVX-512 or AVX2 + FMA) and head_dim a multiple of its width the inner loops are
// explicit vector code (row_vec); with AVX512-BF16, bf16 query-key dot products are vdpbf16ps
// (32 products per instruction); otherwise plain loops the compiler vectorizes (row_portable).
// bf16 prefill rows go to AMX tiles instead where the build and CPU have them (attention_amx.cpp).
//
// Cache type C: T, or 8-bit float codes (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2, scale 1):
// a decode row widens each block exactly once (vec.h's vload of the codes; to bf16 where
// vdpbf16ps reads it, float32 elsewhere: Wide), into a per-thread buffer its heads read as they
// would the cache; half of bf16's bytes come from memory. A prefill
// chunk's rows would widen the same blocks once per row: their sequences' blocks are widened once
// into a T copy the rows then read as a T cache (attend_codes; bf16 chunks on AMX tiles from it).
//
// Layouts (T):
//   query   [T, H, D]   any token / head strides, unit stride along D
//   k_cache [num_blocks, block_size, KVH, D] contiguous (same for v_cache)
//   tables  [S, max_blocks] int32; seq_lens [S] int32 (context incl. this step's tokens)
//   rows    [R, 3] int64: (token index in query/out, sequence index, context length the row
//           sees: seq_len for a decode, its own position + 1 for a prefill token)
//   out     [T, H, D] contiguous; only the rows named are written
// window W > 0: a row of context length n sees positions n - W .. n - 1.
// softcap c > 0: score = c * tanh(score / c) (Gemma 2), before the softmax.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_amx.h"
#include "kernels.h"
#include "vec.h"

namespace {

using namespace kvmesh;

void check(bool ok, const char* msg) { TORCH_CHECK(ok, "paged_attention_rows: ", msg); }

template <typename T, typename C = T>
using Geometry = AttentionGeometry<T, C>;

// What a decode row widens an 8-bit cache's block to: bf16 where vdpbf16ps takes it from there,
// float32 otherwise (a bf16 buffer would be rounded to and widened from again); the cache's own
// type when it is the query's.
template <typename T, typename C>
using Wide = std::conditional_t<std::is_same_v<C, T>, T,
                                std::conditional_t<KVMESH_AVX512BF16 && std::is_same_v<T, bf16>, bf16, float>>;

// n codes widened exactly to T (float32 or bf16).
template <typename T, typename C>
inline void widen(const C* src, int64_t n, T* dst) {
  int64_t i = 0;
#if KVMESH_SIMD
  for (; i + kW <= n; i += kW) vstore(dst + i, vload(src + i));
#endif
  for (; i < n; ++i) dst[i] = from_f<T>(to_f(src[i]));
}

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
#if KVMESH_SIMD
    const vf vm = vset1(m);
    vf vsum = vzero();
    for (; i + kW <= n; i += kW) {
      const vf e = vexp_nonpos(vsub(vload(sg + i), vm));
      vstore(sg + i, e);
      vsum = vadd(vsum, e);
    }
    sum = vhsum(vsum);
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
template <typename T, typename C>
inline void row_span(const Geometry<T, C>& g, int64_t r, int64_t& tok, const int32_t*& table, int64_t& lo,
                     int64_t& ctx) {
  tok = g.rows[3 * r];
  const int64_t seq = g.rows[3 * r + 1];
  ctx = g.rows[3 * r + 2];
  lo = g.span_start(ctx);
  table = g.bt + seq * g.max_blocks;
  g.check_blocks(table, lo, ctx);
}

// Portable path: plain loops the compiler vectorizes (any head_dim, any ISA).
template <typename T, typename C>
void row_portable(const Geometry<T, C>& g, int64_t r, std::vector<float>& scores, std::vector<float>& acc) {
  int64_t tok, lo, ctx;
  const int32_t* table;
  row_span(g, r, tok, table, lo, ctx);
  const int64_t n = ctx - lo, D = g.D;
  scores.resize(g.H * n);
  acc.assign(g.H * D, 0.0f);
  for (int64_t t = lo; t < ctx; ++t) {
    const C* kt = g.kc + table[t / g.block_size] * g.blk_stride + (t % g.block_size) * g.tok_stride;
    for (int64_t h = 0; h < g.H; ++h) {
      const T* qh = g.q + tok * g.qs0 + h * g.qs1;
      const C* kp = kt + (h / g.G) * D;
      float dotv = 0.0f;
#pragma omp simd reduction(+ : dotv)
      for (int64_t i = 0; i < D; ++i) dotv += to_f(qh[i]) * to_f(kp[i]);
      scores[h * n + (t - lo)] = dotv * g.scale;
    }
  }
  softmax_rows(scores.data(), g.H, n, g.cap);
  for (int64_t t = lo; t < ctx; ++t) {
    const C* vt = g.vc + table[t / g.block_size] * g.blk_stride + (t % g.block_size) * g.tok_stride;
    for (int64_t h = 0; h < g.H; ++h) {
      const float w = scores[h * n + (t - lo)];
      const C* vp = vt + (h / g.G) * D;
      float* a = acc.data() + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += w * to_f(vp[d]);
    }
  }
  T* o = g.out + tok * g.H * D;
  for (int64_t i = 0; i < g.H * D; ++i) o[i] = from_f<T>(acc[i]);
}

#if KVMESH_SIMD
// Vector path (head_dim a multiple of kW). The context is walked block by block, so a block's
// keys (and later values) are loaded from memory once and reused from L1 by every head.
//   scores: 8 keys at a time per query head, 8 independent FMA chains (the FMA latency is
//           hidden), folded into one vector of 8 dot products by a horizontal-add tree.
//   values: a head's output kept in registers 8 vectors at a time across the block's tokens.

inline void store8(const vf* a, float scale, float* dst) {
  _mm256_storeu_ps(dst, _mm256_mul_ps(hsum8(fold8(a[0]), fold8(a[1]), fold8(a[2]), fold8(a[3]), fold8(a[4]),
                                            fold8(a[5]), fold8(a[6]), fold8(a[7])),
                                      _mm256_set1_ps(scale)));
}

// Scores of `count` consecutive keys (stride tok_stride) for one query head.
template <typename T, typename K>
inline void qk_keys(const T* qh, const K* k0, int64_t tok_stride, int64_t D, int64_t count, float scale,
                    float* dst) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const K* k = k0 + j * tok_stride;
    vf a[8];
    for (int i = 0; i < 8; ++i) a[i] = vzero();
    for (int64_t c = 0; c < D; c += kW) {
      const vf qv = vload(qh + c);
      for (int i = 0; i < 8; ++i) a[i] = vfmadd(qv, vload(k + i * tok_stride + c), a[i]);
    }
    store8(a, scale, dst + j);
  }
  for (; j < count; ++j) {
    const K* k = k0 + j * tok_stride;
    vf a = vzero();
    for (int64_t c = 0; c < D; c += kW) a = vfmadd(vload(qh + c), vload(k + c), a);
    dst[j] = vhsum(a) * scale;
  }
}

#if KVMESH_AVX512BF16
// bf16 keys with vdpbf16ps: each instruction multiplies 32 bf16 pairs exactly and adds them in
// pairs to 16 float32 lanes (head_dim a multiple of 32; the caller checks).
inline __m512bh ld_bh(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline void qk_keys_dp(const bf16* qh, const bf16* k0, int64_t tok_stride, int64_t D, int64_t count,
                       float scale, float* dst) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const bf16* k = k0 + j * tok_stride;
    vf a[8];
    for (int i = 0; i < 8; ++i) a[i] = vzero();
    for (int64_t c = 0; c < D; c += 32) {
      const __m512bh qv = ld_bh(qh + c);
      for (int i = 0; i < 8; ++i) a[i] = _mm512_dpbf16_ps(a[i], qv, ld_bh(k + i * tok_stride + c));
    }
    store8(a, scale, dst + j);
  }
  for (; j < count; ++j) {
    const bf16* k = k0 + j * tok_stride;
    vf a = vzero();
    for (int64_t c = 0; c < D; c += 32) a = _mm512_dpbf16_ps(a, ld_bh(qh + c), ld_bh(k + c));
    dst[j] = vhsum(a) * scale;
  }
}
#endif

// acc[0:NV*kW] += sum_j w[j] * v_j for `count` consecutive values (stride tok_stride).
template <int NV, typename T>
inline void pv_chunk(const float* w, const T* v0, int64_t tok_stride, int64_t count, float* acc) {
  vf a[NV];
  for (int i = 0; i < NV; ++i) a[i] = vload(acc + i * kW);
  for (int64_t j = 0; j < count; ++j) {
    const vf p = vset1(w[j]);
    const T* v = v0 + j * tok_stride;
    for (int i = 0; i < NV; ++i) a[i] = vfmadd(p, vload(v + i * kW), a[i]);
  }
  for (int i = 0; i < NV; ++i) vstore(acc + i * kW, a[i]);
}

template <typename T>
inline void pv_values(const float* w, const T* v0, int64_t tok_stride, int64_t D, int64_t count, float* acc) {
  int64_t c = 0;
  for (; c + 8 * kW <= D; c += 8 * kW) pv_chunk<8>(w, v0 + c, tok_stride, count, acc + c);
  for (; c + 4 * kW <= D; c += 4 * kW) pv_chunk<4>(w, v0 + c, tok_stride, count, acc + c);
  for (; c < D; c += kW) pv_chunk<1>(w, v0 + c, tok_stride, count, acc + c);
}

// The blocks of a context lie anywhere in the cache, so the hardware prefetchers cannot follow
// from one to the next: the next block's bytes are requested while this one is computed.
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// Calls per_head(h, that head's K/V rows of the block, count, index in the span) for each block
// of the span [lo, ctx) (the part of a block in it) and each query head, the next block of the
// table requested from memory a share per head, so that the requests overlap the compute.
// An 8-bit cache (C != T): the block's rows are widened in `wide` once (W: Wide<T, C>), for all
// its heads (the GQA group and the query heads read them from there, as they would the cache).
template <typename T, typename C, typename W, typename PerHead>
inline void walk_blocks(const Geometry<T, C>& g, const int32_t* table, const C* cache, int64_t lo, int64_t ctx,
                        std::vector<W>& wide, PerHead per_head) {
  const int64_t bs = g.block_size;
  for (int64_t t = lo; t < ctx;) {
    const int64_t count = std::min(bs - t % bs, ctx - t);
    const C* base = cache + table[t / bs] * g.blk_stride + (t % bs) * g.tok_stride;
    const C* next = t + count < ctx ? cache + table[(t + count) / bs] * g.blk_stride : nullptr;
    const int64_t share = next ? (std::min(bs, ctx - t - count) * g.tok_stride + g.H - 1) / g.H : 0;
    const W* rows;
    if constexpr (std::is_same_v<C, W>) {
      rows = base;
    } else {
      wide.resize(bs * g.tok_stride);
      widen(base, count * g.tok_stride, wide.data());
      rows = wide.data();
    }
    for (int64_t h = 0; h < g.H; ++h) {
      if (next) prefetch_span(next + h * share, share * static_cast<int64_t>(sizeof(C)));
      per_head(h, rows + (h / g.G) * g.D, count, t - lo);
    }
    t += count;
  }
}

template <typename T, typename C>
void row_vec(const Geometry<T, C>& g, int64_t r, std::vector<float>& scores, std::vector<float>& acc,
             std::vector<Wide<T, C>>& wide, bool dp) {
  int64_t tok, lo, ctx;
  const int32_t* table;
  row_span(g, r, tok, table, lo, ctx);
  const int64_t n = ctx - lo, D = g.D;
  scores.resize(g.H * n);
  const T* qrow = g.q + tok * g.qs0;
  if (dp) {
#if KVMESH_AVX512BF16
    if constexpr (std::is_same_v<T, bf16>) {
      walk_blocks(g, table, g.kc, lo, ctx, wide, [&](int64_t h, const bf16* keys, int64_t count, int64_t i) {
        qk_keys_dp(qrow + h * g.qs1, keys, g.tok_stride, D, count, g.scale, scores.data() + h * n + i);
      });
    }
#endif
  } else {
    walk_blocks(g, table, g.kc, lo, ctx, wide, [&](int64_t h, const auto* keys, int64_t count, int64_t i) {
      qk_keys(qrow + h * g.qs1, keys, g.tok_stride, D, count, g.scale, scores.data() + h * n + i);
    });
  }
  softmax_rows(scores.data(), g.H, n, g.cap);
  // float32: the row's output doubles as the accumulator; bf16: a float32 one, rounded at the end
  float* out;
  if constexpr (std::is_same_v<T, float>) {
    out = g.out + tok * g.H * D;
  } else {
    acc.resize(g.H * D);
    out = acc.data();
  }
  std::fill(out, out + g.H * D, 0.0f);
  walk_blocks(g, table, g.vc, lo, ctx, wide, [&](int64_t h, const auto* values, int64_t count, int64_t i) {
    pv_values(scores.data() + h * n + i, values, g.tok_stride, D, count, out + h * D);
  });
  if constexpr (!std::is_same_v<T, float>) {
    T* o = g.out + tok * g.H * D;
    for (int64_t c = 0; c < g.H * D; c += kW) vstore(o + c, vload(out + c));
  }
}
#endif

template <typename T, typename C>
void attend_rows(const Geometry<T, C>& g, int64_t R);
template <typename T, typename C>
void attend_codes(Geometry<T, C> g, int64_t R, int64_t S, const at::TensorOptions& wide_options);

template <typename T, typename C>
void run(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& rows, at::Tensor& out, double scale,
         int64_t window, double softcap) {
  Geometry<T, C> g{};
  g.H = query.size(1);
  g.D = query.size(2);
  g.block_size = k_cache.size(1);
  g.KVH = k_cache.size(2);
  check(k_cache.size(3) == g.D && g.KVH > 0 && g.H % g.KVH == 0, "heads / head_dim do not match the cache");
  g.G = g.H / g.KVH;
  const int64_t R = rows.size(0), S = block_tables.size(0), T_ = query.size(0);
  g.max_blocks = block_tables.size(1);
  g.num_blocks = k_cache.size(0);
  g.rows = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {  // O(R): validated once, so the kernel reads no bad address
    check(g.rows[3 * r] >= 0 && g.rows[3 * r] < T_, "row token index out of range");
    check(g.rows[3 * r + 1] >= 0 && g.rows[3 * r + 1] < S, "row sequence index out of range");
    check(g.rows[3 * r + 2] >= 1 && g.rows[3 * r + 2] <= g.max_blocks * g.block_size,
          "row context length exceeds its block table");
  }
  g.q = query.data_ptr<T>();
  g.kc = k_cache.data_ptr<C>();
  g.vc = v_cache.data_ptr<C>();
  g.bt = block_tables.data_ptr<int32_t>();
  g.out = out.data_ptr<T>();
  g.qs0 = query.stride(0);
  g.qs1 = query.stride(1);
  g.tok_stride = g.KVH * g.D;
  g.blk_stride = g.block_size * g.KVH * g.D;
  g.window = window;
  g.scale = static_cast<float>(scale);
  g.cap = static_cast<float>(softcap);
  if constexpr (std::is_same_v<C, T>) {
    attend_rows(g, R);
  } else {
    attend_codes(g, R, S, query.options());
  }
}

// Every row of g.rows [0, R): bf16 prefill on AMX tiles where they are here, the rest (decodes)
// on the vector (or portable) path.
template <typename T, typename C>
void attend_rows(const Geometry<T, C>& g, int64_t R) {
  if (R == 0) return;
  std::vector<int64_t> rest;
  const int64_t* todo = nullptr;   // the row indices left, or null: every row
  int64_t left = R;
  if constexpr (std::is_same_v<T, bf16> && std::is_same_v<C, T>) {
    if (amx_attention_applies(g.H, g.KVH, g.D, g.block_size)) {
      rest = amx_attention(g, R);
      todo = rest.data();
      left = static_cast<int64_t>(rest.size());
    }
  }
#if KVMESH_SIMD
  const bool vectorized = g.D % kW == 0;
  const bool dp = KVMESH_AVX512BF16 && std::is_same_v<T, bf16> && g.D % 32 == 0;
#endif
  at::parallel_for(0, left, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc;
    std::vector<Wide<T, C>> wide;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = todo ? todo[i] : i;
#if KVMESH_SIMD
      if (vectorized) {
        row_vec(g, r, scores, acc, wide, dp);
        continue;
      }
#endif
      row_portable(g, r, scores, acc);
    }
  });
}

// An 8-bit cache. A decode row reads each key once: its blocks are widened as it walks them
// (walk_blocks). The rows of a prefill chunk (a sequence with 2 or more rows here) read the same
// keys once per row: the blocks of those sequences are widened once into a T copy, and their rows
// run over it as over a T cache (bf16: on AMX tiles where they are here).
template <typename T, typename C>
void attend_codes(Geometry<T, C> g, int64_t R, int64_t S, const at::TensorOptions& wide_options) {
  std::vector<int64_t> nrows(S, 0), reach(S, 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t seq = g.rows[3 * r + 1];
    nrows[seq] += 1;
    reach[seq] = std::max(reach[seq], g.rows[3 * r + 2]);
  }
  std::vector<int64_t> chunk_rows, other_rows;
  for (int64_t r = 0; r < R; ++r) {
    auto& dst = nrows[g.rows[3 * r + 1]] >= 2 ? chunk_rows : other_rows;
    dst.insert(dst.end(), g.rows + 3 * r, g.rows + 3 * r + 3);
  }
  if (chunk_rows.empty()) {
    attend_rows(g, R);
    return;
  }
  // the chunked sequences' blocks, renumbered into the copy; other entries kept
  std::vector<int32_t> table(g.bt, g.bt + S * g.max_blocks);
  std::vector<int32_t> sources;
  for (int64_t s = 0; s < S; ++s) {
    if (nrows[s] < 2) continue;
    const int32_t* own = g.bt + s * g.max_blocks;
    g.check_blocks(own, 0, reach[s]);
    for (int64_t b = 0; b <= (reach[s] - 1) / g.block_size; ++b) {
      table[s * g.max_blocks + b] = static_cast<int32_t>(sources.size());
      sources.push_back(own[b]);
    }
  }
  const int64_t nb = static_cast<int64_t>(sources.size());
  at::Tensor wide_k = at::empty({nb, g.block_size, g.KVH, g.D}, wide_options);
  at::Tensor wide_v = at::empty({nb, g.block_size, g.KVH, g.D}, wide_options);
  T* wk = wide_k.data_ptr<T>();
  T* wv = wide_v.data_ptr<T>();
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      widen(g.kc + sources[i] * g.blk_stride, g.blk_stride, wk + i * g.blk_stride);
      widen(g.vc + sources[i] * g.blk_stride, g.blk_stride, wv + i * g.blk_stride);
    }
  });
  Geometry<T, T> w{};
  w.q = g.q;
  w.kc = wk;
  w.vc = wv;
  w.bt = table.data();
  w.rows = chunk_rows.data();
  w.out = g.out;
  w.qs0 = g.qs0;
  w.qs1 = g.qs1;
  w.H = g.H;
  w.KVH = g.KVH;
  w.G = g.G;
  w.D = g.D;
  w.block_size = g.block_size;
  w.max_blocks = g.max_blocks;
  w.num_blocks = nb;
  w.tok_stride = g.tok_stride;
  w.blk_stride = g.blk_stride;
  w.window = g.window;
  w.scale = g.scale;
  w.cap = g.cap;
  attend_rows(w, static_cast<int64_t>(chunk_rows.size() / 3));
  g.rows = other_rows.data();
  attend_rows(g, static_cast<int64_t>(other_rows.size() / 3));
}

}  // namespace

void paged_attention_rows(const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& rows, at::Tensor& out, double scale,
                          int64_t window, double softcap) {
  const auto dt = query.scalar_type();
  const auto ct = k_cache.scalar_type();
  check(query.dim() == 3 && (dt == at::kFloat || dt == at::kBFloat16) && query.stride(2) == 1,
        "query must be float32 or bfloat16 [T, H, D] with unit stride along D");
  check(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
            k_cache.sizes() == v_cache.sizes() && v_cache.scalar_type() == ct &&
            (ct == dt || ct == at::kFloat8_e4m3fn || ct == at::kFloat8_e5m2),
        "k_cache / v_cache must be contiguous [num_blocks, block_size, KVH, D], both in the query's "
        "dtype or both float8_e4m3fn / float8_e5m2");
  check(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt &&
            block_tables.is_contiguous(),
        "block_tables must be contiguous int32 [S, max_blocks]");
  check(rows.dim() == 2 && rows.size(1) == 3 && rows.scalar_type() == at::kLong &&
            rows.is_contiguous(),
        "rows must be contiguous int64 [R, 3]");
  check(out.sizes() == query.sizes() && out.is_contiguous() && out.scalar_type() == dt,
        "out must be contiguous and shaped like query, in its dtype");
  auto with_cache = [&](auto q) {
    using T = decltype(q);
    if (ct == at::kFloat8_e4m3fn) {
      run<T, fp8e4m3>(query, k_cache, v_cache, block_tables, rows, out, scale, window, softcap);
    } else if (ct == at::kFloat8_e5m2) {
      run<T, fp8e5m2>(query, k_cache, v_cache, block_tables, rows, out, scale, window, softcap);
    } else {
      run<T, T>(query, k_cache, v_cache, block_tables, rows, out, scale, window, softcap);
    }
  };
  if (dt == at::kFloat) {
    with_cache(0.0f);
  } else {
    with_cache(bf16{});
  }
}
