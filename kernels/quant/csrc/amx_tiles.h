// What the AMX kernels share (amx.cpp: GGUF blocks on bf16 tiles; hf_amx.cpp: W8A8 on int8 tiles):
// the process's permission to use the tile registers, the tile configuration, and a 16 x 16
// transpose of 32-bit elements (activation rows into a B tile's pair / quad layout, accumulator
// tiles back into y's rows). Only in builds with AMX (KQ_AMX_TILES).
#pragma once

#if defined(__AMX_TILE__) && defined(__AVX512F__)
#define KQ_AMX_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

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

}  // namespace kvmesh_amx
#else
#define KQ_AMX_TILES 0
#endif
