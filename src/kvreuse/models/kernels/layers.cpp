// kvreuse's decoder-layer loop for a Llama step whose projections all run on kvreuse's int4
// kernels: per layer the RMSNorm + q/k/v projection, RoPE, the pool write, attention, o_proj +
// residual, RMSNorm + gate/up, SiLU + down + residual, all in one call for every layer.
//
// Why: a decode step of the default model (30 layers) made ~25 PyTorch calls a layer from
// Python; 4.7 ms of a 10.4 ms step went outside the kernels (AMD EPYC, 2 threads). Here the same
// kernels run in the same order from C++, so a row gets the same bits as through the per-op path
// of llama_forward.py's `_fused_layers` (tests/models/test_kernel_layers.py), and the
// deterministic mode's batch invariance carries over.
//
// Takes bf16 rows, a bf16 pool [layers, 2, kv, slots, d] and plain items: each a sequence's new
// tokens over its keys in attention order, the new ones last, read as one run of consecutive
// slots or through a slot list. Anything else (int8 pools, documents' frames, masked items)
// stays on the Python path.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "bf16.h"
#include "ops.h"

namespace {

using kvreuse_kernels::from_bf16;
using kvreuse_kernels::to_bf16;

constexpr int64_t kPerLayer = 14;  // tensors a layer passes to llama_layers (its comment says which)
constexpr int64_t kMaxDim = 256;
constexpr int64_t kMaxGroupsDecode = 16;  // query heads per KV head decode_attention stacks

// RoPE in place on the first `rotated` heads of every row of x [T, heads, d], bf16 or fp32:
// x * cos + roll(x, d / 2) * sin, `sin` carrying rotate_half's sign (-1 on its first half);
// cos / sin [T, d] in x's dtype. In bf16 the product x * cos rounds to bf16 (a separate op
// would), then the sum of it and the rotated product rounds once.
inline float as_float(float v) { return v; }
inline float as_float(at::BFloat16 v) {
  uint16_t u;
  std::memcpy(&u, &v, 2);
  return from_bf16(u);
}

template <typename T>
void rope_rows(T* x, int64_t rows, int64_t heads, int64_t rotated, int64_t d, const T* cos, const T* sin) {
  constexpr bool bf16 = sizeof(T) == 2;
  const int64_t half = d / 2;
  std::vector<float> src(d);  // any head dim (the per-op path takes every model's)
  for (int64_t t = 0; t < rows; ++t) {
    const T* c = cos + t * d;
    const T* s = sin + t * d;
    for (int64_t h = 0; h < rotated; ++h) {
      T* row = x + (t * heads + h) * d;
      for (int64_t j = 0; j < d; ++j) src[j] = as_float(row[j]);
      for (int64_t j = 0; j < d; ++j) {
        float a = src[j] * as_float(c[j]);
        if (bf16) a = from_bf16(to_bf16(a));
        const float r = a + src[j < half ? j + half : j - half] * as_float(s[j]);
        if constexpr (bf16) {
          const uint16_t b = to_bf16(r);
          std::memcpy(&row[j], &b, 2);
        } else {
          row[j] = r;
        }
      }
    }
  }
}

void check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rotated) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && x.device().is_cpu() &&
                  (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "kvreuse rope_: x must be a contiguous bf16 or fp32 CPU tensor [T, heads, d]");
  const int64_t d = x.size(2);
  TORCH_CHECK(d % 2 == 0 && rotated >= 0 && rotated <= x.size(1),
              "kvreuse rope_: d must be even, rotated_heads within the heads");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->is_contiguous() && t->numel() == x.size(0) * d,
                "kvreuse rope_: cos and sin must be contiguous [T, d] in x's dtype");
}

void rope_any(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rotated) {
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2);
  if (x.scalar_type() == at::kBFloat16)
    rope_rows(x.data_ptr<at::BFloat16>(), rows, heads, rotated, d, cos.data_ptr<at::BFloat16>(),
              sin.data_ptr<at::BFloat16>());
  else
    rope_rows(x.data_ptr<float>(), rows, heads, rotated, d, cos.data_ptr<float>(), sin.data_ptr<float>());
}

at::Tensor rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t rotated) {
  check_rope(x, cos, sin, rotated);
  rope_any(x, cos, sin, rotated);
  return x;
}

// One item of the batch: rows [start, start + n) of the step attend over `length` keys, read
// from slots run_start.. (run_start >= 0) or through `slots` [length].
struct Item {
  int64_t start, n, run_start, length;
  std::optional<at::Tensor> slots;
};

std::vector<Item> check_items(at::IntArrayRef flat, const c10::List<std::optional<at::Tensor>>& slots, int64_t rows,
                              int64_t pool_slots) {
  TORCH_CHECK(flat.size() % 4 == 0 && static_cast<int64_t>(slots.size()) * 4 == static_cast<int64_t>(flat.size()),
              "kvreuse llama_layers: items must be (start, n, run_start, length) per item, one slots entry each");
  std::vector<Item> items;
  for (size_t i = 0; i < slots.size(); ++i) {
    Item it{flat[4 * i], flat[4 * i + 1], flat[4 * i + 2], flat[4 * i + 3], slots.get(i)};
    TORCH_CHECK(it.start >= 0 && it.n > 0 && it.start <= rows && it.n <= rows - it.start && it.length >= it.n,
                "kvreuse llama_layers: item ", i, " rows [", it.start, ", ", it.start + it.n, ") of ", rows,
                " over ", it.length, " keys");
    if (it.slots.has_value()) {  // checked here, not by attention: that runs after layer 0's pool write
      const auto& s = *it.slots;
      TORCH_CHECK(s.dim() == 1 && s.scalar_type() == at::kLong && s.is_contiguous() && s.device().is_cpu(),
                  "kvreuse llama_layers: item ", i, " slots must be a contiguous int64 CPU tensor [L]");
      TORCH_CHECK(s.numel() == it.length, "kvreuse llama_layers: item ", i, " has ", s.numel(), " slots for ",
                  it.length, " keys");
      const int64_t* p = s.data_ptr<int64_t>();
      for (int64_t j = 0; j < it.length; ++j)
        TORCH_CHECK(p[j] >= 0 && p[j] < pool_slots, "kvreuse llama_layers: item ", i, " slot ", p[j],
                    " outside the pool's ", pool_slots, " slots");
    } else {  // written so that no sum overflows
      TORCH_CHECK(it.run_start >= 0 && it.run_start <= pool_slots && it.length <= pool_slots - it.run_start,
                  "kvreuse llama_layers: item ", i, " run outside the pool's ", pool_slots, " slots");
    }
    items.push_back(std::move(it));
  }
  return items;
}

// Store the new tokens' K and V rows (qkv [T, heads + 2 kv, d] after RoPE) into slots[t] of one
// layer's pool sides k / v [kv, slots, d].
void write_kv(const at::Tensor& qkv, int64_t heads, int64_t kv, const int64_t* slots, at::Tensor& k, at::Tensor& v) {
  const int64_t rows = qkv.size(0), d = qkv.size(2), width = qkv.size(1) * d;
  const auto* src = reinterpret_cast<const uint16_t*>(qkv.data_ptr<at::BFloat16>());
  auto* kp = reinterpret_cast<uint16_t*>(k.data_ptr<at::BFloat16>());
  auto* vp = reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>());
  const int64_t hs = k.stride(0), ss = k.stride(1);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < kv; ++h) {
      std::memcpy(kp + h * hs + slots[t] * ss, src + t * width + (heads + h) * d, d * 2);
      std::memcpy(vp + h * hs + slots[t] * ss, src + t * width + (heads + kv + h) * d, d * 2);
    }
}

// x [T, hidden] bf16 through `weights.size() / 14` decoder layers. Per layer, in order:
// q/k/v (qweight, scale, min), o_proj (3), gate/up (3), down (3), input norm weight, post-attention
// norm weight. cos / sin [T, d] (sin with rotate_half's sign); pool [layers, 2, kv, slots, d] bf16;
// write_slots [T] where each row's K / V go. Returns the last layer's [T, hidden]; the pool holds
// every layer's new K / V. Raises (RuntimeError) before any write for bad shapes, dtypes or slots.
at::Tensor llama_layers(const at::Tensor& x_in, at::TensorList weights, double eps, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor pool, const at::Tensor& write_slots, at::IntArrayRef item_flat,
                        const c10::List<std::optional<at::Tensor>>& item_slots, int64_t heads, int64_t kv,
                        double scale) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.is_contiguous() && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "kvreuse llama_layers: x must be contiguous bf16 [T, hidden] on CPU");
  const int64_t rows = x_in.size(0), layers = static_cast<int64_t>(weights.size()) / kPerLayer;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kPerLayer && layers > 0,
              "kvreuse llama_layers: weights must be 14 tensors a layer");
  TORCH_CHECK(pool.dim() == 5 && pool.size(0) >= layers && pool.size(1) == 2 && pool.size(2) == kv && kv > 0 &&
                  pool.scalar_type() == at::kBFloat16 && pool.stride(-1) == 1 && pool.device().is_cpu(),
              "kvreuse llama_layers: pool must be bf16 [layers, 2, kv_heads, slots, d], got ", pool.sizes());
  const int64_t d = pool.size(4), pool_slots = pool.size(3);
  TORCH_CHECK(d % 16 == 0 && d <= kMaxDim, "kvreuse llama_layers: head dim ", d,
              " must be a multiple of 16 up to 256 (the attention kernels' rows)");
  TORCH_CHECK(heads > 0 && heads % kv == 0, "kvreuse llama_layers: heads must be a multiple of kv_heads");
  TORCH_CHECK(write_slots.dim() == 1 && write_slots.numel() == rows && write_slots.scalar_type() == at::kLong &&
                  write_slots.is_contiguous(),
              "kvreuse llama_layers: write_slots must be contiguous int64 [T]");
  const int64_t* ws = write_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(ws[t] >= 0 && ws[t] < pool_slots, "kvreuse llama_layers: write slot ", ws[t], " outside the pool");
  const auto items = check_items(item_flat, item_slots, rows, pool_slots);
  const int64_t width = heads + 2 * kv, groups = heads / kv;
  at::Tensor x = x_in;
  auto o = at::zeros({rows, heads * d}, x.options());  // rows no item covers stay 0
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = &weights[l * kPerLayer];
    auto qkv = kvreuse_kernels::fused_q4_linear(x, w[0], w[1], w[2], w[12], eps, false, std::nullopt);
    TORCH_CHECK(qkv.size(1) == width * d, "kvreuse llama_layers: q/k/v projection gives ", qkv.size(1),
                " columns, heads and kv_heads want ", width * d);
    qkv = qkv.view({rows, width, d});
    if (l == 0) check_rope(qkv, cos, sin, heads + kv);
    rope_any(qkv, cos, sin, heads + kv);
    auto side = pool.select(0, l);
    auto k = side.select(0, 0), v = side.select(0, 1);  // [kv, slots, d]
    write_kv(qkv, heads, kv, ws, k, v);
    for (const Item& it : items) {
      const auto q = qkv.narrow(0, it.start, it.n).narrow(1, 0, heads);  // [n, H, d]
      const auto kk = it.slots.has_value() ? k : k.narrow(1, it.run_start, it.length);
      const auto vv = it.slots.has_value() ? v : v.narrow(1, it.run_start, it.length);
      at::Tensor r;
      if (it.n == 1 && groups <= kMaxGroupsDecode)
        r = std::get<0>(kvreuse_kernels::attention_decode(q.reshape({1, kv, groups, d}), kk.unsqueeze(0),
                                                          vv.unsqueeze(0), scale, it.slots));
      else
        r = kvreuse_kernels::attention_causal(q, kk, vv, scale, it.slots);
      o.narrow(0, it.start, it.n).copy_(r.view({it.n, heads * d}));
    }
    x = kvreuse_kernels::fused_q4_linear(o, w[3], w[4], w[5], std::nullopt, 0.0, false, x);
    const auto gu = kvreuse_kernels::fused_q4_linear(x, w[6], w[7], w[8], w[13], eps, false, std::nullopt);
    x = kvreuse_kernels::fused_q4_linear(gu, w[9], w[10], w[11], std::nullopt, 0.0, true, x);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvreuse, m) {
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int rotated_heads) -> Tensor(a!)");
  m.impl("rope_", c10::DispatchKey::CPU, &rope_);
  m.def(
      "llama_layers(Tensor x, Tensor[] weights, float eps, Tensor cos, Tensor sin, Tensor(a!) pool, "
      "Tensor write_slots, int[] items, Tensor?[] item_slots, int heads, int kv_heads, float scale) -> Tensor");
  m.impl("llama_layers", c10::DispatchKey::CPU, &llama_layers);
}
