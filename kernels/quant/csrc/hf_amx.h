// W8A8 on AMX's int8 tiles (hf_amx.cpp), bound to Python beside the other Hugging Face GEMMs in
// hf_bindings.cpp.
#pragma once

#include "../../csrc/aten.h"

#include <string>
#include <vector>

namespace kvmesh_hfquant {

// x float32 [M, K] -> (int8 codes [M, K], float32 scales [M]): hf_gemm.cpp's activation quantization.
std::vector<at::Tensor> quantize_rows_int8(const at::Tensor& x);

// The W8A8 GEMMs' argument checks: x contiguous float32 [M, K], w int8 [N, K], w_scale float32 [N].
void check_w8a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale);

// w8a8_gemm's product on AMX int8 tiles (K a multiple of 64): the same bits as the VNNI path.
at::Tensor w8a8_gemm_amx(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale);

// The int4 GEMM on AMX bf16 tiles (hf_gemm.cpp; w4a16_gemm takes it from 2 bf16 rows; y bf16 with
// out_bf16, else float32), and "amx_bf16" where it runs here ("" otherwise).
at::Tensor w4a16_gemm_amx(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const at::Tensor& zeros, int64_t group_size, bool out_bf16);
std::string w4a16_amx_isa();

// "amx_int8" where this build has the path and the kernel lets this process use the tiles; "" otherwise.
std::string w8a8_amx_isa();

}  // namespace kvmesh_hfquant
