// LoRA's shrink + expand for one site in one call (float32 / bfloat16, CPU): for every token that
// runs an adapter, out[row] += B[slot] @ (A[slot] @ x[row]), in place.
//
// The tokens come grouped by slot (LoRAMapping): segment s is rows[seg_starts[s]:seg_starts[s+1]],
// all of slot seg_slots[s]. A segment is cut into blocks of up to kBlock tokens; a block is one
// work item: the shrink y[m][RT] = x[rows] @ A[slot]^T into a stack buffer (float32), then the
// expand out[rows] += y @ Bt[slot] over every output column. Each is a small register-tiled GEMM
// (4 tokens x 4 ranks of dot products for the shrink, 4 tokens x 4 vectors of columns for the
// expand), so a prefill segment reads each A / B tile once per block, not once per token.
//
// B is taken transposed, Bt [L, RT, N] (the site's storage on CPU): the expand then reads rows of
// Bt along the output columns, which vectorise without horizontal sums. A site of several parts
// (q/k/v) is block-diagonal in B: output columns [part_cols[p], part_cols[p+1]) use only ranks
// [p*R, (p+1)*R), so the expand skips the zeros (parts times less work and fewer bytes). An
// adapter of rank r < R fills only ranks [p*R, p*R + r) of each part: `slot_ranks[slot]` = r, and
// both the shrink and the expand stop there (a slot of rank 0 does not touch this site: skipped).
//
// bfloat16: x, A, Bt and out are bf16, every sum is float32, each output rounded once; with
// AVX512-BF16 the shrink's dot products are vdpbf16ps (pairs of bf16 products into float32).

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

using kvmesh::bf16;
using kvmesh::from_f;
using kvmesh::to_f;
#if KVMESH_SIMD
using namespace kvmesh;
#endif

namespace {

constexpr int kBlock = 8;     // tokens of one segment per work item
constexpr int kMaxRank = 256; // RT (parts x --max-lora-rank) the stack buffer holds
constexpr int kTok = 4;       // tokens per microkernel tile
constexpr int kRank = 4;      // ranks per shrink tile
#if KVMESH_AVX512
constexpr int kVec = 4;       // output vectors per expand tile (16 accumulators of 32 registers)
#else
constexpr int kVec = 2;       // AVX2: 8 accumulators of 16 registers
#endif

struct Block {
  int64_t slot;
  int64_t rank;    // the slot's adapter rank at this site (<= R)
  int64_t first;   // index into rows
  int64_t count;   // <= kBlock
};

// ---- shrink: y[t][r] = dot(x[t], A[r]) for MT tokens x NR ranks ------------------------------
template <typename T, int MT, int NR>
inline void shrink_tile(const T* const* xs, const T* a, int64_t K, float* y, int64_t ystride) {
  int64_t k = 0;
  float acc[MT][NR] = {};
#if KVMESH_AVX512BF16
  if constexpr (std::is_same_v<T, bf16>) {
    __m512 v[MT][NR];
    for (int t = 0; t < MT; ++t)
      for (int r = 0; r < NR; ++r) v[t][r] = _mm512_setzero_ps();
    for (; k < K; k += 32) {
      // NOTE: the tail is a masked load: zeros add nothing, so no scalar loop is needed
      const __mmask32 m = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
      __m512i xv[MT];
      for (int t = 0; t < MT; ++t) xv[t] = _mm512_maskz_loadu_epi16(m, xs[t] + k);
      for (int r = 0; r < NR; ++r) {
        const __m512i av = _mm512_maskz_loadu_epi16(m, a + r * K + k);
        for (int t = 0; t < MT; ++t) v[t][r] = _mm512_dpbf16_ps(v[t][r], (__m512bh)xv[t], (__m512bh)av);
      }
    }
    for (int t = 0; t < MT; ++t)
      for (int r = 0; r < NR; ++r) y[t * ystride + r] = vhsum(v[t][r]);
    return;
  }
#endif
#if KVMESH_SIMD
  vf v[MT][NR];
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < NR; ++r) v[t][r] = vzero();
  for (; k + kW <= K; k += kW) {
    vf xv[MT];
    for (int t = 0; t < MT; ++t) xv[t] = vload(xs[t] + k);
    for (int r = 0; r < NR; ++r) {
      const vf av = vload(a + r * K + k);
      for (int t = 0; t < MT; ++t) v[t][r] = vfmadd(xv[t], av, v[t][r]);
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = vhsum(v[t][r]);
#endif
  for (; k < K; ++k) {
    for (int t = 0; t < MT; ++t) {
      const float xk = to_f(xs[t][k]);
      for (int r = 0; r < NR; ++r) acc[t][r] += xk * to_f(a[r * K + k]);
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int r = 0; r < NR; ++r) y[t * ystride + r] = acc[t][r];
}

template <typename T, int MT>
inline void shrink_rows(const T* const* xs, const T* a, int64_t K, int64_t RT, float* y) {
  int64_t r = 0;
  for (; r + kRank <= RT; r += kRank) shrink_tile<T, MT, kRank>(xs, a + r * K, K, y + r, kMaxRank);
  for (; r < RT; ++r) shrink_tile<T, MT, 1>(xs, a + r * K, K, y + r, kMaxRank);
}

// y [m][kMaxRank] for m <= kBlock tokens: ranks [p*R, p*R + r) of each part p (the others unread)
template <typename T>
void shrink(const T* const* xs, int64_t m, const T* a, int64_t K, int64_t parts, int64_t R, int64_t r,
            float* y) {
  for (int64_t p = 0; p < parts; ++p) {
    const T* ap = a + p * R * K;
    float* yp = y + p * R;
    int64_t t = 0;
    for (; t + kTok <= m; t += kTok) shrink_rows<T, kTok>(xs + t, ap, K, r, yp + t * kMaxRank);
    for (; t < m; ++t) shrink_rows<T, 1>(xs + t, ap, K, r, yp + t * kMaxRank);
  }
}

// ---- expand: out[t][n0:n1] += sum_r y[t][r] * Bt[r][n0:n1], r over one part's ranks ----------
template <typename T, int MT>
inline void expand_cols(const float* y, const T* bt, int64_t N, int64_t r0, int64_t r1, T* const* os,
                        int64_t n0, int64_t n1) {
  int64_t n = n0;
#if KVMESH_SIMD
  for (; n + kVec * kW <= n1; n += kVec * kW) {
    vf acc[MT][kVec];
    for (int t = 0; t < MT; ++t)
      for (int j = 0; j < kVec; ++j) acc[t][j] = vzero();
    for (int64_t r = r0; r < r1; ++r) {
      vf bv[kVec];
      for (int j = 0; j < kVec; ++j) bv[j] = vload(bt + r * N + n + j * kW);
      for (int t = 0; t < MT; ++t) {
        const vf yv = vset1(y[t * kMaxRank + r]);
        for (int j = 0; j < kVec; ++j) acc[t][j] = vfmadd(yv, bv[j], acc[t][j]);
      }
    }
    for (int t = 0; t < MT; ++t)
      for (int j = 0; j < kVec; ++j) {
        T* o = os[t] + n + j * kW;
        vstore(o, vadd(vload(o), acc[t][j]));
      }
  }
  for (; n + kW <= n1; n += kW) {
    vf acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = vzero();
    for (int64_t r = r0; r < r1; ++r) {
      const vf bv = vload(bt + r * N + n);
      for (int t = 0; t < MT; ++t) acc[t] = vfmadd(vset1(y[t * kMaxRank + r]), bv, acc[t]);
    }
    for (int t = 0; t < MT; ++t) vstore(os[t] + n, vadd(vload(os[t] + n), acc[t]));
  }
#endif
  for (; n < n1; ++n) {
    for (int t = 0; t < MT; ++t) {
      float s = 0.0f;
      for (int64_t r = r0; r < r1; ++r) s += y[t * kMaxRank + r] * to_f(bt[r * N + n]);
      os[t][n] = from_f<T>(to_f(os[t][n]) + s);
    }
  }
}

// Output columns [c0, c1) of m tokens, part by part (each part its own rank range).
template <typename T>
void expand(const float* y, int64_t m, const T* bt, int64_t N, const int64_t* part_cols, int64_t parts,
            int64_t R, int64_t r, T* const* os, int64_t c0, int64_t c1) {
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t n0 = std::max(c0, part_cols[p]), n1 = std::min(c1, part_cols[p + 1]);
    if (n0 >= n1) continue;
    int64_t t = 0;
    for (; t + kTok <= m; t += kTok) expand_cols<T, kTok>(y + t * kMaxRank, bt, N, p * R, p * R + r, os + t, n0, n1);
    for (; t < m; ++t) expand_cols<T, 1>(y + t * kMaxRank, bt, N, p * R, p * R + r, os + t, n0, n1);
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, at::Tensor& out,
         const std::vector<Block>& blocks, const int64_t* rows, const int64_t* part_cols, int64_t parts,
         int64_t R) {
  const int64_t K = x.size(1), N = out.size(1), RT = a.size(1);
  const int64_t xs0 = x.stride(0), os0 = out.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = bt.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t nb = static_cast<int64_t>(blocks.size());
  auto ptrs = [&](const Block& b, const T** xs, T** os) {
    for (int64_t i = 0; i < b.count; ++i) {
      const int64_t row = rows[b.first + i];
      xs[i] = xp + row * xs0;
      os[i] = op + row * os0;
    }
  };
  // multiply-adds of the whole call (the expand at its part-skipping cost)
  int64_t work = 0;
  for (const Block& b : blocks) work += b.count * b.rank * parts * (K + N / parts);
  const int64_t threads = at::get_num_threads();
  // NOTE: a parallel region costs microseconds, and far more while other processes hold the
  // cores: a decode step's few tokens (tens of microseconds of work) run on the calling thread
  constexpr int64_t kParallelWork = 1 << 20;
  if (work < kParallelWork || threads == 1 || nb >= threads) {
    const int64_t grain = work < kParallelWork ? nb + 1 : 1;
    at::parallel_for(0, nb, grain, [&](int64_t begin, int64_t end) {
      float y[kBlock * kMaxRank];
      const T* xs[kBlock];
      T* os[kBlock];
      for (int64_t i = begin; i < end; ++i) {
        const Block& b = blocks[i];
        ptrs(b, xs, os);
        shrink<T>(xs, b.count, ap + b.slot * RT * K, K, parts, R, b.rank, y);
        expand<T>(y, b.count, bp + b.slot * RT * N, N, part_cols, parts, R, b.rank, os, 0, N);
      }
    });
    return;
  }
  // Fewer blocks than threads but much work (a few tokens on a wide site): shrink here, then
  // split the expand over blocks x column chunks so every thread has a share.
  std::vector<float> y(static_cast<size_t>(nb) * kBlock * kMaxRank);
  for (int64_t i = 0; i < nb; ++i) {
    const T* xs[kBlock];
    T* os[kBlock];
    ptrs(blocks[i], xs, os);
    shrink<T>(xs, blocks[i].count, ap + blocks[i].slot * RT * K, K, parts, R, blocks[i].rank,
              y.data() + i * kBlock * kMaxRank);
  }
#if KVMESH_SIMD
  const int64_t step = kVec * kW;
#else
  const int64_t step = 32;
#endif
  const int64_t chunks = std::max<int64_t>(1, std::min((N + step - 1) / step, (threads + nb - 1) / nb));
  const int64_t width = ((N + chunks - 1) / chunks + step - 1) / step * step;
  at::parallel_for(0, nb * chunks, 1, [&](int64_t begin, int64_t end) {
    const T* xs[kBlock];
    T* os[kBlock];
    for (int64_t i = begin; i < end; ++i) {
      const Block& b = blocks[i / chunks];
      const int64_t c0 = (i % chunks) * width, c1 = std::min(N, c0 + width);
      ptrs(b, xs, os);
      expand<T>(y.data() + (i / chunks) * kBlock * kMaxRank, b.count, bp + b.slot * RT * N, N, part_cols,
                parts, R, b.rank, os, c0, c1);
    }
  });
}

}  // namespace

void lora_sgmv_add(const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, at::Tensor& out,
                   const at::Tensor& rows, const at::Tensor& seg_starts, const at::Tensor& seg_slots,
                   const at::Tensor& part_cols, const at::Tensor& slot_ranks) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "lora_sgmv_add: x must be float32 or bfloat16");
  TORCH_CHECK(a.scalar_type() == dt && bt.scalar_type() == dt && out.scalar_type() == dt,
              "lora_sgmv_add: x, a, bt and out must share one dtype");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1 &&
                  x.size(0) == out.size(0),
              "lora_sgmv_add: x [T, K] and out [T, N] need unit stride along their last dim");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.is_contiguous() && bt.is_contiguous(),
              "lora_sgmv_add: a [L, RT, K] and bt [L, RT, N] must be contiguous");
  const int64_t L = a.size(0), RT = a.size(1), K = x.size(1), N = out.size(1);
  TORCH_CHECK(a.size(2) == K && bt.size(0) == L && bt.size(1) == RT && bt.size(2) == N,
              "lora_sgmv_add: shape mismatch: x [T, K], a [L, RT, K], bt [L, RT, N], out [T, N]");
  TORCH_CHECK(RT >= 1 && RT <= kMaxRank, "lora_sgmv_add: a's rank dim must be in [1, 256]");
  for (const at::Tensor* t : {&rows, &seg_starts, &seg_slots, &part_cols, &slot_ranks}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "lora_sgmv_add: rows, seg_starts, seg_slots, part_cols and slot_ranks must be contiguous int64 [n]");
  }
  TORCH_CHECK(slot_ranks.size(0) == L, "lora_sgmv_add: slot_ranks must hold one rank per slot");
  const int64_t S = seg_slots.size(0), parts = part_cols.size(0) - 1, n = rows.size(0), T = x.size(0);
  TORCH_CHECK(seg_starts.size(0) == S + 1, "lora_sgmv_add: seg_starts must hold S + 1 bounds");
  TORCH_CHECK(parts >= 1 && RT % parts == 0, "lora_sgmv_add: part_cols must hold P + 1 bounds, P dividing RT");
  const int64_t* pc = part_cols.data_ptr<int64_t>();
  TORCH_CHECK(pc[0] == 0 && pc[parts] == N, "lora_sgmv_add: part_cols must run from 0 to N");
  for (int64_t p = 0; p < parts; ++p) TORCH_CHECK(pc[p] <= pc[p + 1], "lora_sgmv_add: part_cols must ascend");
  const int64_t* ss = seg_starts.data_ptr<int64_t>();
  const int64_t* sl = seg_slots.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* rk = slot_ranks.data_ptr<int64_t>();
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(rk[l] >= 0 && rk[l] <= RT / parts, "lora_sgmv_add: slot_ranks must be in [0, RT / P]");
  }
  TORCH_CHECK(S == 0 || (ss[0] == 0 && ss[S] == n), "lora_sgmv_add: seg_starts must run from 0 to len(rows)");
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < T, "lora_sgmv_add: row out of range");
  std::vector<Block> blocks;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(sl[s] >= 0 && sl[s] < L, "lora_sgmv_add: slot out of range");
    TORCH_CHECK(ss[s] <= ss[s + 1], "lora_sgmv_add: seg_starts must ascend");
    if (rk[sl[s]] == 0) continue;     // the slot's adapter does not touch this site
    for (int64_t f = ss[s]; f < ss[s + 1]; f += kBlock) {
      blocks.push_back({sl[s], rk[sl[s]], f, std::min<int64_t>(kBlock, ss[s + 1] - f)});
    }
  }
  if (blocks.empty()) return;
  if (dt == at::kFloat) run<float>(x, a, bt, out, blocks, rp, pc, parts, RT / parts);
  else run<bf16>(x, a, bt, out, blocks, rp, pc, parts, RT / parts);
}
