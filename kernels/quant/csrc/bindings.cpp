// The GGUF-block GEMMs as one Python extension module (kvmesh.kernels.quant.build builds it): the
// only source here that includes pybind11 (through torch's type casters).
#include <torch/csrc/utils/pybind.h>

#include "amx.h"
#include "gemm.h"
#include "tiled.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_gemm", &kvmesh_quant::quant_gemm,
        "y = x @ W^T, W as GGUF blocks (float32 x; float or int8-quantized activations)");
  m.def("dequantize_rows", &kvmesh_quant::dequantize_rows, "the float32 rows `ids` of a GGUF-block weight");
  m.def("int8_isa", &kvmesh_quant::int8_isa, "the instruction set of the int8 dot product");
  m.def("quant_gemm_tiled", &kvmesh_quant::quant_gemm_tiled,
        "y = x @ W^T for many rows: W dequantized a tile at a time (float32 or bfloat16 x)");
  m.def("dequantize_into", &kvmesh_quant::dequantize_into,
        "rows [n0, n0 + out.size(0)) of a GGUF-block weight dequantized into out (float32 or bf16)");
  m.def("tiled_isa", &kvmesh_quant::tiled_isa, "the instruction set of the tiled path's kernels");
  m.def("quant_gemm_amx", &kvmesh_quant::quant_gemm_amx,
        "y = x @ W^T on AMX bf16 tiles: W dequantized 32 rows at a time (bfloat16 x; y float32, or bf16 "
        "rounded once when out_bf16)");
  m.def("amx_isa", &kvmesh_quant::amx_isa, "'amx_bf16' where the AMX path runs here, else ''");
}
