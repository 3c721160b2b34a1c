// A GEMM's panels shared by the threads of a parallel region that the caller opened (a decoder
// step's layers in one region, fused/layer_region.cpp): each thread calls the GEMM with its own
// PanelShare and computes the panels it takes (gemm/panels.h's for_each_panel_shared), instead of
// the GEMM opening its own region (docs/one-stream.md, "One OpenMP region a step").
#pragma once

#include <atomic>
#include <cstdint>

namespace orcaserve {

// Thread `thread` of `threads`; `taken` points at `threads` counters, zero before the GEMM and
// shared by its threads (one set a GEMM: the panels taken from each thread's range).
struct PanelShare {
  int64_t thread, threads;
  std::atomic<int64_t>* taken;
};

}  // namespace orcaserve
