// One task of the LoRA update (gemm/lora.cpp; docs/lora.md "The segmented update in the dispatch
// table"): a run of up to kChunk rows under one adapter, for one projection's columns of y: the shrink
// h = A x of its rows (h in L1), then the expand y += rounded(rounded(B h) * scale), kOut outputs at
// a time. Included by gemm/lora.cpp alone (its anonymous namespace).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "gemm/lora_dp.h"
#include "gemm/lora_fma.h"
#include "gemm/lora_vec.h"

namespace orcaserve::ORCA_ISA {
namespace {

using namespace lora;  // the helpers of gemm/lora_vec.h

// One adapter's weights for one projection: A rows a[0..r) of `in`, B^T rows bt[0..r) of `out`
// (ldbt apart, output block o0 / kOut at o0 / kOut * bblk), the scale, and the projection's outputs:
// y's columns [col, col + out). `blocked` (bf16 on vdpbf16ps only): the blocked stacks' layout, each
// read in order (docs/lora.md "Several adapters in one step"): A's four rows at a time [in / 32][4][32]
// (agroup apart), B^T [out / kOut][r][kOut] (ldbt = kOut, bblk = r kOut).
template <typename T>
struct Adapter {
  const T* a;
  const T* bt;
  int64_t ldbt, r;
  float scale;
  int64_t col, out;
  int64_t bblk = kOut, agroup = 0;
  bool blocked = false;
};

// A run of rows (rows[begin, end)) under one adapter.
template <typename T>
struct Task {
  Adapter<T> w;
  int64_t begin, end;
};

#ifdef ORCA_DPBF16
constexpr bool kDpbf16 = true;  // the vdpbf16ps shrink and expand on bf16
#else
constexpr bool kDpbf16 = false;
#endif

#ifdef ORCA_LORA_FMA512
constexpr bool kFma512 = true;  // lora_fma.h's shrink and bf16 expand (AVX-512 without BF16)
#else
constexpr bool kFma512 = false;
#endif

// A thread's buffers, reused by its tasks and kept between calls (grown, never shrunk): rows and
// A's rows widened to fp32, h [rows, r].
struct Work {
  std::vector<float> xs, a, h;
  std::vector<uint32_t> hp;  // h as bf16 pairs (the vdpbf16ps expand)
};

// The calling thread's Work with room for tasks of `in` inputs and rank r in T.
template <typename T>
Work& thread_work(int64_t in, int64_t r) {
  thread_local Work work;
  const bool widened = !std::is_same_v<T, float> && !kDpbf16;  // the FMA shrink widens bf16 rows (and A)
  auto grow = [](auto& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  };
  grow(work.xs, widened ? kChunk * in : 0);
  grow(work.a, widened && !kFma512 ? r * in : 0);
  grow(work.h, kChunk * r);
  grow(work.hp, kDpbf16 ? kChunk * ((r + 1) / 2) : 0);
  return work;
}

// h[i r + j] = A row j . x row i, rounded to T, for the task's n rows (xr).
template <typename T>
void shrink(const Adapter<T>& w, const T* const* xr, int64_t n, int64_t in, Work& work, float* h) {
  const int64_t r = w.r;
#ifdef ORCA_LORA_FMA512
  shrink_fma(w.a, r, xr, n, in, work.xs.data(), h);
#else
  // A's rows from j0 on, two at a time, then the last
  auto pairs = [&](const auto* const* rows, const auto* a, int64_t lda, int64_t j0) {
    const int64_t row_bytes = lda * sizeof(*a);
    if (j0 == 0) prefetch(a, std::min<int64_t>(r, kAhead) * row_bytes);
    for (int64_t j = j0; j < r; j += 2) {
      if (j + kAhead < r) prefetch(a + (j + kAhead) * lda, std::min<int64_t>(2, r - j - kAhead) * row_bytes);
      row_blocks(n, [&](auto nr, int64_t i) {
        constexpr int NR = decltype(nr)::value;
        float s[NR * 2];
        if (j + 1 < r) {
          dots<NR, 2>(rows + i, a + j * lda, lda, in, s);
        } else {
          dots<NR, 1>(rows + i, a + j * lda, lda, in, s);
        }
        const int nj = j + 1 < r ? 2 : 1;
        for (int q = 0; q < NR; ++q)
          for (int p = 0; p < nj; ++p) h[(i + q) * r + j + p] = rounded<T>(s[q * nj + p]);
      });
    }
  };
  if constexpr (std::is_same_v<T, float>) {
    pairs(xr, w.a, in, 0);
#ifdef ORCA_DPBF16
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const int64_t r4 = shrink4(w.a, r, xr, n, in, h, w.blocked, w.agroup);  // four rows at a time, r % 4 in pairs
    pairs(xr, w.a, in, r4);
#endif
  } else {  // widened once: the task's rows and A's r rows (r in)
    const float* xf[kChunk];
    for (int64_t i = 0; i < n; ++i) {
      to_float(xr[i], work.xs.data() + i * in, in);
      xf[i] = work.xs.data() + i * in;
    }
    to_float(w.a, work.a.data(), r * in);
    pairs(xf, work.a.data(), in, 0);
  }
#endif
}

// yr[q][o0, o0 + m) += rounded(rounded(h row q . B^T) * scale) for NR rows: one block of kOut
// outputs (m of them; Full: all kOut, the tail's masks compiled out). The accumulators are plain
// locals, the loops over rows unrolled, so that they stay in registers.
template <typename T, int NR, bool Full>
inline void expand_block(const Adapter<T>& w, const float* h, T* const* yr, int64_t o0, int64_t m, bool ahead) {
  const int64_t r = w.r;
  Vec lo[NR], hi[NR];
#pragma GCC unroll 8
  for (int q = 0; q < NR; ++q) lo[q] = hi[q] = Vec(0.f);
  for (int64_t j = 0; j < r; ++j) {
    const T* bj = w.bt + j * w.ldbt + o0 / kOut * w.bblk;
    if (ahead) prefetch(bj + kAhead * w.bblk, kOut * sizeof(T));
    const auto [b0, b1] = load2(bj, Full ? kOut : m);
#pragma GCC unroll 8
    for (int q = 0; q < NR; ++q) {
      const Vec hv(h[q * r + j]);
      lo[q] = at::vec::fmadd(hv, b0, lo[q]);
      hi[q] = at::vec::fmadd(hv, b1, hi[q]);
    }
  }
  const Vec scale(w.scale);
#pragma GCC unroll 8
  for (int q = 0; q < NR; ++q) {
    Vec dlo = lo[q], dhi = hi[q];
    round2<T>(dlo, dhi);
    dlo = dlo * scale;
    dhi = dhi * scale;
    round2<T>(dlo, dhi);
    const auto [y0, y1] = load2(yr[q] + o0, Full ? kOut : m);
    store2(yr[q] + o0, Full ? kOut : m, y0 + dlo, y1 + dhi);
  }
}

// The expand of NR rows over every output, kOut at a time (hp: h as bf16 pairs, for the vdpbf16ps
// expand; null elsewhere).
template <typename T, int NR>
void expand(const Adapter<T>& w, const float* h, const uint32_t* hp, T* const* yr, int64_t out) {
  int64_t o0 = 0;
#ifdef ORCA_DPBF16
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (hp != nullptr) {
      for (; o0 + kOut <= out; o0 += kOut) expand_block_dp<NR, true>(w.bt, w.ldbt, w.bblk, w.r, w.scale, hp, yr, o0, kOut, o0 + (kAhead + 1) * kOut <= out);
      if (o0 < out) expand_block_dp<NR, false>(w.bt, w.ldbt, w.bblk, w.r, w.scale, hp, yr, o0, out - o0, false);
      return;
    }
  }
#endif
  for (; o0 + kOut <= out; o0 += kOut) expand_block<T, NR, true>(w, h, yr, o0, kOut, o0 + (kAhead + 1) * kOut <= out);
  if (o0 < out) expand_block<T, NR, false>(w, h, yr, o0, out - o0, false);
}

// One task; `next` (the thread's next task, or null): its A's first rows are requested meanwhile.
template <typename T>
void run_task(const Task<T>& task, const Task<T>* next, const int64_t* rows, const T* x, T* y, int64_t ldy,
              int64_t in, Work& work) {
  const int64_t n = task.end - task.begin, out = task.w.out;
  const T* xr[kChunk];
  T* yr[kChunk];
  for (int64_t i = 0; i < n; ++i) {
    xr[i] = x + rows[task.begin + i] * in;
    yr[i] = y + rows[task.begin + i] * ldy + task.w.col;
  }
  float* h = work.h.data();
  if (task.w.blocked) {  // B^T's first kAhead blocks, in order
    prefetch(task.w.bt, std::min((out + kOut - 1) / kOut, kAhead) * task.w.bblk * sizeof(T));
  } else {
    for (int64_t j = 0; j < task.w.r; ++j) prefetch(task.w.bt + j * task.w.ldbt, std::min(out, kAhead * kOut) * sizeof(T));
  }
  shrink(task.w, xr, n, in, work, h);
  if (next != nullptr) {
    const int64_t bytes = next->w.blocked ? next->w.agroup * sizeof(T) : std::min<int64_t>(next->w.r, kAhead) * in * sizeof(T);
    prefetch(next->w.a, bytes);
  }
  const int64_t pairs = (task.w.r + 1) / 2;
  const uint32_t* hp = nullptr;
#ifdef ORCA_DPBF16
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (h_pairs(h, n, task.w.r, work.hp.data())) hp = work.hp.data();
  }
#endif
  auto block = [&](auto nr, int64_t i) {
    expand<T, decltype(nr)::value>(task.w, h + i * task.w.r, hp == nullptr ? nullptr : hp + i * pairs, yr + i, out);
  };
#ifdef ORCA_LORA_FMA512
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    row_blocks8(n, [&](auto nr, int64_t i) {  // B^T's values widened once for 8 rows
      expand_fma<decltype(nr)::value>(task.w.bt, task.w.ldbt, task.w.bblk, task.w.r, task.w.scale, h + i * task.w.r,
                                      yr + i, out);
    });
    return;
  }
#endif
  if constexpr ((kDpbf16 && std::is_same_v<T, at::BFloat16>) || kFma512) {
    row_blocks8(n, block);  // B^T's pairs unpacked once for 8 rows (the FMA expand too: 32 registers here)
  } else {
    row_blocks(n, block);
  }
}

}  // namespace
}  // namespace orcaserve::ORCA_ISA
