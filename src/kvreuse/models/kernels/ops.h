// The kernels one translation unit calls in another (layers.cpp runs gemv.cpp's projections and
// attention.cpp's attention): the same functions the torch ops of those files register.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace kvreuse_kernels {

// kvreuse::q4_linear_fused (gemv.cpp)
at::Tensor fused_q4_linear(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& d, const at::Tensor& mn,
                           const std::optional<at::Tensor>& norm_weight, double eps, bool silu_mul,
                           const std::optional<at::Tensor>& residual);

// kvreuse::decode_attention (attention.cpp)
std::tuple<at::Tensor, at::Tensor> attention_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    double scale, const std::optional<at::Tensor>& slots);

// kvreuse::causal_attention (attention.cpp)
at::Tensor attention_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                            const std::optional<at::Tensor>& slots);

}  // namespace kvreuse_kernels
