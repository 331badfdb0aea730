// Paged attention of bfloat16 prefill rows on AMX tiles: both products as tile multiplies
// (tdpbf16ps: bf16 pairs, float32 sums), K and V read in place from the cache.
//
// The call's rows (attention.cpp's layout and context rules) are grouped into runs of consecutive
// query tokens of one sequence, each seeing one key more than the last (a prefill chunk), up to
// 16 / G tokens: the run's m tokens x G query heads of a KV head are the mg = m * G columns of its
// tiles, so a key tile loaded once serves all of them. Single rows (decodes) go back to the
// caller: a decode's G columns would leave most of a tile idle, and vdpbf16ps streams its keys
// as fast (memory-bound either way). Per run:
//   scores   per KV head and 16-key tile of the run's span: S^T[16 keys, mg] = K[16, D] Q^T, the
//            keys' rows loaded as the A tile straight from the block (no transpose, no copy), the
//            queries as a B tile of bf16 pairs built once per run; the KV heads' tiles side by
//            side in one float32 row per key (lane h * mg + column).
//   softmax  per lane over its own query's keys (causal limit, window), in float32 (scale,
//            soft-cap, max-subtracted exp; a lane mask per key), then the probabilities
//            transposed to [lane, key] and rounded to bf16 (as flash attention rounds P for P V).
//   values   per 32-key group and KV head: O[mg, D] += P[mg, 32] V[32, D], V's rows interleaved
//            in pairs into B tiles once for all mg columns; 4 accumulator tiles of 16 columns per
//            64 of head_dim, kept in memory between groups.
// Keys outside a run's span (a tile's rows before a window's start, the last block's unwritten
// rows) get no probability and their V rows enter as zeros, so whatever those cache rows hold
// (NaN included) reaches no output.
//
// Tile registers (configured per run length):
//   0-3  O accumulators, mg rows x 16 float32       4  P, mg rows x 32 bf16
//   5    K rows or V pairs, 16 rows x 64 bytes      6  S^T, 16 rows x mg float32
//   7    Q^T pairs, 16 rows x mg bf16 pairs
#include "attention_amx.h"

#if KVMESH_AMX
#include "aten.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "../quant/csrc/amx_tiles.h"

namespace kvmesh {
namespace {

kvmesh_amx::TileConfig make_config(int64_t mg) {
  kvmesh_amx::TileConfig c;   // every tile 16 rows x 64 bytes, then the ones that differ
  const auto g = static_cast<uint8_t>(mg);
  for (int t = 0; t < 5; ++t) c.rows[t] = g;
  c.colsb[6] = static_cast<uint16_t>(4 * mg);
  c.colsb[7] = static_cast<uint16_t>(4 * mg);
  return c;
}

// NOTE: tile numbers are literals: GCC pastes them into the asm text.
inline void dot_out(int c) {
  switch (c) {
    case 0: _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_dpbf16ps(1, 4, 5); break;
    case 2: _tile_dpbf16ps(2, 4, 5); break;
    default: _tile_dpbf16ps(3, 4, 5); break;
  }
}
inline void load_out(int c, const float* p, int64_t stride) {
  switch (c) {
    case 0: _tile_loadd(0, p, stride); break;
    case 1: _tile_loadd(1, p, stride); break;
    case 2: _tile_loadd(2, p, stride); break;
    default: _tile_loadd(3, p, stride); break;
  }
}
inline void zero_out(int c) {
  switch (c) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
  }
}
inline void store_out(int c, float* p, int64_t stride) {
  switch (c) {
    case 0: _tile_stored(0, p, stride); break;
    case 1: _tile_stored(1, p, stride); break;
    case 2: _tile_stored(2, p, stride); break;
    default: _tile_stored(3, p, stride); break;
  }
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<uint8_t, FreeDeleter>;

Buffer aligned(size_t bytes) {
  bytes = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes == 0 ? 64 : bytes);
  TORCH_CHECK(p != nullptr, "paged_attention_rows: out of memory for the AMX scratch");
  std::memset(p, 0, bytes == 0 ? 64 : bytes);
  return Buffer(static_cast<uint8_t*>(p));
}

// Up to 16 / G consecutive query tokens of one sequence: column i * G + g of a KV head's tiles
// is query i, head g of its group.
struct Group {
  int64_t tok, seq, ctx, m;   // query i: token tok + i, context ctx + i
  int64_t row;                // the call's row of query 0
};

// One thread's scratch, sized for the longest span of the call.
struct Scratch {
  int64_t cap32;          // tokens per span, rounded up to 32
  Buffer qt;              // [KVH][D/32] B tiles of Q^T pairs, 1 KB each
  Buffer s;               // [cap32][<= 16 KVH] float32 scores, then probabilities (a lane a column)
  Buffer pt;              // [<= 16 KVH][cap32] bf16 probabilities, transposed
  Buffer span;            // [2][<= 16 KVH] int32: each lane's keys [first, end)
  Buffer vb;              // 4 B tiles of V pairs, 1 KB each
  Buffer o;               // [KVH][16][D] float32 output accumulators
  Scratch(const AttentionGeometry<bf16>& a, int64_t cap32_)
      : cap32(cap32_),
        qt(aligned(static_cast<size_t>(a.KVH * (a.D / 32)) * 1024)),
        s(aligned(static_cast<size_t>(cap32_ * 16 * a.KVH) * 4)),
        pt(aligned(static_cast<size_t>(16 * a.KVH * cap32_) * 2)),
        span(aligned(static_cast<size_t>(2 * 16 * a.KVH) * 4)),
        vb(aligned(4 * 1024)),
        o(aligned(static_cast<size_t>(a.KVH * 16 * a.D) * 4)) {}
};

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|) <= 1.
inline __m512 vtanh(__m512 x) {
  const __m512 e = vexp_nonpos(vmul(vset1(2.0f), vneg_abs(x)));
  const __m512 t = vdiv(vsub(vset1(1.0f), e), vadd(vset1(1.0f), e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}

void group(const AttentionGeometry<bf16>& a, const Group& q, Scratch& w) {
  const int64_t G = a.G, mg = q.m * G, D = a.D, chunks = D / 32, bs = a.block_size;
  // lane h*mg + col of a score row: KV head h's column col (query col / G, head h*G + col % G)
  const int64_t lanes = a.KVH * mg, sw = (lanes + 15) / 16 * 16;
  const int64_t lo = a.span_start(q.ctx), last = q.ctx + q.m;   // keys [lo, last - 1) across the run
  const int32_t* table = a.bt + q.seq * a.max_blocks;
  a.check_blocks(table, lo, last - 1);
  const int64_t t0 = lo - lo % 16;                 // tiles start 16-aligned, inside lo's block
  const int64_t n = last - 1 - t0, tiles = (n + 15) / 16, n32 = (n + 31) / 32 * 32;
  const int64_t kv_bytes = 16 * a.tok_stride * 2;  // one 16-token tile of a block, all KV heads
  auto tile_base = [&](const bf16* cache, int64_t i) {  // the cache rows of tile i
    const int64_t t = t0 + 16 * i;
    return cache + table[t / bs] * a.blk_stride + (t % bs) * a.tok_stride;
  };

  // Q^T pairs: B tile (h, c) row p, column i*G + g = query i's head h*G + g, elements 32c + 2p, +1
  auto* qt = reinterpret_cast<uint32_t*>(w.qt.get());
  for (int64_t h = 0; h < a.KVH; ++h) {
    for (int64_t c = 0; c < chunks; ++c) {
      uint32_t* dst = qt + (h * chunks + c) * 256;
      for (int64_t col = 0; col < mg; ++col) {
        const bf16* src = a.q + (q.tok + col / G) * a.qs0 + (h * G + col % G) * a.qs1 + 32 * c;
        for (int64_t p = 0; p < 16; ++p) std::memcpy(dst + p * 16 + col, src + 2 * p, 4);
      }
    }
  }

  // scores: S[j, h*mg + col] for key t0 + j
  float* S = reinterpret_cast<float*>(w.s.get());
  for (int64_t i = 0; i < tiles; ++i) {
    const bf16* kb = tile_base(a.kc, i);
    const bf16* next = i + 1 < tiles ? tile_base(a.kc, i + 1) : nullptr;
    for (int64_t h = 0; h < a.KVH; ++h) {
      if (next) prefetch(reinterpret_cast<const char*>(next) + h * kv_bytes / a.KVH, kv_bytes / a.KVH);
      _tile_zero(6);
      for (int64_t c = 0; c < chunks; ++c) {
        _tile_loadd(5, kb + h * D + 32 * c, a.tok_stride * 2);
        _tile_loadd(7, qt + (h * chunks + c) * 256, 64);
        _tile_dpbf16ps(6, 5, 7);
      }
      _tile_stored(6, S + 16 * i * sw + h * mg, sw * 4);
    }
  }

  // softmax of each lane over its own keys [span_start(ctx_i), ctx_i), 16 lanes a vector
  int32_t* first = reinterpret_cast<int32_t*>(w.span.get());
  int32_t* end = first + 16 * a.KVH;
  for (int64_t l = 0; l < sw; ++l) {
    const int64_t ctx = q.ctx + (l % mg) / G;
    first[l] = l < lanes ? static_cast<int32_t>(a.span_start(ctx) - t0) : 0;
    end[l] = l < lanes ? static_cast<int32_t>(ctx - t0) : 0;
  }
  const int64_t j0 = lo - t0, j1 = last - 1 - t0;
  const __m512 scale = vset1(a.scale), cap = vset1(a.cap), inv_cap = vset1(a.cap > 0 ? 1.0f / a.cap : 0.0f);
  const __m512 ninf = vset1(-std::numeric_limits<float>::infinity());
  auto* pt = reinterpret_cast<bf16*>(w.pt.get());
  for (int64_t v = 0; v < sw / 16; ++v) {
    const __m512i vfirst = _mm512_loadu_si512(first + 16 * v), vend = _mm512_loadu_si512(end + 16 * v);
    auto valid = [&](int64_t j) {
      const __m512i vj = _mm512_set1_epi32(static_cast<int32_t>(j));
      return static_cast<__mmask16>(_mm512_cmpge_epi32_mask(vj, vfirst) & _mm512_cmplt_epi32_mask(vj, vend));
    };
    __m512 mx = ninf, sum = vzero();
    for (int64_t j = j0; j < j1; ++j) {
      float* p = S + j * sw + 16 * v;
      __m512 x = vmul(vload(p), scale);
      if (a.cap > 0.0f) x = vmul(cap, vtanh(vmul(x, inv_cap)));
      vstore(p, x);
      mx = _mm512_mask_max_ps(mx, valid(j), mx, x);
    }
    for (int64_t j = j0; j < j1; ++j) {
      float* p = S + j * sw + 16 * v;
      const __m512 e = _mm512_maskz_mov_ps(valid(j), vexp_nonpos(vsub(vload(p), mx)));
      vstore(p, e);
      sum = vadd(sum, e);
    }
    const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(sum, vzero(), _CMP_GT_OQ), vset1(1.0f), sum);
    // P^T: 16 keys x 16 lanes at a time, transposed, rounded to bf16; nothing outside [j0, j1)
    for (int64_t jt = 0; jt < n32; jt += 16) {
      __m512i m[16];
      for (int64_t k = 0; k < 16; ++k) {
        const int64_t j = jt + k;
        m[k] = (j >= j0 && j < j1) ? _mm512_castps_si512(vmul(vload(S + j * sw + 16 * v), inv))
                                   : _mm512_setzero_si512();
      }
      kvmesh_amx::transpose16(m);
      for (int64_t k = 0; k < 16 && 16 * v + k < lanes; ++k) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pt + (16 * v + k) * w.cap32 + jt),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(m[k])));
      }
    }
  }

  // values: O[h][col, :] += P[h*mg + col, group] V[group, h's columns], 32 keys a group
  float* O = reinterpret_cast<float*>(w.o.get());
  auto* vb = reinterpret_cast<uint16_t*>(w.vb.get());
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i ilo = _mm512_load_si512(lo_idx), ihi = _mm512_load_si512(hi_idx);
  for (int64_t k = 0; k < n32 / 32; ++k) {
    const bf16* base[2] = {2 * k < tiles ? tile_base(a.vc, 2 * k) : nullptr,
                           2 * k + 1 < tiles ? tile_base(a.vc, 2 * k + 1) : nullptr};
    for (int64_t h = 0; h < a.KVH; ++h) {
      for (int64_t e = 2; e < 4; ++e) {          // the next group's tiles, a share per head
        if (2 * k + e < tiles) {
          prefetch(reinterpret_cast<const char*>(tile_base(a.vc, 2 * k + e)) + h * kv_bytes / a.KVH,
                   kv_bytes / a.KVH);
        }
      }
      _tile_loadd(4, pt + h * mg * w.cap32 + 32 * k, w.cap32 * 2);
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int nc = static_cast<int>(std::min<int64_t>(4, (D - d0) / 16));
        float* Oh = O + h * 16 * D + d0;
        // V pairs: B tile c row p = keys 2p, 2p + 1 of the group interleaved, columns d0 + 16c ..
        for (int64_t p = 0; p < 16; ++p) {
          const bf16* rows2[2];
          for (int e = 0; e < 2; ++e) {
            const int64_t j = 32 * k + 2 * p + e;
            rows2[e] = j >= j0 && j < j1 ? base[(2 * p + e) / 16] + ((2 * p + e) % 16) * a.tok_stride + h * D + d0
                                         : nullptr;
          }
          for (int c = 0; c < nc; c += 2) {   // nc is even: D and d0 are multiples of 32
            const __m512i x = rows2[0] ? _mm512_loadu_si512(rows2[0] + 16 * c) : _mm512_setzero_si512();
            const __m512i y = rows2[1] ? _mm512_loadu_si512(rows2[1] + 16 * c) : _mm512_setzero_si512();
            _mm512_store_si512(vb + c * 512 + p * 32, _mm512_permutex2var_epi16(x, ilo, y));
            _mm512_store_si512(vb + (c + 1) * 512 + p * 32, _mm512_permutex2var_epi16(x, ihi, y));
          }
        }
        for (int c = 0; c < nc; ++c) {
          if (k == 0) {
            zero_out(c);
          } else {
            load_out(c, Oh + 16 * c, D * 4);
          }
          _tile_loadd(5, vb + c * 512, 64);
          dot_out(c);
          store_out(c, Oh + 16 * c, D * 4);
        }
      }
    }
  }
  for (int64_t h = 0; h < a.KVH; ++h) {
    for (int64_t col = 0; col < mg; ++col) {
      bf16* o = a.out + ((q.tok + col / G) * a.H + h * G + col % G) * D;
      const float* src = O + (h * 16 + col) * D;
      for (int64_t d = 0; d < D; d += 16) vstore(o + d, vload(src + d));
    }
  }
}

// The call's rows as groups: runs of consecutive tokens of one sequence (each seeing one key more
// than the last), at most 16 / G long, in (sequence, token) order.
std::vector<Group> groups_of(const AttentionGeometry<bf16>& a, int64_t R) {
  std::vector<int64_t> order(R);
  for (int64_t r = 0; r < R; ++r) order[r] = r;
  const int64_t* rows = a.rows;
  std::sort(order.begin(), order.end(), [rows](int64_t x, int64_t y) {
    return rows[3 * x + 1] != rows[3 * y + 1] ? rows[3 * x + 1] < rows[3 * y + 1] : rows[3 * x] < rows[3 * y];
  });
  const int64_t most = 16 / a.G;
  std::vector<Group> runs;
  for (const int64_t r : order) {
    const int64_t tok = rows[3 * r], seq = rows[3 * r + 1], ctx = rows[3 * r + 2];
    if (!runs.empty()) {
      Group& g = runs.back();
      if (g.seq == seq && g.tok + g.m == tok && g.ctx + g.m == ctx && g.m < most) {
        ++g.m;
        continue;
      }
    }
    runs.push_back(Group{tok, seq, ctx, 1, r});
  }
  return runs;
}

}  // namespace

bool amx_attention_applies(int64_t H, int64_t KVH, int64_t D, int64_t block_size) {
  return KVH > 0 && H % KVH == 0 && H / KVH <= 8 && D % 32 == 0 && block_size % 16 == 0 &&
         kvmesh_amx::tiles_permitted();
}

std::vector<int64_t> amx_attention(const AttentionGeometry<bf16>& a, int64_t R) {
  std::vector<int64_t> rest;
  std::vector<Group> runs;
  for (const Group& g : groups_of(a, R)) {
    if (g.m > 1) {
      runs.push_back(g);
    } else {
      rest.push_back(g.row);
    }
  }
  std::sort(rest.begin(), rest.end());   // the call's (thread-balanced) order
  if (runs.empty()) return rest;
  // longest spans first and last alternately: the thread pool's contiguous split then gives each
  // thread about the same number of keys
  auto keys = [&](const Group& g) { return g.ctx + g.m - 1 - a.span_start(g.ctx); };
  std::sort(runs.begin(), runs.end(), [&](const Group& x, const Group& y) { return keys(x) > keys(y); });
  std::vector<Group> zig(runs.size());
  for (size_t i = 0; i < runs.size(); ++i) zig[i] = i % 2 == 0 ? runs[i / 2] : runs[runs.size() - 1 - i / 2];
  int64_t longest = 0;
  for (const Group& g : zig) {
    const int64_t lo = a.span_start(g.ctx);
    longest = std::max(longest, g.ctx + g.m - 1 - (lo - lo % 16));
  }
  const int64_t cap32 = (longest + 31) / 32 * 32;
  at::parallel_for(0, static_cast<int64_t>(zig.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch w(a, cap32);
    int64_t configured = 0;
    kvmesh_amx::TileConfig cfg;
    for (int64_t i = begin; i < end; ++i) {
      if (zig[i].m != configured) {
        configured = zig[i].m;
        cfg = make_config(configured * a.G);
        _tile_loadconfig(&cfg);
      }
      group(a, zig[i], w);
    }
    _tile_release();
  });
  return rest;
}

std::string amx_attention_isa() { return kvmesh_amx::tiles_permitted() ? "amx_bf16" : ""; }

}  // namespace kvmesh

#else  // a build without AMX-BF16

namespace kvmesh {
bool amx_attention_applies(int64_t, int64_t, int64_t, int64_t) { return false; }
std::vector<int64_t> amx_attention(const AttentionGeometry<bf16>&, int64_t R) {
  std::vector<int64_t> all(R);
  for (int64_t r = 0; r < R; ++r) all[r] = r;
  return all;
}
std::string amx_attention_isa() { return ""; }
}  // namespace kvmesh

#endif
