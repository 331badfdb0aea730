// What the AMX kernels share (amx.cpp: GGUF blocks and hf_gemm.cpp: int4 groups, both on bf16
// tiles through bf16_rebuilt_gemm; hf_amx.cpp: W8A8 on int8 tiles): the process's permission to
// use the tile registers, the tile configuration, a 16 x 16 transpose of 32-bit elements
// (activation rows into a B tile's pair / quad layout, accumulator tiles back into y's rows), and
// the one loop all run: 2 weight tiles x 2 activation tiles into 4 accumulators over K. Only in
// builds with AMX (KQ_AMX_TILES).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define KQ_AMX_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../../csrc/aten.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>

namespace kvmesh_amx {

// Linux keeps the tile registers off until a process asks (arch_prctl, process-wide, 5.16+).
inline bool tiles_permitted() {
  constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = [] {
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &bits) == 0 && (bits >> kXfeatureXtiledata & 1)) return true;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Palette 1 with tiles 0-7 all 16 rows of 64 bytes (what both kernels use).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = 16;
    }
  }
};

// A 16 x 16 matrix of 32-bit elements, one row a register, transposed in place.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j) {
      t[8 * h + j] = _mm512_shuffle_i32x4(r[8 * h + j], r[8 * h + 4 + j], 0x88);
      t[8 * h + 4 + j] = _mm512_shuffle_i32x4(r[8 * h + j], r[8 * h + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// x's rows [16g, 16g + 16) (zero rows past M), 64 bytes from byte offset `at` of each row (row
// stride `ld` bytes), as one B tile: tile row r holds, for each of the 16 rows m, bytes
// [at + 4r, at + 4r + 4) of row m (bf16 pairs, int8 quads). `out`: 1 KB, 64-byte aligned.
inline void pack_b_tile(const uint8_t* x, int64_t ld, int64_t M, int64_t g, int64_t at, uint32_t* out) {
  __m512i r[16];
  for (int64_t m = 0; m < 16; ++m) {
    const int64_t row = g * 16 + m;
    r[m] = row < M ? _mm512_loadu_si512(x + row * ld + at) : _mm512_setzero_si512();
  }
  transpose16(r);
  for (int j = 0; j < 16; ++j) _mm512_store_si512(out + j * 16, r[j]);
}

enum class Dot { bf16, int8 };   // tdpbf16ps (float32 sums) or tdpbssd (int32 sums)

// Accumulators 0 and 1 += weight tiles 4, 5 times activation tile 6 (`upper`: 2 and 3 by tile 7).
// NOTE: the tile numbers are literals: GCC's tile intrinsics paste them into the asm text.
template <Dot D>
inline void dot_pair(bool upper) {
  if constexpr (D == Dot::bf16) {
    if (upper) {
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
    }
  } else {
    if (upper) {
      _tile_dpbssd(2, 4, 7);
      _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 5, 6);
    }
  }
}

// Accumulators 0-3 over S steps of K for activation groups g (and g + 1 when TWO), stored into c
// (four 1 KB tiles: tile h + 2b = weight rows 16h.. against group g + b). Weight tiles 4 and 5
// load rows 0-15 and 16-31 of `a` (row stride lda bytes), `step_bytes` further along each step;
// activation tiles 6 and 7 the packed B tiles at xp (1 KB each, S a group). `between()` runs
// after each step's multiplies: AVX-512 work the tile unit's latency hides.
template <Dot D, bool TWO, typename Between>
inline void accumulate_pair(const uint8_t* a, int64_t lda, int64_t step_bytes, const uint32_t* xp, int64_t g,
                            int64_t S, void* c, Between&& between) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint8_t* a1 = a + 16 * lda;
  const uint32_t* b0 = xp + g * S * 256;
  const uint32_t* b1 = b0 + S * 256;
  for (int64_t s = 0; s < S; ++s) {
    _tile_loadd(4, a + s * step_bytes, lda);
    _tile_loadd(5, a1 + s * step_bytes, lda);
    _tile_loadd(6, b0 + s * 256, 64);
    dot_pair<D>(false);
    if constexpr (TWO) {
      _tile_loadd(7, b1 + s * 256, 64);
      dot_pair<D>(true);
    }
    between();
  }
  uint8_t* out = static_cast<uint8_t*>(c);
  _tile_stored(0, out, 64);
  _tile_stored(1, out + 1024, 64);
  if constexpr (TWO) {
    _tile_stored(2, out + 2048, 64);
    _tile_stored(3, out + 3072, 64);
  }
}

// Every group pair of M activation rows against one task's nt (<= 32) weight rows: the
// accumulators (accumulate_pair's, with `between`), then fn(tile, m0, rows, col, cols) for each
// stored tile: activation rows m0 .. m0 + rows, task columns col .. col + cols.
template <Dot D, typename Between, typename Fn>
inline void each_group_pair(const uint8_t* a, int64_t lda, int64_t step_bytes, const uint32_t* xp, int64_t M,
                            int64_t S, int64_t nt, void* c, Between&& between, Fn&& fn) {
  const int64_t G = (M + 15) / 16;
  for (int64_t g = 0; g < G; g += 2) {
    const bool two = g + 1 < G;
    if (two) accumulate_pair<D, true>(a, lda, step_bytes, xp, g, S, c, between);
    else accumulate_pair<D, false>(a, lda, step_bytes, xp, g, S, c, between);
    for (int64_t b = 0; b < (two ? 2 : 1); ++b) {
      const int64_t m0 = (g + b) * 16, rows = std::min<int64_t>(16, M - m0);
      for (int64_t h = 0; h < 2 && 16 * h < nt; ++h)
        fn(static_cast<const uint8_t*>(c) + (h + 2 * b) * 1024, m0, rows, 16 * h, nt - 16 * h);
    }
  }
}

// Accumulator tile `c` (16 weight rows x 16 activation rows, float32) into y's rows m0 .. m0 + rows
// and columns n0 .. n0 + cols (cols <= 16), transposed. Out uint16_t: y is bf16, each value rounded
// as torch's float32 -> bfloat16 conversion rounds (nearest even; NaN as c10::BFloat16's 0x7FC0),
// straight from the accumulators: no float32 [M, N] and no copy.
template <typename Out>
inline void store_transposed(const float* c, Out* y, int64_t N, int64_t m0, int64_t rows, int64_t n0,
                             int64_t cols) {
  static_assert(std::is_same_v<Out, float> || std::is_same_v<Out, uint16_t>, "float32 or bf16 bits");
  __m512i r[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_load_si512(c + j * 16);
  transpose16(r);
  const __mmask16 keep = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), nan = _mm512_set1_epi32(0x7FC0);
  for (int64_t m = 0; m < rows; ++m) {
    const __m512i u = r[m];
    if constexpr (std::is_same_v<Out, float>) {
      _mm512_mask_storeu_ps(y + (m0 + m) * N + n0, keep, _mm512_castsi512_ps(u));
    } else {
      __m512i b = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
      b = _mm512_srli_epi32(b, 16);
      const __mmask16 number = _mm512_cmp_ps_mask(_mm512_castsi512_ps(u), _mm512_castsi512_ps(u), _CMP_ORD_Q);
      b = _mm512_mask_blend_epi32(number, nan, b);
      _mm256_mask_storeu_epi16(y + (m0 + m) * N + n0, keep, _mm512_cvtepi32_epi16(b));
    }
  }
}

// y[M, N] (float32, or bf16 rounded once) = x[M, K] (bf16) @ W^T on bf16 tiles, for a W whose rows are rebuilt in bf16 by
// `rebuild(first_row, count, out)` (count rows of K bf16 into out, row stride K; K a multiple of
// 32): the GGUF blocks' and the int4 groups' AMX paths. x is packed once into pair tiles (zero rows
// pad the last 16-row group); a task takes 32 weight rows, rebuilt into a 64-byte aligned scratch
// (a row split over two cache lines made every tile load about twice as slow, measured), and the
// next task's rows are rebuilt into a second scratch a few at a time between this task's tile
// multiplies, so the AVX-512 work runs while the tile unit is busy (about 2x at 64 rows).
template <typename Out, typename Rebuild>
void bf16_rebuilt_gemm(const uint16_t* x, int64_t M, int64_t N, int64_t K, Out* y, Rebuild&& rebuild) {
  constexpr int64_t TN = 32, TK = 32;
  const int64_t G = (M + 15) / 16, S = K / TK;
  // NOTE: torch's CPU allocator aligns to 64 bytes, as the tile loads want
  auto packed = at::empty({G * S * 256}, at::TensorOptions().dtype(at::kInt));
  uint32_t* xp = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(xp) % 64 == 0, "AMX: unaligned activation tiles");
  at::parallel_for(0, G * S, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      pack_b_tile(reinterpret_cast<const uint8_t*>(x), K * 2, M, i / S, i % S * TK * 2, xp + i * 256);
  });
  const TileConfig cfg;
  at::parallel_for(0, (N + TN - 1) / TN, 1, [&](int64_t t0, int64_t t1) {
    const std::unique_ptr<uint16_t, decltype(&std::free)> scratch(
        static_cast<uint16_t*>(std::aligned_alloc(64, 2 * TN * K * sizeof(uint16_t))), &std::free);
    TORCH_CHECK(scratch, "AMX: out of memory for the weight scratch");
    uint16_t* wt = scratch.get();
    uint16_t* wn = wt + TN * K;
    alignas(64) float c[4 * 256];
    // NOTE: the tile configuration is per thread, and oneDNN's GEMMs load their own between ours
    _tile_loadconfig(&cfg);
    // rows of the next task a step: all of them within this task's steps (S per group pair)
    const int64_t per_step = (TN + S * ((G + 1) / 2) - 1) / (S * ((G + 1) / 2));
    rebuild(t0 * TN, std::min(TN, N - t0 * TN), wt);
    for (int64_t ti = t0; ti < t1; ++ti) {
      const int64_t n0 = ti * TN, nt = std::min(TN, N - n0);
      if (nt < TN) std::memset(wt + nt * K, 0, (TN - nt) * K * sizeof(uint16_t));
      const int64_t next_rows = ti + 1 < t1 ? std::min(TN, N - n0 - TN) : 0;
      int64_t done = 0;
      auto more = [&](int64_t count) {
        const int64_t n = std::min(count, next_rows - done);
        if (n <= 0) return;
        rebuild(n0 + TN + done, n, wn + done * K);
        done += n;
      };
      each_group_pair<Dot::bf16>(
          reinterpret_cast<const uint8_t*>(wt), K * 2, TK * 2, xp, M, S, nt, c, [&] { more(per_step); },
          [&](const uint8_t* tile, int64_t m0, int64_t rows, int64_t col, int64_t cols) {
            store_transposed(reinterpret_cast<const float*>(tile), y, N, m0, rows, n0 + col, cols);
          });
      more(next_rows);     // whatever the steps left
      std::swap(wt, wn);
    }
    _tile_release();
  });
}

}  // namespace kvmesh_amx
#else
#define KQ_AMX_TILES 0
#endif
