"""A lean forward for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over a transformers model's weights.

The transformers forward costs, per layer and step, about 45 small ops and seven GEMMs whose
weights oneDNN re-lays out on every call. This forward computes the same thing with the weights
fused and pre-packed once: q/k/v as one GEMM, gate/up as one, each weight packed for the
project's own GEMM (fp32, and bf16 on CPUs without native bf16; MKL's or oneDNN's where it is not
built), its `vdpbf16ps` GEMM (bf16 with AVX-512 BF16 and no AMX) or in oneDNN's blocked layout
(bf16 elsewhere; `linear.py`), and attention straight through the backend. The element-wise math
(RMSNorm, rotary embedding, SiLU) is written exactly as transformers writes it, and the rotary
tables come from the model's own `rotary_emb`, so any rope type it supports is supported here.
Which models it serves is `families.lean_supports`; the others use the transformers forward
(`ModelRunner`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from orcaserve.kernels import AttentionBackend, dispatch
from orcaserve.kernels.linear import PLAIN_FROM_ROWS, Linear
from orcaserve.kernels.pytorch.fused import add_rms_norm, rms_norm, silu_mul
from orcaserve.kernels.quant import QuantLinear
from orcaserve.kernels.ternary import TernaryLinear
from orcaserve.kernels.triton import fused_ops
from orcaserve.scheduler.lora.resident import LoraStep
from orcaserve.scheduler.model.bitnet import projection, relu2_mul, sub_normed
from orcaserve.scheduler.model.layer_call import LayerCall, layer_call
from orcaserve.scheduler.model.loader import model_dims
from orcaserve.scheduler.model.quantized import fused_linear, head_linear
from orcaserve.scheduler.model.rope_table import RopeTable, rotary_rows
from orcaserve.scheduler.model.row_padding import PAD_MULTIPLE, padded_tokens


@dataclass
class _Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear | QuantLinear | TernaryLinear  # QuantLinear: block codes (quantized.py); Ternary: BitNet
    o: Linear | QuantLinear | TernaryLinear
    gate_up: Linear | QuantLinear | TernaryLinear
    down: Linear | QuantLinear | TernaryLinear
    q_norm: torch.Tensor | None = None  # [D]: Qwen3's RMSNorm of each head's q and k before rotary
    k_norm: torch.Tensor | None = None
    # BitNet (docs/bitnet.md): RMSNorm before o_proj [H D] and before down_proj [I]; ReLU^2 gate
    attn_sub_norm: torch.Tensor | None = None
    ffn_sub_norm: torch.Tensor | None = None
    relu2: bool = False


class Decoder:
    """The forward of one Llama-family model for packed steps (see the module docstring). It takes
    the decoder layers' projection weights over: the transformers forward cannot run afterwards.

    Shapes: T tokens of the step, H/H_kv query/KV heads, D head dim, S rows that sample.
    """

    def __init__(
        self,
        model: Any,  # a *ForCausalLM
        pack: bool = True,
        fused: bool | None = None,
        rope_store: bool | None = None,
        triton_fused: bool | None = None,
        layer_op: bool | None = None,
    ) -> None:
        cfg = model.config
        inner = model.model
        self.num_heads: int = cfg.num_attention_heads
        _, self.num_kv_heads, self.head_dim = model_dims(cfg)
        self.scale = self.head_dim**-0.5
        self.eps: float = cfg.rms_norm_eps
        self.embed: torch.Tensor = inner.embed_tokens.weight  # [V, hidden]
        self.rotary: Any = inner.rotary_emb
        # Its rows by position where they are a function of the position alone (rope_table.py)
        self.rope_table = RopeTable.of(self.rotary, self.head_dim, self.embed.dtype, self.embed.device)
        self.norm: torch.Tensor = inner.norm.weight
        # On the CPU: residual add + RMSNorm and SiLU * up as one C++ op each (csrc/fused/, the
        # variant kernels/dispatch.py picks for the model's dtype). In fp32 the norm's mean sums in
        # another order than ATen's: last-bit differences from transformers, which the token-exact
        # tests allow for (5 % off an fp32 decode step).
        cpu = self.embed.device.type == "cpu"
        dtype = self.embed.dtype
        self.add_rms_norm_op: Any = dispatch.kernel("add_rms_norm", dtype) if cpu else None
        self.silu_mul_op: Any = dispatch.kernel("silu_mul", dtype) if cpu else None
        have_fused = self.add_rms_norm_op is not None and self.silu_mul_op is not None
        self.fused = have_fused if fused is None else fused and have_fused
        # SiLU(gate) * up is ATen's own vector formula in the C++ op, so where ATen's vector loop
        # covers each row (intermediate size a multiple of 32) it is bit for bit ATen's: fp32 fuses
        # it too, where the variant that runs is the one whose vector code is ATen's.
        self.exact_silu = (
            dtype == torch.float32
            and cfg.intermediate_size % 32 == 0
            and have_fused
            and dispatch.resolve("silu_mul", dtype) == f"orcaserve.silu_mul.{dispatch.aten_variant()}"
        )
        # Rotary + K/V write in one C++ pass (csrc/fused/rope_store.cpp): bit for bit the unfused
        # ops, so fp32 too. Used where the step's caches are CPU tensors of the model's dtype.
        self.rope_store_op: Any = dispatch.kernel("rope_store_kv", dtype) if cpu else None
        have_rope = self.rope_store_op is not None
        self.rope_store = have_rope if rope_store is None else rope_store and have_rope
        # On CUDA the same three fusions as Triton kernels (kernels/triton/fused.py, each held to its
        # PyTorch twin in kernels/pytorch/fused.py) instead of separate PyTorch ops; where set they
        # take precedence. triton_fused=False keeps the PyTorch ops (A/B).
        self.triton_ops = fused_ops(triton_fused, self.embed.device.type == "cuda")
        self.lm_head = head_linear(model, pack, dtype)
        # Whether forward(argmax=True) can take the rows' greedy tokens inside the lm_head's GEMM
        # (QuantLinear.argmax), no logits written (docs/one-stream.md, "The argmax inside the lm_head").
        self.head_argmax = isinstance(self.lm_head, QuantLinear) and self.lm_head.has_argmax
        narrow = PLAIN_FROM_ROWS if self.embed.dtype == torch.bfloat16 else None  # see PLAIN_FROM_ROWS
        self.layers: list[_Layer] = []
        relu2 = getattr(cfg, "hidden_act", "silu") == "relu2"
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    in_norm=layer.input_layernorm.weight,
                    post_norm=layer.post_attention_layernorm.weight,
                    qkv=projection(fused_linear, attn.q_proj, attn.k_proj, attn.v_proj, pack=pack, dtype=dtype),
                    o=projection(fused_linear, attn.o_proj, pack=pack, dtype=dtype, plain_from=narrow),
                    gate_up=projection(fused_linear, mlp.gate_proj, mlp.up_proj, pack=pack, dtype=dtype),
                    down=projection(fused_linear, mlp.down_proj, pack=pack, dtype=dtype, plain_from=narrow),
                    q_norm=attn.q_norm.weight if hasattr(attn, "q_norm") else None,
                    k_norm=attn.k_norm.weight if hasattr(attn, "k_norm") else None,
                    attn_sub_norm=attn.attn_sub_norm.weight if hasattr(attn, "attn_sub_norm") else None,
                    ffn_sub_norm=mlp.ffn_sub_norm.weight if hasattr(mlp, "ffn_sub_norm") else None,
                    relu2=relu2,
                )
            )
        # Row counts padded to a few sizes (padded_tokens) where oneDNN runs the layers' GEMMs,
        # which compiles a kernel per new count; 0: none.
        onednn = bool(self.layers) and getattr(self.layers[0].qkv, "onednn", False)
        self.pad_multiple = PAD_MULTIPLE[self.embed.dtype] if onednn else 0
        # A layer in one C++ call where each of its ops is a C++ op (layer_call.py), bit for bit the
        # same; layer_op=False keeps the op-by-op loop (A/B).
        self.layer_call: LayerCall | None = layer_call(self) if layer_op is not False else None
        self.layer_call_rows = self.layer_call.max_rows if self.layer_call is not None else 0  # its most rows

    @torch.inference_mode()
    def warm_up(self, max_tokens: int, max_samples: int) -> None:
        """Call each GEMM shape once at every row count a step can bring: up to `max_tokens` rows
        (padded as the steps pad them) for the layers', up to `max_samples` for the lm_head.
        oneDNN compiles a kernel on a shape's first call (1-14 ms each here, shared by all layers),
        which would otherwise land on the first steps of real traffic. Once, at start: for
        SmolLM2 with 512 tokens per step 0.7 s in bf16, 1.8 s in fp32 (most of it the GEMMs' own
        work at 60 row counts)."""
        if not self.pad_multiple:
            return
        layer, dtype = self.layers[0], self.embed.dtype
        hidden, inner = self.embed.shape[1], layer.down.in_features
        for m in sorted({padded_tokens(t, self.pad_multiple) for t in range(1, max_tokens + 1)}):
            x = torch.zeros(m, hidden, dtype=dtype)
            layer.qkv(x)
            layer.o(torch.zeros(m, self.num_heads * self.head_dim, dtype=dtype))
            layer.gate_up(x)
            layer.down(torch.zeros(m, inner, dtype=dtype))
        for m in range(1, min(max_samples, max_tokens) + 1):
            self.lm_head(torch.zeros(m, hidden, dtype=dtype))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T] int64
        sample_rows: torch.Tensor,  # [S] int64
        backend: AttentionBackend,
        plan: object,
        slot_mapping: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [num_blocks, bs, H_kv, D]
        lora: LoraStep | None = None,
        argmax: bool = False,
    ) -> torch.Tensor:
        """Logits `[S, V]` of the rows in `sample_rows`, in the model's dtype: the sampler widens
        them to fp32 only where it needs more than their argmax. `lora`: the step's rows grouped
        by LoRA adapter, whose updates are added to each projection they target (docs/lora.md).
        `argmax` (where `head_argmax`): their argmax `[S]` int64 instead, taken in the lm_head."""
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        t = input_ids.shape[0]
        tp = padded_tokens(t, self.pad_multiple) if self.pad_multiple else t
        if tp > t:  # pad rows: token 0 at position 0, stored nowhere, attention output zero
            input_ids = F.pad(input_ids, (0, tp - t))
            positions = F.pad(positions, (0, tp - t))
            slot_mapping = F.pad(slot_mapping, (0, tp - t), value=-1)
        attn_buf = input_ids.new_zeros((tp, h, d), dtype=self.embed.dtype) if tp > t else None  # [Tp, H, D]
        x = self._embed(input_ids)  # [Tp, hidden]
        table = self.rope_table if self.rope_table is not None and tp <= self.rope_table.max_rows else None
        cos, sin = table(positions) if table is not None else rotary_rows(self.rotary, x, positions)  # [T, D] each
        fuse_rope = self.rope_store and kv_caches[0][0].device.type == "cpu" and kv_caches[0][0].dtype == x.dtype
        rope_op = self.triton_ops.rope_store_kv if self.triton_ops else self.rope_store_op if fuse_rope else None
        if rope_op is None:
            cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D] each
        delta: torch.Tensor | None = None  # the last MLP's output, not yet added to x
        one_call = self.layer_call if rope_op is self.rope_store_op and tp == t else None
        if t > self.layer_call_rows or (one_call is not None and not one_call.takes(lora)):
            one_call = None  # a larger step runs another GEMM than the call's; adapters it does not run
        if one_call is not None and not LayerCall.applies(backend, plan, kv_caches[0][0]):
            one_call = None
        if one_call is not None:  # every layer, the first too (no delta: x itself normed)
            x, delta = one_call.all(x, cos, sin, kv_caches, slot_mapping, plan, lora)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches) if one_call is None else ()):
            x, hn = self._add_norm(x, delta, layer.in_norm)
            qkv = layer.qkv(hn)  # [T, (H + 2 H_kv) D]
            if lora is not None:
                lora.apply(i, "qkv", hn, qkv)
            if layer.q_norm is not None and layer.k_norm is not None:
                self._qk_norm(qkv, layer.q_norm, layer.k_norm)
            if rope_op is not None:
                q = rope_op(qkv, cos, sin, k_cache, v_cache, slot_mapping, h, hk)
            else:
                qk = qkv[:, : (h + hk) * d].view(-1, h + hk, d)  # [T, H + H_kv, D], rotated together
                qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
                q, k = qk.split([h, hk], dim=1)  # [T, H, D], [T, H_kv, D]
                v = qkv[:, (h + hk) * d :].view(-1, hk, d)  # [T, H_kv, D]
                backend.store_kv(k, v, k_cache, v_cache, slot_mapping)
            if attn_buf is None:
                attn = backend.attend(plan, q, k_cache, v_cache, self.scale)  # [T, H, D]
            else:
                real = backend.attend(plan, q[:t], k_cache, v_cache, self.scale, out=attn_buf[:t])
                if real.data_ptr() != attn_buf.data_ptr():  # a backend that did not write into `out`
                    attn_buf[:t].copy_(real)
                attn = attn_buf
            attn = attn.reshape(-1, h * d)  # [T, H D]
            if lora is None:  # BitNet's sub-layer norms in o's and down's own calls where ternary (bitnet.py)
                x, hn = self._add_norm(x, sub_normed(layer.o, attn, layer.attn_sub_norm, self.eps), layer.post_norm)
                gate_up = layer.gate_up(hn)  # [T, 2 I]
                if layer.relu2:  # [T, hidden]
                    delta = sub_normed(layer.down, gate_up, layer.ffn_sub_norm, self.eps, relu2=True)
                else:
                    delta = layer.down(self._silu_mul(gate_up))
            else:
                x, hn, delta = self._adapted_tail(i, layer, attn, x, lora)
        if one_call is not None and delta is not None:  # the same ops in one call
            last = one_call.last_rows(x, delta, sample_rows, self.norm)  # [S, hidden]
        else:
            x = x + delta if delta is not None else x
            last = self._add_norm(x.index_select(0, sample_rows), None, self.norm)[1]  # [S, hidden]
        if argmax and not self.head_argmax:
            raise ValueError("forward(argmax=True) needs an lm_head with its own argmax (head_argmax)")
        if argmax:  # a QuantLinear's argmax (or a wrapper's of one: the step breakdown's timer)
            return cast(QuantLinear, self.lm_head).argmax(last)  # [S] int64
        return self._head(last)  # [S, V]

    def _adapted_tail(
        self, i: int, layer: _Layer, attn: torch.Tensor, x: torch.Tensor, lora: LoraStep
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """o, norm and MLP of layer `i` with the step's adapter updates (attn [T, H D], x [T, hidden]):
        (x + o, its norm, the MLP's output)."""
        if layer.attn_sub_norm is not None:
            attn = rms_norm(attn, layer.attn_sub_norm, self.eps)
        o = layer.o(attn)  # [T, hidden]
        lora.apply(i, "o", attn, o)
        x, hn = self._add_norm(x, o, layer.post_norm)
        gate_up = layer.gate_up(hn)  # [T, 2 I]
        lora.apply(i, "gate_up", hn, gate_up)
        act = self._activate(layer, gate_up)  # [T, I]
        down = layer.down(act)  # [T, hidden]
        lora.apply(i, "down", act, down)
        return x, hn, down

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return F.embedding(input_ids, self.embed)

    def _head(self, last: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, V]; a split one gathers (parallel/)
        return self.lm_head(last)

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, rms_norm(x + delta)); no delta adds nothing."""
        if self.triton_ops:
            return self.triton_ops.add_rms_norm(x, delta, weight, self.eps)
        if delta is None:
            return x, rms_norm(x, weight, self.eps)
        if self.fused:
            return self.add_rms_norm_op(x, delta, weight, self.eps)
        return add_rms_norm(x, delta, weight, self.eps)

    def _qk_norm(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor) -> None:
        """Qwen3: RMSNorm over each head of q and of k, in place in the fused projection's output
        (the rotary step, fused or not, reads them from there)."""
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, : h * d].view(-1, h, d)  # [T, H, D]
        k = qkv[:, h * d : (h + hk) * d].view(-1, hk, d)  # [T, H_kv, D]
        q.copy_(rms_norm(q, q_norm, self.eps))
        k.copy_(rms_norm(k, k_norm, self.eps))

    def _activate(self, layer: _Layer, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
        """act(gate) * up: SiLU, or BitNet's ReLU^2 followed by its sub-layer norm."""
        if not layer.relu2:
            return self._silu_mul(gate_up)
        out = relu2_mul(gate_up)  # [T, I]
        return rms_norm(out, layer.ffn_sub_norm, self.eps) if layer.ffn_sub_norm is not None else out

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
        if self.triton_ops:
            return self.triton_ops.silu_mul(gate_up)
        if self.fused or self.exact_silu:
            return self.silu_mul_op(gate_up)
        return silu_mul(gate_up)
