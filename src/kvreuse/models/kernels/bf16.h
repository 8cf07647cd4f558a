// bfloat16 bit helpers shared by kvreuse's kernels (gemv.cpp, attention.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace kvreuse_kernels {

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's float -> bfloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // NaN: quiet NaN
}

inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float round_bf16(float f, bool bf16) { return bf16 ? from_bf16(to_bf16(f)) : f; }

}  // namespace kvreuse_kernels
