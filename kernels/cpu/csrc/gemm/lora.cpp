// The LoRA update of a step's rows (docs/lora.md "The segmented update in the dispatch table"):
// for each row t of an adapter, y[t] += (B (A x[t])) * scale, in place, fp32 or bf16, rows of no
// adapter untouched. The twins are kernels/pytorch/lora.py's `lora_sgmv` and `lora_batched`.
//
// - lora_sgmv: one group (one adapter's rows, by index) against its own A [r, in], B [out, r].
// - lora_batched: the rows of many adapters in one call, each row against its own slot's R columns
//   of the stacked A [S R, in] and B [out, S R] (no mask over the S R columns, no index_select of
//   the slots present): rows are sorted by slot and each slot's rows run as one group.
//
// B is read as B^T (`bt` [r, out], each of its r columns contiguous over the outputs): the layout
// the stacks keep (scheduler/lora/resident.py: B [out, S R] a view of [S R, out]); a B in PEFT's
// layout ([out, r] rows contiguous, lora_sgmv's adapters) is transposed once per call.
//
// A group is cut into tasks of up to kChunk rows; a task reads its adapter's A and B once, against
// all its rows, in register blocks of up to 4 rows (the loops over them unrolled, so that the
// accumulators stay in registers): the shrink h = A x (r dot products over `in` a row; on
// avx512_bf16 vdpbf16ps on the bf16 values as stored, four rows of A at a time, gemm/lora_dp.h;
// else FMAs on fp32), then the expand, kOut outputs at a time: rows of B^T against each row's h
// values broadcast (on avx512_bf16 vdpbf16ps, two ranks at a time; else widened in registers, FMAs),
// the [rows, r] intermediate in L1. A's next rows and B^T's next blocks are prefetched. The roundings
// are PEFT's, as the twins': in bf16 the shrink, the expand and the scale are each rounded to bf16
// (nearest even, c10's bits: lora_vec.h), then y + that rounded once more (the twins' `y +=
// delta`); the sums run in another order than the GEMMs', so the tests hold it to the twins
// within the dtype's tolerance, and bit for bit where every sum is exact.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "gemm/lora_dp.h"
#include "gemm/lora_vec.h"
#include "ops.h"
#include "rows.h"

namespace orcaserve::ORCA_ISA {
namespace {

using namespace lora;  // the helpers of gemm/lora_vec.h

// One adapter's weights for one projection: A rows a[0..r) of `in`, B^T rows bt[0..r) of `out`
// (ldbt apart), and the scale.
template <typename T>
struct Adapter {
  const T* a;
  const T* bt;
  int64_t ldbt, r;
  float scale;
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

// A thread's buffers, reused by its tasks: rows and A's rows widened to fp32, h [rows, r].
struct Work {
  std::vector<float> xs, a, h;
  std::vector<uint32_t> hp;  // h as bf16 pairs (the vdpbf16ps expand)
};

// h[i r + j] = A row j . x row i, rounded to T, for the task's n rows (xr).
template <typename T>
void shrink(const Adapter<T>& w, const T* const* xr, int64_t n, int64_t in, Work& work, float* h) {
  const int64_t r = w.r;
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
    const int64_t r4 = shrink4(w.a, r, xr, n, in, h);  // A's rows four at a time, the last r % 4 in pairs
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
}

// yr[q][o0, o0 + m) += rounded(rounded(h row q . B^T) * scale) for NR rows: one block of kOut
// outputs (m of them; Full: all kOut, the tail's masks compiled out). The accumulators are plain
// locals, the loops over rows unrolled, so that they stay in registers.
template <typename T, int NR, bool Full>
inline void expand_block(const Adapter<T>& w, const float* h, T* const* yr, int64_t o0, int64_t m, bool ahead) {
  const int64_t r = w.r;
  Vec lo[NR], hi[NR];
#pragma GCC unroll 4
  for (int q = 0; q < NR; ++q) lo[q] = hi[q] = Vec(0.f);
  for (int64_t j = 0; j < r; ++j) {
    const T* bj = w.bt + j * w.ldbt + o0;
    if (ahead) prefetch(bj + kAhead * kOut, kOut * sizeof(T));
    const auto [b0, b1] = load2(bj, Full ? kOut : m);
#pragma GCC unroll 4
    for (int q = 0; q < NR; ++q) {
      const Vec hv(h[q * r + j]);
      lo[q] = at::vec::fmadd(hv, b0, lo[q]);
      hi[q] = at::vec::fmadd(hv, b1, hi[q]);
    }
  }
  const Vec scale(w.scale);
#pragma GCC unroll 4
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
      for (; o0 + kOut <= out; o0 += kOut) expand_block_dp<NR, true>(w.bt, w.ldbt, w.r, w.scale, hp, yr, o0, kOut, o0 + (kAhead + 1) * kOut <= out);
      if (o0 < out) expand_block_dp<NR, false>(w.bt, w.ldbt, w.r, w.scale, hp, yr, o0, out - o0, false);
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
              int64_t in, int64_t out, Work& work) {
  const int64_t n = task.end - task.begin;
  const T* xr[kChunk];
  T* yr[kChunk];
  for (int64_t i = 0; i < n; ++i) {
    xr[i] = x + rows[task.begin + i] * in;
    yr[i] = y + rows[task.begin + i] * ldy;
  }
  float* h = work.h.data();
  for (int64_t j = 0; j < task.w.r; ++j) prefetch(task.w.bt + j * task.w.ldbt, std::min(out, kAhead * kOut) * sizeof(T));
  shrink(task.w, xr, n, in, work, h);
  if (next != nullptr) prefetch(next->w.a, std::min<int64_t>(next->w.r, kAhead) * in * sizeof(T));
  const int64_t pairs = (task.w.r + 1) / 2;
  const uint32_t* hp = nullptr;
#ifdef ORCA_DPBF16
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (h_pairs(h, n * task.w.r, task.w.r, work.hp.data())) hp = work.hp.data();
  }
#endif
  row_blocks(n, [&](auto nr, int64_t i) {
    expand<T, decltype(nr)::value>(task.w, h + i * task.w.r, hp == nullptr ? nullptr : hp + i * pairs, yr + i, out);
  });
}

template <typename T>
void run_all(const std::vector<Task<T>>& tasks, const int64_t* rows, const at::Tensor& x, const at::Tensor& y,
             int64_t rank) {
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t ldy = y.stride(0), in = x.size(1), out = y.size(1);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t k0, int64_t k1) {
    const bool widened = !std::is_same_v<T, float> && !kDpbf16;  // the FMA shrink widens bf16 (shrink)
    Work work{std::vector<float>(widened ? kChunk * in : 0), std::vector<float>(widened ? rank * in : 0),
              std::vector<float>(kChunk * rank), std::vector<uint32_t>(kDpbf16 ? kChunk * ((rank + 1) / 2) : 0)};
    for (int64_t k = k0; k < k1; ++k) run_task(tasks[k], k + 1 < k1 ? &tasks[k + 1] : nullptr, rows, xp, yp, ldy, in, out, work);
  });
}

template <typename T>
void chunk(std::vector<Task<T>>& tasks, const Adapter<T>& w, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += kChunk) tasks.push_back({w, i, std::min(end, i + kChunk)});
}

// B^T as the kernel reads it: b itself where its rows are the outputs' unit stride (the stacks),
// else (PEFT's [out, r]) a transposed copy, kept alive in `keep`.
const at::Tensor& transposed(const at::Tensor& b, at::Tensor& keep) {
  if (b.stride(0) == 1) return b;
  keep = b.t().contiguous().t();
  return keep;
}

// f(T{}) for the dtype `check` let through: fp32 or bf16.
template <typename F>
void by_dtype(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else {
    f(at::BFloat16{});
  }
}

void check(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(y.device().is_cpu() && y.dim() == 2 && y.stride(1) == 1 && x.dim() == 2 && x.is_contiguous() &&
                  y.size(0) == x.size(0),
              op, ": y [T, out] with unit column stride (a column slice is fine), x [T, in] contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  b.scalar_type() == y.scalar_type() &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              op, ": y, x, a and b of one dtype, fp32 or bf16");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(1) == x.size(1) && b.dim() == 2 &&
                  (b.stride(0) == 1 || b.stride(1) == 1) && b.size(0) == y.size(1),
              op, ": a [r, in] contiguous, b [out, r] with a unit stride (B^T's rows or B's)");
}

}  // namespace

// The ops, one instance per ISA variant, registered by bindings.cpp (declared in ops.h).
void lora_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& a,
               const at::Tensor& b, double scale) {
  check(y, x, a, b, "lora_sgmv");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() && b.size(1) == a.size(0),
              "lora_sgmv: rows [N] int64, b [out, r] for a [r, in]");
  const int64_t n = rows.numel();
  if (n == 0) return;
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < x.size(0), "lora_sgmv: row ", rp[i], " out of range");
  at::Tensor keep;
  const at::Tensor& bt = transposed(b, keep);
  by_dtype(y.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    std::vector<Task<scalar_t>> tasks;
    const Adapter<scalar_t> w{a.data_ptr<scalar_t>(), bt.data_ptr<scalar_t>(), bt.stride(1), a.size(0),
                              static_cast<float>(scale)};
    chunk(tasks, w, 0, n);
    run_all(tasks, rp, x, y, a.size(0));
  });
}

void lora_batched(const at::Tensor& y, const at::Tensor& x, const at::Tensor& row_slot, const at::Tensor& scales,
                  const at::Tensor& a, const at::Tensor& b, int64_t rank) {
  check(y, x, a, b, "lora_batched");
  const int64_t slots = scales.numel(), t = row_slot.numel();
  TORCH_CHECK(row_slot.scalar_type() == at::kLong && row_slot.is_contiguous() && t <= x.size(0) &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() && rank > 0 &&
                  a.size(0) == slots * rank && b.size(1) == slots * rank,
              "lora_batched: row_slot [T] int64 (-1: no adapter), scales [S] fp32, a [S R, in], b [out, S R]");
  // Rows sorted by slot (a counting sort, stable: each slot's rows in step order).
  const int64_t* rs = row_slot.data_ptr<int64_t>();
  std::vector<int64_t> start(slots + 1, 0), rows;
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(rs[i] < slots, "lora_batched: row ", i, " names slot ", rs[i], " of ", slots);
    if (rs[i] >= 0) ++start[rs[i] + 1];
  }
  for (int64_t s = 0; s < slots; ++s) start[s + 1] += start[s];
  if (start[slots] == 0) return;
  rows.resize(start[slots]);
  std::vector<int64_t> at_slot(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < t; ++i)
    if (rs[i] >= 0) rows[at_slot[rs[i]]++] = i;
  const float* sc = scales.data_ptr<float>();
  at::Tensor keep;
  const at::Tensor& bt = transposed(b, keep);
  by_dtype(y.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    std::vector<Task<scalar_t>> tasks;
    for (int64_t s = 0; s < slots; ++s) {
      const Adapter<scalar_t> w{a.data_ptr<scalar_t>() + s * rank * a.size(1),
                                bt.data_ptr<scalar_t>() + s * rank * bt.stride(1), bt.stride(1), rank, sc[s]};
      chunk(tasks, w, start[s], start[s + 1]);
    }
    run_all(tasks, rows.data(), x, y, rank);
  });
}

}  // namespace orcaserve::ORCA_ISA
