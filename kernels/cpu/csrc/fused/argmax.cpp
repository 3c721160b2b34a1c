// Row-wise argmax of fp32 or bf16 logits for the sampler, in place of ATen's slower CPU argmax
// (docs/performance-log.md#figures-from-code-comments).
//
// Same answer as torch.argmax(dim=-1): the first index of the maximum, and the first NaN's index
// if a row has one (torch counts NaN as the largest value).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <limits>
#include <vector>
#include "ops.h"

namespace orcaserve::ORCA_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;

// First index in [0, n) whose value is `target` (NaN: the first NaN); n if none.
int64_t first_index_of(const float* x, int64_t n, float target) {
  const bool nan = std::isnan(target);
  const Vec t(target);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec v = Vec::loadu(x + i);
    const Vec hit = nan ? v.isnan() : (v == t);
    if (hit.zero_mask() != (1 << Vec::size()) - 1) break;  // some lane matched
  }
  for (; i < n; ++i) {
    if (nan ? std::isnan(x[i]) : x[i] == target) return i;
  }
  return n;
}

int64_t argmax_row(const float* x, int64_t n) {
  // maximum() propagates NaN, so a row with a NaN reduces to NaN.
  float best = at::vec::reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, x, n);
  return first_index_of(x, n, best);
}

}  // namespace

// The op, one instance per ISA variant, registered by bindings.cpp (declared in ops.h).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16) &&
                  logits.size(1) > 0,
              "argmax_rows: a contiguous, non-empty [rows, V] fp32 or bf16 CPU tensor");
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t grain = std::max<int64_t>(1, 65536 / n);
  if (logits.scalar_type() == at::kFloat) {
    const float* lp = logits.data_ptr<float>();
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(lp + r * n, n);
    });
    return out;
  }
  // bf16 widens to fp32 exactly, so the argmax of the widened row is the answer; a row at a time
  // into a buffer that stays in cache, instead of a whole fp32 copy of the batch's logits.
  const at::BFloat16* lp = logits.data_ptr<at::BFloat16>();
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(n);
    for (int64_t r = r0; r < r1; ++r) {
      at::vec::convert(lp + r * n, row.data(), n);
      op[r] = argmax_row(row.data(), n);
    }
  });
  return out;
}

}  // namespace orcaserve::ORCA_ISA

