// Runs runtime/kernels/fused.cu's kernels on the CPU through shim.h, one launch per call, read
// from the file argv[1] (written by runtime/tests/it/cuda_kernel_on_cpu.rs, little-endian):
//   i32 op: 0 rope_cache_write, 1 swiglu
//   rope_cache_write: i32 x 9: tokens, num_heads, num_kv_heads, head_dim, stride, interleaved,
//                table rows, pool rows, cache type (0 f32, 1 f16, 2 bf16); then qkv (tokens x
//                stride f32), cos and sin (table rows x head_dim / 2 f32), positions and
//                slots (tokens u32 each), the key pool and the value pool (pool rows x kv_dim
//                of the cache type); writes q (tokens x q_dim f32) and both pools to argv[2].
//   swiglu:      i32 x 3: tokens, ffn, stride; then gate_up (tokens x stride f32); writes the
//                tokens x ffn outputs to argv[2].
// Blocks and their threads run one after another (these kernels never synchronise). Every
// buffer is its own exact-size allocation, so AddressSanitizer reports any access outside one.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "io.h"
#include "shim.h"
#include "../../kernels/fused.cu"

// Every (block, thread) of a one-dimensional grid, in order.
template <typename F>
static void grid(unsigned blocks, unsigned threads, F kernel) {
  ferrite_shim::block_dim = {threads, 1, 1};
  ferrite_shim::grid_dim = {blocks, 1, 1};
  for (unsigned b = 0; b < blocks; ++b) {
    ferrite_shim::block_idx = {b, 1, 1};
    for (unsigned t = 0; t < threads; ++t) {
      ferrite_shim::thread_idx = {t, 0, 0};
      kernel();
    }
  }
}

template <typename C, typename K>
static void rope_cache_write(const int *h, FILE *f, FILE *o, K kernel) {
  const unsigned tokens = h[0], nh = h[1], kvh = h[2], hd = h[3], stride = h[4], inter = h[5];
  const size_t table_rows = h[6], rows = h[7];
  const size_t q_dim = (size_t)nh * hd, kv_dim = (size_t)kvh * hd;
  auto qkv = read<float>(f, (size_t)tokens * stride);
  auto cos = read<float>(f, table_rows * (hd / 2));
  auto sin = read<float>(f, table_rows * (hd / 2));
  auto positions = read<uint32_t>(f, tokens);
  auto slots = read<uint32_t>(f, tokens);
  auto kc = read<C>(f, rows * kv_dim);
  auto vc = read<C>(f, rows * kv_dim);
  std::vector<float> q(tokens * q_dim, NAN);
  // The launch cache_write.rs makes: one block per token, a multiple of 32 threads covering the
  // rotation pairs or the value columns, whichever is more, up to 256.
  size_t pairs = (size_t)(nh + kvh) * hd / 2;
  if (pairs < kv_dim) pairs = kv_dim;
  unsigned threads = pairs < 32 ? 32 : pairs > 256 ? 256 : (unsigned)((pairs + 31) / 32 * 32);
  grid(tokens, threads, [&] {
    kernel(q.data(), kc.data(), vc.data(), qkv.data(), cos.data(), sin.data(), positions.data(),
           slots.data(), nh, kvh, hd, stride, inter);
  });
  write(o, q);
  write(o, kc);
  write(o, vc);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: fused_harness INPUT OUTPUT\n");
    return 2;
  }
  FILE *f = std::fopen(argv[1], "rb");
  FILE *o = std::fopen(argv[2], "wb");
  if (!f || !o) {
    std::perror("open");
    return 2;
  }
  const int op = read<int32_t>(f, 1)[0];
  if (op == 0) {
    auto h = read<int32_t>(f, 9);
    switch (h[8]) {
      case 0: rope_cache_write<float>(h.data(), f, o, rope_cache_write_f32); break;
      case 1: rope_cache_write<__half>(h.data(), f, o, rope_cache_write_f16); break;
      case 2: rope_cache_write<__nv_bfloat16>(h.data(), f, o, rope_cache_write_bf16); break;
      default: std::fprintf(stderr, "cache type %d\n", h[8]); return 2;
    }
  } else if (op == 1) {
    auto h = read<int32_t>(f, 3);
    const unsigned tokens = h[0], ffn = h[1], stride = h[2];
    auto gate_up = read<float>(f, (size_t)tokens * stride);
    std::vector<float> out((size_t)tokens * ffn, NAN);
    const size_t n = out.size();
    // The launch activation.rs makes: 256 threads, enough blocks for every output (capped).
    unsigned blocks = n == 0 ? 1 : (unsigned)((n + 255) / 256 > 65535 ? 65535 : (n + 255) / 256);
    grid(blocks, 256, [&] { swiglu_f32(out.data(), gate_up.data(), tokens, ffn, stride); });
    write(o, out);
  } else {
    std::fprintf(stderr, "op %d\n", op);
    return 2;
  }
  std::fclose(f);
  std::fclose(o);
  return 0;
}
