// Bytes a GEMM requests into cache while it computes (docs/lora.md "Reading the adapters during the
// base GEMM"): the LoRA adapters' weights the update after it reads, whose read from memory would
// otherwise run alone after the GEMM. A GEMM of many rows is compute-bound and leaves memory
// bandwidth unused; spread over its micro-tiles, these requests use it. Prefetches only: what the
// GEMM computes is unchanged, bit for bit.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace orcaserve::ORCA_ISA {

// The cache lines of a list of tensors' storage, numbered in one sequence; a task asks for its share.
class AheadLines {
 public:
  explicit AheadLines(at::TensorList tensors) {
    for (const at::Tensor& t : tensors) {
      if (t.numel() == 0) continue;
      // The tensor's extent: from its first element to its last (a transposed view covers its storage).
      int64_t last = 0;
      for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
      const auto* p = static_cast<const char*>(t.data_ptr());
      const auto begin = reinterpret_cast<std::uintptr_t>(p) & ~std::uintptr_t(63);
      const auto end = reinterpret_cast<std::uintptr_t>(p + (last + 1) * t.element_size());
      begin_.push_back(begin);
      first_.push_back(total_);
      total_ += static_cast<int64_t>((end - begin + 63) / 64);
    }
    first_.push_back(total_);
  }
  int64_t total() const { return total_; }

  // Lines [l0, l1) of the sequence, requested into L2 one per `step` call, `per` lines at a time.
  class Cursor {
   public:
    Cursor() = default;
    Cursor(const AheadLines* lines, int64_t l0, int64_t l1) : lines_(lines), line_(l0), end_(l1) {
      if (line_ < end_) seek();
    }
    // Requests the next n lines (fewer at the end of the share).
    inline void next(int64_t n) {
      for (; n > 0 && line_ < end_; --n) {
        _mm_prefetch(reinterpret_cast<const char*>(addr_), _MM_HINT_T1);
        addr_ += 64;
        if (++line_ < end_ && line_ == lines_->first_[region_ + 1]) {
          ++region_;
          addr_ = lines_->begin_[region_];
        }
      }
    }
    int64_t left() const { return end_ - line_; }

   private:
    void seek() {
      region_ = std::upper_bound(lines_->first_.begin(), lines_->first_.end(), line_) - lines_->first_.begin() - 1;
      addr_ = lines_->begin_[region_] + (line_ - lines_->first_[region_]) * 64;
    }
    const AheadLines* lines_ = nullptr;
    int64_t line_ = 0, end_ = 0, region_ = 0;
    std::uintptr_t addr_ = 0;
  };

  // Task `i` of `n` tasks: its even share of the lines.
  Cursor share(int64_t i, int64_t n) const { return Cursor(this, i * total_ / n, (i + 1) * total_ / n); }

 private:
  std::vector<std::uintptr_t> begin_;  // each region's first line's address
  std::vector<int64_t> first_;         // each region's first line in the sequence, then the total
  int64_t total_ = 0;
};

}  // namespace orcaserve::ORCA_ISA
