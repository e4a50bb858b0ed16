// Per-token row operations of the native decoder stack (see native_rowops.h for the contract).
//
// The element-wise loops (RoPE, the SiLU product, adds, the norm's scaling) are written once as plain loops and
// compiled three times: for AVX-512, for AVX2 and for the portable baseline (GCC vectorises the first two with
// the wide registers; the build's baseline ISA is SSE2). Element-wise, the three run the same IEEE operations in
// the same order, so they give the same bits; the exceptions are the RMS norm's double sum of squares, explicitly
// vectorised in 8 (AVX-512) or 4 (AVX2) double lanes added in a fixed order, and the SiLU's exp (exp_inplace,
// which differs between the vector and portable paths).
#include "native_rowops.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "native_attention.h"  // exp_inplace

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12 reports the intrinsics' own _mm512_undefined_* placeholders as uninitialised (as in native_linear.cpp)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define SA_ROW_X86 1
#define SA_ROW512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define SA_ROW2 __attribute__((target("avx2,fma")))
#else
#define SA_ROW_X86 0
#endif

#define SA_INLINE inline __attribute__((always_inline))

namespace specadapt {
namespace cpu {
namespace native {

int active_isa_value();  // native_linear.cpp: 0 scalar, 1 AVX2, 2 AVX-512

namespace {

// ---- the element-wise bodies, inlined into each ISA's wrapper ---------------------------------------------
SA_INLINE void scale_row_body(const float* x, const float* weight, float inv, int64_t dim, float* o) {
  for (int64_t i = 0; i < dim; ++i) o[i] = weight[i] * (x[i] * inv);
}

SA_INLINE void rope_body(float* v, int64_t heads, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* a = v + h * D;
    float* b = a + half;
    for (int64_t i = 0; i < half; ++i) {
      const float ai = a[i], bi = b[i];
      a[i] = ai * cos[i] - bi * sin[i];
      b[i] = bi * cos[i + half] + ai * sin[i + half];
    }
  }
}

SA_INLINE void negate_body(const float* g, int64_t n, float* e) {
  for (int64_t i = 0; i < n; ++i) e[i] = -g[i];
}

SA_INLINE void silu_body(const float* g, const float* u, const float* e, int64_t n, float* a) {
  for (int64_t i = 0; i < n; ++i) a[i] = (g[i] / (1.f + e[i])) * u[i];
}

SA_INLINE void add_body(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

double sum_squares_scalar(const float* x, int64_t dim) {
  double acc = 0.0;
  for (int64_t i = 0; i < dim; ++i) acc += static_cast<double>(x[i]) * x[i];
  return acc;
}

// The element-wise kernels of one ISA: `name_suffix` wrappers (with the ISA's target attribute) around the bodies.
#define SA_ROW_KERNELS(suffix, attr)                                                                         \
  attr void scale_row_##suffix(const float* x, const float* w, float inv, int64_t dim, float* o) {           \
    scale_row_body(x, w, inv, dim, o);                                                                       \
  }                                                                                                          \
  attr void rope_##suffix(float* v, int64_t heads, const float* c, const float* s, int64_t D) {              \
    rope_body(v, heads, c, s, D);                                                                            \
  }                                                                                                          \
  attr void negate_##suffix(const float* g, int64_t n, float* e) { negate_body(g, n, e); }                   \
  attr void silu_##suffix(const float* g, const float* u, const float* e, int64_t n, float* a) {             \
    silu_body(g, u, e, n, a);                                                                                \
  }                                                                                                          \
  attr void add_##suffix(float* x, const float* y, int64_t n) { add_body(x, y, n); }

SA_ROW_KERNELS(scalar, )

#if SA_ROW_X86
SA_ROW512 double sum_squares_avx512(const float* x, int64_t dim) {
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    const __m512d lo = _mm512_cvtps_pd(_mm256_loadu_ps(x + i)), hi = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
    acc0 = _mm512_fmadd_pd(lo, lo, acc0);
    acc1 = _mm512_fmadd_pd(hi, hi, acc1);
  }
  double acc = _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
  for (; i < dim; ++i) acc += static_cast<double>(x[i]) * x[i];
  return acc;
}
SA_ROW_KERNELS(avx512, SA_ROW512)

SA_ROW2 double sum_squares_avx2(const float* x, int64_t dim) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m256d lo = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), hi = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
    acc0 = _mm256_fmadd_pd(lo, lo, acc0);
    acc1 = _mm256_fmadd_pd(hi, hi, acc1);
  }
  const __m256d s = _mm256_add_pd(acc0, acc1);
  const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
  double acc = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
  for (; i < dim; ++i) acc += static_cast<double>(x[i]) * x[i];
  return acc;
}
SA_ROW_KERNELS(avx2, SA_ROW2)
#endif

// The kernels of the active ISA.
struct RowKernels {
  double (*sum_squares)(const float*, int64_t) = sum_squares_scalar;
  void (*scale_row)(const float*, const float*, float, int64_t, float*) = scale_row_scalar;
  void (*rope)(float*, int64_t, const float*, const float*, int64_t) = rope_scalar;
  void (*negate)(const float*, int64_t, float*) = negate_scalar;
  void (*silu)(const float*, const float*, const float*, int64_t, float*) = silu_scalar;
  void (*add)(float*, const float*, int64_t) = add_scalar;
};

RowKernels kernels() {
  RowKernels k;
#if SA_ROW_X86
  const int isa = active_isa_value();
  if (isa == 2) {
    k.sum_squares = sum_squares_avx512, k.scale_row = scale_row_avx512, k.rope = rope_avx512;
    k.negate = negate_avx512, k.silu = silu_avx512, k.add = add_avx512;
  } else if (isa == 1) {
    k.sum_squares = sum_squares_avx2, k.scale_row = scale_row_avx2, k.rope = rope_avx2;
    k.negate = negate_avx2, k.silu = silu_avx2, k.add = add_avx2;
  }
#endif
  return k;
}

}  // namespace

void rms_norm_rows(const float* x, const float* weight, int64_t rows, int64_t dim, int64_t ld_in, int64_t ld_out,
                   double eps, float* out) {
  const RowKernels k = kernels();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ld_in;
    const double mean = k.sum_squares(xr, dim) / static_cast<double>(dim);
    const float inv = static_cast<float>(1.0 / std::sqrt(mean + eps));
    k.scale_row(xr, weight, inv, dim, out + r * ld_out);
  }
}

void silu_mul_rows(const float* gu, int64_t rows, int64_t I, float* act) {
  // exp(-g) in chunks of 256 (a multiple of every vector width, so each element's exp is the one a single
  // exp_inplace over the whole row would give).
  constexpr int64_t kChunk = 256;
  float e[kChunk];
  const RowKernels k = kernels();
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * I;
    const float* u = g + I;
    float* a = act + r * I;
    for (int64_t i0 = 0; i0 < I; i0 += kChunk) {
      const int64_t n = std::min(kChunk, I - i0);
      k.negate(g + i0, n, e);
      exp_inplace(e, n);
      k.silu(g + i0, u + i0, e, n, a + i0);
    }
  }
}

void rope_heads(float* v, int64_t heads, const float* cos, const float* sin, int64_t D) {
  kernels().rope(v, heads, cos, sin, D);
}

void add_inplace(float* x, const float* y, int64_t n) { kernels().add(x, y, n); }

}  // namespace native
}  // namespace cpu
}  // namespace specadapt
