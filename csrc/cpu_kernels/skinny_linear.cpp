// Module agentaccel._cpu_kernels: y = x W^T for the few rows of a decoding or verification step
// on CPU (x: M x K, W: N x K as nn.Linear keeps it, M small).
//
// Why: decoding streams every weight once per step, so a step is bound by memory reads. MKL's
// GEMV/GEMM reach about half of this machine's read bandwidth for one row and worse for 2-16
// (docs/BENCHMARKS.md); here each weight vector loaded from memory is used by every row while it
// sits in a register or L1, and the rows of x are walked in L1-sized chunks of K.
//
// Batch invariance: each output is one dot product whose summation order (8 lane-wise partial
// sums over K in order, then a fixed horizontal sum, then the K % 8 tail) does not depend on M, on
// the K chunking or on which block computed it. A row's result is therefore bit-identical whether
// it runs alone (a plain step) or beside draft rows (a verification step).
#include <nanobind/nanobind.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

namespace nb = nanobind;

namespace {

#if defined(__x86_64__) || defined(_M_X64)
}  // namespace
#include <immintrin.h>
namespace {

constexpr int kWeightRows = 4;  // weight rows per block: 4 x 2 accumulators + 4 + 1 registers fit AVX2's 16
constexpr int64_t kMaxRows = 64;  // input rows whose partial sums one block keeps (8 KiB on the stack)
constexpr int64_t kChunk = 128;   // K values per pass over the rows: their slices then stay in L1

__attribute__((target("avx2,fma"))) inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// One step of 8 K values: NB weight vectors, each used by MB input rows while in a register.
template <int NB, int MB>
__attribute__((target("avx2,fma"))) inline void fma_step(const float* x, const float* w, int64_t K, int64_t k,
                                                         __m256 (&a)[NB][MB]) {
  __m256 wv[NB];
  for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
  for (int r = 0; r < MB; ++r) {
    const __m256 xv = _mm256_loadu_ps(x + r * K + k);
    for (int j = 0; j < NB; ++j) a[j][r] = _mm256_fmadd_ps(wv[j], xv, a[j][r]);
  }
}

// Adds K values [k0, k1) of NB weight rows (w, stride K) times MB input rows (x, stride K) to the
// lane-wise partial sums acc[r * NB + j]. Carrying them in memory between chunks keeps each
// output's summation order the same as one pass over K.
template <int NB, int MB>
__attribute__((target("avx2,fma"))) inline void dot_chunk(const float* x, const float* w, int64_t K, int64_t k0,
                                                          int64_t k1, __m256* acc) {
  __m256 a[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < MB; ++r) a[j][r] = acc[r * NB + j];
#pragma GCC unroll 4  // one row took ~15 % less time unrolled (docs/BENCHMARKS.md)
  for (int64_t k = k0; k < k1; k += 8) fma_step<NB, MB>(x, w, K, k, a);
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < MB; ++r) acc[r * NB + j] = a[j][r];
}

// y[r, j] for NB weight rows and M <= kMaxRows input rows; y has stride N. One or two rows (a
// plain step) take K in one pass; more go through K in chunks, two rows at a time, so that the
// rows' current slices stay in L1 while the weights' slices are reused from registers and L1
// (groups of three rows, unrolled or not, measured no faster).
template <int NB>
__attribute__((target("avx2,fma"))) void weight_block(const float* x, int64_t M, int64_t K, const float* w, float* y,
                                                      int64_t N) {
  alignas(32) __m256 acc[kMaxRows * NB];
  for (int64_t i = 0; i < M * NB; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t K8 = K / 8 * 8;
  const int64_t chunk = M <= 2 ? K8 : kChunk;
  for (int64_t k0 = 0; k0 < K8; k0 += chunk) {
    const int64_t k1 = std::min(K8, k0 + chunk);
    int64_t r = 0;
    for (; r + 2 <= M; r += 2) dot_chunk<NB, 2>(x + r * K, w, K, k0, k1, acc + r * NB);
    if (r < M) dot_chunk<NB, 1>(x + r * K, w, K, k0, k1, acc + r * NB);
  }
  for (int64_t r = 0; r < M; ++r)
    for (int j = 0; j < NB; ++j) {
      float s = horizontal_sum(acc[r * NB + j]);
      for (int64_t t = K8; t < K; ++t) s += w[j * K + t] * x[r * K + t];
      y[r * N + j] = s;
    }
}

__attribute__((target("avx2,fma"))) void skinny_linear(const float* x, int64_t M, int64_t K, const float* w,
                                                       int64_t N, float* y) {
  const int64_t blocks = N / kWeightRows;
  for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {  // more rows than a block holds: weights read again per group
    const int64_t rows = std::min(kMaxRows, M - r0);
    const float* xs = x + r0 * K;
    float* ys = y + r0 * N;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b)
      weight_block<kWeightRows>(xs, rows, K, w + b * kWeightRows * K, ys + b * kWeightRows, N);
    for (int64_t j = blocks * kWeightRows; j < N; ++j) weight_block<1>(xs, rows, K, w + j * K, ys + j, N);
  }
}

bool cpu_supported() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#else  // other processors: Python keeps torch's products
void skinny_linear(const float*, int64_t, int64_t, const float*, int64_t, float*) {}
bool cpu_supported() { return false; }
#endif

}  // namespace

NB_MODULE(_cpu_kernels, m) {
  m.doc() = "agentaccel CPU kernels for few-row decoding steps";
  m.def("available", &cpu_supported, "Whether this CPU runs the kernels (AVX2 and FMA).");
  // Raised whenever a change alters the kernels' speed: cached cost profiles are keyed by it.
  m.attr("VERSION") = 2;
  // Raw addresses, not arrays: importing three torch tensors through DLPack costs ~10 us a call,
  // and a step makes ~200 of them. The Python caller (backends/local/cpu_matmul.py) checks dtype,
  // device, layout and shapes, and keeps the tensors alive across the call.
  m.def(
      "linear_into",
      [](uintptr_t x, int64_t rows, int64_t inner, uintptr_t weight, int64_t outer, uintptr_t out) {
        if (!cpu_supported()) throw std::runtime_error("this CPU lacks AVX2/FMA");
        if (rows <= 0 || inner <= 0 || outer <= 0) throw std::invalid_argument("linear_into: empty shape");
        nb::gil_scoped_release release;
        skinny_linear(reinterpret_cast<const float*>(x), rows, inner, reinterpret_cast<const float*>(weight), outer,
                      reinterpret_cast<float*>(out));
      },
      nb::arg("x"), nb::arg("rows"), nb::arg("inner"), nb::arg("weight"), nb::arg("outer"), nb::arg("out"),
      "out[rows, outer] = x[rows, inner] @ weight[outer, inner].T; float32, C-contiguous, by address.");
}
