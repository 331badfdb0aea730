// The per-row GEMMs of GGUF-block weights (gemm.cpp), for the bindings.
#pragma once

#include "../../csrc/aten.h"

#include <string>

namespace kvmesh_quant {

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K, bool int8_activations);

at::Tensor dequantize_rows(const at::Tensor& w, const at::Tensor& ids, int64_t fmt, int64_t K);

std::string int8_isa();

}  // namespace kvmesh_quant
