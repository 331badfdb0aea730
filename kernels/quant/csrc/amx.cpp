// y[M, N] = x[M, K] @ W^T on AMX's bf16 tiles, W as GGUF blocks: the "amx" path (ops.py).
//
// One AMX instruction multiplies tiles: C[16 x 16] float32 += A[16 x 32] bf16 . B, where B holds
// 32 x 16 bf16 as pairs (tile row r: for each of its 16 columns, elements 2r and 2r + 1). The
// weights are A and the activations B, so each accumulator is a 16 x 16 block of Y^T
// (amx_tiles.h's bf16_rebuilt_gemm): 32 weight rows at a time are dequantized, whole K, into a
// row-major bf16 scratch by tiled.cpp's arithmetic (the same bf16 weights as the bf16 tiles and
// slabs), the next 32 between this task's multiplies. So the result is a bf16 GEMM of the
// dequantized weights with float32 accumulation, as the bf16 tiles'; the weights are read from
// their blocks once a call and no copy of the matrix is made.
#include "amx.h"

#include "amx_tiles.h"
#include "blocks.h"
#include "tiled.h"

#if KQ_AMX_TILES && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define KQ_AMX 1
#else
#define KQ_AMX 0
#endif

namespace kvmesh_quant {

at::Tensor quant_gemm_amx(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t K, bool out_bf16) {
  TORCH_CHECK(x.dtype() == at::kBFloat16 && x.dim() == 2 && x.size(1) == K && x.device().is_cpu(),
              "quant_gemm_amx: x must be a CPU bfloat16 [M, K] tensor");
  const int64_t row_bytes = check_weight(w, fmt, K);
  TORCH_CHECK(K % 32 == 0, "quant_gemm_amx: K=", K, " is not a multiple of 32");
  TORCH_CHECK(!amx_isa().empty(), "quant_gemm_amx: no AMX bf16 tiles in this build or process");
  const int64_t M = x.size(0), N = w.size(0);
  auto y = at::empty({M, N}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  if (M == 0 || N == 0) return y;
#if KQ_AMX
  const auto xc = x.contiguous();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const auto rebuild = [&](int64_t row, int64_t count, uint16_t* out) {
    dequantize_rows_bf16(fmt, wp + row * row_bytes, row_bytes, count, K, out);
  };
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  if (out_bf16)
    kvmesh_amx::bf16_rebuilt_gemm(xp, M, N, K, reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), rebuild);
  else
    kvmesh_amx::bf16_rebuilt_gemm(xp, M, N, K, y.data_ptr<float>(), rebuild);
#endif
  return y;
}

std::string amx_isa() {
#if KQ_AMX
  return kvmesh_amx::tiles_permitted() ? "amx_bf16" : "";
#else
  return "";
#endif
}

}  // namespace kvmesh_quant
