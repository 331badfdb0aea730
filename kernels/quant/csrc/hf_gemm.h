// The Hugging Face quantized checkpoints' GEMMs (hf_gemm.cpp), for the bindings.
#pragma once

#include "../../csrc/aten.h"

#include <string>

namespace kvmesh_hfquant {

at::Tensor w8a8_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale, const at::Tensor& w_sum);

std::string w8a8_isa();

at::Tensor w4a16_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& zeros, int64_t group_size, bool out_bf16);

std::string w4a16_isa();

}  // namespace kvmesh_hfquant
