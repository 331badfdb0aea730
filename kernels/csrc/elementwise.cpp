// Elementwise CPU kernels of the decoder layer (float32 or bfloat16 tensors, float32 arithmetic),
// one pass each, no temporaries: RMSNorm with the fused residual add, NeoX RoPE of q and k,
// SiLU(gate) * up, and the KV-cache write (to an 8-bit float cache: the codes). In bfloat16 each result is rounded where the torch
// reference's ops round (the residual sum, the normalised value, each product), so the kernels
// and the reference agree to the last bit or within an ulp of bf16.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec.h"

using kvmesh::bf16;
using kvmesh::exp_nonpos;
using kvmesh::from_f;
using kvmesh::to_f;
#if KVMESH_SIMD
using namespace kvmesh;
#endif

namespace {

bool float_or_bf16(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16;
}

// (norm(x [+ residual]), x [+ residual]) of one row of H: y = w * (v * (1 / sqrt(mean(v^2) + eps))).
template <typename T>
inline void rms_row(const T* x, const T* res, const T* w, T* o, T* s, int64_t H, float eps) {
  const T* v = x;
  int64_t i = 0;
  if (res != nullptr) {
#if KVMESH_SIMD
    for (; i + kW <= H; i += kW) vstore(s + i, vadd(vload(x + i), vload(res + i)));
#endif
    for (; i < H; ++i) s[i] = from_f<T>(to_f(x[i]) + to_f(res[i]));
    v = s;
  }
  float ss = 0.0f;
  i = 0;
#if KVMESH_SIMD
  vf acc = vzero();
  for (; i + kW <= H; i += kW) {
    const vf a = vload(v + i);
    acc = vfmadd(a, a, acc);
  }
  ss = vhsum(acc);
#endif
  for (; i < H; ++i) ss += to_f(v[i]) * to_f(v[i]);
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  i = 0;
#if KVMESH_SIMD
  const vf vinv = vset1(inv);
  for (; i + kW <= H; i += kW) {
    vstore(o + i, vmul(vload(w + i), vround(vmul(vload(v + i), vinv), static_cast<const T*>(nullptr))));
  }
#endif
  for (; i < H; ++i) o[i] = from_f<T>(to_f(w[i]) * to_f(from_f<T>(to_f(v[i]) * inv)));
}

// SiLU(g) * u of one row of I; sigmoid(x) from e = exp(-|x|) <= 1 (exp_nonpos): 1 / (1 + e) for
// x >= 0, e / (1 + e) below. bf16 rounds the SiLU before the product (torch's two ops).
template <typename T>
inline void silu_row(const T* g, const T* u, T* o, int64_t I) {
  int64_t i = 0;
#if KVMESH_SIMD
  const vf one = vset1(1.0f);
  for (; i + kW <= I; i += kW) {
    const vf v = vload(g + i);
    const vf e = vexp_nonpos(vneg_abs(v));                        // exp(-|v|)
    const vf sig = vdiv(vselect_ge0(v, one, e), vadd(one, e));
    vstore(o + i, vmul(vround(vmul(v, sig), static_cast<const T*>(nullptr)), vload(u + i)));
  }
#endif
  for (; i < I; ++i) {
    const float v = to_f(g[i]), e = exp_nonpos(-std::fabs(v));
    o[i] = from_f<T>(to_f(from_f<T>(v * ((v >= 0.0f ? 1.0f : e) / (1.0f + e)))) * to_f(u[i]));
  }
}

}  // namespace

// ---- RMSNorm (+ residual) and RoPE: one pass each, no temporaries ----------------------------
// Small batches (a decode step) run inline on the calling thread: a parallel region per op costs
// more than the op there, and far more when other processes hold the cores.

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                 const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && float_or_bf16(x) && x.is_contiguous(),
              "rms_norm: x must be contiguous float32 or bfloat16 [T, H]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "rms_norm: weight must be contiguous [H] in x's dtype");
  const int64_t T = x.size(0), H = x.size(1);
  const bool has_res = residual.has_value();
  if (has_res) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                    residual->is_contiguous(),
                "rms_norm: residual must be contiguous, shaped like x, in its dtype");
  }
  at::Tensor out = at::empty_like(x);
  at::Tensor sum = has_res ? at::empty_like(x) : x;
  const float feps = static_cast<float>(eps);
  auto go = [&](auto tag) {
    using E = decltype(tag);
    const E* xp = x.data_ptr<E>();
    const E* rp = has_res ? residual->data_ptr<E>() : nullptr;
    const E* wp = weight.data_ptr<E>();
    E* op = out.data_ptr<E>();
    E* sp = has_res ? sum.data_ptr<E>() : nullptr;
    at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rms_row<E>(xp + t * H, rp ? rp + t * H : nullptr, wp, op + t * H, sp ? sp + t * H : nullptr, H, feps);
      }
    });
  };
  if (x.scalar_type() == at::kFloat) go(float{}); else go(bf16{});
  return {out, sum};
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// NeoX RoPE of one [T, heads, D] tensor (unit stride along D) into a new contiguous one:
// x1 * cos - x2 * sin | x2 * cos + x1 * sin, rounded as torch's separate ops round (no FMA);
// bf16 is widened, rotated in float32 and rounded once (the reference's upcast).
template <typename E>
static void rope_rows(const E* xp, const int64_t* pp, const float* cs, E* op, int64_t T, int64_t NH, int64_t D,
                      int64_t s0, int64_t s1, int64_t P) {
  const int64_t half = D / 2;
  at::parallel_for(0, T, 128, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pos = pp[t];
      TORCH_CHECK(pos >= 0 && pos < P, "rotary_embedding: position out of the table's range");
      const float* c = cs + pos * D;
      const float* sn = c + half;
      for (int64_t h = 0; h < NH; ++h) {
        const E* a = xp + t * s0 + h * s1;
        E* o = op + (t * NH + h) * D;
        int64_t i = 0;
#if KVMESH_SIMD
        if constexpr (!std::is_same_v<E, float>) {
          for (; i + kW <= half; i += kW) {
            const vf x1 = vload(a + i), x2 = vload(a + i + half), vc = vload(c + i), vs = vload(sn + i);
            vstore(o + i, vsub(vmul(x1, vc), vmul(x2, vs)));
            vstore(o + i + half, vadd(vmul(x2, vc), vmul(x1, vs)));
          }
        }
#endif
#pragma omp simd
        for (int64_t j = i; j < half; ++j) {
          const float x1 = to_f(a[j]), x2 = to_f(a[j + half]);
          const float p1 = x1 * c[j], p2 = x2 * sn[j], p3 = x2 * c[j], p4 = x1 * sn[j];
          o[j] = from_f<E>(p1 - p2);
          o[j + half] = from_f<E>(p3 + p4);
        }
      }
    }
  });
}

static at::Tensor rope_one(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin) {
  TORCH_CHECK(x.dim() == 3 && float_or_bf16(x) && x.stride(2) == 1,
              "rotary_embedding: q / k must be float32 or bfloat16 [T, heads, D] with unit stride along D");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2);
  TORCH_CHECK(D % 2 == 0 && cos_sin.size(1) == D, "rotary_embedding: head_dim does not match the table");
  at::Tensor out = at::empty({T, NH, D}, x.options());
  const int64_t* pp = positions.data_ptr<int64_t>();
  const float* cs = cos_sin.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    rope_rows<float>(x.data_ptr<float>(), pp, cs, out.data_ptr<float>(), T, NH, D, x.stride(0), x.stride(1),
                     cos_sin.size(0));
  } else {
    rope_rows<bf16>(x.data_ptr<bf16>(), pp, cs, out.data_ptr<bf16>(), T, NH, D, x.stride(0), x.stride(1),
                    cos_sin.size(0));
  }
  return out;
}
#pragma GCC pop_options

std::vector<at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                         const at::Tensor& k, const at::Tensor& cos_sin) {
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.size(0) == q.size(0) && k.size(0) == q.size(0),
              "rotary_embedding: positions must be contiguous int64 [T] matching q and k");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous(),
              "rotary_embedding: cos_sin must be contiguous float32 [positions, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_embedding: q and k must share a dtype");
  return {rope_one(q, positions, cos_sin), rope_one(k, positions, cos_sin)};
}

// ---- SiLU(gate) * up of a fused [T, 2I] gate|up projection, in one pass --------------------------
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && float_or_bf16(x) && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be float32 or bfloat16 [T, 2I] with unit stride along the last dim");
  const int64_t T = x.size(0), I = x.size(1) / 2, stride = x.stride(0);
  at::Tensor out = at::empty({T, I}, x.options());
  auto go = [&](auto tag) {
    using E = decltype(tag);
    const E* xp = x.data_ptr<E>();
    E* op = out.data_ptr<E>();
    at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_row<E>(xp + t * stride, xp + t * stride + I, op + t * I, I);
    });
  };
  if (x.scalar_type() == at::kFloat) go(float{}); else go(bf16{});
  return out;
}

// ---- KV-cache write: each token's K and V rows into their slots, -1 skipped ----------------------
namespace {

// float32 -> the nearest 8-bit float code with M mantissa bits and exponent bias B (nearest
// even), saturated at the largest finite code MAXC (infinities too); NaN -> the format's NaN
// (0x7f). Normal results: the float's exponent and mantissa rounded to M bits in place, then
// rebiased; below the smallest normal 2^(1-B): a multiple of the subnormal step 2^(1-B-M).
// Torch's conversion of the value clamped to +-MAXC's value gives the same bits.
template <int M, int B, int MAXC>
inline uint8_t fp8_code(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t sign = (bits >> 24) & 0x80u;
  bits &= 0x7fffffffu;
  float a;
  std::memcpy(&a, &bits, 4);
  if (a != a) return static_cast<uint8_t>(sign | 0x7fu);
  constexpr int S = 23 - M;
  constexpr float kMinNormal = 1.0f / static_cast<float>(1u << (B - 1));
  constexpr float kSubSteps = static_cast<float>(1u << (B - 1 + M));
  int32_t code;
  if (a < kMinNormal) {
    code = static_cast<int32_t>(std::nearbyint(a * kSubSteps));   // the default mode: nearest even
  } else {
    const uint32_t r = (bits + ((1u << (S - 1)) - 1u) + ((bits >> S) & 1u)) >> S;
    code = static_cast<int32_t>(r) - ((127 - B) << M);
  }
  return static_cast<uint8_t>(sign | static_cast<uint32_t>(std::min(code, MAXC)));
}

// Rows of T [T, KVH, D] (any token / head strides) into an 8-bit cache's slots.
template <typename T, int M, int B, int MAXC>
void write_codes(const at::Tensor& src, at::Tensor& cache, const int64_t* sp) {
  const int64_t T_ = src.size(0), KVH = src.size(1), D = src.size(2);
  const T* x = static_cast<const T*>(src.data_ptr());
  uint8_t* c = static_cast<uint8_t*>(cache.data_ptr());
  const int64_t s0 = src.stride(0), s1 = src.stride(1);
  at::parallel_for(0, T_, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (sp[t] < 0) continue;   // a padding token
      for (int64_t h = 0; h < KVH; ++h) {
        const T* in = x + t * s0 + h * s1;
        uint8_t* out = c + (sp[t] * KVH + h) * D;
        for (int64_t d = 0; d < D; ++d) out[d] = fp8_code<M, B, MAXC>(to_f(in[d]));
      }
    }
  });
}

template <typename T>
void write_fp8(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
               const int64_t* sp) {
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {   // 448 = 0x7e
    write_codes<T, 3, 7, 0x7e>(key, k_cache, sp);
    write_codes<T, 3, 7, 0x7e>(value, v_cache, sp);
  } else {                                            // e5m2: 57344 = 0x7b
    write_codes<T, 2, 15, 0x7b>(key, k_cache, sp);
    write_codes<T, 2, 15, 0x7b>(value, v_cache, sp);
  }
}

}  // namespace

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "write_kv_cache: key / value must be [T, KVH, D] with unit stride along D");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == key.size(1) &&
                  k_cache.size(3) == key.size(2),
              "write_kv_cache: caches must be contiguous [num_blocks, block_size, KVH, D] matching key");
  const auto ct = k_cache.scalar_type();
  const bool codes = ct == at::kFloat8_e4m3fn || ct == at::kFloat8_e5m2;
  TORCH_CHECK(float_or_bf16(key) && value.scalar_type() == key.scalar_type() && v_cache.scalar_type() == ct &&
                  (ct == key.scalar_type() || codes),
              "write_kv_cache: key and value must be float32 or bfloat16, the caches in their dtype or both "
              "float8_e4m3fn / float8_e5m2");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "write_kv_cache: slot_mapping must be contiguous int64 [T]");
  const int64_t T = key.size(0), KVH = key.size(1), D = key.size(2);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {  // checked before anything is written
    TORCH_CHECK(sp[t] >= -1 && sp[t] < slots, "write_kv_cache: slot ", sp[t], " outside the cache");
  }
  if (codes) {
    if (key.scalar_type() == at::kFloat) {
      write_fp8<float>(key, value, k_cache, v_cache, sp);
    } else {
      write_fp8<bf16>(key, value, k_cache, v_cache, sp);
    }
    return;
  }
  const int64_t bytes = D * key.element_size();
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t es = key.element_size();
  const int64_t ks0 = key.stride(0) * es, ks1 = key.stride(1) * es, vs0 = value.stride(0) * es,
                vs1 = value.stride(1) * es, row = KVH * bytes;
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (sp[t] < 0) continue;   // a padding token
      for (int64_t h = 0; h < KVH; ++h) {
        std::memcpy(kc + sp[t] * row + h * bytes, kp + t * ks0 + h * ks1, bytes);
        std::memcpy(vc + sp[t] * row + h * bytes, vp + t * vs0 + h * vs1, bytes);
      }
    }
  });
}

// The instruction-set path of this build: "avx512_bf16", "avx512", "avx2" or "portable".
std::string isa() { return kvmesh::isa_name(); }
