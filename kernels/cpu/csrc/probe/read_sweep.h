// probe/read_sweep.cpp: the machine's read bandwidth, as the roof of a decode step
// (docs/one-stream.md "Measuring it"). Compiled once, without ISA flags; registered by bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace orcaserve {

// Reads `chunks` chunks of `chunk_bytes` of `buf` in turn (chunk i at (i mod buf's chunks) *
// chunk_bytes), every thread of one OpenMP region its contiguous share of each chunk, a barrier
// between chunks; returns each chunk's seconds [chunks] (float64), timed between the barriers.
at::Tensor read_sweep(const at::Tensor& buf, int64_t chunk_bytes, int64_t chunks);

}  // namespace orcaserve
