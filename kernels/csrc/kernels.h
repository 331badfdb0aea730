// The C++ CPU kernels' entry points (bound to Python in bindings.cpp).
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

// attention.cpp
void paged_attention_rows(const torch::Tensor& query, const torch::Tensor& k_cache,
                          const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                          const torch::Tensor& rows, torch::Tensor& out, double scale,
                          int64_t window, double softcap);
// elementwise.cpp
std::vector<torch::Tensor> rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                                    const c10::optional<torch::Tensor>& residual);
std::vector<torch::Tensor> rotary_embedding(const torch::Tensor& positions, const torch::Tensor& q,
                                            const torch::Tensor& k, const torch::Tensor& cos_sin);
torch::Tensor silu_and_mul(const torch::Tensor& x);
void write_kv_cache(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& k_cache,
                    torch::Tensor& v_cache, const torch::Tensor& slot_mapping);
std::string isa();
// sampling.cpp
torch::Tensor argmax_rows(const torch::Tensor& x);
// lora.cpp
void lora_sgmv_add(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& bt, torch::Tensor& out,
                   const torch::Tensor& rows, const torch::Tensor& seg_starts, const torch::Tensor& seg_slots,
                   const torch::Tensor& part_cols, const torch::Tensor& slot_ranks);
// small_gemm.cpp
torch::Tensor small_gemm(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias);
bool small_gemm_supports(const std::string& dtype);
