// Runs the CUDA paged-attention kernel on the CPU through shim.h. Reads one launch from the file
// named by argv[1] (written by runtime/tests/cuda_kernel_on_cpu.rs, little-endian):
//   i32 x 12: tokens, seqs, num_heads, num_kv_heads, head_dim, block_size, window, cache type
//             (0 f32, 1 f16, 2 bf16), slots, tables length, threads per block, shared bytes
//   f32: scale, softcap (0: none)
//   q (f32), k cache, v cache (the cache type), token_seq, token_pos, table_start, tables (u32)
// and writes the output rows (f32) to argv[2]. Every buffer, each block's shared memory
// included, is its own exact-size allocation, so AddressSanitizer reports any access outside a
// cache, a table or the shared buffer.
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "io.h"
#include "shim.h"
#include "../../kernels/paged_attention.cu"

template <typename C, typename K>
static std::vector<float> launch(const int *h, float scale, float softcap, FILE *f, K kernel) {
  const int tokens = h[0], seqs = h[1], nh = h[2], kvh = h[3], hd = h[4], bs = h[5], window = h[6];
  const size_t slots = h[8], tables_len = h[9];
  const int threads = h[10], shared_bytes = h[11];
  auto q = read<float>(f, (size_t)tokens * nh * hd);
  auto k = read<C>(f, slots * kvh * hd);
  auto v = read<C>(f, slots * kvh * hd);
  auto token_seq = read<uint32_t>(f, tokens);
  auto token_pos = read<uint32_t>(f, tokens);
  auto table_start = read<uint32_t>(f, seqs);
  auto tables = read<uint32_t>(f, tables_len);
  std::vector<float> out((size_t)tokens * nh * hd, NAN);
  // One thread per lane of the block, reused for every block in grid order. Thread 0 sets up
  // each block (its index, and a fresh shared buffer of exactly the launch's size, filled with
  // NaNs so a read before a write shows in the output) between two barriers.
  ferrite_shim::block_dim = {(unsigned)threads, 1, 1};
  std::barrier<> barrier(threads);
  ferrite_shim::barrier = &barrier;
  std::vector<unsigned char> *shared = nullptr;
  std::vector<std::thread> lanes;
  for (int x = 0; x < threads; ++x) {
    lanes.emplace_back([&, x] {
      ferrite_shim::thread_idx = {(unsigned)x, 0, 0};
      for (int t = 0; t < tokens; ++t) {
        for (int g = 0; g < kvh; ++g) {
          if (x == 0) {
            delete shared;
            shared = new std::vector<unsigned char>(shared_bytes, 0xff);  // NaNs, not zeros
            ferrite_shim::shared = shared->data();
            ferrite_shim::block_idx = {(unsigned)t, (unsigned)g, 1};
          }
          barrier.arrive_and_wait();
          kernel(out.data(), q.data(), k.data(), v.data(), token_seq.data(), token_pos.data(),
                 table_start.data(), tables.data(), nh, kvh, hd, bs, scale, window, softcap);
          barrier.arrive_and_wait();
        }
      }
    });
  }
  for (auto &lane : lanes) lane.join();
  delete shared;
  return out;
}

int main(int argc, char **argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: harness INPUT OUTPUT\n");
    return 2;
  }
  FILE *f = std::fopen(argv[1], "rb");
  if (!f) {
    std::perror(argv[1]);
    return 2;
  }
  auto header = read<int32_t>(f, 12);
  auto scalars = read<float>(f, 2);
  const float scale = scalars[0], softcap = scalars[1];
  std::vector<float> out;
  switch (header[7]) {
    case 0: out = launch<float>(header.data(), scale, softcap, f, paged_attention_f32); break;
    case 1: out = launch<__half>(header.data(), scale, softcap, f, paged_attention_f16); break;
    case 2: out = launch<__nv_bfloat16>(header.data(), scale, softcap, f, paged_attention_bf16); break;
    default: std::fprintf(stderr, "cache type %d\n", header[7]); return 2;
  }
  std::fclose(f);
  FILE *o = std::fopen(argv[2], "wb");
  if (!o) {
    std::perror(argv[2]);
    return 2;
  }
  write(o, out);
  std::fclose(o);
  return 0;
}
