// Device helpers shared by the paged-KV kernels: element conversions, 16-byte
// vector loads, warp reductions.
//
// Device-side and header-only. kernels/cuda/launch.py pastes this file into each .cu
// before handing it to NVRTC (cupy.RawModule), and tests/kernels/test_cuda_compile.py
// compiles the same pasted text with `nvcc -cubin`. No host headers beyond
// cuda_fp16.h / cuda_bf16.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace hr {

using i64 = long long;

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Elements of T in one 16-byte load: the unit every cache read is made of.
template <typename T>
struct Vec16 {
  static constexpr int kSize = 16 / static_cast<int>(sizeof(T));
};

// Two packed 16-bit values of one 32-bit word, widened to fp32. The low half
// is the element at the lower address (little-endian).
__device__ __forceinline__ void unpack2(unsigned w, __half, float* out) {
  out[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
  out[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
}
__device__ __forceinline__ void unpack2(unsigned w, __nv_bfloat16, float* out) {
  // bf16 is the top half of an fp32: widening is a shift, exact.
  out[0] = __uint_as_float(w << 16);
  out[1] = __uint_as_float(w & 0xffff0000u);
}

// Loads 16 bytes at p (16-byte aligned) as Vec16<T>::kSize floats.
template <typename T>
__device__ __forceinline__ void load16(const T* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  unpack2(raw.x, T(), out + 0);
  unpack2(raw.y, T(), out + 2);
  unpack2(raw.z, T(), out + 4);
  unpack2(raw.w, T(), out + 6);
}
template <>
__device__ __forceinline__ void load16<float>(const float* p, float* out) {
  const float4 raw = *reinterpret_cast<const float4*>(p);
  out[0] = raw.x;
  out[1] = raw.y;
  out[2] = raw.z;
  out[3] = raw.w;
}

// Like load16, but zeros instead of reading when `valid` is false: slots past
// context_len may hold garbage (NaN), and 0 * NaN would still be NaN.
template <typename T>
__device__ __forceinline__ void load16_or_zero(const T* p, bool valid, float* out) {
  if (valid) {
    load16(p, out);
  } else {
#pragma unroll
    for (int i = 0; i < Vec16<T>::kSize; ++i) out[i] = 0.0f;
  }
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, mask));
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) v += __shfl_xor_sync(kFullMask, v, mask);
  return v;
}

}  // namespace hr
