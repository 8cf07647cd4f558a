// Float vectors on the build's instruction set (AVX-512: 16 lanes, AVX2: 8, else 1) and an exp
// whose vector and scalar forms give the same bits: shared by gemv.cpp and attention.cpp.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvreuse_kernels {

#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t kW = 16;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int64_t kW = 8;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#else
using Vec = float;
constexpr int64_t kW = 1;
inline Vec vload(const float* p) { return *p; }
inline void vstore(float* p, Vec v) { *p = v; }
inline Vec vset1(float x) { return x; }
inline Vec vfma(Vec a, Vec b, Vec c) { return std::fma(a, b, c); }
#endif

// exp for x in [-87, 88] (clamped there) by 2^(x log2 e): a degree-6 polynomial (fused multiply-adds) on the fraction,
// the integer part in the exponent bits; relative error below 1e-5 (9.4e-6 worst over [-87, 88],
// measured exhaustively by a reviewer: far below a bf16 step). `exp_clamped` and `exp_lanes`
// compute the same bits for an element: every step is exactly rounded.
constexpr float kExpPoly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                               5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.f};
constexpr float kLog2e = 1.44269504088896341f;

inline float exp_clamped(float x) {
  if (std::isnan(x)) return x;  // NaN in, NaN out (as the vector form: max / min keep a NaN operand)
  x = std::min(std::max(x, -87.f), 88.f);
  const float t = x * kLog2e;
  const float fi = std::floor(t);
  const float f = t - fi;  // [0, 1)
  float p = kExpPoly[0];
  for (int c = 1; c < 7; ++c) p = std::fma(p, f, kExpPoly[c]);
  const int32_t e = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

// x[j] = exp_clamped(x[j] - m) for j < n, n a multiple of kW (the same bits per element).
inline void exp_lanes(float* x, int64_t n, float m) {
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m), lo = _mm512_set1_ps(-87.f), hi = _mm512_set1_ps(88.f), l2e = _mm512_set1_ps(kLog2e);
  for (int64_t j = 0; j < n; j += 16) {
    // max / min return their second operand when either is NaN: x second, so a NaN stays NaN
    const __m512 xv = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_sub_ps(_mm512_loadu_ps(x + j), vm)));
    const __m512 t = _mm512_mul_ps(xv, l2e);
    const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, fi);
    __m512 p = _mm512_set1_ps(kExpPoly[0]);
    for (int c = 1; c < 7; ++c) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpPoly[c]));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fi), _mm512_set1_epi32(127)), 23);
    _mm512_storeu_ps(x + j, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.f), hi = _mm256_set1_ps(88.f), l2e = _mm256_set1_ps(kLog2e);
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 xv = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_sub_ps(_mm256_loadu_ps(x + j), vm)));
    const __m256 t = _mm256_mul_ps(xv, l2e);
    const __m256 fi = _mm256_floor_ps(t);
    const __m256 f = _mm256_sub_ps(t, fi);
    __m256 p = _mm256_set1_ps(kExpPoly[0]);
    for (int c = 1; c < 7; ++c) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpPoly[c]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
    _mm256_storeu_ps(x + j, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
#else
  for (int64_t j = 0; j < n; ++j) x[j] = exp_clamped(x[j] - m);
#endif
}

}  // namespace kvreuse_kernels
