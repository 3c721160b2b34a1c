// The layers of a decode step of 1-4 rows in one OpenMP region (docs/one-stream.md, "One OpenMP
// region a step"). decoder_layers calls each GEMM as its own region (at::parallel_for: a fork, the
// threads taking panels, a join), 120 or more a step; here the step's threads enter once and meet at
// a barrier after each stage:
//
//   every thread: add + RMSNorm of its own copy of the residual, its own int8 rows of the GEMM's input
//   every thread: its panels of the GEMM (linear_int8_shared), into one shared output      | barrier
//   thread 0: rotary + K/V write, attention (the other threads wait, as before)            | barrier
//
// The element-wise ops each thread runs are the very functions decoder_layer calls on the same
// inputs, so every thread's copy holds the same bits and thread 0's is returned; each GEMM output
// element is one panel's tile, whichever thread computes it. So the result is decoder_layers', bit
// for bit (tests/model/test_layer_call.py). Redundant norms and quantizations cost a few us a layer at
// one row; what they save is a barrier before each GEMM. Compiled once, like decoder_layer.cpp.
#include "fused/layer_region.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <vector>

namespace orcaserve {
namespace {

constexpr int64_t kRegionRows = 4;  // a decode step of up to 4 streams (gemm/panels.h's kStreamRows)
// The most K and V bytes a step's attention may read in the region, all layers: at one thread's read rate
// (25-30 GB/s here) about 0.3 ms, under what the region saves a step in forks and joins, so the other
// thread's idle wait during attention does not outweigh it; a longer context takes the call's own path.
constexpr int64_t kRegionKvBytes = 8 << 20;

// Thrown at a barrier where another thread of the region failed: every thread leaves the region.
struct Aborted {};

// A reusable barrier for the region's threads: spins (the waits are the other thread's share of a
// GEMM, microseconds), then sleeps on the generation's futex (a preempted partner on a loaded
// machine: the core goes back to the scheduler, as OMP_WAIT_POLICY=passive does for libgomp's own
// waits); the last thread to arrive wakes sleepers only where there are any. abort() releases every
// waiter with Aborted.
class Barrier {
 public:
  // The team's size, before its first wait (a region may get fewer threads than it asks for).
  void join(int64_t threads) { threads_ = threads; }

  void wait() {
    const int gen = gen_.load();
    if (count_.fetch_add(1) + 1 == threads_) {
      count_.store(0);
      gen_.store(gen + 1);
      if (sleepers_.load() > 0) gen_.notify_all();
      return;
    }
    for (int64_t spin = 0; gen_.load() == gen; ++spin) {
      if (aborted_.load()) throw Aborted{};
      if (spin < kSpins) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        continue;
      }
      sleepers_.fetch_add(1);  // seq_cst: the releaser sees it, or this thread sees the new generation
      gen_.wait(gen);
      sleepers_.fetch_sub(1);
    }
    if (aborted_.load()) throw Aborted{};  // released by abort(), not by the team
  }

  void abort() {
    aborted_.store(true);
    gen_.fetch_add(1);  // wakes sleepers into their abort check
    gen_.notify_all();
  }

 private:
  static constexpr int64_t kSpins = 4096;
  int64_t threads_ = 1;
  std::atomic<int64_t> count_{0};
  std::atomic<int> gen_{0}, sleepers_{0};
  std::atomic<bool> aborted_{false};
};

}  // namespace

bool region_applies(const at::Tensor& x, int64_t family, at::IntArrayRef meta, const at::Tensor& seq_lens,
                    at::TensorList k_caches) {
  const char* env = std::getenv("ORCASERVE_LAYER_REGION");
  if ((family != 0 && family != 2) || x.size(0) > kRegionRows || x.size(0) == 0 || (env != nullptr && std::strcmp(env, "0") == 0))
    return false;
  int64_t context = 0;  // keys read a layer, over the step's requests
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < seq_lens.size(0); ++b) context += sl[b];
  const at::Tensor& k = k_caches[0];  // [blocks, block_size, KV heads, D] or alike: a key is a row of its last two
  const int64_t key_bytes = k.size(-1) * k.size(-2) * static_cast<int64_t>(k.element_size());
  if (2 * context * key_bytes * static_cast<int64_t>(k_caches.size()) > kRegionKvBytes) return false;
  for (size_t i = 16; i < meta.size(); ++i)
    if (meta[i] != meta[i % 16]) return false;  // the shared outputs are sized by the first layer's
  return true;
}

std::tuple<at::Tensor, at::Tensor> layers_in_region(
    const RegionOps& ops, const at::Tensor& x, const at::Tensor& h0, at::TensorList in_norms, at::TensorList post_norms,
    at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases, at::IntArrayRef meta,
    const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& slots, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
    const at::Tensor& block_tables, double scale, double eps, int64_t num_heads, int64_t num_kv_heads) {
  const int64_t n = static_cast<int64_t>(in_norms.size()), rows = x.size(0);
  const int64_t threads = std::max(1, at::get_num_threads());
  // The GEMMs' outputs, shared by the threads and reused by every layer (each is read before the
  // next layer's GEMM writes it again, barriers apart); down's is the step's last delta.
  std::vector<at::Tensor> out;
  for (int j = 0; j < 4; ++j) out.push_back(at::empty({rows, meta[4 * j]}, x.options()));
  std::vector<std::atomic<int64_t>> taken(4 * n * threads);  // per GEMM, per thread's range: zero
  Barrier barrier;
  at::Tensor attn, last;  // thread 0's attention output [rows, H * D]; its residual after the last layer
  int64_t team = 1;  // the threads the region got
  std::exception_ptr error;
  std::mutex error_lock;

  auto layers = [&](int64_t tid) {
    at::Tensor xt = x, h = h0;
    for (int64_t i = 0; i < n; ++i) {
      auto gemm = [&](int j, const at::Tensor& in) {  // projection j of layer i, then the barrier
        const int64_t* m = meta.data() + 16 * i + 4 * j;
        const PanelShare share{tid, team, taken.data() + (4 * i + j) * threads};
        if (ops.int8 != nullptr)
          ops.int8(in, weights[4 * i + j], biases.get(4 * i + j), m[0], m[1], m[2] != 0, m[3] != 0, out[j], share);
        else
          ops.bf16(in, weights[4 * i + j], biases.get(4 * i + j), m[0], out[j], share);
        barrier.wait();
      };
      if (i > 0) std::tie(xt, h) = ops.norm(xt, out[3], in_norms[i], eps);
      gemm(0, h);
      if (tid == 0) {
        const at::Tensor q = ops.rope(out[0], cos, sin, k_caches[i], v_caches[i], slots, num_heads, num_kv_heads);
        const at::Tensor a = at::empty(q.sizes(), q.options());  // [rows, H, D]
        ops.attend(q, k_caches[i], v_caches[i], cu_seqlens_q, seq_lens, block_tables, scale, a);
        attn = a.view({rows, -1});
      }
      barrier.wait();
      gemm(1, attn);
      std::tie(xt, h) = ops.norm(xt, out[1], post_norms[i], eps);
      gemm(2, h);
      gemm(3, ops.silu(out[2]));
    }
    if (tid == 0) last = xt;
  };
#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    {
      team = omp_get_num_threads();
      barrier.join(team);
    }  // (and its implicit barrier)
    const int64_t tid = omp_get_thread_num();
    try {
      layers(tid);
    } catch (const Aborted&) {
    } catch (...) {
      barrier.abort();
      const std::lock_guard<std::mutex> lock(error_lock);
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
  return {last, out[3]};
}

}  // namespace orcaserve
