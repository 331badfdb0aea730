// The rows' geometry attention.cpp resolves, and paged attention of bfloat16 prefill rows on AMX
// tiles (attention_amx.cpp) for it to hand its bf16 rows to where this build and CPU have
// AMX-BF16 (`amx_attention_applies`).
#pragma once

#include "aten.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "vec.h"

namespace kvmesh {

// Everything one call's rows read, resolved and validated once by attention.cpp (its layouts).
// T: the query's and output's element type; C: the cache's (T, or an 8-bit float code).
template <typename T, typename C = T>
struct AttentionGeometry {
  const T* q;
  const C* kc;
  const C* vc;
  const int32_t* bt;
  const int64_t* rows;
  T* out;
  int64_t qs0, qs1;              // query strides (token, head)
  int64_t H, KVH, G, D;          // query heads, KV heads, heads per KV head, head_dim
  int64_t block_size, max_blocks, num_blocks;
  int64_t tok_stride, blk_stride;
  int64_t window;
  float scale, cap;

  // The first key a row of context length ctx sees (its window's start, else 0).
  int64_t span_start(int64_t ctx) const { return window > 0 ? std::max<int64_t>(0, ctx - window) : 0; }
  // Every block-table entry of keys [lo, ctx) of `table` is a block of the cache, checked
  // before any key is read.
  void check_blocks(const int32_t* table, int64_t lo, int64_t ctx) const {
    for (int64_t b = lo / block_size; b <= (ctx - 1) / block_size; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "paged_attention_rows: block id out of range");
    }
  }
};

// Whether the AMX kernel takes these shapes here: a build with AMX-BF16, tile registers granted
// by Linux, head_dim a multiple of 32, block_size a multiple of 16, GQA groups of at most 8 heads
// (a run of 2 tokens fills at most a tile's 16 columns).
bool amx_attention_applies(int64_t H, int64_t KVH, int64_t D, int64_t block_size);
// Runs of 2 or more consecutive query tokens of one sequence (prefill chunks), on tiles; returns
// the rows it left, in the call's order (decodes: vdpbf16ps streams their keys as fast).
std::vector<int64_t> amx_attention(const AttentionGeometry<bf16>& a, int64_t R);
// "amx_bf16" where amx_attention can run in this process, else "".
std::string amx_attention_isa();

}  // namespace kvmesh
