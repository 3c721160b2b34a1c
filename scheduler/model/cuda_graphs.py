"""CUDA graphs of the lean decoder's step, one per padded size: replayed instead of ~20 launches
per layer from Python.

A graph is captured over the persistent device buffers of `StepBuffers` (token ids, positions,
slots, query offsets, context lengths, the block table, the sampling rows) and replays whatever
values they hold, so a step runs from a graph when it is padded to that graph's sizes
(`GraphKey`): tokens to the next bucket (`padded_size`), requests and sampling rows to the
bucket (decode steps, where B == T) or to min(bucket, max_num_seqs) (mixed steps). Pad tokens
store nowhere and sit outside every request's queries, so the real rows are computed as
unpadded; the GEMMs run at more rows, which on a GPU may round differently (cuBLAS picks kernels
by shape), as any change of batch does.

Everything the attention kernels decide on the host is fixed per graph: the tile configuration
(decode graphs are captured with max_seqlen_q 1, mixed ones with their token count, which
selects the prefill tiles, exact for any step) and the split-K count. A step's split count is
the heuristic's (`choose_num_splits` at the padded sizes and the step's longest context), rounded
down to a power of two; the split kernel is exact for any count, so this changes speed only.
Graphs of one split are captured at start; other counts on first use (at most
`MAX_LAZY_GRAPHS`), as only decode steps with few requests and long contexts take them.

Modelled on vLLM v1's full CUDA graphs (`gpu_model_runner.py`: cu_seqlens padded by repeating
its last value, context lengths 0) and SGLang's `cuda_graph_runner.py` (two warm-up runs on the
capture stream, capture from the largest size down into one shared memory pool).
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from orcaserve.kernels import AttentionBackend
from orcaserve.scheduler.model.step_buffers import StepBuffers, StepShape

log = logging.getLogger(__name__)

MAX_LAZY_GRAPHS = 64  # split-K variants captured on first use


def bucket_sizes(max_tokens: int) -> list[int]:
    """The padded token counts: 1, 2, 4, then multiples of 8 up to 128, then 8 sizes per doubling
    (step size / 8: 144, 160, ..., 256, 288, ..., 512, 576, ...), and `max_tokens` itself.

    Small sizes are dense because decode steps live there and padding a GPU decode step costs
    little but a graph per size costs nothing at replay; above 128 tokens a step pads by at most
    12.5 %, while the count stays small (59 sizes up to 4096, 27 up to 256) so start-up captures
    them in seconds and their memory is one shared pool."""
    sizes = [s for s in (1, 2, 4) if s < max_tokens]
    size, step = 8, 8
    while size < max_tokens:
        sizes.append(size)
        if size >= 128 and size & (size - 1) == 0:  # a power of two from 128 on: next octave
            step = size // 8
        size += step
    return sizes + [max_tokens]


def padded_size(num_tokens: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding `num_tokens`; None above the largest."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class GraphKey:
    num_tokens: int  # padded T
    num_seqs: int  # padded B (and sample rows)
    decode: bool  # every request one query token: decode tiles
    num_splits: int = 1


class CudaGraphRunner:
    """Captures and replays the lean decoder's forward per `GraphKey` (see the module docstring).

    `run_eager` runs the same padded forward without a graph: the CPU tests' check that padding
    changes nothing, and the path a size takes whose graph is missing."""

    def __init__(
        self,
        decoder: Any,  # the lean `Decoder`
        backend: AttentionBackend,
        buffers: StepBuffers,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_num_tokens: int,
        max_model_len: int,
    ) -> None:
        self.decoder, self.backend, self.buffers, self.kv_caches = decoder, backend, buffers, kv_caches
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.mixed_sizes = bucket_sizes(max_num_tokens)
        self.decode_sizes = bucket_sizes(min(max_num_seqs, max_num_tokens))
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.logits: torch.Tensor | None = None  # [max_num_seqs, V], written by every graph
        self.pool: Any = None
        self.stream: torch.cuda.Stream | None = None
        self.lazy_left = MAX_LAZY_GRAPHS
        self.capture_seconds = 0.0
        self.replays = 0

    # ---- which graph --------------------------------------------------------------------------
    def key_for(self, shape: StepShape) -> GraphKey:
        """The sizes a step pads to, and its split count."""
        if shape.decode_only:
            t = padded_size(shape.num_tokens, self.decode_sizes)
            if t is not None:
                return self._with_splits(GraphKey(t, t, True), shape.max_seqlen_k)
        t = padded_size(shape.num_tokens, self.mixed_sizes)
        if t is None:
            raise ValueError(f"a step of {shape.num_tokens} tokens exceeds the largest bucket {self.mixed_sizes[-1]}")
        return self._with_splits(GraphKey(t, min(t, self.max_num_seqs), False), shape.max_seqlen_k)

    def _with_splits(self, key: GraphKey, max_seqlen_k: int) -> GraphKey:
        if self.backend.name != "triton":
            return key
        from orcaserve.kernels.triton.attention import SPLIT_MAX, choose_num_splits, num_sms

        k_cache = self.kv_caches[0][0]
        n_kv = k_cache.shape[2]
        g = self.decoder.num_heads // n_kv
        max_q = 1 if key.decode else key.num_tokens
        n = choose_num_splits(
            key.num_tokens,
            key.num_seqs,
            n_kv,
            g,
            max_q,
            max_seqlen_k,
            num_sms(k_cache.device),
            k_cache.dtype,
            head_dim=k_cache.shape[3],
        )
        n = 1 << (min(n, SPLIT_MAX).bit_length() - 1)  # a power of two: few graphs
        return GraphKey(key.num_tokens, key.num_seqs, key.decode, n)

    def _plan(self, key: GraphKey, max_seqlen_k: int) -> Any:
        t = self.buffers.tensors(key.num_tokens, key.num_seqs, key.num_seqs, width=None)
        max_q = 1 if key.decode else key.num_tokens
        bs = self.buffers.block_size
        plan = self.backend.plan(t.cu_seqlens_q, t.seq_lens, t.block_tables, bs, max_q, max_seqlen_k)
        if hasattr(plan, "num_splits"):  # the Triton plan: fixed, not chosen at the first layer
            plan.num_splits = key.num_splits
        return plan

    def _forward(self, key: GraphKey, plan: Any) -> torch.Tensor:
        """The decoder over the buffers at the key's sizes: logits [num_seqs, V] of the rows."""
        t = self.buffers.tensors(key.num_tokens, key.num_seqs, key.num_seqs, width=None)
        return self.decoder.forward(
            t.input_ids, t.positions, t.sample_rows, self.backend, plan, t.slot_mapping, self.kv_caches
        )

    def _fill(self, shape: StepShape, key: GraphKey) -> None:
        self.buffers.pad(shape, key.num_tokens, key.num_seqs, key.num_seqs)
        self.buffers.upload(shape, graph_table=True)

    # ---- running ------------------------------------------------------------------------------
    def run_eager(self, shape: StepShape) -> torch.Tensor:
        """The step (already `prepare`d in the buffers) padded to its graph's sizes, run eagerly:
        logits [S, V] of its sampling rows."""
        key = self.key_for(shape)
        self._fill(shape, key)
        plan = self._plan(key, shape.max_seqlen_k)  # the CPU plans read the step's values here
        return self._forward(key, plan)[: shape.num_samples]

    def replay(self, shape: StepShape) -> torch.Tensor | None:
        """The step from its graph (captured now if it is a split-K variant not yet seen);
        None if there is none. The logits are a view of a buffer the next replay overwrites."""
        key = self.key_for(shape)
        if key not in self.graphs:
            if key.num_splits == 1 or self.lazy_left <= 0 or not self.graphs:
                return None
            self.lazy_left -= 1
            if not self.capture(key):
                return None
        graph, _ = self.graphs[key]
        self._fill(shape, key)
        graph.replay()
        self.replays += 1
        assert self.logits is not None
        return self.logits[: shape.num_samples]

    # ---- capture ------------------------------------------------------------------------------
    def capture_all(self) -> None:
        """One-split graphs of every size, largest first (smaller ones reuse its pool memory)."""
        keys = [GraphKey(t, min(t, self.max_num_seqs), False) for t in self.mixed_sizes]
        keys += [GraphKey(t, t, True) for t in self.decode_sizes]
        keys.sort(key=lambda k: (k.num_tokens, k.num_seqs), reverse=True)
        gc.collect()
        gc.freeze()  # nothing Python holds is collected while capturing (SGLang does the same)
        failures = 0
        try:
            for key in keys:
                # A forward that cannot be captured fails at every size: stop after a few (one
                # size alone failing, e.g. the largest out of memory, leaves the others).
                failures = 0 if self.capture(key) else failures + 1
                if failures == 3:
                    break
        finally:
            gc.unfreeze()
        log.info("CUDA graphs: %d captured in %.1f s", len(self.graphs), self.capture_seconds)

    def capture(self, key: GraphKey) -> bool:
        """Warm up and capture `key`'s graph; False (logged) if this forward cannot be captured,
        which leaves its steps eager."""
        dev = self.buffers.device
        if dev.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, not {dev}")
        started = time.perf_counter()
        if self.stream is None:
            self.stream = torch.cuda.Stream(dev)
        buf = self.buffers
        try:
            torch.cuda.synchronize(dev)  # real steps' copies into the buffers are done
            buf.reset_device(key.num_tokens, key.num_seqs)
            plan = self._plan(key, self.max_model_len)
            self.stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(self.stream):
                for _ in range(2):  # compiles the Triton kernels, sets up cuBLAS on this stream
                    out = self._forward(key, plan)
            torch.cuda.synchronize(dev)
            if self.logits is None:  # outside any graph: it outlives them all
                self.logits = torch.empty(self.max_num_seqs, out.shape[1], dtype=out.dtype, device=dev)
            del out
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                self.logits[: key.num_seqs].copy_(self._forward(key, plan))
            torch.cuda.synchronize(dev)
        except Exception as e:  # e.g. a host sync inside the model (a dynamic rope): eager it is
            log.warning("CUDA graph of %s not captured (%s: %s); those steps run eagerly", key, type(e).__name__, e)
            torch.cuda.synchronize(dev)
            return False
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, plan)
        self.capture_seconds += time.perf_counter() - started
        return True
