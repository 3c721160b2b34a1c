// How the project's GEMMs (gemm/gemm_fp32.cpp, gemm/gemm_bf16.cpp) share out their work: the weight is
// packed into panels of output columns, each panel is computed in row tiles by a micro-kernel, and
// the threads take panels from a counter.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <utility>
#include <vector>

#include "gemm/panel_share.h"

namespace orcaserve::ORCA_ISA {

// M rows in tiles of at most Max rows, spread as evenly as the tile count allows (17 rows in tiles
// of 4: 4, 4, 3, 3, 3, not 4, 4, 4, 4, 1). A tile of R rows runs 3 R independent FMA chains; under
// 8 each k waits on the FMA latency, so a 1-row tail took about as long as a 3-row tile.
template <int Max>
class RowTiles {
 public:
  explicit RowTiles(int64_t rows)
      : count_((rows + Max - 1) / Max), base_(count_ ? rows / count_ : 0), wide_(count_ ? rows % count_ : 0) {}
  int64_t count() const { return count_; }
  int64_t rows(int64_t t) const { return base_ + (t < wide_ ? 1 : 0); }

  // f(t, first row, std::integral_constant<int, R>) for each tile t of R rows, R in 1..Max, so that
  // the micro-kernel is instantiated per tile height.
  template <typename F>
  void each(F&& f) const {
    for (int64_t t = 0, m = 0; t < count_; m += rows(t), ++t) dispatch<Max>(rows(t), [&](auto r) { f(t, m, r); });
  }

 private:
  template <int R, typename F>
  static void dispatch(int64_t rows, F&& f) {
    if constexpr (R > 1) {
      if (rows < R) return dispatch<R - 1>(rows, std::forward<F>(f));
    }
    f(std::integral_constant<int, R>{});
  }

  int64_t count_, base_, wide_;
};

// body(p, q) for each of P panels, on the threads torch runs: q is the panel the calling thread
// computes next if it is already known (< P), for a prefetch into L2 while p is computed.
//
// Panels are taken in adjacent pairs (1-4 measured alike), from a counter: a thread that is
// preempted holds up little of the other's work, where a static split would wait at the barrier
// with half of it. With `claim_ahead` a thread claims its next pair as it starts the last panel of
// this one, so that this panel's q is known. Taken one at a time with the next claimed ahead (every
// thread's panels then 2 apart), the offline workload ran 1-6 % slower than without the prefetch in
// 4 of 4 alternated runs, and 9-13 % faster as pairs in 2 of 2: likely because a pair is one stream
// for the hardware prefetcher (docs/performance-log.md, "2026-12-02: engine limits re-tuned, the
// next panel prefetched into L2 (Zen 3)").
template <typename Body>
void for_each_panel(int64_t P, bool claim_ahead, Body&& body) {
  constexpr int64_t kChunk = 2;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (P + kChunk - 1) / kChunk);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t p0 = next.fetch_add(kChunk); p0 < P;) {
      const int64_t p1 = std::min(P, p0 + kChunk);
      int64_t after = P;  // the pair after this one, when claimed early
      for (int64_t p = p0; p < p1; ++p) {
        if (claim_ahead && p + 1 == p1) after = next.fetch_add(kChunk);
        body(p, p + 1 < p1 ? p + 1 : after);
      }
      p0 = claim_ahead ? after : next.fetch_add(kChunk);
    }
  });
}

// Rows up to which a GEMM is GEMV-shaped (a decode step of 1-4 streams): its weight's read from
// DRAM is nearly its whole cost, so its panels are walked as streams (for_each_panel_streamed) and
// its micro-kernels prefetch ahead in them (docs/architecture.md, "Dispatch").
constexpr int64_t kStreamRows = 4;
// How far ahead in its stream a GEMV-shaped micro-kernel prefetches: 4 KiB (21 steps of a 48-column
// bf16 panel). On Sapphire Rapids, a stand-alone GEMV over SmolLM2's 269 MB of bf16 panels read
// 10-11 GB/s by thread CPU time as pairs from one counter, 17-19 as contiguous halves, 21-24 with
// this prefetch (0.5-2 KiB: 19-22).
constexpr int64_t kStreamAhead = 4096;

// body(p, q) for each of P panels, for GEMV-shaped calls: thread t of T owns the contiguous panels
// [t P / T, (t + 1) P / T), one sequential stream for the hardware prefetcher, and takes them in
// chunks from its own counter; a thread done with its range takes chunks from the others' (a
// preempted thread's share is not waited for). q is the next panel of the calling thread's range
// (P at its end), for a prefetch. Interleaved pairs from one counter (for_each_panel) broke each
// thread's read into 2-panel pieces: half the bandwidth above.
template <typename Body>
void for_each_panel_streamed(int64_t P, Body&& body) {
  constexpr int64_t kChunk = 4;
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (P + kChunk - 1) / kChunk));
  std::vector<std::atomic<int64_t>> next(T);
  for (int64_t t = 0; t < T; ++t) next[t].store(t * P / T, std::memory_order_relaxed);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < T; ++i) {  // its own range first, then the others'
        const int64_t r = (t + i) % T, end = (r + 1) * P / T;
        for (int64_t p0 = next[r].fetch_add(kChunk); p0 < end; p0 = next[r].fetch_add(kChunk))
          for (int64_t p = p0, p1 = std::min(end, p0 + kChunk); p < p1; ++p) body(p, p + 1 < end ? p + 1 : P);
      }
  });
}

// for_each_panel_streamed's walk for one thread of a region the caller opened: the same ranges and
// chunks, the counters the region's threads share (PanelShare), no region of its own. Which thread
// computes a panel changes none of its bits.
template <typename Body>
void for_each_panel_shared(int64_t P, const PanelShare& share, Body&& body) {
  constexpr int64_t kChunk = 4;
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(share.threads, (P + kChunk - 1) / kChunk));
  for (int64_t i = 0; i < T; ++i) {  // its own range first (if it has one), then the others'
    const int64_t r = (share.thread + i) % T, start = r * P / T, end = (r + 1) * P / T;
    for (int64_t p0 = start + share.taken[r].fetch_add(kChunk); p0 < end; p0 = start + share.taken[r].fetch_add(kChunk))
      for (int64_t p = p0, p1 = std::min(end, p0 + kChunk); p < p1; ++p) body(p, p + 1 < end ? p + 1 : P);
  }
}

// for_each_panel_streamed where M rows are GEMV-shaped, else for_each_panel.
template <typename Body>
void for_each_panel_of(int64_t M, int64_t P, bool claim_ahead, Body&& body) {
  if (M <= kStreamRows)
    for_each_panel_streamed(P, body);
  else
    for_each_panel(P, claim_ahead, body);
}

}  // namespace orcaserve::ORCA_ISA
