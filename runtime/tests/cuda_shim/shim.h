// Just enough of CUDA to compile runtime/kernels/paged_attention.cu and fused.cu with g++ and
// run them on the CPU: a thread block is blockDim.x std::threads sharing one dynamic shared buffer, and
// __syncthreads is a barrier among them. Blocks run one after another. The kernel uses no warp
// shuffles or atomics, so nothing else is needed.
#pragma once
#include <barrier>
#include <cstdint>
#include <cstring>
#include <math.h>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace ferrite_shim {
inline dim3 block_idx, block_dim, grid_dim;
inline thread_local dim3 thread_idx;
inline std::barrier<> *barrier = nullptr;
inline void *shared = nullptr;
}  // namespace ferrite_shim

#define threadIdx ferrite_shim::thread_idx
#define blockIdx ferrite_shim::block_idx
#define blockDim ferrite_shim::block_dim
#define gridDim ferrite_shim::grid_dim
#define __global__
#define __device__
#define __forceinline__ inline
#define FERRITE_DYNAMIC_SHARED(T, name) T *name = static_cast<T *>(ferrite_shim::shared)

inline void __syncthreads() { ferrite_shim::barrier->arrive_and_wait(); }

// The cache element types, as their bits; widened exactly, as the GPU does.
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
inline float ferrite_to_f32(__half x) {
  _Float16 h;
  std::memcpy(&h, &x.bits, 2);
  return static_cast<float>(h);
}
inline float ferrite_to_f32(__nv_bfloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Stores to the cache types, rounding to nearest even as __float2half_rn and
// __float2bfloat16_rn do.
inline void ferrite_store(float x, __half *p) {
  _Float16 h = static_cast<_Float16>(x);
  std::memcpy(&p->bits, &h, 2);
}
inline void ferrite_store(float x, __nv_bfloat16 *p) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p->bits = static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    p->bits = static_cast<uint16_t>(u >> 16);
  }
}
