// Runs the CUDA paged-attention kernels on the CPU through shim.h. Reads one launch from the
// file named by argv[1] (written by runtime/tests/it/cuda_kernel_on_cpu.rs, little-endian):
//   i32 x 15: tokens, seqs, num_heads, num_kv_heads, head_dim, block_size, window, cache type
//             (0 f32, 1 f16, 2 bf16), slots, tables length, threads per block, shared bytes,
//             max parts, scratch floats per run (0: no token has several parts), runs
//   f32: scale, softcap (0: none)
//   i32 x 3 per run: first token, tokens, blocks per (token, head)
//   q (f32), k cache, v cache (the cache type), token_seq, token_pos, table_start, tables (u32)
// and writes the output rows (f32) to argv[2]. Each run is the attention launch's blocks in grid
// order, then the combine's where there is scratch, as the CUDA launch runs them. Every buffer,
// each block's shared memory and each run's scratch included, is its own exact-size allocation
// filled with NaNs, so AddressSanitizer reports any access outside a cache, a table, the shared
// buffer or the scratch, and a read before a write shows in the output.
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "io.h"
#include "shim.h"
#include "../../kernels/paged_attention.cu"

namespace {
// One block of a launch: its run, which kernel, its index and its grid.
struct Block {
  int run;
  bool combine;
  dim3 idx;
  dim3 grid;
};
}  // namespace

template <typename C, typename K>
static std::vector<float> launch(const int *h, float scale, float softcap, FILE *f, K kernel) {
  const int tokens = h[0], seqs = h[1], nh = h[2], kvh = h[3], hd = h[4], bs = h[5], window = h[6];
  const size_t slots = h[8], tables_len = h[9];
  const int threads = h[10], shared_bytes = h[11], max_parts = h[12];
  const size_t scratch_floats = h[13];
  const int nruns = h[14];
  auto runs = read<int32_t>(f, 3 * (size_t)nruns);
  auto q = read<float>(f, (size_t)tokens * nh * hd);
  auto k = read<C>(f, slots * kvh * hd);
  auto v = read<C>(f, slots * kvh * hd);
  auto token_seq = read<uint32_t>(f, tokens);
  auto token_pos = read<uint32_t>(f, tokens);
  auto table_start = read<uint32_t>(f, seqs);
  auto tables = read<uint32_t>(f, tables_len);
  std::vector<float> out((size_t)tokens * nh * hd, NAN);
  std::vector<Block> blocks;
  for (int r = 0; r < nruns; ++r) {
    const unsigned n = runs[3 * r + 1], z = runs[3 * r + 2];
    for (unsigned bz = 0; bz < z; ++bz)
      for (unsigned by = 0; by < (unsigned)nh; ++by)
        for (unsigned bx = 0; bx < n; ++bx) blocks.push_back({r, false, {bx, by, bz}, {n, (unsigned)nh, z}});
    if (scratch_floats)
      for (unsigned by = 0; by < (unsigned)nh; ++by)
        for (unsigned bx = 0; bx < n; ++bx) blocks.push_back({r, true, {bx, by, 0}, {n, (unsigned)nh, 1}});
  }
  // One thread per lane of the block, reused for every block in order. Thread 0 sets up each
  // block (its index and grid, a fresh shared buffer of exactly the launch's size, and at a
  // run's first block a fresh scratch) between two barriers.
  ferrite_shim::block_dim = {(unsigned)threads, 1, 1};
  std::barrier<> barrier(threads);
  ferrite_shim::barrier = &barrier;
  std::vector<unsigned char> *shared = nullptr;
  std::vector<float> *scratch = nullptr;
  std::vector<std::thread> lanes;
  for (int x = 0; x < threads; ++x) {
    lanes.emplace_back([&, x] {
      ferrite_shim::thread_idx = {(unsigned)x, 0, 0};
      for (size_t i = 0; i < blocks.size(); ++i) {
        const Block &b = blocks[i];
        if (x == 0) {
          delete shared;
          shared = new std::vector<unsigned char>(shared_bytes, 0xff);  // NaNs, not zeros
          ferrite_shim::shared = shared->data();
          ferrite_shim::block_idx = b.idx;
          ferrite_shim::grid_dim = b.grid;
          if (i == 0 || blocks[i - 1].run != b.run) {
            delete scratch;
            scratch = new std::vector<float>(scratch_floats ? scratch_floats : 1, NAN);
          }
        }
        barrier.arrive_and_wait();
        const int token0 = runs[3 * b.run];
        if (b.combine)
          paged_attention_combine(out.data(), scratch->data(), token_pos.data(), token0, nh, hd,
                                  window, threads, max_parts);
        else
          kernel(out.data(), scratch->data(), q.data(), k.data(), v.data(), token_seq.data(),
                 token_pos.data(), table_start.data(), tables.data(), token0, nh, kvh, hd, bs,
                 scale, window, softcap, max_parts);
        barrier.arrive_and_wait();
      }
    });
  }
  for (auto &lane : lanes) lane.join();
  delete shared;
  delete scratch;
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
  auto header = read<int32_t>(f, 15);
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
