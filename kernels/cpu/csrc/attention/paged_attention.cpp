// Ragged paged attention on the CPU, reading the paged KV cache in place.
//
// Same semantics as orcaserve.kernels.pytorch.attention.unified_attention: request b owns the queries
// cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1, which are the last q_len positions of its seq_lens[b]
// tokens; each attends causally to the keys at or before its position, found through
// block_tables[b]. Prefill chunks and decodes share one call.
//
// Work item = (request, tile of its queries, KV heads). Its rows are the tile's tokens times the
// G query heads of each KV head, so each K/V block row is read once per item and used by all of
// them. A prefill tile covers one KV head; a decode covers all of them when there are enough
// decodes to keep the threads busy. Items are drained from an atomic counter (largest first) by
// at::parallel_for's threads: a static split would leave one thread alone with a long prefill.
//
// Two kernels, picked by the rows per KV head:
//  * few (decodes, short chunks): attention/decode.h, scores per key and row, softmax and
//    P @ V per segment of up to 256 keys, bf16 caches multiplied as stored where the CPU can;
//  * many (prefill tiles), here with the block kernels of attention/tile.h: rows in vector
//    lanes, so no key needs a horizontal sum (fp32 FMAs, or bf16 pairs through vdpbf16ps where
//    the CPU has it); an fp32 online softmax per block, vectorised over rows, and a
//    register-blocked P @ V update. bf16 on a CPU with AMX runs its prefill tiles, in larger
//    tiles, through AMX instead (attention/amx.h), about twice as fast.
// Only slots before each item's last query position are read: the rest may hold anything.

#include <ATen/Parallel.h>

#include <atomic>

#include "attention/amx.h"
#include "attention/common.h"
#include "attention/decode.h"
#include "attention/tile.h"
#include "ops.h"

namespace orcaserve::ORCA_ISA {
namespace {

// Tunables (measured on a 2-core AVX-512 VM, SmolLM2 heads): an item with at most kDotRows rows
// per KV head uses the decode kernel; a prefill tile holds about kTileRows rows; below kSerialWork
// row-keys per call the OpenMP fork costs more than it saves.
constexpr int kDotRows = 8;
constexpr int kTileRows = 64;
constexpr int64_t kSerialWork = 4096;
// A request with at most this many new tokens (a verifying row of speculative decoding: 1 + K, K up
// to 16) runs its queries in items of the decode kernel (kDotRows / G tokens each), never in a
// prefill tile: each query then sums exactly as a decode of it alone does, so speculation's
// greedy answers equal plain decoding's bit for bit (docs/speculative-decoding.md, "Exactness").
constexpr int64_t kFewTokens = 17;

// A prefill tile: one KV head, rows r = (token i0 + r / G, query head g = r % G), more than kDotRows.
template <typename T, int D>
void attend_tile(const Args& a, const Item& it, Scratch& sc) {
  constexpr bool dp = kHaveDpBf16 && std::is_same_v<T, at::BFloat16>;
  constexpr int NC = D / kV;
  const int G = static_cast<int>(a.group);
  const int64_t bs = a.block_size;
  const Span sp(a, it, D);
  const int64_t q_begin = sp.q_begin, first_pos = sp.first_pos, kmax = sp.kmax, row_stride = sp.row_stride;
  const int R = sp.R;
  const int Rp = (R + kV - 1) / kV * kV;
  const int64_t diag = first_pos + it.i0;  // keys past this are masked for some rows
  const int32_t* table = sp.table;
  const T* kc = static_cast<const T*>(a.k_cache) + it.h0 * D;
  const T* vc = static_cast<const T*>(a.v_cache) + it.h0 * D;

  float* qb = sc.q.data();
  float* o = sc.o.data();
  float* s = sc.s.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  float* alpha = sc.alpha.data();
  float* qpos = sc.qpos.data();
  auto token = [&](int r) { return it.i0 + r / G; };
  auto head = [&](int r) { return it.h0 * G + r % G; };
  for (int r = 0; r < Rp; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
    // Padding rows see every key, so they never produce -inf - -inf.
    qpos[r] = r < R ? static_cast<float>(first_pos + token(r)) : 3e38f;
  }
  int32_t* qp = sc.pairs.data();  // bf16 dot path: [D / 2, Rp] query pairs, then P @ V's operands
  int32_t* pp = qp + Rp * D / 2;
  int32_t* vp = pp + (bs + 1) / 2 * Rp;
  if constexpr (dp) {
    std::fill(o, o + D * Rp, 0.f);  // transposed, [D, Rp]
    std::fill(qp, qp + Rp * D / 2, 0);
    for (int r = 0; r < R; ++r) {
      const T* qr = static_cast<const T*>(a.q) + (q_begin + token(r)) * a.sq_t + head(r) * a.sq_h;
      for (int d2 = 0; d2 < D / 2; ++d2) std::memcpy(qp + d2 * Rp + r, qr + 2 * d2, sizeof(int32_t));
    }
  } else {
    std::fill(o, o + R * D, 0.f);
    const Vec vscale(a.scale);
    for (int r = 0; r < R; ++r) {
      const T* qr = static_cast<const T*>(a.q) + (q_begin + token(r)) * a.sq_t + head(r) * a.sq_h;
      alignas(64) float tmp[D];
      for (int c = 0; c < NC; ++c) (load_f(qr + c * kV) * vscale).store(tmp + c * kV);
      for (int d = 0; d < D; ++d) qb[d * Rp + r] = tmp[d];
    }
    for (int d = 0; d < D; ++d) std::fill(qb + d * Rp + R, qb + (d + 1) * Rp, 0.f);
  }

  const int64_t num_blocks = (kmax + bs - 1) / bs;
  for (int64_t bi = 0; bi < num_blocks; ++bi) {
    const int64_t k0 = bi * bs;
    const int nk = static_cast<int>(std::min<int64_t>(bs, kmax - k0));
    const int64_t slot0 = static_cast<int64_t>(table[bi]) * bs * row_stride;
    if (bi + 1 < num_blocks) {
      const int64_t next0 = static_cast<int64_t>(table[bi + 1]) * bs * row_stride;
      const int nk_next = static_cast<int>(std::min<int64_t>(bs, kmax - k0 - bs));
      prefetch_rows(kc + next0, nk_next, D, row_stride);
      prefetch_rows(vc + next0, nk_next, D, row_stride);
    }
    // Scores transposed, s[j * Rp + r].
    int64_t ldk = 0, ldv = 0;
    const float* vb = nullptr;
    if constexpr (dp) {
#ifdef ORCA_DPBF16  // as in attend_rows: a discarded branch must still name declared things
      qk_block_dp<D>(qp, Rp, kc + slot0, row_stride, nk, s, a.scale);
#endif
    } else {
      const float* kb = block_rows<T, D>(kc + slot0, sc.kf.data(), nk, row_stride, &ldk);
      vb = block_rows<T, D>(vc + slot0, sc.vf.data(), nk, row_stride, &ldv);
      int rc = 0;  // eight accumulators per call hide the FMA latency
      for (; rc + 2 * kV <= Rp; rc += 2 * kV) {
        int j = 0;
        for (; j + 4 <= nk; j += 4) qk_tile<D, 2, 4>(qb, Rp, kb, ldk, s, rc, j);
        for (; j < nk; ++j) qk_tile<D, 2, 1>(qb, Rp, kb, ldk, s, rc, j);
      }
      if (rc < Rp) {
        int j = 0;
        for (; j + 8 <= nk; j += 8) qk_tile<D, 1, 8>(qb, Rp, kb, ldk, s, rc, j);
        for (; j < nk; ++j) qk_tile<D, 1, 1>(qb, Rp, kb, ldk, s, rc, j);
      }
    }
    const bool masked = k0 + nk - 1 > diag;
    const Vec ninf(kNegInf);
    for (int rc = 0; rc < Rp; rc += kV) {
      const Vec qv = Vec::loadu(qpos + rc);
      const Vec m_old = Vec::loadu(m + rc);
      Vec mv = m_old;
      for (int j = 0; j < nk; ++j) {
        Vec sj = Vec::loadu(s + j * Rp + rc);
        if (masked) {
          sj = Vec::blendv(sj, ninf, Vec(static_cast<float>(k0 + j)) > qv);
          sj.store(s + j * Rp + rc);
        }
        mv = at::vec::maximum(mv, sj);
      }
      const Vec al = (m_old - mv).exp_u20();
      Vec sum(0.f);
      for (int j = 0; j < nk; ++j) {
        Vec p = (Vec::loadu(s + j * Rp + rc) - mv).exp_u20();
        p.store(s + j * Rp + rc);
        sum = sum + p;
      }
      (Vec::loadu(l + rc) * al + sum).store(l + rc);
      mv.store(m + rc);
      al.store(alpha + rc);
    }
    if constexpr (dp) {
#ifdef ORCA_DPBF16
      pv_operands_dp<D>(s, Rp, vc + slot0, row_stride, nk, pp, vp);
      pv_block_dp<D>(o, Rp, alpha, pp, vp, nk);
#endif
    } else {
      const int64_t block0 = 0;  // vb is the block itself
      pv_fma<float, D>(o, D, R, alpha, s, 1, Rp, vb, &block0, 1, nk, ldv, nk);
    }
  }

  for (int r = 0; r < R; ++r) {
    alignas(64) float tmp[D];
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; ++d) tmp[d] = (dp ? o[d * Rp + r] : o[r * D + d]) * inv;
    at::vec::convert(tmp, static_cast<T*>(a.out) + (q_begin + token(r)) * a.so_t + head(r) * a.so_h, D);
  }
}

template <typename T, int D>
void run(const Args& a, int64_t batch) {
  const int64_t G = a.group, n_kv = a.n_kv;
  bool amx = false;  // bf16 prefill tiles on AMX (attention/amx.h), in larger tiles
#ifdef ORCA_DPBF16
  if constexpr (std::is_same_v<T, at::BFloat16> && D % 32 == 0) amx = amx_attention();
#endif
  const int64_t tile = std::max<int64_t>(1, (amx ? kAmxRows : kTileRows) / G);
  const int64_t threads = at::get_num_threads();
  // Decodes take all KV heads per item (fewer, larger items) unless that leaves too few items to
  // keep every thread busy, or their rows need the tile kernel, which does one KV head.
  int64_t decodes = 0;
  for (int64_t b = 0; b < batch; ++b) decodes += a.cu[b + 1] - a.cu[b] == 1;
  const int64_t heads_per_decode = decodes >= 4 * threads && G <= kDotRows ? n_kv : 1;
  std::vector<Item> items;
  int64_t total = 0, max_rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = a.cu[b + 1] - a.cu[b];
    const int64_t ctx = a.seq_lens[b];
    TORCH_CHECK(n >= 0 && n <= ctx, "paged_attention: request ", b, " has ", n,
                " new tokens but a context of ", ctx);
    const int64_t nh = n == 1 ? heads_per_decode : 1;
    const int64_t step = n <= kFewTokens ? std::max<int64_t>(1, kDotRows / G) : tile;
    for (int64_t i0 = 0; i0 < n; i0 += step) {
      const int64_t i1 = std::min(n, i0 + step);
      const int64_t cost = (i1 - i0) * G * nh * (ctx - n + i1);
      for (int64_t h = 0; h < n_kv; h += nh)
        items.push_back({(int32_t)b, (int32_t)i0, (int32_t)i1, (int32_t)h, (int32_t)(h + nh), cost});
      total += cost * (n_kv / nh);
      max_rows = std::max(max_rows, (i1 - i0) * G);  // both kernels work one KV head at a time
    }
  }
  if (items.empty()) return;
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });

  const int64_t bs = a.block_size;
  const int64_t rp = (max_rows + kV - 1) / kV * kV;
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t workers = total < kSerialWork ? 1 : std::min(threads, n_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local Scratch sc;
    sc.reserve(rp, kPaddedDim<D>, bs, score_stride(bs));
    bool used_amx = false;
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      if ((it.i1 - it.i0) * G <= kDotRows) {
        attend_rows<T, D>(a, it, sc);
        continue;
      }
#ifdef ORCA_DPBF16
      if constexpr (std::is_same_v<T, at::BFloat16> && D % 32 == 0) {
        if (amx) {
          thread_local AmxScratch asc;
          asc.reserve(rp, D);
          attend_tile_amx<D>(a, it, asc);
          used_amx = true;
          continue;
        }
      }
#endif
      attend_tile<T, D>(a, it, sc);
    }
    if (used_amx) at::native::cpublas::brgemm_release();  // the thread's AMX tile configuration
  });
}

template <typename T>
void dispatch_dim(const Args& a, int64_t batch, int64_t d) {
  switch (d) {
    case 16: return run<T, 16>(a, batch);
    case 32: return run<T, 32>(a, batch);
    case 64: return run<T, 64>(a, batch);
    case 80: return run<T, 80>(a, batch);
    case 96: return run<T, 96>(a, batch);
    case 128: return run<T, 128>(a, batch);
    case 256: return run<T, 256>(a, batch);
    default: TORCH_CHECK(false, "paged_attention: head dim ", d, " not compiled (16, 32, 64, 80, 96, 128, 256)");
  }
}

}  // namespace

// The op, one instance per ISA variant, registered by bindings.cpp (declared in ops.h).
void paged_attention(const at::Tensor& q,             // [T, H, D]
                     const at::Tensor& k_cache,       // [num_blocks, block_size, H_kv, D]
                     const at::Tensor& v_cache,       // [num_blocks, block_size, H_kv, D]
                     const at::Tensor& cu_seqlens_q,  // [B + 1] int32
                     const at::Tensor& seq_lens,      // [B] int32
                     const at::Tensor& block_tables,  // [B, max_blocks] int32
                     double scale, const at::Tensor& out) {  // [T, H, D]
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 4, "paged_attention: bad ranks");
  TORCH_CHECK(q.device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.sizes() == out.sizes(), "paged_attention: out must have q's shape");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "paged_attention: K/V caches differ in shape");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype,
              "paged_attention: q, caches and out must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_attention: head dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches must be contiguous");
  for (const auto* t : {&cu_seqlens_q, &seq_lens, &block_tables})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "paged_attention: metadata must be contiguous int32 CPU tensors");
  const int64_t h = q.size(1), d = q.size(2), n_kv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && h % n_kv == 0, "paged_attention: head layout mismatch");
  const int64_t batch = seq_lens.size(0);
  TORCH_CHECK(cu_seqlens_q.size(0) == batch + 1 && block_tables.dim() == 2 && block_tables.size(0) == batch,
              "paged_attention: metadata shapes mismatch");
  TORCH_CHECK(cu_seqlens_q.data_ptr<int32_t>()[0] >= 0 && cu_seqlens_q.data_ptr<int32_t>()[batch] <= q.size(0),
              "paged_attention: cu_seqlens_q outside [0, T]");
  if (batch == 0 || q.size(0) == 0) return;
  // The kernel trusts block_tables for the blocks a request's context covers: check them once.
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bs = k_cache.size(1), width = block_tables.size(1), num_blocks = k_cache.size(0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t nb = (sl[b] + bs - 1) / bs;
    TORCH_CHECK(sl[b] >= 0 && nb <= width, "paged_attention: request ", b, " needs ", nb, " blocks, table has ", width);
    for (int64_t i = 0; i < nb; ++i)
      TORCH_CHECK(bt[b * width + i] >= 0 && bt[b * width + i] < num_blocks, "paged_attention: block id out of range");
  }

  Args a{q.data_ptr(), q.stride(0), q.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
         k_cache.data_ptr(), v_cache.data_ptr(), bs, n_kv, h / n_kv,
         cu_seqlens_q.data_ptr<int32_t>(), sl, bt, width, static_cast<float>(scale)};
  switch (dtype) {
    case at::kFloat: return dispatch_dim<float>(a, batch, d);
    case at::kBFloat16: return dispatch_dim<at::BFloat16>(a, batch, d);
    case at::kHalf: return dispatch_dim<at::Half>(a, batch, d);
    default: TORCH_CHECK(false, "paged_attention: dtype ", dtype, " not supported");
  }
}

}  // namespace orcaserve::ORCA_ISA

