// kvreuse's CPU kernels for few-row quantized linear layers (a decode step): the weights are
// streamed once per call, row-interleaved so one vector lane is one output row and no
// horizontal sum is needed, and the activations are quantized to int8 per group of 32 (a
// llama.cpp Q8_0 block) so the products run on 8-bit dot-product instructions
// (AVX512-VNNI vpdpbusd, or AVX2 vpmaddubsw + vpmaddwd).
//
// Contract shared by every op: a row of the output depends on its own row of x and the weights
// only: the same instructions in the same order run for it whatever the number of rows, so the
// kernels are batch-invariant (kvreuse's --deterministic mode relies on it).
//
// Built at first use by kvreuse/models/kernels/native.py with the machine's own -march=native.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "bf16.h"
#include "ops.h"
#include "simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using kvreuse_kernels::exp_lanes;
using kvreuse_kernels::round_bf16;
using kvreuse_kernels::to_bf16;

constexpr int kRows = 16;   // output rows per interleaved block (one AVX-512 vector of fp32)
constexpr int kGroup = 32;  // input channels per activation / weight scale
constexpr int kMaxM = 4;    // activation rows multiplied per pass over a weight block
#ifndef KVREUSE_PREFETCH
// bytes ahead of the int4 weight stream to prefetch (0: none); measured on an AVX-512 EPYC, one
// thread, 120 decode-step calls over 66 MB: 5.96 -> 5.25 ms (medians of 5). The int8 kernel was
// slower with it (1.2 -> 1.6 ms for a 28 MB lm_head) and goes without.
#define KVREUSE_PREFETCH 1024
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr const char* kIsa = "avx512vnni";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr const char* kIsa = "avx2";
#else
constexpr const char* kIsa = "scalar";
#endif

// One activation row quantized per group of 32: q = round(x / s) in [-127, 127], s = amax / 127.
struct QuantRow {
  std::vector<int8_t> q;       // [K]
  std::vector<float> scale;    // [K / 32]
  std::vector<float> sum;      // [K / 32] the group's sum of x (exact, for the int4 min term)
  std::vector<int32_t> qsum;   // [K / 32] the group's sum of q (the int8 kernel's +128 term)
  std::vector<int32_t> qsum16;  // [K / 16] each half group's sum of q (the 6-bit kernel's -32 term)
};

template <typename T>
void quantize_row(const T* x, int64_t k, QuantRow& out) {
  const int64_t groups = k / kGroup;
  out.q.resize(k);
  out.scale.resize(groups);
  out.sum.resize(groups);
  out.qsum.resize(groups);
  out.qsum16.resize(2 * groups);
  float v[kGroup];
  for (int64_t g = 0; g < groups; ++g) {
    float amax = 0.f, sum = 0.f;
    bool finite = true;
    for (int i = 0; i < kGroup; ++i) {
      v[i] = static_cast<float>(x[g * kGroup + i]);
      finite = finite && std::isfinite(v[i]);
      amax = std::max(amax, std::fabs(v[i]));  // skips a NaN: `finite` catches it
      sum += v[i];
    }
    // A NaN or inf in the group: a NaN scale makes the row's outputs NaN (a float product would
    // be non-finite), codes 0 (converting NaN or inf to an integer is undefined: it gave -127, a
    // finite int8 output for NaN and -inf for +inf)
    const float s = finite ? amax / 127.f : NAN;
    const float inv = finite && amax > 0.f ? 127.f / amax : 0.f;
    const bool tiny = std::isinf(inv);  // amax below ~3.7e-37: 127 / amax overflows, scale in double
    int32_t half[2] = {0, 0};
    for (int i = 0; i < kGroup; ++i) {
      const float t = !finite ? 0.f : tiny ? static_cast<float>(v[i] * (127.0 / amax)) : v[i] * inv;
      const int8_t c = static_cast<int8_t>(std::nearbyint(std::min(127.f, std::max(-127.f, t))));
      out.q[g * kGroup + i] = c;
      half[i / 16] += c;
    }
    const int32_t qsum = half[0] + half[1];
    out.qsum16[2 * g] = half[0];
    out.qsum16[2 * g + 1] = half[1];
    out.scale[g] = s;
    out.sum[g] = sum;
    out.qsum[g] = qsum;
  }
}

inline void store_rows(float* acc, at::Tensor& y, int64_t m, int64_t n0, const at::Tensor* residual) {
  const int64_t at_row = m * y.size(1) + n0;
  if (y.scalar_type() == at::kFloat) {
    if (residual != nullptr) {
      const float* res = static_cast<const float*>(residual->const_data_ptr()) + at_row;
      for (int r = 0; r < kRows; ++r) acc[r] += res[r];
    }
    std::memcpy(y.data_ptr<float>() + at_row, acc, kRows * sizeof(float));
  } else {
    if (residual != nullptr) {
      const auto* res = static_cast<const uint16_t*>(residual->const_data_ptr()) + at_row;
      for (int r = 0; r < kRows; ++r) acc[r] += kvreuse_kernels::from_bf16(res[r]);
    }
    auto* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) + at_row;
    for (int r = 0; r < kRows; ++r) out[r] = to_bf16(acc[r]);
  }
}

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// ---- int4: qw [N/16, K/32, 256] u8, d / mn [N/16, K/32, 16] fp16; w = code * d + mn ----------
// Byte (p, r, i) of a group's 256 holds row r's code for input 8p + i (low nibble) and 8p + 4 + i
// (high nibble). mn == nullptr: symmetric groups (a GGUF Q4_0 block, w = (code - 8) * d), the min
// taken as -8 * d in fp32: exactly the fp16 min -8 * d would convert to, so the same bits as the
// two-plane layout holding it, from 10% fewer bytes (no min plane to stream).
template <int M>
void q4_block(const uint8_t* qw, const uint16_t* d, const uint16_t* mn, int64_t groups,
              const QuantRow* const* xr, float (*acc)[kRows]) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512 f[M];
  for (int m = 0; m < M; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i s[M], t[M];  // two chains: the low and the high nibbles' products (latency, not width)
    for (int m = 0; m < M; ++m) s[m] = t[m] = _mm512_setzero_si512();
    const uint8_t* w = qw + g * 256;
    if (KVREUSE_PREFETCH > 0) {
      for (int p = 0; p < 4; ++p) _mm_prefetch(reinterpret_cast<const char*>(w + KVREUSE_PREFETCH + 64 * p), _MM_HINT_T0);
    }
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(w + 64 * p);
      const __m512i lo = _mm512_and_si512(v, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      for (int m = 0; m < M; ++m) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(xr[m]->q.data() + g * kGroup + 8 * p);
        s[m] = _mm512_dpbusd_epi32(s[m], lo, _mm512_set1_epi32(xq[0]));
        t[m] = _mm512_dpbusd_epi32(t[m], hi, _mm512_set1_epi32(xq[1]));
      }
    }
    for (int m = 0; m < M; ++m) s[m] = _mm512_add_epi32(s[m], t[m]);
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * kRows)));
    const __m512 mv = mn == nullptr ? _mm512_mul_ps(dv, _mm512_set1_ps(-8.f))
                                    : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + g * kRows)));
    for (int m = 0; m < M; ++m) {
      const __m512 ds = _mm512_mul_ps(dv, _mm512_set1_ps(xr[m]->scale[g]));
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m]), ds, f[m]);
      f[m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xr[m]->sum[g]), f[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(acc[m], f[m]);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[M][2];
  for (int m = 0; m < M; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i s[M][2];
    for (int m = 0; m < M; ++m) s[m][0] = s[m][1] = _mm256_setzero_si256();
    const uint8_t* w = qw + g * 256;
    for (int p = 0; p < 4; ++p) {
      for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * p + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int m = 0; m < M; ++m) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(xr[m]->q.data() + g * kGroup + 8 * p);
          const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[0])), ones);
          const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[1])), ones);
          s[m][h] = _mm256_add_epi32(s[m][h], _mm256_add_epi32(a, b));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * kRows + 8 * h)));
      const __m256 mv = mn == nullptr
                            ? _mm256_mul_ps(dv, _mm256_set1_ps(-8.f))
                            : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + g * kRows + 8 * h)));
      for (int m = 0; m < M; ++m) {
        const __m256 ds = _mm256_mul_ps(dv, _mm256_set1_ps(xr[m]->scale[g]));
        f[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m][h]), ds, f[m][h]);
        f[m][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xr[m]->sum[g]), f[m][h]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(acc[m], f[m][0]);
    _mm256_storeu_ps(acc[m] + 8, f[m][1]);
  }
#else
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = qw + g * 256;
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = xr[m]->q.data() + g * kGroup;
      for (int r = 0; r < kRows; ++r) {
        int32_t s = 0;
        for (int p = 0; p < 4; ++p)
          for (int i = 0; i < 4; ++i) {
            const uint8_t b = w[64 * p + 4 * r + i];
            s += (b & 0x0f) * xq[8 * p + i] + (b >> 4) * xq[8 * p + 4 + i];
          }
        const float ds = half_to_float(d[g * kRows + r]) * xr[m]->scale[g];
        acc[m][r] = std::fma(static_cast<float>(s), ds, acc[m][r]);
        const float mi = mn == nullptr ? -8.f * half_to_float(d[g * kRows + r]) : half_to_float(mn[g * kRows + r]);
        acc[m][r] = std::fma(mi, xr[m]->sum[g], acc[m][r]);
      }
    }
  }
#endif
}

// ---- int8: qw [N/16, K/4, 64] (AVX512-VNNI: u8 = w + 128; else s8 = w), scale [N] fp32 -----
// Byte (r, i) of chunk c holds row r's weight for input 4c + i.
template <int M>
void q8_block(const uint8_t* qw, const float* scale, int64_t groups, const QuantRow* const* xr,
              float (*acc)[kRows]) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  // vpdpbusd multiplies unsigned by signed bytes: the weights carry +128, taken back per group
  // as 128 * sum(q) of the activations (exact in int32)
  __m512 f[M];
  for (int m = 0; m < M; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i s[M], t[M];  // two chains (even and odd chunks): latency, not width
    for (int m = 0; m < M; ++m) {
      s[m] = _mm512_set1_epi32(-128 * xr[m]->qsum[g]);
      t[m] = _mm512_setzero_si512();
    }
    const uint8_t* w = qw + g * 8 * 64;
    for (int c = 0; c < 8; c += 2) {
      const __m512i v = _mm512_loadu_si512(w + 64 * c);
      const __m512i u = _mm512_loadu_si512(w + 64 * c + 64);
      for (int m = 0; m < M; ++m) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(xr[m]->q.data() + g * kGroup);
        s[m] = _mm512_dpbusd_epi32(s[m], v, _mm512_set1_epi32(xq[c]));
        t[m] = _mm512_dpbusd_epi32(t[m], u, _mm512_set1_epi32(xq[c + 1]));
      }
    }
    for (int m = 0; m < M; ++m) s[m] = _mm512_add_epi32(s[m], t[m]);
    for (int m = 0; m < M; ++m)
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m]), _mm512_set1_ps(xr[m]->scale[g]), f[m]);
  }
  const __m512 sc = _mm512_loadu_ps(scale);
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(acc[m], _mm512_mul_ps(f[m], sc));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  // vpmaddubsw with |x| unsigned and the weights carrying x's sign: pairs stay below 2^15
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[M][2];
  for (int m = 0; m < M; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i s[M][2];
    for (int m = 0; m < M; ++m) s[m][0] = s[m][1] = _mm256_setzero_si256();
    const uint8_t* w = qw + g * 8 * 64;
    for (int c = 0; c < 8; ++c) {
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * c + 32 * h));
        for (int m = 0; m < M; ++m) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(xr[m]->q.data() + g * kGroup);
          const __m256i x = _mm256_set1_epi32(xq[c]);
          const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(v, x));
          s[m][h] = _mm256_add_epi32(s[m][h], _mm256_madd_epi16(p, ones));
        }
      }
    }
    for (int m = 0; m < M; ++m)
      for (int h = 0; h < 2; ++h)
        f[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[m][h]), _mm256_set1_ps(xr[m]->scale[g]), f[m][h]);
  }
  for (int m = 0; m < M; ++m)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc[m] + 8 * h, _mm256_mul_ps(f[m][h], _mm256_loadu_ps(scale + 8 * h)));
#else
  for (int m = 0; m < M; ++m) {
    float f[kRows] = {0.f};
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* xq = xr[m]->q.data() + g * kGroup;
      const uint8_t* w = qw + g * 8 * 64;
      for (int r = 0; r < kRows; ++r) {
        int32_t s = 0;
        for (int c = 0; c < 8; ++c)
          for (int i = 0; i < 4; ++i) s += static_cast<int8_t>(w[64 * c + 4 * r + i]) * xq[4 * c + i];
        f[r] = std::fma(static_cast<float>(s), xr[m]->scale[g], f[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) acc[m][r] = f[r] * scale[r];
  }
#endif
}

// ---- 6-bit (a GGUF Q6_K tensor): w = d * sc * (code - 32), code 0..63 ---------------------------
// qw [N/16, K/32, 384] u8: bytes 0..255 the codes' low nibbles in the int4 layout, bytes
// 256 + 64 (p / 2) + 4r + i their high two bits (bits 4 (p % 2) + 0..1: input 8p + i, + 2..3: input
// 8p + 4 + i); sc [N/16, K/32, 2, 16] int8 (row r's scale of inputs 0..15 / 16..31 of the group);
// d [N/16, K/256, 16] fp16. d * sc is exact in fp32 (11 x 8 significant bits).
template <int M>
void q6_block(const uint8_t* qw, const int8_t* sc, const uint16_t* d, int64_t groups,
              const QuantRow* const* xr, float (*acc)[kRows]) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i bits45 = _mm512_set1_epi8(0x30);
  __m512 f[M];
  __m512 dv = _mm512_setzero_ps();
  for (int m = 0; m < M; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if (g % 8 == 0) dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + (g / 8) * kRows)));
    __m512i s[M][2], t[M][2];  // [half of the group]: two chains each (latency, not width)
    for (int m = 0; m < M; ++m) s[m][0] = s[m][1] = t[m][0] = t[m][1] = _mm512_setzero_si512();
    const uint8_t* w = qw + g * 384;
    if (KVREUSE_PREFETCH > 0) {
      for (int p = 0; p < 6; ++p) _mm_prefetch(reinterpret_cast<const char*>(w + KVREUSE_PREFETCH + 64 * p), _MM_HINT_T0);
    }
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(w + 64 * p);
      const __m512i h = _mm512_loadu_si512(w + 256 + 64 * (p / 2));
      // the high bits moved to bits 4..5 of each byte (16-bit shifts: the mask drops what crossed)
      const __m512i hl = p % 2 == 0 ? _mm512_slli_epi16(h, 4) : h;
      const __m512i hh = p % 2 == 0 ? _mm512_slli_epi16(h, 2) : _mm512_srli_epi16(h, 2);
      const __m512i lo = _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_and_si512(hl, bits45));
      const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), _mm512_and_si512(hh, bits45));
      for (int m = 0; m < M; ++m) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(xr[m]->q.data() + g * kGroup + 8 * p);
        s[m][p / 2] = _mm512_dpbusd_epi32(s[m][p / 2], lo, _mm512_set1_epi32(xq[0]));
        t[m][p / 2] = _mm512_dpbusd_epi32(t[m][p / 2], hi, _mm512_set1_epi32(xq[1]));
      }
    }
    const __m512 wa = _mm512_mul_ps(
        dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * 32)))));
    const __m512 wb = _mm512_mul_ps(
        dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + g * 32 + 16)))));
    for (int m = 0; m < M; ++m) {
      const __m512 sx = _mm512_set1_ps(xr[m]->scale[g]);
      const __m512i a = _mm512_sub_epi32(_mm512_add_epi32(s[m][0], t[m][0]), _mm512_set1_epi32(32 * xr[m]->qsum16[2 * g]));
      const __m512i b =
          _mm512_sub_epi32(_mm512_add_epi32(s[m][1], t[m][1]), _mm512_set1_epi32(32 * xr[m]->qsum16[2 * g + 1]));
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), _mm512_mul_ps(wa, sx), f[m]);
      f[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b), _mm512_mul_ps(wb, sx), f[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(acc[m], f[m]);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i bits45 = _mm256_set1_epi8(0x30);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[M][2];
  __m256 dv[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int m = 0; m < M; ++m) f[m][0] = f[m][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if (g % 8 == 0)
      for (int h = 0; h < 2; ++h)
        dv[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + (g / 8) * kRows + 8 * h)));
    __m256i s[M][2][2];  // [m][rows 8h..][half of the group]
    for (int m = 0; m < M; ++m) s[m][0][0] = s[m][0][1] = s[m][1][0] = s[m][1][1] = _mm256_setzero_si256();
    const uint8_t* w = qw + g * 384;
    for (int p = 0; p < 4; ++p) {
      for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * p + 32 * h));
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 256 + 64 * (p / 2) + 32 * h));
        const __m256i hl = p % 2 == 0 ? _mm256_slli_epi16(hb, 4) : hb;
        const __m256i hh = p % 2 == 0 ? _mm256_slli_epi16(hb, 2) : _mm256_srli_epi16(hb, 2);
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(hl, bits45));
        const __m256i hi =
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_and_si256(hh, bits45));
        for (int m = 0; m < M; ++m) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(xr[m]->q.data() + g * kGroup + 8 * p);
          // codes <= 63 and |x| <= 127: a pair's sum stays below 2^15 (no saturation)
          const __m256i a = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[0])), ones);
          const __m256i b = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[1])), ones);
          s[m][h][p / 2] = _mm256_add_epi32(s[m][h][p / 2], _mm256_add_epi32(a, b));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 wa = _mm256_mul_ps(
          dv[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + g * 32 + 8 * h)))));
      const __m256 wb = _mm256_mul_ps(dv[h], _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + g * 32 + 16 + 8 * h)))));
      for (int m = 0; m < M; ++m) {
        const __m256 sx = _mm256_set1_ps(xr[m]->scale[g]);
        const __m256i a = _mm256_sub_epi32(s[m][h][0], _mm256_set1_epi32(32 * xr[m]->qsum16[2 * g]));
        const __m256i b = _mm256_sub_epi32(s[m][h][1], _mm256_set1_epi32(32 * xr[m]->qsum16[2 * g + 1]));
        f[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), _mm256_mul_ps(wa, sx), f[m][h]);
        f[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), _mm256_mul_ps(wb, sx), f[m][h]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(acc[m], f[m][0]);
    _mm256_storeu_ps(acc[m] + 8, f[m][1]);
  }
#else
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = qw + g * 384;
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = xr[m]->q.data() + g * kGroup;
      for (int r = 0; r < kRows; ++r) {
        int32_t s[2] = {0, 0};
        for (int p = 0; p < 4; ++p)
          for (int i = 0; i < 4; ++i) {
            const uint8_t b = w[64 * p + 4 * r + i];
            const uint8_t h = w[256 + 64 * (p / 2) + 4 * r + i] >> (4 * (p % 2));
            s[p / 2] += ((b & 0x0f) | ((h & 3) << 4)) * xq[8 * p + i] + ((b >> 4) | (((h >> 2) & 3) << 4)) * xq[8 * p + 4 + i];
          }
        const float dr = half_to_float(d[(g / 8) * kRows + r]);
        for (int k = 0; k < 2; ++k) {
          const float wk = dr * static_cast<float>(sc[g * 32 + 16 * k + r]);
          const int32_t a = s[k] - 32 * xr[m]->qsum16[2 * g + k];
          acc[m][r] = std::fma(static_cast<float>(a), wk * xr[m]->scale[g], acc[m][r]);
        }
      }
    }
  }
#endif
}

// A decoder layer's small ops fused into its projections (a decode step pays ~2 us of dispatch
// an op, ~14 ops a layer): on each x row before it is quantized, on each output row after.
// In bf16 each step rounds to bf16 where the unfused PyTorch ops would.
struct Fused {
  const at::Tensor* norm = nullptr;      // RMSNorm weight [K]: x * rsqrt(mean(x^2) + eps) * w
  double eps = 0;
  bool silu_mul = false;                 // x is [M, 2K]: silu(x[:, :K]) * x[:, K:]
  const at::Tensor* residual = nullptr;  // [M, N] in y's dtype: y + residual
  std::vector<float> norm_w;             // the norm weight as floats (filled once a call)
};

// One x row as the projection takes it: SiLU-and-multiply or RMSNorm applied (each step rounded
// to bf16 in bf16). The sum of squares runs in 16 lanes then in order; exp is simd.h's.
template <typename T>
void prepare_row(const T* x, int64_t k, const Fused& f, bool bf16, std::vector<float>& v) {
  v.resize(f.silu_mul ? 3 * k : k);
  if (f.silu_mul) {
    float* a = v.data() + k;  // v = [exp(-a) | a = x[:, :K] | b = x[:, K:]] as floats
    for (int64_t i = 0; i < 2 * k; ++i) a[i] = static_cast<float>(x[i]);
    for (int64_t i = 0; i < k; ++i) v[i] = -a[i];
    exp_lanes(v.data(), k, 0.f);
    for (int64_t i = 0; i < k; ++i) {
      const float s = round_bf16(a[i] / (1.f + v[i]), bf16);
      v[i] = round_bf16(s * a[k + i], bf16);
    }
  } else {
    for (int64_t i = 0; i < k; ++i) v[i] = static_cast<float>(x[i]);
  }
  if (f.norm != nullptr) {
    float part[16] = {};
    for (int64_t i = 0; i < k; i += 16)
      for (int l = 0; l < 16; ++l) part[l] += v[i + l] * v[i + l];
    float ss = 0.f;
    for (int l = 0; l < 16; ++l) ss += part[l];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(k) + static_cast<float>(f.eps));
    const float* w = f.norm_w.data();
    for (int64_t i = 0; i < k; ++i) v[i] = round_bf16(w[i] * round_bf16(v[i] * r, bf16), bf16);
  }
}

std::vector<QuantRow> quantize(const at::Tensor& x, int64_t k, const Fused& f = Fused{}) {
  const int64_t rows = x.size(0), width = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  std::vector<QuantRow> q(rows);
  at::parallel_for(0, rows, 16, [&](int64_t m0, int64_t m1) {  // a prefill chunk's rows: each alone
    std::vector<float> v;
    for (int64_t m = m0; m < m1; ++m) {
      if (bf16) {
        prepare_row(x.data_ptr<at::BFloat16>() + m * width, k, f, true, v);
      } else {
        prepare_row(x.data_ptr<float>() + m * width, k, f, false, v);
      }
      quantize_row(v.data(), k, q[m]);
    }
  });
  return q;
}

void check_x(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "kvreuse gemv: x must be [M, ", k, "], got ", x.sizes());
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "kvreuse gemv: x must be a contiguous CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "kvreuse gemv: x must be float32 or bfloat16");
  TORCH_CHECK(k % kGroup == 0, "kvreuse gemv: in_features must be a multiple of 32");
}

// Calls fn(block, rows_of_x, M, acc) for every 16-row weight block and every pass of up to 4 rows.
template <typename Fn>
void for_blocks(int64_t nblocks, const std::vector<QuantRow>& q, at::Tensor& y, Fn fn,
                const at::Tensor* residual = nullptr) {
  const int64_t rows = static_cast<int64_t>(q.size());
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    float acc[kMaxM][kRows];
    const QuantRow* xr[kMaxM];
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t m0 = 0; m0 < rows; m0 += kMaxM) {
        const int mm = static_cast<int>(std::min<int64_t>(kMaxM, rows - m0));
        for (int i = 0; i < mm; ++i) xr[i] = &q[m0 + i];
        fn(b, xr, mm, acc);
        for (int i = 0; i < mm; ++i) store_rows(acc[i], y, m0 + i, b * kRows, residual);
      }
    }
  });
}

at::Tensor q4_fused(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& mn,
                    Fused& f) {
  TORCH_CHECK(qw.dim() == 3 && qw.size(2) == 256 && qw.scalar_type() == at::kByte && qw.is_contiguous(),
              "kvreuse q4_linear: qweight must be contiguous uint8 [N/16, K/32, 256]");
  // float16 values, or their bits as int16 (a module's .to(dtype) leaves integer buffers alone)
  const auto half_bits = [](const at::Tensor& t) { return t.scalar_type() == at::kHalf || t.scalar_type() == at::kShort; };
  TORCH_CHECK(half_bits(d) && half_bits(mn) && d.is_contiguous() && mn.is_contiguous() &&
                  d.numel() == qw.size(0) * qw.size(1) * kRows && (mn.numel() == d.numel() || mn.numel() == 0),
              "kvreuse q4_linear: scales and mins must be contiguous float16 (or its int16 bits) [N/16, K/32, 16] "
              "(mins empty: symmetric Q4_0 groups)");
  const int64_t nblocks = qw.size(0), groups = qw.size(1), k = groups * kGroup;
  check_x(x, f.silu_mul ? 2 * k : k);
  auto y = at::empty({x.size(0), nblocks * kRows}, x.options());
  if (f.norm != nullptr)
    TORCH_CHECK(f.norm->numel() == k && f.norm->is_contiguous() &&
                    (f.norm->scalar_type() == at::kFloat || f.norm->scalar_type() == at::kBFloat16),
                "kvreuse q4_linear: norm_weight must be contiguous [", k, "] float32 or bfloat16");
  if (f.residual != nullptr)
    TORCH_CHECK(f.residual->sizes() == y.sizes() && f.residual->scalar_type() == y.scalar_type() &&
                    f.residual->is_contiguous(),
                "kvreuse q4_linear: residual must be contiguous ", y.sizes(), " in x's dtype");
  if (f.norm != nullptr) {  // read in place (a .to(float) was an allocation and ~3 us a call)
    f.norm_w.resize(k);
    if (f.norm->scalar_type() == at::kBFloat16) {
      const auto* w = static_cast<const uint16_t*>(f.norm->const_data_ptr());
      for (int64_t i = 0; i < k; ++i) f.norm_w[i] = kvreuse_kernels::from_bf16(w[i]);
    } else {
      std::memcpy(f.norm_w.data(), f.norm->const_data_ptr(), k * sizeof(float));
    }
  }
  const auto q = quantize(x, k, f);
  const auto* w = qw.data_ptr<uint8_t>();
  const auto* dp = static_cast<const uint16_t*>(d.data_ptr());
  const auto* mp = mn.numel() == 0 ? nullptr : static_cast<const uint16_t*>(mn.data_ptr());
  for_blocks(nblocks, q, y, [&](int64_t b, const QuantRow* const* xr, int mm, float (*acc)[kRows]) {
    const uint8_t* wb = w + b * groups * 256;
    const uint16_t* db = dp + b * groups * kRows;
    const uint16_t* mb = mp == nullptr ? nullptr : mp + b * groups * kRows;
    switch (mm) {
      case 1: q4_block<1>(wb, db, mb, groups, xr, acc); break;
      case 2: q4_block<2>(wb, db, mb, groups, xr, acc); break;
      case 3: q4_block<3>(wb, db, mb, groups, xr, acc); break;
      default: q4_block<4>(wb, db, mb, groups, xr, acc); break;
    }
  }, f.residual);
  return y;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& mn) {
  Fused plain;
  return q4_fused(x, qw, d, mn, plain);
}

at::Tensor q4_linear_fused(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& mn,
                           const std::optional<at::Tensor>& norm_weight, double eps, bool silu_mul,
                           const std::optional<at::Tensor>& residual) {
  Fused f;
  f.norm = norm_weight.has_value() ? &*norm_weight : nullptr;
  f.eps = eps;
  f.silu_mul = silu_mul;
  f.residual = residual.has_value() ? &*residual : nullptr;
  TORCH_CHECK(!(silu_mul && f.norm != nullptr), "kvreuse q4_linear_fused: silu_mul and norm_weight do not combine");
  return q4_fused(x, qw, d, mn, f);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& scale) {
  TORCH_CHECK(qw.dim() == 3 && qw.size(2) == 64 && qw.scalar_type() == at::kByte && qw.is_contiguous(),
              "kvreuse q8_linear: qweight must be contiguous uint8 [N/16, K/4, 64]");
  // float32 values, or their bits as int32 (a module's .to(dtype) leaves integer buffers alone)
  TORCH_CHECK((scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kInt) && scale.is_contiguous() &&
                  scale.numel() == qw.size(0) * kRows,
              "kvreuse q8_linear: scale must be contiguous float32 (or its int32 bits) [N]");
  const int64_t nblocks = qw.size(0), k = qw.size(1) * 4;
  check_x(x, k);
  auto y = at::empty({x.size(0), nblocks * kRows}, x.options());
  const auto q = quantize(x, k);
  const auto* w = qw.data_ptr<uint8_t>();
  const float* sp = static_cast<const float*>(scale.data_ptr());
  const int64_t groups = k / kGroup;
  for_blocks(nblocks, q, y, [&](int64_t b, const QuantRow* const* xr, int mm, float (*acc)[kRows]) {
    const uint8_t* wb = w + b * k * kRows;
    const float* sb = sp + b * kRows;
    switch (mm) {
      case 1: q8_block<1>(wb, sb, groups, xr, acc); break;
      case 2: q8_block<2>(wb, sb, groups, xr, acc); break;
      case 3: q8_block<3>(wb, sb, groups, xr, acc); break;
      default: q8_block<4>(wb, sb, groups, xr, acc); break;
    }
  });
  return y;
}

at::Tensor q6_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& sc, const at::Tensor& d) {
  TORCH_CHECK(qw.dim() == 3 && qw.size(2) == 384 && qw.scalar_type() == at::kByte && qw.is_contiguous(),
              "kvreuse q6_linear: qweight must be contiguous uint8 [N/16, K/32, 384]");
  const int64_t nblocks = qw.size(0), groups = qw.size(1), k = groups * kGroup;
  TORCH_CHECK(groups % 8 == 0, "kvreuse q6_linear: in_features must be a multiple of 256");
  TORCH_CHECK(sc.scalar_type() == at::kChar && sc.is_contiguous() && sc.numel() == nblocks * groups * 32,
              "kvreuse q6_linear: scales must be contiguous int8 [N/16, K/32, 2, 16]");
  TORCH_CHECK((d.scalar_type() == at::kHalf || d.scalar_type() == at::kShort) && d.is_contiguous() &&
                  d.numel() == nblocks * (groups / 8) * kRows,
              "kvreuse q6_linear: d must be contiguous float16 (or its int16 bits) [N/16, K/256, 16]");
  check_x(x, k);
  auto y = at::empty({x.size(0), nblocks * kRows}, x.options());
  const auto q = quantize(x, k);
  const auto* w = qw.data_ptr<uint8_t>();
  const auto* sp = sc.data_ptr<int8_t>();
  const auto* dp = static_cast<const uint16_t*>(d.data_ptr());
  for_blocks(nblocks, q, y, [&](int64_t b, const QuantRow* const* xr, int mm, float (*acc)[kRows]) {
    const uint8_t* wb = w + b * groups * 384;
    const int8_t* sb = sp + b * groups * 32;
    const uint16_t* db = dp + b * (groups / 8) * kRows;
    switch (mm) {
      case 1: q6_block<1>(wb, sb, db, groups, xr, acc); break;
      case 2: q6_block<2>(wb, sb, db, groups, xr, acc); break;
      case 3: q6_block<3>(wb, sb, db, groups, xr, acc); break;
      default: q6_block<4>(wb, sb, db, groups, xr, acc); break;
    }
  });
  return y;
}

// The int4 layout's weight [N, K] = code * scale + min (min = -8 * scale when mins are empty), rounded once to bfloat16 (or float32):
// what a many-row call (a prefill chunk) multiplies densely.
at::Tensor q4_dequantize(const at::Tensor& qw, const at::Tensor& d, const at::Tensor& mn, at::ScalarType dtype) {
  TORCH_CHECK(qw.dim() == 3 && qw.size(2) == 256 && qw.scalar_type() == at::kByte && qw.is_contiguous(),
              "kvreuse q4_dequantize: qweight must be contiguous uint8 [N/16, K/32, 256]");
  TORCH_CHECK(d.numel() == qw.size(0) * qw.size(1) * kRows && (mn.numel() == d.numel() || mn.numel() == 0) &&
                  d.is_contiguous() && mn.is_contiguous() && d.element_size() == 2 && mn.element_size() == 2,
              "kvreuse q4_dequantize: scales and mins must be contiguous float16 bits [N/16, K/32, 16] "
              "(mins empty: symmetric Q4_0 groups)");
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "kvreuse q4_dequantize: dtype must be bf16 or fp32");
  const int64_t nblocks = qw.size(0), groups = qw.size(1), k = groups * kGroup;
  auto out = at::empty({nblocks * kRows, k}, qw.options().dtype(dtype));
  const auto* w = qw.data_ptr<uint8_t>();
  const auto* dp = static_cast<const uint16_t*>(d.data_ptr());
  const auto* mp = mn.numel() == 0 ? nullptr : static_cast<const uint16_t*>(mn.data_ptr());
  const bool bf16 = dtype == at::kBFloat16;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    float row[kGroup];
    for (int64_t b = b0; b < b1; ++b) {
      for (int r = 0; r < kRows; ++r) {
        const int64_t n = b * kRows + r;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* wg = w + (b * groups + g) * 256;
          const float sc = half_to_float(dp[(b * groups + g) * kRows + r]);
          const float mi = mp == nullptr ? -8.f * sc : half_to_float(mp[(b * groups + g) * kRows + r]);
          for (int p = 0; p < 4; ++p)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = wg[64 * p + 4 * r + i];
              row[8 * p + i] = static_cast<float>(byte & 0x0f) * sc + mi;
              row[8 * p + 4 + i] = static_cast<float>(byte >> 4) * sc + mi;
            }
          if (bf16) {
            auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + n * k + g * kGroup;
            for (int i = 0; i < kGroup; ++i) o[i] = to_bf16(row[i]);
          } else {
            std::memcpy(out.data_ptr<float>() + n * k + g * kGroup, row, sizeof(row));
          }
        }
      }
    }
  });
  return out;
}

std::string isa() { return kIsa; }

}  // namespace

namespace kvreuse_kernels {
at::Tensor fused_q4_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& mn,
                           const std::optional<at::Tensor>& norm_weight, double eps, bool silu_mul,
                           const std::optional<at::Tensor>& residual) {
  return q4_linear_fused(x, qw, d, mn, norm_weight, eps, silu_mul, residual);
}
}  // namespace kvreuse_kernels

TORCH_LIBRARY(kvreuse, m) {
  m.def("q4_linear(Tensor x, Tensor qweight, Tensor scale, Tensor min) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor qweight, Tensor scale) -> Tensor");
  m.def("q6_linear(Tensor x, Tensor qweight, Tensor scales, Tensor d) -> Tensor");
  m.impl("q6_linear", c10::DispatchKey::CPU, &q6_linear);
  m.def(
      "q4_linear_fused(Tensor x, Tensor qweight, Tensor scale, Tensor min, Tensor? norm_weight, float eps, "
      "bool silu_mul, Tensor? residual) -> Tensor");
  m.impl("q4_linear_fused", c10::DispatchKey::CPU, &q4_linear_fused);
  m.def("q4_dequantize(Tensor qweight, Tensor scale, Tensor min, ScalarType dtype) -> Tensor");
  m.impl("q4_dequantize", c10::DispatchKey::CPU, &q4_dequantize);
  m.def("isa() -> str", &isa);
  m.impl("q4_linear", c10::DispatchKey::CPU, &q4_linear);
  m.impl("q8_linear", c10::DispatchKey::CPU, &q8_linear);
}
