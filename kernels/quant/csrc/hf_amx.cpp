// y[M, N] = x[M, K] @ W^T for W8A8 (int8 weights with a float32 scale per row, activations
// quantized per row to int8) on AMX's int8 tiles: the "amx" path of hf_ops.hf_linear.
//
// One instruction (tdpbssd) adds A[16 x 64] s8 . B to C[16 x 16] int32, B holding 64 x 16 s8 as
// quads (tile row r: for each of its 16 columns, elements 4r .. 4r + 3). The weights are A as
// the checkpoint stores them (int8 rows, stride K: no copy, no conversion), the activations B
// (quantized and packed once a call), so each accumulator is a 16 x 16 block of Y^T's integer
// sums over the whole K, exact. Then y = float(acc) * sx[m] * sw[n], the VNNI path's arithmetic
// in its order: the two paths give the same bits. A task takes 32 weight rows (two A tiles; the
// last, partial one from a zero-padded copy) and every pair of 16-row activation groups; tiles
// 0-3 accumulate, 4-5 weights, 6-7 activations.
#include "hf_amx.h"


#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "amx_tiles.h"

#if KQ_AMX_TILES && defined(__AVX512BW__)
#define KQ_AMX_INT8 1
#else
#define KQ_AMX_INT8 0
#endif

namespace kvmesh_hfquant {
namespace {

#if KQ_AMX_INT8
constexpr int64_t TN = 32;   // weight rows a task: two A tiles
constexpr int64_t TK = 64;   // K elements a tile step
constexpr int64_t TM = 16;   // activation rows a group: one B tile's columns

// Accumulator tile `c` ([i, m] = row n0 + i of W against activation row m0 + m) into y, scaled.
inline void store_scaled(const int32_t* c, float* y, int64_t N, int64_t m0, int64_t rows, int64_t n0,
                         int64_t cols, const float* sx, const float* sw) {
  __m512i r[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_load_si512(c + j * 16);
  kvmesh_amx::transpose16(r);
  const __mmask16 keep = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 swv = _mm512_maskz_loadu_ps(keep, sw + n0);
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(r[m]), _mm512_set1_ps(sx[m0 + m])), swv);
    _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, keep, v);
  }
}
#endif

}  // namespace

at::Tensor w8a8_gemm_amx(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale) {
  check_w8a8(x, w, w_scale);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 64 == 0, "w8a8_gemm_amx: K=", K, " is not a multiple of 64");
  TORCH_CHECK(!w8a8_amx_isa().empty(), "w8a8_gemm_amx: no AMX int8 tiles in this build or process");
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#if KQ_AMX_INT8
  auto qs = quantize_rows_int8(x);
  const uint8_t* xq = reinterpret_cast<const uint8_t*>(qs[0].data_ptr<int8_t>());
  const float* sx = qs[1].data_ptr<float>();
  const int64_t G = (M + TM - 1) / TM, S = K / TK;
  // NOTE: torch's CPU allocator aligns to 64 bytes, as the tile loads want
  auto packed = at::empty({G * S * 256}, at::TensorOptions().dtype(at::kInt));
  uint32_t* xp = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  at::parallel_for(0, G * S, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) kvmesh_amx::pack_b_tile(xq, K, M, i / S, i % S * TK, xp + i * 256);
  });
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sw = w_scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const kvmesh_amx::TileConfig cfg;
  at::parallel_for(0, (N + TN - 1) / TN, 1, [&](int64_t t0, int64_t t1) {
    std::unique_ptr<int8_t, decltype(&std::free)> tail(nullptr, &std::free);
    alignas(64) int32_t c[4 * 256];
    _tile_loadconfig(&cfg);
    for (int64_t ti = t0; ti < t1; ++ti) {
      const int64_t n0 = ti * TN, nt = std::min(TN, N - n0);
      const int8_t* a = wp + n0 * K;
      if (nt < TN) {   // the last rows, zero-padded to two whole tiles
        tail.reset(static_cast<int8_t*>(std::aligned_alloc(64, TN * K)));
        TORCH_CHECK(tail, "w8a8_gemm_amx: out of memory for the last rows");
        std::memset(tail.get(), 0, TN * K);
        std::memcpy(tail.get(), a, nt * K);
        a = tail.get();
      }
      kvmesh_amx::each_group_pair<kvmesh_amx::Dot::int8>(
          reinterpret_cast<const uint8_t*>(a), K, TK, xp, M, S, nt, c, [] {},
          [&](const uint8_t* tile, int64_t m0, int64_t rows, int64_t col, int64_t cols) {
            store_scaled(reinterpret_cast<const int32_t*>(tile), yp, N, m0, rows, n0 + col, cols, sx, sw);
          });
    }
    _tile_release();
  });
#endif
  return y;
}

std::string w8a8_amx_isa() {
#if KQ_AMX_INT8
  return kvmesh_amx::tiles_permitted() ? "amx_int8" : "";
#else
  return "";
#endif
}

}  // namespace kvmesh_hfquant
