// y[M, N] = x[M, K] · W[N, K]^T (+ b) for the decode step's few rows (float32 / bfloat16, CPU).
//
// At 1-32 rows a projection is a read of its weight: oneDNN's linear gets there too, but costs
// ~20-40 µs of fixed work a call (primitive lookup, its own threading). This kernel reads the
// weight as the model holds it (dense row-major [N, K], no packed copy) exactly once per call:
//
//   - the work is split over N: each thread owns a contiguous range of weight rows, a multiple
//     of kNR rows, so its weight bytes are one contiguous stream;
//   - a tile is kMR activation rows x kNR weight rows of dot products over K, kMR * kNR vector
//     accumulators in registers; for M > kMR the same kNR weight rows (kNR * K elements, a few
//     KB) are re-read from L1 by the next activation tile (or a shorter one for the last
//     M % kMR rows), not from memory; the first activation tile prefetches the weight kAhead
//     tiles on;
//   - K is walked in vectors (16 float32 lanes with AVX-512, 8 with AVX2, 32 bf16 with
//     AVX512-BF16's vdpbf16ps, which adds pairs of bf16 products into float32 lanes); the last
//     partial vector is a masked load whose zero lanes add nothing.
//
// Each output element is one accumulator's lanes summed in an order set by where its weight
// row falls in N, the bias added in float32, and (bf16) rounded once. The instructions computing
// y[m, n] depend only on K, N, n, x[m] and W[n]: not on M, on m's place in its tile or the
// tile's height, nor on the thread count, so a row's result is bitwise the same alone or in a
// batch (speculative verification relies on it).

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels.h"
#include "vec.h"

using kvmesh::bf16;
using kvmesh::from_f;
using kvmesh::to_f;
#if KVMESH_SIMD
using namespace kvmesh;
#endif

namespace {

constexpr int64_t kMaxRows = 64;   // M the kernel takes (linear.py dispatches far fewer)
constexpr int kNR = 4;             // weight rows per tile
#if KVMESH_AVX512
constexpr int kMR = 4;             // activation rows per tile: 16 accumulators of 32 registers
#else
constexpr int kMR = 2;             // AVX2: 8 accumulators of 16 registers
#endif
// NOTE: a parallel region costs microseconds (far more while other processes hold the cores):
// a weight under this many bytes is read on the calling thread.
constexpr int64_t kParallelBytes = 256 * 1024;
constexpr int kAhead = 2;          // weight tiles the prefetch runs ahead of the loads

// NOTE: the tile loops over t and j unrolled before GCC's optimisers see the accumulator array:
// otherwise it keeps the array in memory and stores all of it on every step of K (~3x slower).
#define UNROLL _Pragma("GCC unroll 16")

#if KVMESH_SIMD
// NOTE: the first activation tile of each weight tile fetches the next weight tile (a few KB
// ahead of the loads) into L1: the multiply-adds between the loads otherwise leave too few
// cache misses in flight to stream the weight at the memory's speed.
template <typename T>
inline void prefetch(const T* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

#if KVMESH_AVX512
inline vf load_tail(const float* p, int64_t n) {   // n < kW lanes, the rest zero
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
#else
inline vf load_tail(const float* p, int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
}
#endif

// [sum(a0), sum(a1), sum(a2), sum(a3)] into out: a pairwise tree over each vector's lanes (one
// order for every element of a 4-row weight tile), a third of the work of four vhsum.
inline void hsum4(vf a0, vf a1, vf a2, vf a3, float* out) {
  const __m256 t0 = _mm256_hadd_ps(fold8(a0), fold8(a1)), t1 = _mm256_hadd_ps(fold8(a2), fold8(a3));
  const __m256 u = _mm256_hadd_ps(t0, t1);
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}

// out[j] = the sum of acc[j]'s lanes; the order depends on NR (where the weight row falls in N)
template <int NR>
inline void reduce(const vf (&acc)[NR], float (&out)[NR]) {
  if constexpr (NR == 4) {
    hsum4(acc[0], acc[1], acc[2], acc[3], out);
  } else {
    UNROLL for (int j = 0; j < NR; ++j) out[j] = vhsum(acc[j]);
  }
}

// out[t][j] = x[t] · w[j] over K (float32): lane-wise partial sums, then each summed in one order
template <int MR, int NR, bool PF>
inline void dot_tile(const float* const* xs, const float* w, int64_t K, float (&out)[MR][NR]) {
  // NOTE: the accumulators stay local (never passed by reference): so they live in registers
  vf acc[MR][NR];
  UNROLL for (int t = 0; t < MR; ++t)
    UNROLL for (int j = 0; j < NR; ++j) acc[t][j] = vzero();
  int64_t k = 0;
  for (; k + kW <= K; k += kW) {
    vf xv[MR];
    UNROLL for (int t = 0; t < MR; ++t) xv[t] = vload(xs[t] + k);
    UNROLL for (int j = 0; j < NR; ++j) {
      if constexpr (PF) prefetch(w + (kAhead * NR + j) * K + k);
      const vf wv = vload(w + j * K + k);
      UNROLL for (int t = 0; t < MR; ++t) acc[t][j] = vfmadd(xv[t], wv, acc[t][j]);
    }
  }
  if (k < K) {
    vf xv[MR];
    UNROLL for (int t = 0; t < MR; ++t) xv[t] = load_tail(xs[t] + k, K - k);
    UNROLL for (int j = 0; j < NR; ++j) {
      const vf wv = load_tail(w + j * K + k, K - k);
      UNROLL for (int t = 0; t < MR; ++t) acc[t][j] = vfmadd(xv[t], wv, acc[t][j]);
    }
  }
  UNROLL for (int t = 0; t < MR; ++t) reduce<NR>(acc[t], out[t]);
}
#endif

#if KVMESH_AVX512BF16
// The same for bf16: 32 elements a step, pairs of products summed into 16 float32 lanes.
template <int MR, int NR, bool PF>
inline void dot_tile(const bf16* const* xs, const bf16* w, int64_t K, float (&out)[MR][NR]) {
  vf acc[MR][NR];
  UNROLL for (int t = 0; t < MR; ++t)
    UNROLL for (int j = 0; j < NR; ++j) acc[t][j] = vzero();
  auto step = [&](int64_t k, __mmask32 m) {
    __m512i xv[MR];
    UNROLL for (int t = 0; t < MR; ++t) xv[t] = _mm512_maskz_loadu_epi16(m, xs[t] + k);
    UNROLL for (int j = 0; j < NR; ++j) {
      if constexpr (PF) prefetch(w + (kAhead * NR + j) * K + k);
      const __m512i wv = _mm512_maskz_loadu_epi16(m, w + j * K + k);
      UNROLL for (int t = 0; t < MR; ++t) acc[t][j] = _mm512_dpbf16_ps(acc[t][j], (__m512bh)xv[t], (__m512bh)wv);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, ~__mmask32(0));
  if (k < K) step(k, (__mmask32(1) << (K - k)) - 1);
  UNROLL for (int t = 0; t < MR; ++t) reduce<NR>(acc[t], out[t]);
}
#endif

// Rows [t0, t0 + MR) of y for weight rows [n, n + NR).
template <typename T, int MR, int NR, bool PF = false>
inline void tile(const T* xp, int64_t xs0, const T* w, const T* bias, T* yp, int64_t N, int64_t K,
                 int64_t t0, int64_t n) {
  const T* xs[MR];
  UNROLL for (int t = 0; t < MR; ++t) xs[t] = xp + (t0 + t) * xs0;
#if KVMESH_SIMD
  float sum[MR][NR];
  dot_tile<MR, NR, PF>(xs, w + n * K, K, sum);
  UNROLL for (int t = 0; t < MR; ++t)
    UNROLL for (int j = 0; j < NR; ++j) {
      float s = sum[t][j];
      if (bias != nullptr) s += to_f(bias[n + j]);
      yp[(t0 + t) * N + n + j] = from_f<T>(s);
    }
#else
  (void)xs;
  TORCH_CHECK(false, "small_gemm: this build has no vector path");
#endif
}

// Rows [t0, t0 + rows) of y, rows < kMR, for weight rows [n, n + NR): one tile of that height.
template <typename T, int NR, bool PF>
inline void part(int64_t rows, const T* xp, int64_t xs0, const T* w, const T* bias, T* yp, int64_t N,
                 int64_t K, int64_t t0, int64_t n) {
  if constexpr (kMR > 3) {
    if (rows == 3) return tile<T, 3, NR, PF>(xp, xs0, w, bias, yp, N, K, t0, n);
  }
  if constexpr (kMR > 2) {
    if (rows == 2) return tile<T, 2, NR, PF>(xp, xs0, w, bias, yp, N, K, t0, n);
  }
  tile<T, 1, NR, PF>(xp, xs0, w, bias, yp, N, K, t0, n);
}

// The first activation tile of weight rows [n, n + NR), fetching the weight kAhead tiles on
// when PF; returns the rows it did.
template <typename T, int NR, bool PF>
inline int64_t first(int64_t M, const T* xp, int64_t xs0, const T* w, const T* bias, T* yp, int64_t N,
                     int64_t K, int64_t n) {
  if (M >= kMR) {
    tile<T, kMR, NR, PF>(xp, xs0, w, bias, yp, N, K, 0, n);
    return kMR;
  }
  part<T, NR, PF>(M, xp, xs0, w, bias, yp, N, K, 0, n);
  return M;
}

// Weight rows [n0, n1) for every activation row: for each weight tile, the activations in tiles
// of kMR rows and one shorter tile for the rest.
template <typename T>
void rows(const T* xp, int64_t xs0, const T* w, const T* bias, T* yp, int64_t M, int64_t N, int64_t K,
          int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kNR <= n1; n += kNR) {
    // the prefetch stays inside [n0, n1): another thread streams what lies past it
    int64_t t = n + (kAhead + 1) * kNR <= n1 ? first<T, kNR, true>(M, xp, xs0, w, bias, yp, N, K, n)
                                              : first<T, kNR, false>(M, xp, xs0, w, bias, yp, N, K, n);
    for (; t + kMR <= M; t += kMR) tile<T, kMR, kNR>(xp, xs0, w, bias, yp, N, K, t, n);
    if (t < M) part<T, kNR, false>(M - t, xp, xs0, w, bias, yp, N, K, t, n);
  }
  for (; n < n1; ++n) {
    int64_t t = 0;
    for (; t + kMR <= M; t += kMR) tile<T, kMR, 1>(xp, xs0, w, bias, yp, N, K, t, n);
    if (t < M) part<T, 1, false>(M - t, xp, xs0, w, bias, yp, N, K, t, n);
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& w, const T* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), xs0 = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  // NOTE: tiles of kNR rows from 0, the chunk bounds multiples of kNR: where a weight row falls
  // (a 4-row tile or the last partial one) depends on N alone, never on the thread count.
  const int64_t tiles = (N + kNR - 1) / kNR;
  const int64_t bytes = N * K * static_cast<int64_t>(sizeof(T));
  const int64_t threads = bytes < kParallelBytes ? 1 : std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = (tiles + threads - 1) / threads;
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    rows<T>(xp, xs0, wp, bias, yp, M, N, K, begin * kNR, std::min(N, end * kNR));
  });
}

}  // namespace

bool small_gemm_supports(const std::string& dtype) {
  if (dtype == "float32") return KVMESH_SIMD;
  if (dtype == "bfloat16") return KVMESH_AVX512BF16;
  return false;
}

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "small_gemm: CPU tensors only");
  const bool f32 = small_gemm_supports("float32"), b16 = small_gemm_supports("bfloat16");
  TORCH_CHECK((dt == at::kFloat && f32) || (dt == at::kBFloat16 && b16), "small_gemm: this build takes ",
              b16 ? "float32 and bfloat16" : (f32 ? "float32" : "no dtype (no vector path)"), ", not ", dt);
  TORCH_CHECK(w.scalar_type() == dt, "small_gemm: x and w must share one dtype");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "small_gemm: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.size(1) > 0 && x.stride(1) == 1 && (x.size(0) == 1 || x.stride(0) >= x.size(1)),
              "small_gemm: x needs unit stride along K (copy it with .contiguous())");
  TORCH_CHECK(w.is_contiguous(), "small_gemm: w must be contiguous [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_gemm: x must have 1 to ", kMaxRows, " rows");
  const int64_t N = w.size(0);
  const void* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == dt && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                "small_gemm: bias must be a contiguous [N] tensor of x's dtype");
    bp = bias->data_ptr();
  }
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  if (N == 0) return y;
#if KVMESH_SIMD
  if (dt == at::kFloat) run<float>(x, w, static_cast<const float*>(bp), y);
#endif
#if KVMESH_AVX512BF16
  if (dt == at::kBFloat16) run<bf16>(x, w, static_cast<const bf16*>(bp), y);
#endif
  return y;
}
