// The many-row quantized GEMM (tiled.cpp), registered beside the per-row paths in gemm.cpp.
#pragma once

#include <torch/extension.h>

#include <string>

namespace kvmesh_quant {

// The row width in bytes of W [N, row_bytes] for K (checks dtype, layout and width; gemm.cpp).
int64_t check_weight(const torch::Tensor& w, int64_t fmt, int64_t K);

// y[M, N] float32 = x[M, K] @ W^T, x float32 or bfloat16, W as GGUF blocks [N, row_bytes].
torch::Tensor quant_gemm_tiled(const torch::Tensor& x, const torch::Tensor& w, int64_t fmt, int64_t K);

// Rows [n0, n0 + out.size(0)) of W dequantized into out ([rows, K], float32, or bfloat16 where the
// build has bf16 tiles): the large-batch path's transient slab (ops.py), the tiles' arithmetic.
void dequantize_into(const torch::Tensor& w, int64_t n0, const torch::Tensor& out, int64_t fmt, int64_t K);

// The tile kernels this build has: "avx512_bf16", "avx512", "avx2" or "portable".
std::string tiled_isa();

}  // namespace kvmesh_quant
