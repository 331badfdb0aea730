// y[M, N] = x[M, K] @ W^T on AMX's bf16 tiles, W as GGUF blocks: the "amx" path (ops.py).
//
// One AMX instruction multiplies tiles: C[16 x 16] float32 += A[16 x 32] bf16 . B, where B holds
// 32 x 16 bf16 as pairs (tile row r: for each of its 16 columns, elements 2r and 2r + 1). The
// weights are A and the activations B, so each accumulator is a 16 x 16 block of Y^T:
//   - a task takes TN = 32 weight rows, dequantized once, whole K, into a row-major bf16 scratch
//     (tiled.cpp's arithmetic: the same bf16 weights as the bf16 tiles and slabs), which is A as
//     it stands: two tiles of 16 rows, loaded with the scratch's row stride. The next task's rows
//     are dequantized into a second scratch a few at a time between this task's tile multiplies,
//     so the AVX-512 work runs while the tile unit is busy (about 2x at 64 rows);
//   - the activations are packed once a call into B's pair layout, 16 rows a group, zero rows
//     padding the last group (their results are dropped);
//   - per two groups, 4 accumulator tiles (2 weight tiles x 2 groups) run over K, 32 elements a
//     step, then are stored and written transposed into y.
// So the result is a bf16 GEMM of the dequantized weights with float32 accumulation, as the bf16
// tiles'; the weights are read from their blocks once a call and no copy of the matrix is made.
// Tiles: 0-3 accumulators, 4-5 weights, 6-7 activations (palette 1: 16 rows of 64 bytes each).
#include "amx.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "amx_tiles.h"
#include "blocks.h"
#include "tiled.h"

#if KQ_AMX_TILES && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KQ_AMX 1
#else
#define KQ_AMX 0
#endif

namespace kvmesh_quant {
namespace {

#if KQ_AMX
constexpr int64_t TN = 32;   // weight rows a task: two A tiles
constexpr int64_t TK = 32;   // K elements a tile step
constexpr int64_t TM = 16;   // activation rows a group: one B tile's columns

// x [M, K] bf16 -> xp: for group g (16 rows) and K step s, the B tile (16 x 16 pairs, 1 KB) at
// xp + (g * S + s) * 256: xp[r * 16 + m] = the pair (x[16g + m, 32s + 2r], x[16g + m, 32s + 2r + 1]),
// i.e. the 16 x 16 pairs of x's block transposed.
void pack_activations(const uint16_t* x, int64_t M, int64_t K, uint32_t* xp) {
  const int64_t G = (M + TM - 1) / TM, S = K / TK;
  at::parallel_for(0, G * S, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      kvmesh_amx::pack_b_tile(reinterpret_cast<const uint8_t*>(x), K * 2, M, i / S, i % S * TK * 2, xp + i * 256);
  });
}

// Accumulator tile `c` (16 weight rows x 16 activation rows, float32) into y's rows m0 .. m0 + rows
// and columns n0 .. n0 + cols (cols <= 16), transposed.
inline void store_transposed(const float* c, float* y, int64_t N, int64_t m0, int64_t rows, int64_t n0,
                             int64_t cols) {
  __m512i r[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_load_si512(c + j * 16);
  kvmesh_amx::transpose16(r);
  const __mmask16 keep = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t m = 0; m < rows; ++m)
    _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, keep, _mm512_castsi512_ps(r[m]));
}

// The next task's weight rows, dequantized a few at a time between the current task's tile
// multiplies: the AVX-512 work runs while the tile unit is busy, instead of after it.
struct NextRows {
  int64_t fmt, row_bytes, K;
  const uint8_t* w = nullptr;   // the next task's first row (nullptr: none)
  int64_t rows = 0, done = 0;   // its row count, and how many are in `out`
  uint16_t* out = nullptr;

  void some(int64_t count) {
    const int64_t n = std::min(count, rows - done);
    if (n <= 0) return;
    dequantize_rows_bf16(fmt, w + done * row_bytes, row_bytes, n, K, out + done * K);
    done += n;
  }
};

void gemm_amx(int64_t fmt, const uint32_t* xp, int64_t M, const uint8_t* w, int64_t N, int64_t K,
              int64_t row_bytes, float* y) {
  const int64_t G = (M + TM - 1) / TM, S = K / TK;
  const kvmesh_amx::TileConfig cfg;
  at::parallel_for(0, (N + TN - 1) / TN, 1, [&](int64_t t0, int64_t t1) {
    // NOTE: tile rows 64-byte aligned (K * 2 bytes a row is a multiple of 64): a row split over two
    // cache lines made every tile load about twice as slow (measured). Two scratches: the task's
    // rows, and the next task's, filled between the multiplies.
    const std::unique_ptr<uint16_t, decltype(&std::free)> scratch(
        static_cast<uint16_t*>(std::aligned_alloc(64, 2 * TN * K * sizeof(uint16_t))), &std::free);
    TORCH_CHECK(scratch, "quant_gemm_amx: out of memory for the weight scratch");
    uint16_t* wt = scratch.get();
    uint16_t* wn = wt + TN * K;
    alignas(64) float c[4 * 256];
    // NOTE: the tile configuration is per thread and oneDNN's GEMMs load their own between ours
    _tile_loadconfig(&cfg);
    // rows of the next task a step: all of them within this task's steps (S per group pair)
    const int64_t per_step = (TN + S * ((G + 1) / 2) - 1) / (S * ((G + 1) / 2));
    NextRows next{fmt, row_bytes, K};
    next.rows = std::min(TN, N - t0 * TN);
    next.w = w + t0 * TN * row_bytes;
    next.out = wt;
    next.some(next.rows);
    for (int64_t ti = t0; ti < t1; ++ti) {
      const int64_t n0 = ti * TN, nt = std::min(TN, N - n0);
      if (nt < TN) std::memset(wt + nt * K, 0, (TN - nt) * K * sizeof(uint16_t));
      next = NextRows{fmt, row_bytes, K};
      if (ti + 1 < t1) {
        next.rows = std::min(TN, N - n0 - TN);
        next.w = w + (n0 + TN) * row_bytes;
        next.out = wn;
      }
      kvmesh_amx::each_group_pair<kvmesh_amx::Dot::bf16>(
          reinterpret_cast<const uint8_t*>(wt), K * 2, TK * 2, xp, M, S, nt, c,
          [&] { next.some(per_step); },
          [&](const uint8_t* tile, int64_t m0, int64_t rows, int64_t col, int64_t cols) {
            store_transposed(reinterpret_cast<const float*>(tile), y, N, m0, rows, n0 + col, cols);
          });
      next.some(next.rows);     // whatever the steps left
      std::swap(wt, wn);
    }
    _tile_release();
  });
}
#endif

}  // namespace

torch::Tensor quant_gemm_amx(const torch::Tensor& x, const torch::Tensor& w, int64_t fmt, int64_t K) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2 && x.size(1) == K && x.device().is_cpu(),
              "quant_gemm_amx: x must be a CPU bfloat16 [M, K] tensor");
  const int64_t row_bytes = check_weight(w, fmt, K);
  TORCH_CHECK(K % 32 == 0, "quant_gemm_amx: K=", K, " is not a multiple of 32");
  TORCH_CHECK(!amx_isa().empty(), "quant_gemm_amx: no AMX bf16 tiles in this build or process");
  const int64_t M = x.size(0), N = w.size(0);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  if (M == 0 || N == 0) return y;
#if KQ_AMX
  const auto xc = x.contiguous();
  // NOTE: torch's CPU allocator aligns to 64 bytes, as the tile loads want
  auto xp = torch::empty({(M + TM - 1) / TM * TM * K / 2}, torch::TensorOptions().dtype(torch::kInt32));
  uint32_t* xpp = reinterpret_cast<uint32_t*>(xp.data_ptr<int32_t>());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(xpp) % 64 == 0, "quant_gemm_amx: unaligned activation tiles");
  pack_activations(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), M, K, xpp);
  gemm_amx(fmt, xpp, M, w.data_ptr<uint8_t>(), N, K, row_bytes, y.data_ptr<float>());
#endif
  return y;
}

std::string amx_isa() {
#if KQ_AMX
  return kvmesh_amx::tiles_permitted() ? "amx_bf16" : "";
#else
  return "";
#endif
}

}  // namespace kvmesh_quant
