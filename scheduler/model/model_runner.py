"""Selective batching: one packed forward for all scheduled tokens, attention split per request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from orcaserve.kernels import AttentionBackend
from orcaserve.kernels.pytorch.attention import TorchAttentionPlan
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.scheduler import SchedulerOutput
from orcaserve.scheduler.lora.resident import LoraSet
from orcaserve.scheduler.model.cuda_graphs import CudaGraphRunner
from orcaserve.scheduler.model.decoder import Decoder
from orcaserve.scheduler.model.families import lean_supports
from orcaserve.scheduler.model.step_buffers import StepBuffers

ATTN_NAME = "orcaserve_paged"
# A transformers causal LM (`PreTrainedModel`: `.config`, `.model.layers`, `.lm_head`); Any because
# transformers builds those attributes per architecture, which no static type describes.
CausalLM = Any


@dataclass
class StepLayout:
    """Where a step's queries sit: what an attention plan is built from."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    block_size: int
    max_seqlen_k: int


@dataclass
class StepContext:
    """Attention metadata of one step, built once and read by every layer."""

    backend: AttentionBackend
    plan: Any
    slot_mapping: torch.Tensor  # [T] int64
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [num_blocks, bs, H_kv, D]
    layout: StepLayout
    windowed: dict[int, TorchAttentionPlan] = field(default_factory=dict)  # sliding window -> plan

    def attend(self, q: torch.Tensor, k_cache, v_cache, scale: float | None, window: int | None) -> torch.Tensor:
        """The backend's attention, or for a sliding-window layer (Gemma 3's local layers) whose
        step reaches past its window, the PyTorch plan with the window in its masks: the C++ and
        Triton kernels attend to whole sequences (docs/serving.md "Supported architectures")."""
        if window is None or self.layout.max_seqlen_k <= window:
            return self.backend.attend(self.plan, q, k_cache, v_cache, scale)
        plan = self.windowed.get(window)
        if plan is None:
            lay = self.layout
            plan = TorchAttentionPlan(lay.cu_seqlens_q, lay.seq_lens, lay.block_tables, lay.block_size, window)
            self.windowed[window] = plan
        return plan.attend(q, k_cache, v_cache, scale if scale is not None else q.shape[-1] ** -0.5)


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention hook: write this step's K/V to the paged cache, attend through it."""
    ctx: StepContext = kwargs["orca_step"]
    k_cache, v_cache = ctx.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, H_kv, D]
    v = value[0].transpose(0, 1)
    ctx.backend.store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
    out = ctx.attend(q, k_cache, v_cache, scaling, kwargs.get("sliding_window"))  # [T, H, D]
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_NAME, _paged_attention)
# Masks are the backend's business: stop transformers from building a 4-D one.
AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)


class ModelRunner:
    """Runs a transformers causal LM over the packed tokens of a step.

    The whole step is one `[1, T]` sequence with per-token positions, so every linear layer and
    the MLP run once over all requests' tokens (ORCA's selective batching); only attention looks
    at request boundaries, through the paged cache. Logits are computed only where a request
    samples: the last scheduled token of a request that has caught up with its sequence.

    A step's inputs are built in `StepBuffers` (numpy on the host, one copy to the device); on
    CUDA the lean decoder's steps replay CUDA graphs (`CudaGraphRunner`) where one fits.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        backend: AttentionBackend,
        device: torch.device,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        cuda_graphs: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.device = device
        model.set_attn_implementation(ATTN_NAME)
        # Llama-family models run through the lean forward; others through transformers'.
        self.decoder = self._make_decoder(model) if lean_supports(model) else None
        max_blocks = -(-max_model_len // block_size) + 1
        self.buffers = StepBuffers(max_num_batched_tokens, max_num_seqs, max_blocks, block_size, device)
        self.graphs = (
            CudaGraphRunner(
                self.decoder, backend, self.buffers, kv_caches, max_num_seqs, max_num_batched_tokens, max_model_len
            )
            if self.decoder is not None
            else None
        )
        # Replay captured graphs (CUDA, triton backend, lean decoder only: the config decides).
        self.use_graphs = cuda_graphs and self.graphs is not None and device.type == "cuda"
        # Test-only: run every step padded to its graph's sizes, eagerly, on any device; the CPU
        # tests' proof that padding leaves every request's tokens unchanged.
        self.pad_steps = False
        # The LoRA adapters served (set by the engine; lora/resident.py): each step groups its rows by
        # adapter. In the lean decoder only (lora/load.py); steps holding adapters run eagerly, never
        # from a CUDA graph (docs/lora.md "The Triton kernels in the engine").
        self.loras: LoraSet | None = None

    def _make_decoder(self, model: CausalLM) -> Decoder:
        """The lean forward over `model` (a split one where the model is split: parallel/runner.py)."""
        return Decoder(model)

    def warm_up(self, max_tokens: int, max_samples: int) -> None:
        """Compile the GEMM kernels of every step size up front (`Decoder.warm_up`); capture the
        CUDA graphs."""
        if self.decoder is not None:
            self.decoder.warm_up(max_tokens, max_samples)
        if self.use_graphs and self.graphs is not None:
            self.graphs.capture_all()

    @property
    def argmax_head(self) -> bool:
        """Whether `execute(..., argmax=True)` runs: the lean decoder's lm_head takes the argmax."""
        return self.decoder is not None and self.decoder.head_argmax and not (self.use_graphs or self.pad_steps)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager, argmax: bool = False) -> torch.Tensor:
        """Forward the step; returns logits `[S, V]` of the S requests in `sched.sampling`: fp32, or
        the model's dtype from the lean decoder (the sampler widens them where it needs to). From
        a CUDA graph they are a view of its output buffer, valid until the next step runs.
        `argmax` (where `argmax_head`): each row's argmax `[S]` int64 instead, no logits made."""
        shape = self.buffers.prepare(sched, kv)
        lora = self.loras.step(sched.num_scheduled_tokens, sched.requests) if self.loras is not None else None
        if self.graphs is not None and lora is None:  # graphs hold no adapter's update: such steps run eagerly
            if self.use_graphs:
                logits = self.graphs.replay(shape)
                if logits is not None:
                    return logits
            if self.pad_steps:
                return self.graphs.run_eager(shape)
        self.buffers.upload(shape)
        t = self.buffers.tensors(shape.num_tokens, shape.num_seqs, shape.num_samples, shape.width)
        plan = self.backend.plan(
            t.cu_seqlens_q, t.seq_lens, t.block_tables, self.block_size, shape.max_seqlen_q, shape.max_seqlen_k
        )
        if self.decoder is not None:
            inputs = (t.input_ids, t.positions, t.sample_rows, self.backend, plan, t.slot_mapping, self.kv_caches)
            return self.decoder.forward(*inputs, lora=lora, argmax=argmax)
        layout = StepLayout(t.cu_seqlens_q, t.seq_lens, t.block_tables, self.block_size, shape.max_seqlen_k)
        ctx = StepContext(self.backend, plan, t.slot_mapping, self.kv_caches, layout)
        out = self.model(
            input_ids=t.input_ids[None],
            position_ids=t.positions[None],
            use_cache=False,
            logits_to_keep=t.sample_rows,
            orca_step=ctx,
        )
        return out.logits[0].float()  # [S, V]

    def to_host(self, tokens: torch.Tensor) -> Callable[[], list[int]]:  # tokens [S] int64 on the device
        """The step's one device-to-host copy, queued now: the returned call waits for it and
        gives the ids. On the CPU the ids are read at once (the step has run by now, and a later
        one may reuse the sampler's buffers)."""
        if tokens.device.type != "cuda":
            ids = tokens.tolist()
            return lambda: ids
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> list[int]:
            done.synchronize()
            return host.tolist()

        return wait
