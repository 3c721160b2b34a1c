"""Selective batching: one packed forward for all scheduled tokens, attention split per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from orcaserve.kernels import AttentionBackend
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.scheduler import SchedulerOutput
from orcaserve.scheduler.model.decoder import Decoder
from orcaserve.scheduler.model.decoder import supports as decoder_supports

ATTN_NAME = "orcaserve_paged"
# A transformers causal LM (`PreTrainedModel`: `.config`, `.model.layers`, `.lm_head`); Any because
# transformers builds those attributes per architecture, which no static type describes.
CausalLM = Any


@dataclass
class StepContext:
    """Attention metadata of one step, built once and read by every layer."""

    backend: AttentionBackend
    plan: Any
    slot_mapping: torch.Tensor  # [T] int64
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [num_blocks, bs, H_kv, D]


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention hook: write this step's K/V to the paged cache, attend through it."""
    ctx: StepContext = kwargs["orca_step"]
    k_cache, v_cache = ctx.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [T, H, D]
    k = key[0].transpose(0, 1)  # [T, H_kv, D]
    v = value[0].transpose(0, 1)
    ctx.backend.store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
    out = ctx.backend.attend(ctx.plan, q, k_cache, v_cache, scaling)  # [T, H, D]
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
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        backend: AttentionBackend,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.backend = backend
        self.device = device
        model.set_attn_implementation(ATTN_NAME)
        # Llama-family models run through the lean forward; others through transformers'.
        self.decoder = Decoder(model) if decoder_supports(model) else None

    def warm_up(self, max_tokens: int, max_samples: int) -> None:
        """Compile the GEMM kernels of every step size up front (`Decoder.warm_up`)."""
        if self.decoder is not None:
            self.decoder.warm_up(max_tokens, max_samples)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> torch.Tensor:
        """Forward the step; returns logits `[S, V]` of the S requests in `sched.sampling`: fp32, or
        the model's dtype from the lean decoder (the sampler widens them where it needs to)."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampling = {r.request_id for r in sched.sampling}  # the scheduler decides; rows follow its order
        for rid, n in sched.num_scheduled_tokens.items():
            req = sched.requests[rid]
            start = req.num_computed_tokens
            tokens.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            tables.append(kv.blocks_of(rid))
            if rid in sampling:
                sample_rows.append(cu[-1] - 1)

        dev = self.device
        width = max(len(t) for t in tables)
        table = torch.tensor([blocks + [0] * (width - len(blocks)) for blocks in tables], dtype=torch.int32)
        cu_t = torch.tensor(cu, dtype=torch.int32)
        pos_t = torch.tensor(positions, dtype=torch.long)  # [T]
        req_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), cu_t.diff().long())
        slots = table[req_of_token, pos_t // bs].long() * bs + pos_t % bs  # [T]

        table, cu_t, seq_t = table.to(dev), cu_t.to(dev), torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        max_q = max(b - a for a, b in zip(cu, cu[1:]))
        plan = self.backend.plan(cu_t, seq_t, table, bs, max_q, max(seq_lens))
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        if self.decoder is not None:
            return self.decoder.forward(
                torch.tensor(tokens, device=dev), pos_t.to(dev), rows, self.backend, plan, slots.to(dev), self.kv_caches
            )
        ctx = StepContext(self.backend, plan, slots.to(dev), self.kv_caches)
        out = self.model(
            input_ids=torch.tensor([tokens], device=dev),
            position_ids=pos_t.to(dev)[None],
            use_cache=False,
            logits_to_keep=rows,
            orca_step=ctx,
        )
        return out.logits[0].float()  # [S, V]
