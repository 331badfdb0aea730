// The AMX path of the quantized GEMM (amx.cpp), bound to Python beside the others in bindings.cpp.
#pragma once

#include "../../csrc/aten.h"

#include <string>

namespace kvmesh_quant {

// y[M, N] = x[M, K] @ W^T on AMX bf16 tiles: x bfloat16, W as GGUF blocks [N, row_bytes]; y float32,
// or (out_bf16) bfloat16 rounded from the float32 accumulators as torch rounds.
at::Tensor quant_gemm_amx(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K,
                          bool out_bf16);

// "amx_bf16" where this build has the AMX path and the kernel lets this process use the tiles
// (Linux's arch_prctl permission, asked once); "" otherwise.
std::string amx_isa();

}  // namespace kvmesh_quant
