// Paged attention for ferrite-server's CUDA build: every query token of a mixed batch (prefill
// chunks and decodes together) attends to its own sequence's keys and values, read from the
// layer's slot pools through that sequence's block table. Nothing is gathered: each key and
// value element is read from the pool where it lies, once per thread block.
//
// One thread block per (query token, kv head). The block keeps the `group` query heads that
// share the kv head, so each key and value is loaded once for all of them (GQA). Keys are taken
// in chunks of blockDim.x positions from the token's first visible position: one thread scores
// one key for every head of the group, the block reduces each head's chunk max and sum, and an
// online softmax (running max m and sum l per head) folds the chunk into the output rows. The
// chunking depends only on the token's own position, so the result is the same whatever else
// is in the batch (batch invariance), and it is deterministic run to run (no atomics).
//
// The indexing (token -> sequence and position, position -> block table entry -> slot) is the
// same as the fused CPU kernel's (`AttnMeta::slot`); the flattened tables come from
// `runtime/src/model/attention_kernel.rs`. The same source is compiled for the CPU in
// `runtime/tests/cuda_kernel_on_cpu.rs` (with `tests/cuda_shim/`) and checked against the CPU
// kernel there, which is how its indexing is tested on machines without a GPU.
//
// Reductions use shared memory and __syncthreads only (no warp shuffles), so the CPU shim needs
// nothing but a barrier. Every thread reaches every __syncthreads: loops have block-uniform
// bounds.

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#define FERRITE_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
__device__ __forceinline__ float ferrite_to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float ferrite_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
#endif
// Elsewhere (the CPU shim) the includer defines FERRITE_DYNAMIC_SHARED, __half,
// __nv_bfloat16, their ferrite_to_f32, and the CUDA qualifiers and built-ins.

__device__ __forceinline__ float ferrite_to_f32(float x) { return x; }

template <typename C>
__device__ void ferrite_paged_attention(
    float *__restrict__ out,             // [tokens, num_heads * head_dim]
    const float *__restrict__ q,         // [tokens, num_heads * head_dim]
    const C *__restrict__ k_cache,       // [slots, num_kv_heads * head_dim]
    const C *__restrict__ v_cache,       // [slots, num_kv_heads * head_dim]
    const uint32_t *__restrict__ token_seq,   // [tokens]: the token's sequence
    const uint32_t *__restrict__ token_pos,   // [tokens]: its position in that sequence
    const uint32_t *__restrict__ table_start, // [seqs]: where its block table starts in `tables`
    const uint32_t *__restrict__ tables,      // every sequence's block table, back to back
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
    int window /* 0: none; else a token sees its last `window` positions */,
    float softcap /* 0: none; else scores become softcap * tanh(score / softcap) */) {
  const int token = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int tid = threadIdx.x;
  const int chunk = blockDim.x;
  const int group = num_heads / num_kv_heads;
  const int kv_dim = num_kv_heads * head_dim;
  const int rows = group * head_dim;

  const int pos = (int)token_pos[token];
  const int first = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
  const uint32_t *table = tables + table_start[token_seq[token]];

  // Shared: q rows, output rows, scores and reduction scratch per head and key, one slot per
  // key of the chunk, and per head the running max, sum and this chunk's rescale factor.
  FERRITE_DYNAMIC_SHARED(float, smem);
  float *q_s = smem;                      // [group * head_dim]
  float *acc = q_s + rows;                // [group * head_dim]
  float *p_s = acc + rows;                // [group * chunk]
  float *red = p_s + group * chunk;       // [group * chunk]
  float *m_s = red + group * chunk;       // [group]
  float *l_s = m_s + group;               // [group]
  float *f_s = l_s + group;               // [group]
  int *slot_s = (int *)(f_s + group);     // [chunk]

  const float *q_row = q + (size_t)token * num_heads * head_dim + (size_t)kv_head * rows;
  for (int i = tid; i < rows; i += chunk) {
    q_s[i] = q_row[i];
    acc[i] = 0.0f;
  }
  for (int h = tid; h < group; h += chunk) {
    m_s[h] = -INFINITY;
    l_s[h] = 0.0f;
  }
  __syncthreads();

  for (int c0 = first; c0 <= pos; c0 += chunk) {
    // Score: this thread's key against every head of the group.
    const int j = c0 + tid;
    const bool valid = j <= pos;
    int slot = 0;
    if (valid) {
      slot = (int)table[j / block_size] * block_size + j % block_size;
      const C *k = k_cache + (size_t)slot * kv_dim + (size_t)kv_head * head_dim;
      for (int h = 0; h < group; ++h) {
        const float *qh = q_s + h * head_dim;
        float s = 0.0f;
        for (int d = 0; d < head_dim; ++d) s += qh[d] * ferrite_to_f32(k[d]);
        float x = s * scale;
        if (softcap > 0.0f) x = softcap * tanhf(x / softcap);
        p_s[h * chunk + tid] = x;
        red[h * chunk + tid] = x;
      }
    } else {
      for (int h = 0; h < group; ++h) {
        p_s[h * chunk + tid] = -INFINITY;
        red[h * chunk + tid] = -INFINITY;
      }
    }
    slot_s[tid] = slot;
    __syncthreads();

    // Each head's max over the chunk (tree; chunk is a power of two).
    for (int stride = chunk / 2; stride > 0; stride /= 2) {
      if (tid < stride)
        for (int h = 0; h < group; ++h)
          red[h * chunk + tid] = fmaxf(red[h * chunk + tid], red[h * chunk + tid + stride]);
      __syncthreads();
    }
    for (int h = tid; h < group; h += chunk) {
      // The first chunk always holds the token's own position, so the max is finite.
      const float m_new = fmaxf(m_s[h], red[h * chunk]);
      f_s[h] = expf(m_s[h] - m_new);  // exp(-inf) = 0 on the first chunk
      m_s[h] = m_new;
    }
    __syncthreads();

    // Probabilities against the running max, and their sum per head.
    for (int h = 0; h < group; ++h) {
      const float p = valid ? expf(p_s[h * chunk + tid] - m_s[h]) : 0.0f;
      p_s[h * chunk + tid] = p;
      red[h * chunk + tid] = p;
    }
    __syncthreads();
    for (int stride = chunk / 2; stride > 0; stride /= 2) {
      if (tid < stride)
        for (int h = 0; h < group; ++h) red[h * chunk + tid] += red[h * chunk + tid + stride];
      __syncthreads();
    }
    for (int h = tid; h < group; h += chunk) l_s[h] = l_s[h] * f_s[h] + red[h * chunk];

    // Fold the chunk's values into the output rows: consecutive threads read consecutive
    // elements of each value row.
    const int n = pos - c0 + 1 < chunk ? pos - c0 + 1 : chunk;
    for (int i = tid; i < rows; i += chunk) {
      const int h = i / head_dim;
      const int d = i - h * head_dim;
      float a = acc[i] * f_s[h];
      const float *p = p_s + h * chunk;
      const C *v = v_cache + (size_t)kv_head * head_dim + d;
      for (int jj = 0; jj < n; ++jj) a += p[jj] * ferrite_to_f32(v[(size_t)slot_s[jj] * kv_dim]);
      acc[i] = a;
    }
    __syncthreads();
  }

  float *o = out + (size_t)token * num_heads * head_dim + (size_t)kv_head * rows;
  for (int i = tid; i < rows; i += chunk) o[i] = acc[i] / l_s[i / head_dim];
}

#define FERRITE_PAGED_ATTENTION(NAME, C)                                                      \
  extern "C" __global__ void NAME(float *out, const float *q, const C *k_cache,               \
                                  const C *v_cache, const uint32_t *token_seq,                \
                                  const uint32_t *token_pos, const uint32_t *table_start,     \
                                  const uint32_t *tables, int num_heads, int num_kv_heads,    \
                                  int head_dim, int block_size, float scale, int window,      \
                                  float softcap) {                                            \
    ferrite_paged_attention<C>(out, q, k_cache, v_cache, token_seq, token_pos, table_start,   \
                               tables, num_heads, num_kv_heads, head_dim, block_size, scale,  \
                               window, softcap);                                               \
  }

FERRITE_PAGED_ATTENTION(paged_attention_f32, float)
FERRITE_PAGED_ATTENTION(paged_attention_f16, __half)
FERRITE_PAGED_ATTENTION(paged_attention_bf16, __nv_bfloat16)
