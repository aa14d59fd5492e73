// Small fused kernels for ferrite-server's CUDA build, each replacing a chain of candle ops:
//
// - rope_cache_write: rotates each token's query and key heads of the fused q/k/v projection
//   by its position (RoPE, either pairing), writes the queries out and the keys and values
//   into the layer's slot pools, converted to the cache type: one launch for what took two
//   copies, a rotation, two casts and two scatters. candle's scatter runs one thread per
//   column and loops over the tokens one after another, so a 4,096-token prefill step spent
//   about a second in it.
// - swiglu: silu(gate) * up over a fused gate/up projection, one launch instead of three.
//
// Both read their operands where they lie (row strides are arguments), so the strided views
// the forward makes need no copies. The same source is compiled for the CPU with
// runtime/tests/cuda_shim/ and checked against candle's CPU ops in
// runtime/tests/it/cuda_kernel_on_cpu.rs. No shared memory, no synchronisation: each thread
// writes its own elements.

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
__device__ __forceinline__ void ferrite_store(float x, __half *p) { *p = __float2half_rn(x); }
__device__ __forceinline__ void ferrite_store(float x, __nv_bfloat16 *p) {
  *p = __float2bfloat16_rn(x);
}
#endif
// Elsewhere (the CPU shim) the includer defines __half, __nv_bfloat16, their ferrite_store, and
// the CUDA qualifiers and built-ins.

__device__ __forceinline__ void ferrite_store(float x, float *p) { *p = x; }

// One block per token. Row t of `qkv` (at qkv + t * stride) holds the token's query heads, key
// heads and value heads, head_dim each; cos and sin are the [positions, head_dim / 2] tables.
// Pairs rotate as candle's rope kernels pair them: (2i, 2i + 1) when `interleaved`, else
// (i, i + head_dim / 2), with the same expressions, so the result is the unfused ops'.
template <typename C>
__device__ void ferrite_rope_cache_write(
    float *__restrict__ q_out,
    C *__restrict__ k_cache,
    C *__restrict__ v_cache,
    const float *__restrict__ qkv,
    const float *__restrict__ cos,
    const float *__restrict__ sin,
    const uint32_t *__restrict__ positions,
    const uint32_t *__restrict__ slots,
    uint32_t num_heads,
    uint32_t num_kv_heads,
    uint32_t head_dim,
    uint32_t stride,
    uint32_t interleaved) {
  const uint32_t t = blockIdx.x;
  const uint32_t half = head_dim / 2;
  const uint32_t q_dim = num_heads * head_dim, kv_dim = num_kv_heads * head_dim;
  const float *row = qkv + (size_t)t * stride;
  const float *c = cos + (size_t)positions[t] * half;
  const float *s = sin + (size_t)positions[t] * half;
  const size_t slot = (size_t)slots[t] * kv_dim;
  const uint32_t pairs = (num_heads + num_kv_heads) * half;
  for (uint32_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    const uint32_t head = p / half, i = p % half;
    const uint32_t i1 = head * head_dim + (interleaved ? 2 * i : i);
    const uint32_t i2 = i1 + (interleaved ? 1 : half);
    const float x1 = row[i1], x2 = row[i2];
    const float y1 = x1 * c[i] - x2 * s[i];
    const float y2 = x1 * s[i] + x2 * c[i];
    if (head < num_heads) {
      q_out[(size_t)t * q_dim + i1] = y1;
      q_out[(size_t)t * q_dim + i2] = y2;
    } else {
      ferrite_store(y1, k_cache + slot + (i1 - q_dim));
      ferrite_store(y2, k_cache + slot + (i2 - q_dim));
    }
  }
  for (uint32_t j = threadIdx.x; j < kv_dim; j += blockDim.x) {
    ferrite_store(row[q_dim + kv_dim + j], v_cache + slot + j);
  }
}

#define FERRITE_ROPE_CACHE_WRITE(NAME, C)                                                      \
  extern "C" __global__ void NAME(float *q_out, C *k_cache, C *v_cache, const float *qkv,      \
                                  const float *cos, const float *sin, const uint32_t *positions, \
                                  const uint32_t *slots, uint32_t num_heads,                   \
                                  uint32_t num_kv_heads, uint32_t head_dim, uint32_t stride,   \
                                  uint32_t interleaved) {                                      \
    ferrite_rope_cache_write<C>(q_out, k_cache, v_cache, qkv, cos, sin, positions, slots,      \
                                num_heads, num_kv_heads, head_dim, stride, interleaved);       \
  }
FERRITE_ROPE_CACHE_WRITE(rope_cache_write_f32, float)
FERRITE_ROPE_CACHE_WRITE(rope_cache_write_f16, __half)
FERRITE_ROPE_CACHE_WRITE(rope_cache_write_bf16, __nv_bfloat16)

// out[t, j] = silu(gate_up[t, j]) * gate_up[t, ffn + j], rows of gate_up `stride` apart. A grid
// of threads strides over the tokens x ffn outputs. silu is written as candle's CUDA silu is
// (x / (1 + exp(-x))), so the result is the one the unfused ops give.
extern "C" __global__ void swiglu_f32(
    float *__restrict__ out,
    const float *__restrict__ gate_up,
    uint32_t tokens,
    uint32_t ffn,
    uint32_t stride) {
  const size_t n = (size_t)tokens * ffn;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)blockDim.x * gridDim.x) {
    const size_t t = i / ffn, j = i % ffn;
    const float g = gate_up[t * stride + j];
    const float u = gate_up[t * stride + ffn + j];
    out[i] = g / (1.0f + expf(-g)) * u;
  }
}
