// Paged attention for ferrite-server's CUDA build: every query token of a mixed batch (prefill
// chunks and decodes together) attends to its own sequence's keys and values, read from the
// layer's slot pools through that sequence's block table. Nothing is gathered: each key and
// value element is read from the pool where it lies.
//
// Work is split so that a small decode batch still fills the GPU (flash-decoding, as vLLM's
// paged attention v2): a token's visible keys are cut into chunks of blockDim.x keys, and the
// chunks into at most `max_parts` parts of whole chunks. One thread block takes one (query
// token, query head) and every gridDim.z-th part of it. Within a part the block folds chunk by
// chunk: one thread scores one key, the block reduces the chunk's max and sum, the keys'
// values are summed by `groups` sets of threads (each a contiguous run of the chunk's keys,
// one thread per head dimension) and the chunk is folded into the part's state (max m, sum l,
// output row) by an online softmax. A token with one part writes its output row directly;
// otherwise each part writes its state to `partial` and paged_attention_combine folds the parts
// in order.
//
// Chunks and parts depend only on the token's own position (and the window), never on the
// batch, the grid or the launch's token range, so a token's output is bitwise the same whatever
// else is in the batch (batch invariance), and it is deterministic run to run (no atomics).
//
// The indexing (token -> sequence and position, position -> block table entry -> slot) is the
// same as the fused CPU kernel's (`AttnMeta::slot`); the flattened tables and the launch come
// from `runtime/src/model/attention_kernel.rs`. The same source is compiled for the CPU in
// `runtime/tests/it/cuda_kernel_on_cpu.rs` (with `tests/cuda_shim/`) and checked against the
// CPU kernel there, which is how its indexing is tested on machines without a GPU.
//
// Reductions use shared memory and __syncthreads only (no warp shuffles), so the CPU shim needs
// nothing but a barrier. Every thread reaches every __syncthreads: loops around them have
// block-uniform bounds.

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#define FERRITE_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#define FERRITE_UNROLL8 _Pragma("unroll 8")
__device__ __forceinline__ float ferrite_to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float ferrite_to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
#else
// The CPU shim: the includer defines FERRITE_DYNAMIC_SHARED, __half, __nv_bfloat16, their
// ferrite_to_f32, and the CUDA qualifiers and built-ins.
#define FERRITE_UNROLL8
#endif

__device__ __forceinline__ float ferrite_to_f32(float x) { return x; }

// A token's keys and how they are cut: [first, end) visible, parts of `part_keys` keys.
struct FerriteParts {
  int first;
  int end;
  int part_keys;
  int parts;
};

// Mirrored by attention_kernel::parts on the host.
__device__ __forceinline__ FerriteParts ferrite_parts(int pos, int window, int chunk,
                                                      int max_parts) {
  FerriteParts s;
  s.first = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
  s.end = pos + 1;
  const int chunks = (s.end - s.first + chunk - 1) / chunk;
  const int per_part = (chunks + max_parts - 1) / max_parts;
  s.part_keys = per_part * chunk;
  s.parts = (chunks + per_part - 1) / per_part;
  return s;
}

template <typename C>
__device__ void ferrite_paged_attention(
    float *__restrict__ out,             // [tokens, num_heads * head_dim]
    float *__restrict__ partial,         // [launch tokens, num_heads, max_parts, 2 + head_dim]
    const float *__restrict__ q,         // [tokens, num_heads * head_dim]
    const C *__restrict__ k_cache,       // [slots, num_kv_heads * head_dim]
    const C *__restrict__ v_cache,       // [slots, num_kv_heads * head_dim]
    const uint32_t *__restrict__ token_seq,   // [tokens]: the token's sequence
    const uint32_t *__restrict__ token_pos,   // [tokens]: its position in that sequence
    const uint32_t *__restrict__ table_start, // [seqs]: where its block table starts in `tables`
    const uint32_t *__restrict__ tables,      // every sequence's block table, back to back
    int token0 /* the launch's first token */, int num_heads, int num_kv_heads, int head_dim,
    int block_size, float scale,
    int window /* 0: none; else a token sees its last `window` positions */,
    float softcap /* 0: none; else scores become softcap * tanh(score / softcap) */,
    int max_parts) {
  const int local = blockIdx.x;
  const int token = token0 + local;
  const int head = blockIdx.y;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int tid = threadIdx.x;
  const int chunk = blockDim.x;
  const int kv_dim = num_kv_heads * head_dim;
  // Sets of threads that sum a chunk's values, each over its own run of keys.
  const int groups = head_dim < chunk ? chunk / head_dim : 1;
  const FerriteParts P = ferrite_parts((int)token_pos[token], window, chunk, max_parts);
  const uint32_t *table = tables + table_start[token_seq[token]];

  // Shared: the q row and the part's output row; per key of the chunk its probability and
  // slot; reduction scratch (a key each, or a value group's sums); the part's max and sum.
  FERRITE_DYNAMIC_SHARED(float, smem);
  float *q_s = smem;                                       // [head_dim]
  float *acc = q_s + head_dim;                             // [head_dim]
  float *p_s = acc + head_dim;                             // [chunk]
  float *red = p_s + chunk;                                // [max(chunk, head_dim)]
  float *st = red + (chunk > head_dim ? chunk : head_dim); // [2]: m, l
  int *slot_s = (int *)(st + 2);                           // [chunk]

  const float *q_row = q + ((size_t)token * num_heads + head) * head_dim;
  for (int i = tid; i < head_dim; i += chunk) q_s[i] = q_row[i];

  for (int part = blockIdx.z; part < P.parts; part += gridDim.z) {
    const int begin = P.first + part * P.part_keys;
    const int end = begin + P.part_keys < P.end ? begin + P.part_keys : P.end;
    for (int i = tid; i < head_dim; i += chunk) acc[i] = 0.0f;
    if (tid == 0) {
      st[0] = -INFINITY;
      st[1] = 0.0f;
    }
    __syncthreads();

    for (int c0 = begin; c0 < end; c0 += chunk) {
      // Score: this thread's key.
      const int j = c0 + tid;
      const bool valid = j < end;
      float s = -INFINITY;
      int slot = 0;
      if (valid) {
        slot = (int)table[j / block_size] * block_size + j % block_size;
        const C *k = k_cache + (size_t)slot * kv_dim + (size_t)kv_head * head_dim;
        float dot = 0.0f;
        FERRITE_UNROLL8
        for (int d = 0; d < head_dim; ++d) dot += q_s[d] * ferrite_to_f32(k[d]);
        s = dot * scale;
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
      }
      slot_s[tid] = slot;
      red[tid] = s;
      __syncthreads();

      // The chunk's max (tree; chunk is a power of two). It holds at least one key, so the
      // max is finite.
      for (int stride = chunk / 2; stride > 0; stride /= 2) {
        if (tid < stride) red[tid] = fmaxf(red[tid], red[tid + stride]);
        __syncthreads();
      }
      const float m_c = red[0];
      __syncthreads();

      // Probabilities against the chunk's max, and their sum.
      const float p = valid ? expf(s - m_c) : 0.0f;
      p_s[tid] = p;
      red[tid] = p;
      __syncthreads();
      for (int stride = chunk / 2; stride > 0; stride /= 2) {
        if (tid < stride) red[tid] += red[tid + stride];
        __syncthreads();
      }
      const float l_c = red[0];
      __syncthreads();

      // The chunk's values weighted by their probabilities: group g sums its run of keys for
      // each dimension; consecutive threads read consecutive elements of a value row.
      const int n = end - c0 < chunk ? end - c0 : chunk;
      const int run = (n + groups - 1) / groups;
      for (int t = tid; t < groups * head_dim; t += chunk) {
        const int g = t / head_dim;
        const int d = t - g * head_dim;
        const int j0 = g * run;
        const int j1 = j0 + run < n ? j0 + run : n;
        const C *v = v_cache + (size_t)kv_head * head_dim + d;
        float a = 0.0f;
        FERRITE_UNROLL8
        for (int jj = j0; jj < j1; ++jj) a += p_s[jj] * ferrite_to_f32(v[(size_t)slot_s[jj] * kv_dim]);
        red[t] = a;
      }
      __syncthreads();

      // Fold the chunk into the part (online softmax; exp(-inf) = 0 on the first chunk).
      const float m_old = st[0];
      const float m_new = fmaxf(m_old, m_c);
      const float f_old = expf(m_old - m_new);
      const float f_c = expf(m_c - m_new);
      for (int d = tid; d < head_dim; d += chunk) {
        float a = red[d];
        for (int g = 1; g < groups; ++g) a += red[g * head_dim + d];
        acc[d] = acc[d] * f_old + a * f_c;
      }
      __syncthreads();
      if (tid == 0) {
        st[1] = st[1] * f_old + l_c * f_c;
        st[0] = m_new;
      }
      __syncthreads();
    }

    if (P.parts == 1) {
      float *o = out + ((size_t)token * num_heads + head) * head_dim;
      for (int d = tid; d < head_dim; d += chunk) o[d] = acc[d] / st[1];
    } else {
      float *w = partial + (((size_t)local * num_heads + head) * max_parts + part) * (2 + head_dim);
      if (tid == 0) {
        w[0] = st[0];
        w[1] = st[1];
      }
      for (int d = tid; d < head_dim; d += chunk) w[2 + d] = acc[d];
    }
    __syncthreads();
  }
}

// Folds the parts of each (token, head) with several, in part order, into its output row.
// `chunk` is the attention launch's blockDim.x.
__device__ void ferrite_paged_attention_combine(
    float *__restrict__ out, const float *__restrict__ partial,
    const uint32_t *__restrict__ token_pos, int token0, int num_heads, int head_dim, int window,
    int chunk, int max_parts) {
  const int local = blockIdx.x;
  const int token = token0 + local;
  const int head = blockIdx.y;
  const FerriteParts P = ferrite_parts((int)token_pos[token], window, chunk, max_parts);
  if (P.parts == 1) return;  // written by the attention launch
  const float *w = partial + ((size_t)local * num_heads + head) * max_parts * (2 + head_dim);
  float *o = out + ((size_t)token * num_heads + head) * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float m = -INFINITY, l = 0.0f, a = 0.0f;
    for (int part = 0; part < P.parts; ++part) {
      const float *wp = w + (size_t)part * (2 + head_dim);
      const float m_new = fmaxf(m, wp[0]);
      const float f_old = expf(m - m_new);
      const float f_p = expf(wp[0] - m_new);
      l = l * f_old + wp[1] * f_p;
      a = a * f_old + wp[2 + d] * f_p;
      m = m_new;
    }
    o[d] = a / l;
  }
}

#define FERRITE_PAGED_ATTENTION(NAME, C)                                                      \
  extern "C" __global__ void NAME(float *out, float *partial, const float *q,                 \
                                  const C *k_cache, const C *v_cache,                         \
                                  const uint32_t *token_seq, const uint32_t *token_pos,       \
                                  const uint32_t *table_start, const uint32_t *tables,        \
                                  int token0, int num_heads, int num_kv_heads, int head_dim,  \
                                  int block_size, float scale, int window, float softcap,     \
                                  int max_parts) {                                            \
    ferrite_paged_attention<C>(out, partial, q, k_cache, v_cache, token_seq, token_pos,       \
                               table_start, tables, token0, num_heads, num_kv_heads,          \
                               head_dim, block_size, scale, window, softcap, max_parts);      \
  }

FERRITE_PAGED_ATTENTION(paged_attention_f32, float)
FERRITE_PAGED_ATTENTION(paged_attention_f16, __half)
FERRITE_PAGED_ATTENTION(paged_attention_bf16, __nv_bfloat16)

extern "C" __global__ void paged_attention_combine(float *out, const float *partial,
                                                   const uint32_t *token_pos, int token0,
                                                   int num_heads, int head_dim, int window,
                                                   int chunk, int max_parts) {
  ferrite_paged_attention_combine(out, partial, token_pos, token0, num_heads, head_dim, window,
                                  chunk, max_parts);
}
