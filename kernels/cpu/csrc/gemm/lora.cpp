// The LoRA update of a step's rows (docs/lora.md "The segmented update in the dispatch table"):
// for each row t of an adapter, y[t] += (B (A x[t])) * scale, in place, fp32 or bf16, rows of no
// adapter untouched. The twins are kernels/pytorch/lora.py's `lora_sgmv` and `lora_batched`.
//
// - lora_sgmv: one group (one adapter's rows, by index) against its own A [r, in], B [out, r].
// - lora_batched: the rows of many adapters in one call, each row against its own slot's R columns
//   of the stacked A [S R, in] and B [out, S R] (no mask over the S R columns, no index_select of
//   the slots present): rows are sorted by slot and each slot's rows run as one group.
//
// A group is cut into tasks of up to kChunk rows; a task reads its adapter's A and B once, each row
// of them (widened to fp32 in L1 for bf16) against all the task's rows: the shrink h = A x (r dot
// products over `in` a row), then the expand (kOut outputs at a time, B's columns for them transposed
// in L1, each row's h broadcast against them), the [rows, r] intermediate in cache. The roundings are PEFT's, as
// the twins': in bf16 the shrink, the expand and the scale are each rounded to bf16, then y + that
// rounded once more (the twins' `y += delta`); fp32 sums in another order than the GEMMs', so the
// tests hold it to the twins within the dtype's tolerance.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "rows.h"

namespace orcaserve::ORCA_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 16;  // rows per task: the adapter's weights widened once per task
constexpr int64_t kOut = 2 * at::vec::Vectorized<float>::size();  // outputs per expand block

template <typename T>
inline float rounded(float v) {  // v as T would hold it (nearest even), back in fp32
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return static_cast<float>(T(v));
  }
}

float dot(const float* a, const float* b, int64_t n) {
  const int64_t w = Vec::size();
  Vec acc0(0.f), acc1(0.f);
  int64_t i = 0;
  for (; i + 2 * w <= n; i += 2 * w) {
    acc0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + i + w), Vec::loadu(b + i + w), acc1);
  }
  for (; i + w <= n; i += w) acc0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc0);
  float s = at::vec::vec_reduce_all<float>([](Vec p, Vec q) { return p + q; }, acc0 + acc1);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One adapter's weights for one projection: A rows a[0..r) of `in`, B's r columns from c0 of rows
// strided by ldb, and the scale.
template <typename T>
struct Adapter {
  const T* a;
  const T* b;
  int64_t ldb, c0, r;
  float scale;
};

// A run of rows (rows[begin, end)) under one adapter.
template <typename T>
struct Task {
  Adapter<T> w;
  int64_t begin, end;
};

// `n` values of T at `src` as fp32: `src` itself for fp32, else widened into `buf` (exact).
template <typename T>
const float* widened(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    to_float(src, buf, n);
    return buf;
  }
}

template <typename T>
void run_task(const Task<T>& task, const int64_t* rows, const T* x, T* y, int64_t ldy, int64_t in, int64_t out) {
  const Adapter<T>& w = task.w;
  const int64_t n = task.end - task.begin, r = w.r;
  std::vector<float> xs(n * in), abuf(in), h(n * r), bbuf(r);
  for (int64_t i = 0; i < n; ++i) to_float(x + rows[task.begin + i] * in, xs.data() + i * in, in);
  // The shrink, A's row j read once for the task's rows (in L1 across them).
  for (int64_t j = 0; j < r; ++j) {
    const float* aj = widened(w.a + j * in, abuf.data(), in);
    for (int64_t i = 0; i < n; ++i) h[i * r + j] = rounded<T>(dot(xs.data() + i * in, aj, in));
  }
  // The expand, kOut outputs at a time: their B columns transposed into bt [r, kOut] (widened), then
  // each row's update for the kOut outputs is r vector FMAs of h's values broadcast against bt's
  // rows (a dot product and a horizontal sum per output per row, as first built, cost more than
  // the base GEMMs; docs/lora.md "The segmented update in the dispatch table"). The rounded,
  // scaled update is added lane by lane.
  std::vector<float> bt(r * kOut);
  float sums[kOut];
  for (int64_t o0 = 0; o0 < out; o0 += kOut) {
    const int64_t m = std::min(kOut, out - o0);
    std::fill(bt.begin(), bt.end(), 0.f);
    for (int64_t k = 0; k < m; ++k) {
      const float* bo = widened(w.b + (o0 + k) * w.ldb + w.c0, bbuf.data(), r);
      for (int64_t j = 0; j < r; ++j) bt[j * kOut + k] = bo[j];
    }
    for (int64_t i = 0; i < n; ++i) {
      const float* hi = h.data() + i * r;
      Vec acc0(0.f), acc1(0.f);
      for (int64_t j = 0; j < r; ++j) {
        const Vec hj(hi[j]);
        acc0 = at::vec::fmadd(hj, Vec::loadu(bt.data() + j * kOut), acc0);
        acc1 = at::vec::fmadd(hj, Vec::loadu(bt.data() + j * kOut + Vec::size()), acc1);
      }
      acc0.store(sums);
      acc1.store(sums + Vec::size());
      T* yo = y + rows[task.begin + i] * ldy + o0;
      for (int64_t k = 0; k < m; ++k) {
        const float delta = rounded<T>(rounded<T>(sums[k]) * w.scale);
        yo[k] = static_cast<T>(static_cast<float>(yo[k]) + delta);
      }
    }
  }
}

template <typename T>
void run_all(const std::vector<Task<T>>& tasks, const int64_t* rows, const at::Tensor& x, const at::Tensor& y) {
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  const int64_t ldy = y.stride(0), in = x.size(1), out = y.size(1);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) run_task(tasks[k], rows, xp, yp, ldy, in, out);
  });
}

template <typename T>
void chunk(std::vector<Task<T>>& tasks, const Adapter<T>& w, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += kChunk) tasks.push_back({w, i, std::min(end, i + kChunk)});
}

void check(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK(y.device().is_cpu() && y.dim() == 2 && y.stride(1) == 1 && x.dim() == 2 && x.is_contiguous() &&
                  y.size(0) == x.size(0),
              op, ": y [T, out] with unit column stride (a column slice is fine), x [T, in] contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  b.scalar_type() == y.scalar_type() &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              op, ": y, x, a and b of one dtype, fp32 or bf16");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(1) == x.size(1) && b.dim() == 2 && b.stride(1) == 1 &&
                  b.size(0) == y.size(1),
              op, ": a [r, in] contiguous, b [out, r] with unit column stride");
}

}  // namespace

// The ops, one instance per ISA variant, registered by bindings.cpp (declared in ops.h).
void lora_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& rows, const at::Tensor& a,
               const at::Tensor& b, double scale) {
  check(y, x, a, b, "lora_sgmv");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous() && b.size(1) == a.size(0),
              "lora_sgmv: rows [N] int64, b [out, r] for a [r, in]");
  const int64_t n = rows.numel();
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < x.size(0), "lora_sgmv: row ", rp[i], " out of range");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "lora_sgmv", [&] {
    std::vector<Task<scalar_t>> tasks;
    const Adapter<scalar_t> w{a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), b.stride(0), 0, a.size(0),
                              static_cast<float>(scale)};
    chunk(tasks, w, 0, n);
    run_all(tasks, rp, x, y);
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
  rows.resize(start[slots]);
  std::vector<int64_t> at_slot(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < t; ++i)
    if (rs[i] >= 0) rows[at_slot[rs[i]]++] = i;
  const float* sc = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "lora_batched", [&] {
    std::vector<Task<scalar_t>> tasks;
    for (int64_t s = 0; s < slots; ++s) {
      const Adapter<scalar_t> w{a.data_ptr<scalar_t>() + s * rank * a.size(1), b.data_ptr<scalar_t>(), b.stride(0),
                                s * rank, rank, sc[s]};
      chunk(tasks, w, start[s], start[s + 1]);
    }
    run_all(tasks, rows.data(), x, y);
  });
}

}  // namespace orcaserve::ORCA_ISA
