// kvreuse's CPU attention kernels: a decode (a few query rows over many keys, the keys split
// across threads) and a causal chunk (many query rows, each over the keys up to its own).
//
// Contract shared by both: a query row's output is a fixed function of that row and the keys it
// sees, whatever else shares the call. The keys are cut into items of 256 aligned at key 0; an
// item's partial (max, sum of exps, sum of exp * value) is computed by `item_partials` with the
// same instructions for a row whatever the other rows are; a row's items are merged in order by
// `merge_row`. So a token gets the same bits as one of 2,048 prompt rows (a prefix-cache miss),
// as the 3-token suffix of a hit and as a decode alone or beside other streams: kvreuse's
// deterministic mode relies on it (docs/deterministic.md).
//
// Scores take 16 keys a vector (keys transposed per group of 16, one key a lane): each score is
// a chain of fused multiply-adds over the head dimension in order, with no horizontal sum.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "ops.h"
#include "simd.h"

namespace {

using kvreuse_kernels::exp_lanes;
using kvreuse_kernels::exp_clamped;
using kvreuse_kernels::from_bf16;
using kvreuse_kernels::kW;
using kvreuse_kernels::round_bf16;
using kvreuse_kernels::to_bf16;
using kvreuse_kernels::Vec;
using kvreuse_kernels::vfma;
using kvreuse_kernels::vload;
using kvreuse_kernels::vset1;
using kvreuse_kernels::vstore;

constexpr int64_t kItem = 256;      // keys an item holds (a decode thread's share of a head)
constexpr int64_t kLanes = 16;      // keys scored together, one a vector lane
constexpr int64_t kRowTile = 4;     // query rows scored together against each key group
constexpr int64_t kMaxRowsDecode = 16;  // query rows per KV head decode_attention takes
constexpr int64_t kMaxDim = 256;
constexpr int64_t kBlockTokens = 32;  // causal_attention: query tokens a work unit takes

template <typename T>
inline void load_row(const T* src, int64_t d, float* dst) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_row<at::BFloat16>(const at::BFloat16* src, int64_t d, float* dst) {
  const auto* u = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < d; ++i) dst[i] = from_bf16(u[i]);
}

// An int8 KV row (engine/kv_quant.py): d int8 values then their bf16 scale; read as the pool's
// dequantize does, one bf16 rounding of q * scale.
struct Int8Row {
  uint8_t byte;
};

template <>
inline void load_row<Int8Row>(const Int8Row* src, int64_t d, float* dst) {
  const auto* b = reinterpret_cast<const uint8_t*>(src);
  uint16_t sbits;
  std::memcpy(&sbits, b + d, 2);
  const float scale = from_bf16(sbits);
  for (int64_t i = 0; i < d; ++i) dst[i] = round_bf16(static_cast<float>(static_cast<int8_t>(b[i])) * scale, true);
}

// One item's keys as the scoring loop reads them: kt [groups][d][16] (key 16 g + l of the item,
// dim i at kt[(g d + i) 16 + l]; lanes past the item's end 0), vf [n][d] values as floats.
// bf16 rows on AVX-512 instead: kb / vb, each key's K and V row read in place (kb padded to whole
// groups of 16 with a zero row), converted in registers to the same floats.
struct ItemKV {
  std::vector<float> kt, vf;
  std::vector<const uint16_t*> kb, vb;  // empty unless the bf16 in-place form
  int64_t n = 0;
};

template <typename KV>
void load_item(const KV* k, const KV* v, int64_t key_stride, const int64_t* slots, int64_t j0, int64_t n, int64_t d,
               ItemKV& it) {
  const int64_t groups = (n + kLanes - 1) / kLanes;
  it.n = n;
  it.kb.clear();  // the float form (a thread's ItemKV may have held the bf16 one last)
  it.vb.clear();
  it.kt.assign(groups * d * kLanes, 0.f);
  it.vf.resize(n * d);
  float row[kMaxDim];
  for (int64_t j = 0; j < n; ++j) {
    const int64_t at_ = (slots == nullptr ? j0 + j : slots[j0 + j]) * key_stride;  // key j0 + j's row
    load_row(k + at_, d, row);
    float* dst = it.kt.data() + (j / kLanes) * d * kLanes + j % kLanes;
    for (int64_t i = 0; i < d; ++i) dst[i * kLanes] = row[i];
    load_row(v + at_, d, it.vf.data() + j * d);
  }
}

#if defined(__AVX512F__)
// 16 x 16 floats transposed in registers: lane j of r[i] moves to lane i of r[j].
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {  // then whole 128-bit lanes
    t[i] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

inline __m512 bf16x16(const uint16_t* p) {  // 16 bf16 -> 16 floats, exact
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// bf16 rows on AVX-512: row pointers only; scoring transposes 16 keys x 16 dims in registers and
// the value products read the rows as they are (the generic form's float copies cost more than
// the arithmetic: a decode reads each key for only a few query rows). The same floats either way.
alignas(64) constexpr uint16_t kZeroRow[kMaxDim] = {};

template <>
void load_item<at::BFloat16>(const at::BFloat16* k, const at::BFloat16* v, int64_t key_stride, const int64_t* slots,
                             int64_t j0, int64_t n, int64_t d, ItemKV& it) {
  (void)d;
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  it.n = n;
  it.kt.clear();
  it.vf.clear();
  it.kb.resize(padded);
  it.vb.resize(n);
  const auto* ku = reinterpret_cast<const uint16_t*>(k);
  const auto* vu = reinterpret_cast<const uint16_t*>(v);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t row = (slots == nullptr ? j0 + j : slots[j0 + j]) * key_stride;
    it.kb[j] = ku + row;
    it.vb[j] = vu + row;
  }
  for (int64_t j = n; j < padded; ++j) it.kb[j] = kZeroRow;
}
#endif

// The largest of e[0..n), NaNs skipped (-inf when every one is NaN); exact in any order, so the
// vector form gives the scalar loop's value (a zero's sign aside, which no later step sees).
inline float row_max(const float* e, int64_t n) {
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) m = _mm512_max_ps(_mm512_loadu_ps(e + j), m);  // NaN: m, the second operand
  if (j < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - j)) - 1);
    m = _mm512_mask_max_ps(m, tail, _mm512_maskz_loadu_ps(tail, e + j), m);
  }
  return _mm512_reduce_max_ps(m);
#else
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, e[j]);
  return m;
#endif
}

// Scores of kRowTile query rows (q: rows of d, already scaled) against G groups of 16 keys (kt:
// the item's transposed groups from the first one taken): score (r, key) is a chain of fmas over
// i in order, whatever G; G = 2 keeps twice the chains in flight (fma latency, not width).
// Rows past `tile` score the padding rows and are not stored.
template <int G>
inline void score_groups(const float* q, const float* kt, int64_t d, int64_t tile, float* out) {
  constexpr int64_t kV = kLanes / kW;
  Vec s[kRowTile][G * kV];
  for (auto& row : s)
    for (auto& x : row) x = vset1(0.f);
  for (int64_t i = 0; i < d; ++i) {
    Vec kx[G * kV];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < kV; ++c) kx[g * kV + c] = vload(kt + g * d * kLanes + i * kLanes + c * kW);
    for (int64_t r = 0; r < kRowTile; ++r) {
      const Vec qi = vset1(q[r * d + i]);
      for (int64_t c = 0; c < G * kV; ++c) s[r][c] = vfma(qi, kx[c], s[r][c]);
    }
  }
  for (int64_t r = 0; r < tile; ++r)
    for (int64_t c = 0; c < G * kV; ++c) vstore(out + r * kItem + c * kW, s[r][c]);
}

// acc rows a[0..R) += scores[r][j] * v[j] for keys 0..fewest-1 in order (one fma a key and
// vector, the same chain a row computes alone); returns fewest.
template <int R, int64_t C>
inline int64_t pv_common(const float (*scores)[kItem], const float* vi, int64_t d, int64_t fewest, Vec (*a)[C]) {
  Vec b[R][C];
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) b[r][c] = a[r][c];
  for (int64_t j = 0; j < fewest; ++j) {
    Vec vx[C];
    for (int64_t c = 0; c < C; ++c) vx[c] = vload(vi + j * d + c * kW);
    for (int r = 0; r < R; ++r) {
      const Vec p = vset1(scores[r][j]);
      for (int64_t c = 0; c < C; ++c) b[r][c] = vfma(p, vx[c], b[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) a[r][c] = b[r][c];
  return fewest;
}

#if defined(__AVX512F__)
// score_groups over bf16 key rows (kb: 16 G row pointers): each 16 x 16 block transposed in
// registers, then the same fma chains over i in order.
template <int G>
inline void score_groups_bf16(const float* q, const uint16_t* const* kb, int64_t d, int64_t tile, float* out) {
  __m512 s[kRowTile][G];
  for (auto& row : s)
    for (auto& x : row) x = _mm512_setzero_ps();
  for (int64_t i0 = 0; i0 < d; i0 += kLanes) {
    __m512 kx[G][kLanes];
    for (int g = 0; g < G; ++g) {
      for (int64_t l = 0; l < kLanes; ++l) kx[g][l] = bf16x16(kb[g * kLanes + l] + i0);
      transpose16(kx[g]);  // kx[g][c]: dim i0 + c of the group's 16 keys
    }
    for (int64_t c = 0; c < kLanes; ++c)
      for (int64_t r = 0; r < kRowTile; ++r) {
        const __m512 qi = _mm512_set1_ps(q[r * d + i0 + c]);
        for (int g = 0; g < G; ++g) s[r][g] = _mm512_fmadd_ps(qi, kx[g][c], s[r][g]);
      }
  }
  for (int64_t r = 0; r < tile; ++r)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(out + r * kItem + g * kLanes, s[r][g]);
}

// pv_common over bf16 value rows (vb[j] + i0: the 4 C vectors of key j's dims i0..).
template <int R, int64_t C>
inline int64_t pv_common_bf16(const float (*scores)[kItem], const uint16_t* const* vb, int64_t i0, int64_t fewest,
                              __m512 (*a)[C]) {
  __m512 b[R][C];
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) b[r][c] = a[r][c];
  for (int64_t j = 0; j < fewest; ++j) {
    __m512 vx[C];
    for (int64_t c = 0; c < C; ++c) vx[c] = bf16x16(vb[j] + i0 + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(scores[r][j]);
      for (int64_t c = 0; c < C; ++c) b[r][c] = _mm512_fmadd_ps(p, vx[c], b[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) a[r][c] = b[r][c];
  return fewest;
}
#endif

// Partials of `rows` query rows over one item: row r (qf + r d, already scaled; qf padded to a
// multiple of kRowTile rows) sees the item's first vis[r] >= 1 keys. Writes mx[r * ps], sm[r * ps]
// and acc[r * pa .. + d]. A row's values depend on that row, vis[r] and the keys only.
void item_partials(const float* qf, const int64_t* vis, int64_t rows, int64_t d, const ItemKV& it, float* mx,
                   float* sm, float* acc, int64_t ps, int64_t pa) {
  alignas(64) float scores[kRowTile][kItem];
  for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
    const int64_t tile = std::min(kRowTile, rows - r0);
    int64_t most = 0;
    for (int64_t r = 0; r < tile; ++r) most = std::max(most, vis[r0 + r]);
    const int64_t groups = (most + kLanes - 1) / kLanes;
    for (int64_t g = 0; g < groups; g += 2) {  // scores: each a chain of fmas over i in order
#if defined(__AVX512F__)
      if (!it.kb.empty()) {
        if (g + 1 < groups)
          score_groups_bf16<2>(qf + r0 * d, it.kb.data() + g * kLanes, d, tile, &scores[0][g * kLanes]);
        else
          score_groups_bf16<1>(qf + r0 * d, it.kb.data() + g * kLanes, d, tile, &scores[0][g * kLanes]);
        continue;
      }
#endif
      if (g + 1 < groups)
        score_groups<2>(qf + r0 * d, it.kt.data() + g * d * kLanes, d, tile, &scores[0][g * kLanes]);
      else
        score_groups<1>(qf + r0 * d, it.kt.data() + g * d * kLanes, d, tile, &scores[0][g * kLanes]);
    }
    int64_t fewest = kItem;
    for (int64_t r = 0; r < tile; ++r) {
      const int64_t n = vis[r0 + r];
      fewest = std::min(fewest, n);
      float* e = scores[r];
      const float m = row_max(e, n);
      const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
      exp_lanes(e, padded, m);
      for (int64_t j = n; j < padded; ++j) e[j] = 0.f;  // exact: x + 0 = x
      float part[kLanes] = {};
      for (int64_t j = 0; j < padded; j += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) part[l] += e[j + l];
      float sum = 0.f;
      for (int64_t l = 0; l < kLanes; ++l) sum += part[l];
      mx[(r0 + r) * ps] = m;
      sm[(r0 + r) * ps] = sum;
    }
    // acc[r][i] = sum over the row's keys j, in order, of e[r][j] * v[j][i] (one fma a key)
    constexpr int64_t kC = 4;  // vectors of a row's accumulator held in registers
    for (int64_t i0 = 0; i0 < d; i0 += kC * kW) {
      const int64_t nc = std::min(kC, (d - i0) / kW);
      Vec a[kRowTile][kC];
      for (auto& row : a)
        for (auto& x : row) x = vset1(0.f);
      const bool bf16_rows = !it.vb.empty();  // the bf16 in-place form (AVX-512 only)
      const float* vi = bf16_rows ? nullptr : it.vf.data() + i0;
      // key jj's dims i0 + c kW .. as floats, from either form
      const auto vrow = [&](int64_t jj, int64_t c) -> Vec {
#if defined(__AVX512F__)
        if (bf16_rows) return bf16x16(it.vb[jj] + i0 + c * kW);
#endif
        return vload(vi + jj * d + c * kW);
      };
      int64_t j = 0;
#if defined(__AVX512F__)
      if (nc == kC && bf16_rows) {
        switch (tile) {
          case 4: j = pv_common_bf16<4, kC>(scores, it.vb.data(), i0, fewest, a); break;
          case 3: j = pv_common_bf16<3, kC>(scores, it.vb.data(), i0, fewest, a); break;
          case 2: j = pv_common_bf16<2, kC>(scores, it.vb.data(), i0, fewest, a); break;
          default: j = pv_common_bf16<1, kC>(scores, it.vb.data(), i0, fewest, a); break;
        }
      }
#endif
      if (nc == kC && !bf16_rows) {  // keys every row of the tile sees: the tile's rows together
        switch (tile) {
          case 4: j = pv_common<4, kC>(scores, vi, d, fewest, a); break;
          case 3: j = pv_common<3, kC>(scores, vi, d, fewest, a); break;
          case 2: j = pv_common<2, kC>(scores, vi, d, fewest, a); break;
          default: j = pv_common<1, kC>(scores, vi, d, fewest, a); break;
        }
      }
      for (int64_t r = 0; r < tile; ++r) {
        if (nc == kC) {  // a full-width row: its accumulators in registers (a[r] indexed by r spills)
          Vec b[kC];
          for (int64_t c = 0; c < kC; ++c) b[c] = a[r][c];
          for (int64_t jj = j; jj < vis[r0 + r]; ++jj) {
            const Vec p = vset1(scores[r][jj]);
            for (int64_t c = 0; c < kC; ++c) b[c] = vfma(p, vrow(jj, c), b[c]);
          }
          for (int64_t c = 0; c < kC; ++c) a[r][c] = b[c];
          continue;
        }
        for (int64_t jj = j; jj < vis[r0 + r]; ++jj) {
          const Vec p = vset1(scores[r][jj]);
          for (int64_t c = 0; c < nc; ++c) a[r][c] = vfma(p, vrow(jj, c), a[r][c]);
        }
      }
      for (int64_t r = 0; r < tile; ++r)
        for (int64_t c = 0; c < nc; ++c) vstore(acc + (r0 + r) * pa + i0 + c * kW, a[r][c]);
    }
  }
}

// One row's items merged in order (item s at mx[s * step], sm[s * step], acc[s * astep]):
// writes the row's output (bf16 bits or float) and returns its log-sum-exp.
float merge_row(const float* mx, const float* sm, const float* acc, int64_t items, int64_t step, int64_t astep,
                int64_t d, bool bf16, void* out) {
  float m = -INFINITY;
  for (int64_t s = 0; s < items; ++s) m = std::max(m, mx[s * step]);
  float total = 0.f, o[kMaxDim] = {};
  for (int64_t s = 0; s < items; ++s) {
    const float w = exp_clamped(mx[s * step] - m);
    total = std::fma(sm[s * step], w, total);
    for (int64_t i = 0; i < d; ++i) o[i] = std::fma(acc[s * astep + i], w, o[i]);
  }
  const float inv = 1.f / total;
  if (bf16) {
    auto* dst = static_cast<uint16_t*>(out);
    for (int64_t i = 0; i < d; ++i) dst[i] = to_bf16(o[i] * inv);
  } else {
    auto* dst = static_cast<float*>(out);
    for (int64_t i = 0; i < d; ++i) dst[i] = o[i] * inv;
  }
  return m + std::log(total);
}

// q rows scaled as every path scales them: float(q) * scale, then kRowTile copies of the last row
// (a tile that starts anywhere reads whole tiles; the padding rows' scores are never used).
template <typename T>
void scaled_rows(const T* q, int64_t rows, int64_t d, float scale, std::vector<float>& qf) {
  const int64_t padded = rows + kRowTile;
  qf.resize(padded * d);
  for (int64_t r = 0; r < padded; ++r) {
    load_row(q + std::min(r, rows - 1) * d, d, qf.data() + r * d);
    for (int64_t i = 0; i < d; ++i) qf[r * d + i] *= scale;
  }
}

// The key tensors' element types a kernel reads: bf16 or fp32 (q's own), or an int8 pool's rows.
enum class Rows { kBF16, kFloat, kInt8 };

Rows check_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t d, const char* op) {
  const bool int8_rows = k.scalar_type() == at::kByte;
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(-1) == (int8_rows ? d + 2 : d) && d <= kMaxDim && d % 16 == 0 &&
                  k.size(-2) > 0,
              "kvreuse ", op, ": shapes ", q.sizes(), " ", k.sizes(), " ", v.sizes());
  TORCH_CHECK(k.stride(-1) == 1 && v.stride(-1) == 1 && k.strides() == v.strides(), "kvreuse ", op,
              ": k and v rows must be contiguous with equal strides");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                  ((int8_rows && q.scalar_type() == at::kBFloat16) ||
                   (q.scalar_type() == k.scalar_type() &&
                    (k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat))),
              "kvreuse ", op, ": q, k, v must share one dtype, bfloat16 or float32 (or bf16 q over int8 rows)");
  return int8_rows ? Rows::kInt8 : k.scalar_type() == at::kBFloat16 ? Rows::kBF16 : Rows::kFloat;
}

// The keys a call reads: rows 0..L-1 of k / v, or with `slots` ([L] int64) rows slots[j] of a
// pool side. Returns (slot pointer or null, L); refuses a slot outside k's rows.
std::pair<const int64_t*, int64_t> key_rows(const at::Tensor& k, const std::optional<at::Tensor>& slots,
                                            const char* op) {
  if (!slots.has_value()) return {nullptr, k.size(-2)};
  const auto& s = *slots;
  TORCH_CHECK(s.dim() == 1 && s.scalar_type() == at::kLong && s.is_contiguous() && s.numel() > 0, "kvreuse ", op,
              ": slots must be a non-empty contiguous int64 [L]");
  const int64_t* p = s.data_ptr<int64_t>();
  const int64_t rows = k.size(-2);
  for (int64_t j = 0; j < s.numel(); ++j)
    TORCH_CHECK(p[j] >= 0 && p[j] < rows, "kvreuse ", op, ": slot ", p[j], " outside the ", rows, " rows of k");
  return {p, s.numel()};
}

// Load keys [j0, j0 + n) of KV head h (k / v laid out [.., kv, rows, row]; key j at row j, or at
// row slots[j]) into `it`.
void load_head_item(const at::Tensor& k, const at::Tensor& v, Rows kind, const int64_t* slots, int64_t h,
                    int64_t j0, int64_t n, int64_t d, ItemKV& it) {
  const int64_t off = h * k.stride(-3), stride = k.stride(-2);
  switch (kind) {
    case Rows::kInt8:
      load_item(reinterpret_cast<const Int8Row*>(k.data_ptr<uint8_t>()) + off,
                reinterpret_cast<const Int8Row*>(v.data_ptr<uint8_t>()) + off, stride, slots, j0, n, d, it);
      break;
    case Rows::kBF16:
      load_item(k.data_ptr<at::BFloat16>() + off, v.data_ptr<at::BFloat16>() + off, stride, slots, j0, n, d, it);
      break;
    case Rows::kFloat:
      load_item(k.data_ptr<float>() + off, v.data_ptr<float>() + off, stride, slots, j0, n, d, it);
      break;
  }
}

template <typename Fn>
void for_q_dtype(const at::Tensor& q, Fn fn) {
  if (q.scalar_type() == at::kBFloat16)
    fn(q.data_ptr<at::BFloat16>());
  else
    fn(q.data_ptr<float>());
}

// q [1, H, R, D], k / v [1, H, L, D] (rows of D contiguous, any other strides; with `slots` [L],
// key j is row slots[j] of k / v [1, H, rows, D]): every key visible to every row. Returns (out
// [1, H, R, D] in q's dtype, lse [1, H, R] float32), as PyTorch's CPU flash kernel. Items of a
// head run on different threads, then merge in order.
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                                    double scale, const std::optional<at::Tensor>& slots) {
  TORCH_CHECK(q_in.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q_in.size(0) == 1 && k.size(0) == 1 &&
                  v.size(0) == 1 && k.size(1) == q_in.size(1) && q_in.size(2) <= kMaxRowsDecode,
              "kvreuse decode_attention: q, k, v must be [1, H, n, D] with n <= 16");
  TORCH_CHECK(q_in.size(1) > 0 && q_in.size(2) > 0, "kvreuse decode_attention: q has no heads or no rows");
  const int64_t heads = q_in.size(1), rows = q_in.size(2), d = q_in.size(3);
  const Rows kind = check_kv(q_in, k, v, d, "decode_attention");
  const auto rows_read = key_rows(k, slots, "decode_attention");
  const int64_t* slot = rows_read.first;
  const int64_t n_keys = rows_read.second;
  const auto q = q_in.contiguous();
  const int64_t splits = (n_keys + kItem - 1) / kItem, items = heads * splits;
  std::vector<float> mx(items * rows), sm(items * rows), acc(items * rows * d);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    thread_local ItemKV it;  // its buffers kept between calls (no allocation, no page faults)
    std::vector<float> qf;
    int64_t vis[kMaxRowsDecode];
    for (int64_t t = i0; t < i1; ++t) {
      const int64_t h = t / splits, j0 = (t % splits) * kItem, n = std::min(kItem, n_keys - j0);
      load_head_item(k, v, kind, slot, h, j0, n, d, it);
      for_q_dtype(q, [&](const auto* qp) { scaled_rows(qp + h * rows * d, rows, d, sc, qf); });
      std::fill(vis, vis + rows, n);
      item_partials(qf.data(), vis, rows, d, it, &mx[t * rows], &sm[t * rows], &acc[t * rows * d], 1, d);
    }
  });
  auto out = at::empty({1, heads, rows, d}, q.options());
  auto lse = at::empty({1, heads, rows}, q.options().dtype(at::kFloat));
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  const int64_t esize = out.element_size();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t first = h * splits * rows + r;  // item s of the row at first + s * rows
      void* dst = static_cast<char*>(out.data_ptr()) + (h * rows + r) * d * esize;
      lse.data_ptr<float>()[h * rows + r] =
          merge_row(&mx[first], &sm[first], &acc[first * d], splits, rows, rows * d, d, bf16, dst);
    }
  return {out, lse};
}

// q [n, H, D] (the chunk's new tokens), k / v [kv, L, D] every key in attention order, the new
// tokens' last (rows of D contiguous, any other strides; or an int8 pool's rows [kv, L, D + 2];
// or, with `slots` [L], a pool side [kv, rows, D] whose row slots[j] is key j).
// Token t (logical key index L - n + t) sees keys 0 .. L - n + t; query head h uses KV head
// h / (H / kv). Returns out [n, H, D] in q's dtype. Work units are (KV head, 32 tokens); each
// computes its rows' item partials in order and merges them (with fewer units than twice the
// threads, the units' items run as separate tasks first).
at::Tensor causal_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, double scale,
                            const std::optional<at::Tensor>& slots) {
  constexpr const char* kShapes =
      "kvreuse causal_attention: q [n, H, D], k / v [kv, L, D] with H a multiple of kv and n <= L";
  TORCH_CHECK(q_in.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.size(0) > 0 && q_in.size(1) > 0 &&
                  q_in.size(1) % k.size(0) == 0,
              kShapes);
  const auto rows_read = key_rows(k, slots, "causal_attention");  // after the dims: it reads k.size(-2)
  const int64_t* slot = rows_read.first;
  const int64_t length = rows_read.second;
  TORCH_CHECK(q_in.size(0) <= length, kShapes);
  const int64_t n = q_in.size(0), heads = q_in.size(1), d = q_in.size(2), kv = k.size(0);
  const int64_t groups = heads / kv, context = length - n;
  const Rows kind = check_kv(q_in, k, v, d, "causal_attention");
  const auto q = q_in.contiguous();
  auto out = at::empty({n, heads, d}, q.options());
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  const int64_t esize = out.element_size(), blocks = (n + kBlockTokens - 1) / kBlockTokens;
  const float sc = static_cast<float>(scale);
  const int64_t units = kv * blocks;
  // Unit u: KV head h, token block b (interleaved from both ends: the later blocks see more keys,
  // so each thread's contiguous share of units mixes long and short ones); rows (token, group)
  // are the query heads h * groups + group of tokens t0 ..
  struct Unit {
    int64_t h, t0, tokens, rows, items;
  };
  const auto unit = [&](int64_t u) {
    const int64_t rank = u / kv, h = u % kv;
    const int64_t b = rank % 2 == 0 ? blocks - 1 - rank / 2 : rank / 2;
    const int64_t t0 = b * kBlockTokens, tokens = std::min(kBlockTokens, n - t0);
    return Unit{h, t0, tokens, tokens * groups, (context + t0 + tokens - 1) / kItem + 1};  // items: its last token's
  };
  const auto queries = [&](const Unit& w, std::vector<float>& qf) {
    for_q_dtype(q, [&](const auto* qp) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
      std::vector<T> gathered(w.rows * d);
      for (int64_t t = 0; t < w.tokens; ++t)
        for (int64_t g = 0; g < groups; ++g)
          std::memcpy(&gathered[(t * groups + g) * d], qp + ((w.t0 + t) * heads + w.h * groups + g) * d, d * sizeof(T));
      scaled_rows(gathered.data(), w.rows, d, sc, qf);
    });
  };
  // the partials of the unit's rows over item s: row r's at [r * items + s] of mx, sm (acc: times d)
  const auto item = [&](const Unit& w, int64_t s, const float* qf, ItemKV& it, std::vector<int64_t>& vis, float* mx,
                        float* sm, float* acc) {
    const int64_t j0 = s * kItem;
    const int64_t first_token = std::max<int64_t>(0, j0 - context);  // the block's first token seeing key j0
    const int64_t r0 = std::max<int64_t>(0, first_token - w.t0) * groups;  // rows before r0 do not see the item
    load_head_item(k, v, kind, slot, w.h, j0, std::min(kItem, length - j0), d, it);
    vis.resize(w.rows);
    for (int64_t r = r0; r < w.rows; ++r) vis[r] = std::min(kItem, context + w.t0 + r / groups + 1 - j0);
    item_partials(qf + r0 * d, vis.data() + r0, w.rows - r0, d, it, &mx[r0 * w.items + s], &sm[r0 * w.items + s],
                  &acc[(r0 * w.items + s) * d], w.items, w.items * d);
  };
  const auto merge = [&](const Unit& w, const float* mx, const float* sm, const float* acc) {
    for (int64_t r = 0; r < w.rows; ++r) {
      const int64_t t = w.t0 + r / groups, head = w.h * groups + r % groups;
      const int64_t seen = (context + t) / kItem + 1;
      void* dst = static_cast<char*>(out.data_ptr()) + (t * heads + head) * d * esize;
      merge_row(&mx[r * w.items], &sm[r * w.items], &acc[r * w.items * d], seen, 1, d, d, bf16, dst);
    }
  };
  if (units >= 2 * at::get_num_threads()) {  // enough units to share: each unit's items in one task
    at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
      thread_local ItemKV it;  // its buffers kept between calls (no allocation, no page faults)
      std::vector<float> qf, mx, sm, acc;
      std::vector<int64_t> vis;
      for (int64_t u = u0; u < u1; ++u) {
        const Unit w = unit(u);
        queries(w, qf);
        mx.assign(w.rows * w.items, 0.f);
        sm.assign(w.rows * w.items, 0.f);
        acc.assign(w.rows * w.items * d, 0.f);
        for (int64_t s = 0; s < w.items; ++s) item(w, s, qf.data(), it, vis, mx.data(), sm.data(), acc.data());
        merge(w, mx.data(), sm.data(), acc.data());
      }
    });
    return out;
  }
  // Few units (a short chunk: 3 KV heads x one block on 2 threads left one idle a third of the
  // time): every (unit, item) is a task, then each unit merges its items. The same partials and
  // merges as above, so the same bits; only the work's split across threads differs.
  std::vector<Unit> work(units);
  std::vector<std::vector<float>> qf(units), mx(units), sm(units), acc(units);
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t u = 0; u < units; ++u) {
    work[u] = unit(u);
    queries(work[u], qf[u]);
    mx[u].assign(work[u].rows * work[u].items, 0.f);
    sm[u].assign(work[u].rows * work[u].items, 0.f);
    acc[u].assign(work[u].rows * work[u].items * d, 0.f);
    for (int64_t s = 0; s < work[u].items; ++s) tasks.emplace_back(u, s);
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t i0, int64_t i1) {
    thread_local ItemKV it;
    std::vector<int64_t> vis;
    for (int64_t i = i0; i < i1; ++i) {
      const auto [u, s] = tasks[i];
      item(work[u], s, qf[u].data(), it, vis, mx[u].data(), sm[u].data(), acc[u].data());
    }
  });
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) merge(work[u], mx[u].data(), sm[u].data(), acc[u].data());
  });
  return out;
}

}  // namespace

namespace kvreuse_kernels {
std::tuple<at::Tensor, at::Tensor> attention_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    double scale, const std::optional<at::Tensor>& slots) {
  return decode_attention(q, k, v, scale, slots);
}

at::Tensor attention_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            const std::optional<at::Tensor>& slots) {
  return causal_attention(q, k, v, scale, slots);
}
}  // namespace kvreuse_kernels

TORCH_LIBRARY_FRAGMENT(kvreuse, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor? slots=None) -> (Tensor, Tensor)");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor? slots=None) -> Tensor");
  m.impl("causal_attention", c10::DispatchKey::CPU, &causal_attention);
}
