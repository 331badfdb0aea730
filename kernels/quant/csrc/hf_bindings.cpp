// The Hugging Face quantized checkpoints' GEMMs as one Python extension module
// (kvmesh.kernels.quant.hf_build builds it): the only source of it that includes pybind11.
#include <torch/csrc/utils/pybind.h>

#include "hf_amx.h"
#include "hf_gemm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w8a8_gemm", &kvmesh_hfquant::w8a8_gemm,
        "y = x @ W^T: int8 weights (per-row scales) x int8 activations quantized per row");
  m.def("quantize_rows_int8", &kvmesh_hfquant::quantize_rows_int8,
        "x -> (int8 codes, float32 per-row scales): the activation quantization of w8a8_gemm");
  m.def("w8a8_isa", &kvmesh_hfquant::w8a8_isa, "the instruction set of the int8 dot product");
  m.def("w8a8_gemm_amx", &kvmesh_hfquant::w8a8_gemm_amx,
        "w8a8_gemm's product on AMX int8 tiles (K a multiple of 64): the same bits");
  m.def("w8a8_amx_isa", &kvmesh_hfquant::w8a8_amx_isa, "'amx_int8' where the AMX path runs here, else ''");
  m.def("w4a16_gemm", &kvmesh_hfquant::w4a16_gemm,
        "y = x @ W^T: 4-bit group weights (scales, zeros) x float32 or bf16 activations; float32 y, "
        "or bf16 with out_bf16 where the AMX tiles run (rounded from their float32 sums)",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("zeros"), py::arg("group_size"),
        py::arg("out_bf16") = false);
  m.def("w4a16_isa", &kvmesh_hfquant::w4a16_isa, "the instruction set of the int4 GEMM");
  m.def("w4a16_gemm_amx", &kvmesh_hfquant::w4a16_gemm_amx,
        "w4a16_gemm's product on AMX bf16 tiles (bfloat16 x), whatever the row count",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("zeros"), py::arg("group_size"),
        py::arg("out_bf16") = false);
  m.def("w4a16_amx_isa", &kvmesh_hfquant::w4a16_amx_isa, "'amx_bf16' where the int4 AMX path runs here, else ''");
}
