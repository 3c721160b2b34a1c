// The read bandwidth a decode step's weight stream can reach: every thread of the pool reads its
// share of a chunk of a buffer far larger than the last-level cache, the chunks timed one by one
// inside one OpenMP region (no fork or join between them). A chunk of a few MiB takes well under a
// millisecond, so on a shared machine most chunks run unpreempted and the fastest of many is the
// machine's rate, where a sum of the whole buffer (~10 ms) is preempted more often than not.
#include "probe/read_sweep.h"

#include <ATen/ATen.h>
#include <omp.h>

#include <chrono>
#include <cstring>

namespace orcaserve {
namespace {

volatile uint64_t g_sink;  // the sums are kept, so the reads are too

// Sums n bytes (a multiple of 64) as 64-bit words in eight independent chains: every cache line is
// loaded whole, and the compiler's vector loads keep the loop well ahead of DRAM.
uint64_t read_bytes(const char* p, int64_t n) {
  uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t off = 0; off < n; off += 64) {
    uint64_t w[8];
    std::memcpy(w, p + off, 64);
    for (int j = 0; j < 8; ++j) acc[j] += w[j];
  }
  uint64_t s = 0;
  for (int j = 0; j < 8; ++j) s += acc[j];
  return s;
}

}  // namespace

at::Tensor read_sweep(const at::Tensor& buf, int64_t chunk_bytes, int64_t chunks) {
  TORCH_CHECK(buf.device().is_cpu() && buf.is_contiguous(), "read_sweep: a contiguous CPU buffer");
  TORCH_CHECK(chunk_bytes > 0 && chunk_bytes % 64 == 0, "read_sweep: chunk_bytes a positive multiple of 64");
  const int64_t in_buf = static_cast<int64_t>(buf.nbytes()) / chunk_bytes;
  TORCH_CHECK(in_buf > 0 && chunks > 0, "read_sweep: at least one chunk, and the buffer holds one");
  const char* base = static_cast<const char*>(buf.const_data_ptr());
  at::Tensor seconds = at::empty({chunks}, at::kDouble);
  double* out = seconds.data_ptr<double>();
  uint64_t sink = 0;
  using clock = std::chrono::steady_clock;
  clock::time_point start;
#pragma omp parallel reduction(+ : sink)
  {
    const int64_t nt = omp_get_num_threads();
    const int64_t tid = omp_get_thread_num();
    const int64_t lines = chunk_bytes / 64;
    const int64_t lo = lines * tid / nt * 64;
    const int64_t hi = lines * (tid + 1) / nt * 64;
    for (int64_t c = 0; c < chunks; ++c) {
#pragma omp barrier
#pragma omp master
      start = clock::now();
      const char* chunk = base + (c % in_buf) * chunk_bytes;
      sink += read_bytes(chunk + lo, hi - lo);
#pragma omp barrier
#pragma omp master
      out[c] = std::chrono::duration<double>(clock::now() - start).count();
    }
  }
  g_sink = sink;
  return seconds;
}

}  // namespace orcaserve
