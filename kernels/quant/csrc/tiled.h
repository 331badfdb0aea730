// The many-row quantized GEMM (tiled.cpp), bound to Python beside the per-row paths in bindings.cpp.
#pragma once

#include "../../csrc/aten.h"

#include <string>

namespace kvmesh_quant {

// The row width in bytes of W [N, row_bytes] for K (checks dtype, layout and width; gemm.cpp).
int64_t check_weight(const at::Tensor& w, int64_t fmt, int64_t K);

// y[M, N] float32 = x[M, K] @ W^T, x float32 or bfloat16, W as GGUF blocks [N, row_bytes].
at::Tensor quant_gemm_tiled(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K);

// Rows [n0, n0 + out.size(0)) of W dequantized into out ([rows, K], float32, or bfloat16 where the
// build has bf16 tiles): the large-batch path's transient slab (ops.py), the tiles' arithmetic.
void dequantize_into(const at::Tensor& w, int64_t n0, const at::Tensor& out, int64_t fmt, int64_t K);

// `rows` whole weight rows from `w` (row_bytes apart) dequantized into out ([rows, K] bf16 bits,
// row-major), serially: the bf16 tiles' weights, for the AMX path (amx.cpp). Only in builds with
// bf16 tiles (AVX512-BF16); elsewhere an error.
void dequantize_rows_bf16(int64_t fmt, const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K,
                          uint16_t* out);

// `rows` whole weight rows from `w` (row_bytes apart) dequantized into out ([rows, K] float32,
// row-major) by the tiles' arithmetic, serially: the per-row float path's weights for the formats
// it has no in-register kernel for (gemm.cpp).
void dequantize_rows_f32(int64_t fmt, const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t K,
                         float* out);

// The tile kernels this build has: "avx512_bf16", "avx512", "avx2" or "portable".
std::string tiled_isa();

}  // namespace kvmesh_quant
