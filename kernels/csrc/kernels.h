// The C++ CPU kernels' entry points (bound to Python in bindings.cpp).
#pragma once

#include "aten.h"

#include <string>
#include <vector>

// attention.cpp
void paged_attention_rows(const at::Tensor& query, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          const at::Tensor& rows, at::Tensor& out, double scale,
                          int64_t window, double softcap);
// elementwise.cpp
std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual);
std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                         const at::Tensor& k, const at::Tensor& cos_sin);
at::Tensor silu_and_mul(const at::Tensor& x);
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping);
std::string isa();
// sampling.cpp
at::Tensor argmax_rows(const at::Tensor& x);
// lora.cpp
void lora_sgmv_add(const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, at::Tensor& out,
                   const at::Tensor& rows, const at::Tensor& seg_starts, const at::Tensor& seg_slots,
                   const at::Tensor& part_cols, const at::Tensor& slot_ranks);
// small_gemm.cpp
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
bool small_gemm_supports(const std::string& dtype);
