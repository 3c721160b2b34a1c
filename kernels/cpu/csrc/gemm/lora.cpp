// The LoRA update of a step's rows (docs/lora.md "The segmented update in the dispatch table"):
// for each row t of an adapter, y[t] += (B (A x[t])) * scale, in place, fp32 or bf16, rows of no
// adapter untouched. The twins are kernels/pytorch/lora.py's `lora_sgmv` and `lora_batched`.
//
// - lora_sgmv: one group (one adapter's rows, by index) against its own A [r, in], B [out, r].
// - lora_batched: the rows of many adapters in one call, each row against its own slot's R columns
//   of the stacked A [S R, in] and B [out, S R] (no mask over the S R columns, no index_select of
//   the slots present): rows are sorted by slot and each slot's rows run as one group. One call
//   takes every projection of a fused output (q/k/v, gate/up: each part's A, B and first column of
//   y), so that its tasks share one parallel region.
//
// B is read as B^T (`bt` [r, out], each of its r columns contiguous over the outputs): the layout
// the stacks keep (scheduler/lora/resident.py: B [out, S R] a view of [S R, out]); a B in PEFT's
// layout ([out, r] rows contiguous, lora_sgmv's adapters) is transposed once per call. On vdpbf16ps
// in bf16, lora_batched also takes the blocked stacks (a [S, R/4, in/32, 4, 32], b [S, out/32, R,
// 32]: kernels/cpu/lora.py), each slot's A and B^T then read in order (lora_task.h's Adapter).
//
// A group is cut into tasks of up to kChunk rows (gemm/lora_task.h), split over the threads by
// their cost; a task reads its adapter's A and B once, against all its rows, in register blocks of
// up to 4 rows (8 in the vdpbf16ps expand and in avx512's, gemm/lora_fma.h; the loops over them unrolled, so that the accumulators
// stay in registers): the shrink h = A x (r dot products over `in` a row; on
// avx512_bf16 vdpbf16ps on the bf16 values as stored, four rows of A at a time, gemm/lora_dp.h;
// else FMAs on fp32, on avx512 bf16 widened in registers), then the expand, kOut outputs at a time: rows of B^T against each row's h
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

#include "gemm/lora_task.h"
#include "ops.h"
#include "rows.h"

namespace orcaserve::ORCA_ISA {
namespace {

using namespace lora;  // the helpers of gemm/lora_vec.h

// The tasks split over the threads in contiguous runs of about equal cost (each a task's weights,
// r (in + out), read once, plus its rows' arithmetic, taken as about a third of that a row: the
// weights from memory cost more than a few rows' dot products), so that both threads stream.
template <typename T>
void run_all(const std::vector<Task<T>>& tasks, const int64_t* rows, const at::Tensor& x, T* yp, int64_t ldy,
             int64_t rank) {
  const T* xp = x.data_ptr<T>();
  const int64_t in = x.size(1), nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks.size()));
  std::vector<double> cost(tasks.size() + 1, 0.0);
  for (size_t k = 0; k < tasks.size(); ++k)
    cost[k + 1] = cost[k] + static_cast<double>(tasks[k].w.r * (in + tasks[k].w.out) * (3 + tasks[k].end - tasks[k].begin));
  std::vector<int64_t> cut(nt + 1, static_cast<int64_t>(tasks.size()));
  cut[0] = 0;
  for (int64_t p = 1; p < nt; ++p)
    cut[p] = std::lower_bound(cost.begin(), cost.end(), cost.back() * p / nt) - cost.begin();
  at::parallel_for(0, nt, 1, [&](int64_t p0, int64_t p1) {
    const int64_t k0 = cut[p0], k1 = cut[p1];
    Work& work = thread_work<T>(in, rank);
    for (int64_t k = k0; k < k1; ++k) run_task(tasks[k], k + 1 < k1 ? &tasks[k + 1] : nullptr, rows, xp, yp, ldy, in, work);
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

// y [T, ...] and x [T, in] as the kernels read them, of one dtype with the weights a and b.
void check_yx(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(y.device().is_cpu() && y.dim() == 2 && y.stride(1) == 1 && x.dim() == 2 && x.is_contiguous() &&
                  y.size(0) == x.size(0),
              op, ": y [T, out] with unit column stride (a column slice is fine), x [T, in] contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  b.scalar_type() == y.scalar_type() &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              op, ": y, x, a and b of one dtype, fp32 or bf16");
}

// check_yx, and a [r, in], b [out, r] with b's outputs at y's columns [col, col + out).
void check(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, int64_t col,
           const char* op) {
  check_yx(y, x, a, b, op);
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(1) == x.size(1) && b.dim() == 2 &&
                  (b.stride(0) == 1 || b.stride(1) == 1) && col >= 0 && col + b.size(0) <= y.size(1),
              op, ": a [r, in] contiguous, b [out, r] with a unit stride (B^T's rows or B's), its outputs within y");
}

}  // namespace

// The ops, one instance per ISA variant, registered by bindings.cpp (declared in ops.h).
void lora_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& a,
               const at::Tensor& b, double scale) {
  check(y, x, a, b, 0, "lora_sgmv");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() && b.size(1) == a.size(0) &&
                  b.size(0) == y.size(1),
              "lora_sgmv: rows [N] int64, b [out, r] for a [r, in], y [T, out]");
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
                              static_cast<float>(scale), 0, y.size(1)};
    chunk(tasks, w, 0, n);
    run_all(tasks, rp, x, y.data_ptr<scalar_t>(), y.stride(0), a.size(0));
  });
}

void lora_batched(const at::Tensor& y, const at::Tensor& x, const at::Tensor& row_slot, const at::Tensor& scales,
                  at::TensorList a, at::TensorList b, at::IntArrayRef cols, int64_t rank) {
  const int64_t slots = scales.numel(), t = row_slot.numel(), parts = a.size();
  TORCH_CHECK(parts > 0 && b.size() == a.size() && static_cast<int64_t>(cols.size()) == 2 * parts,
              "lora_batched: as many a and b, and a first and last column of y for each");
  for (int64_t m = 0; m < parts; ++m) {
    const int64_t first = cols[2 * m], last = cols[2 * m + 1];
    if (a[m].dim() == 5) {  // the blocked stacks (lora_task.h's Adapter): [S, R/4, in/32, 4, 32], [S, out/kOut, R, kOut]
      check_yx(y, x, a[m], b[m], "lora_batched");
      const int64_t in32 = a[m].size(2) * 32;
      TORCH_CHECK(kDpbf16 && y.scalar_type() == at::kBFloat16 && a[m].is_contiguous() && b[m].is_contiguous() &&
                      a[m].size(0) == slots && a[m].size(1) * 4 == rank && a[m].size(3) == 4 && a[m].size(4) == 32 &&
                      in32 >= x.size(1) && in32 < x.size(1) + 32 && b[m].dim() == 4 && b[m].size(0) == slots &&
                      b[m].size(2) == rank && b[m].size(3) == kOut && first >= 0 && first <= last &&
                      last <= y.size(1) && b[m].size(1) * kOut >= last - first && b[m].size(1) * kOut < last - first + kOut,
                  "lora_batched: blocked stacks (bf16 on vdpbf16ps only): a [S, R/4, in/32, 4, 32], b [S, out/",
                  kOut, ", R, ", kOut, "], contiguous");
    } else {
      check(y, x, a[m], b[m], first, "lora_batched");
      TORCH_CHECK(a[m].size(0) == slots * rank && b[m].size(1) == slots * rank && last == first + b[m].size(0),
                  "lora_batched: a [S R, in], b [out, S R] for scales [S] and rank R, at y's columns [first, last)");
    }
  }
  TORCH_CHECK(row_slot.scalar_type() == at::kLong && row_slot.is_contiguous() && t <= x.size(0) &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() && rank > 0,
              "lora_batched: row_slot [T] int64 (-1: no adapter), scales [S] fp32");
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
  std::vector<at::Tensor> keep(parts);
  by_dtype(y.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    std::vector<Task<scalar_t>> tasks;  // projection by projection, slot by slot: each thread's weights contiguous
    for (int64_t m = 0; m < parts; ++m) {
      const bool blocked = a[m].dim() == 5;
      const at::Tensor& bt = blocked ? b[m] : transposed(b[m], keep[m]);
      const int64_t first = cols[2 * m], out = cols[2 * m + 1] - first;
      for (int64_t s = 0; s < slots; ++s) {
        Adapter<scalar_t> w{a[m].data_ptr<scalar_t>() + s * rank * a[m].size(-1) * (blocked ? a[m].size(2) : 1),
                            bt.data_ptr<scalar_t>() + s * (blocked ? bt.stride(0) : rank * bt.stride(1)),
                            blocked ? kOut : bt.stride(1), rank, sc[s], first, out};
        if (blocked) {
          w.bblk = rank * kOut;
          w.agroup = 4 * a[m].size(2) * 32;
          w.blocked = true;
        }
        chunk(tasks, w, start[s], start[s + 1]);
      }
    }
    run_all(tasks, rows.data(), x, y.data_ptr<scalar_t>(), y.stride(0), rank);
  });
}

}  // namespace orcaserve::ORCA_ISA
