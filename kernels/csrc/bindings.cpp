// The C++ CPU kernels as one Python extension module (kvmesh.kernels.cpu_kernels builds it).
#include <torch/csrc/utils/pybind.h>

#include "attention_amx.h"
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_rows", &paged_attention_rows,
        "Paged attention of the given rows over the block cache, in place (float32 / bfloat16, CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm with an optional fused residual add (float32 / bfloat16, CPU)");
  m.def("rotary_embedding", &rotary_embedding, "NeoX RoPE of q and k (float32 / bfloat16, CPU)");
  m.def("silu_and_mul", &silu_and_mul, "SiLU(x[:, :I]) * x[:, I:] (float32 / bfloat16, CPU)");
  m.def("write_kv_cache", &write_kv_cache, "K/V rows into their cache slots, -1 skipped (float32 / bfloat16, CPU)");
  m.def("argmax_rows", &argmax_rows, "Index of each row's first maximum (float32, CPU; NaN first)");
  m.def("lora_sgmv_add", &lora_sgmv_add,
        "LoRA shrink + expand of one site over tokens grouped by slot, in place (float32 / bfloat16, CPU)");
  m.def("small_gemm", &small_gemm, "x [M, K] @ w [N, K]^T (+ bias) for a few rows, w read once (float32 / bfloat16, CPU)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("small_gemm_supports", &small_gemm_supports, "Whether small_gemm runs this dtype (\"float32\", \"bfloat16\") here");
  m.def("isa", &isa, "The instruction-set path this build runs: amx, avx512_bf16, avx512, avx2 or portable");
  m.def("attention_amx_isa", &kvmesh::amx_attention_isa,
        "\"amx_bf16\" where bf16 paged attention runs on AMX tiles in this process, else \"\"");
}
