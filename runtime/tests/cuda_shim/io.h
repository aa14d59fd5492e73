// Reading a launch's inputs and writing its outputs for the CPU harnesses (harness.cpp,
// fused_harness.cpp): raw little-endian arrays, exact sizes, a short read is an error.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <vector>

template <typename T>
static std::vector<T> read(FILE *f, size_t n) {
  std::vector<T> v(n);
  if (n && std::fread(v.data(), sizeof(T), n, f) != n) {
    std::fprintf(stderr, "short input\n");
    std::exit(2);
  }
  return v;
}

template <typename T>
static void write(FILE *o, const std::vector<T> &v) {
  if (!v.empty() && std::fwrite(v.data(), sizeof(T), v.size(), o) != v.size()) {
    std::perror("write");
    std::exit(2);
  }
}
