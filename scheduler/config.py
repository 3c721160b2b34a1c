"""Engine arguments as the user gives them; derived sizes are computed, never written back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orcaserve.kernels import dispatch
from orcaserve.scheduler.core.fair_policy import DEFAULT_PREFILL_CAP
from orcaserve.scheduler.core.fair_share import check_weights
from orcaserve.scheduler.core.policies import check_policy
from orcaserve.scheduler.core.slo_class import check_slo_classes
from orcaserve.scheduler.lora.config import check_lora_config
from orcaserve.scheduler.spec.config import SpeculativeConfig

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

QUANTIZATIONS = (None, "none", "gguf", "int8", "int4")


@dataclass(frozen=True)
class EngineConfig:
    """What `Engine.from_pretrained(path, **engine_args)` accepts.

    None means "choose for this machine": device cuda if available else cpu; dtype bf16 on CUDA
    and on CPUs that compute bf16 natively (AVX-512 BF16 or AMX), else fp32; attention_backend
    triton on CUDA, cpu (the C++ operator) on CPU; kv_cache_memory 1 GiB on CPU, 80% of free memory
    after loading on CUDA; max_model_len the model's limit, capped by what the KV cache holds.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes
    max_model_len: int | None = None
    dtype: str | torch.dtype | None = None
    device: str | None = None
    attention_backend: str | None = None  # "cpu" | "torch" | "triton"
    # A name in core/policies.py: "fcfs" | "priority" | "fair" (per tenant, docs/fair-share.md).
    scheduling_policy: str = "fcfs"
    # fair: a tenant's share is proportional to its weight (default 1); a prompt token computed
    # costs prompt_token_weight, an output token output_token_weight (VTC's 1 and 2).
    tenant_weights: dict[str, float] | None = None
    prompt_token_weight: float = 1.0
    output_token_weight: float = 2.0
    # fair: while a tenant below its share runs in a step, the tenants above theirs compute at most
    # this many prompt tokens in it (docs/fair-share.md, "Prompt cap beside a below-share tenant");
    # None: no cap.
    fair_prefill_cap: int | None = DEFAULT_PREFILL_CAP
    trace: bool = False  # record every step for the schedule picture
    enable_prefix_caching: bool = True  # reuse cached K/V blocks of shared prompt prefixes
    # Replay each step from a CUDA graph captured for its padded size (cuda_graphs.py). None: on
    # where it can run (CUDA with the triton backend), off elsewhere; False turns it off for A/B.
    cuda_graphs: bool | None = None
    # Serve an architecture that has no token-exact test (scheduler/model/families.py), at the
    # user's own risk; by default such a model is refused at load.
    allow_unverified_architecture: bool = False
    # Linear weights kept in low-bit blocks (docs/quantized-weights.md): "gguf" keeps the file's
    # Q8_0/Q4_0/Q4_1/Q4_K/Q6_K blocks; "int8" (q8_0) and "int4" (q4_1) quantize at load; "none"
    # serves every weight dense in `dtype`, a GGUF dequantized (the exact path). None: chosen by
    # from_pretrained for the file (model/defaults.py: a GGUF on a CPU with integer dot products gets
    # "gguf" with int8 activations, anything else "none"); a model handed to from_model stays dense.
    # `dtype` stays the activations' and KV cache's type.
    quantization: str | None = None
    # Schedule step N+1 while the device runs step N (docs/host-overlap.md). None: on for CUDA,
    # off on the CPU, where the model's threads are the host's and nothing overlaps.
    async_scheduling: bool | None = None
    # Ranks the model is split over (docs/tensor-parallel.md): rank 0 runs the engine, every rank
    # its share of each forward. from_pretrained starts the other ranks itself, offline and in a
    # TorchServe worker alike. kv_cache_memory is per rank.
    tensor_parallel_size: int = 1
    # Latency targets per class of traffic (docs/latency-targets.md): class name -> {ttft_ms,
    # tpot_ms, slo_reject}; a request names its class (`Engine.add_request(slo_class=...)`).
    slo_classes: dict[str, dict] | None = None
    # With quantization named: None keeps the GEMMs bit for bit the fp32 one on the dequantized
    # weights; "int8" quantizes each row of activations per block of 32 and runs integer dot products
    # against the codes (docs/int8-activations.md): faster where the CPU has VNNI, not bitwise fp32.
    # With quantization None, chosen with it (model/defaults.py).
    activations: str | None = None
    # LoRA adapters served beside the base model (docs/lora.md): name -> directory in PEFT's format,
    # loaded at start; a request names one (`EngineRequest.lora`; over HTTP the `model` field).
    # max_loras: adapters stacked for the steps (None: as many as given, at least 1); max_cpu_loras:
    # adapters held on the host, stacked by LRU as requests need them (None: as many as given, at
    # least max_loras); max_lora_rank: the largest rank accepted; enable_lora: serve adapters even
    # with none given (loaded at run time: docs/lora.md "Loading and unloading while serving").
    lora_adapters: dict[str, str] | None = None
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    enable_lora: bool = False
    # Speculative decoding (docs/speculative-decoding.md): {method: ngram, num_speculative_tokens: K,
    # prompt_lookup_min, prompt_lookup_max}; None: off.
    speculative: dict | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.attention_backend not in (None, "cpu", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'cpu', 'torch' or 'triton', got {self.attention_backend!r}")
        if not isinstance(self.enable_prefix_caching, bool):  # "false" from a config file is truthy
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if not isinstance(self.allow_unverified_architecture, bool):
            raise ValueError(
                f"allow_unverified_architecture must be true or false, got {self.allow_unverified_architecture!r}"
            )
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be true, false or null, got {self.cuda_graphs!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true, false or null, got {self.async_scheduling!r}")
        check_policy(self.scheduling_policy)
        check_weights(self.tenant_weights)
        for name in ("prompt_token_weight", "output_token_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        cap = self.fair_prefill_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"fair_prefill_cap must be a positive integer (tokens) or null for no cap, got {cap!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.activations not in (None, "int8"):
            raise ValueError(f"activations must be 'int8' or null, got {self.activations!r}")
        if self.activations is not None and self.quantization == "none":
            raise ValueError(
                f"activations={self.activations!r} runs against quantized weights only: "
                "set quantization to gguf, int8 or int4"
            )
        # Refused here, before any weight is loaded: off the CPU the PyTorch twin would keep an fp32
        # copy of every quantized weight (docs/quantized-weights.md).
        if self.quantized() is not None and self.resolved_device().type != "cpu":
            raise ValueError(f"quantization={self.quantization!r} runs on the CPU's low-bit GEMMs only: set none")
        check_slo_classes(self.slo_classes)
        self.resolved_dtype()  # validates
        self._check_tensor_parallel()
        check_lora_config(
            self.lora_adapters,
            self.max_loras,
            self.max_lora_rank,
            self.max_cpu_loras,
            self.enable_lora,
            tensor_parallel_size=self.tensor_parallel_size,
            quantization=self.quantized(),
            device=self.resolved_device(),
        )
        spec = SpeculativeConfig.parse(self.speculative)  # raises naming the key
        if spec is not None:
            spec.check_engine(
                self.resolved_device().type, self.async_scheduling, self.tensor_parallel_size, self.max_num_seqs
            )
            if self.lora_adapters or self.enable_lora:  # no test holds speculation's verify rows under adapters yet
                raise ValueError("speculative decoding with lora_adapters is not proven exact: set one of them to null")

    def _check_tensor_parallel(self) -> None:
        from orcaserve.scheduler.model.parallel.shard import TensorParallelUnsupported

        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if tp > 1 and self.quantized() is not None:
            raise TensorParallelUnsupported(
                f"quantization={self.quantization!r} is not split over ranks: set none with tensor_parallel_size > 1"
            )
        if tp > 1 and self.resolved_device().type != "cpu":
            raise TensorParallelUnsupported("tensor parallelism runs on the CPU (gloo) only: NCCL ranks are not built")
        if tp > 1 and self.async_scheduling:
            # The other ranks would need the previous step's ids to fill placeholders (docs/tensor-parallel.md).
            raise TensorParallelUnsupported("async_scheduling is not built for tensor_parallel_size > 1: set it null")

    def quantized(self) -> str | None:
        """The low-bit format the weights are served in; None: dense (also where the choice was
        left to from_pretrained and this config reached from_model unresolved)."""
        return None if self.quantization in (None, "none") else self.quantization

    def resolved_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def resolved_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype in (None, "auto"):
            return torch.bfloat16 if self.resolved_device().type == "cuda" or dispatch.native_bf16() else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        return _DTYPES[self.dtype]

    def resolved_backend(self) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.resolved_device().type == "cuda" else "cpu"

    def resolved_cuda_graphs(self) -> bool:
        """Whether steps replay CUDA graphs: only on CUDA with the triton backend (the graphs hold
        its kernels; the others sync on the host), and never where the user said False. True
        elsewhere is not an error: a config written for a GPU still loads on a CPU."""
        runs_there = self.resolved_device().type == "cuda" and self.resolved_backend() == "triton"
        return runs_there and self.cuda_graphs is not False

    def resolved_async_scheduling(self) -> bool:
        """Whether steps overlap the host's work with the device's (docs/host-overlap.md)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        # Null is off with speculation, which needs the synchronous step (spec/config.py check_engine).
        return self.resolved_device().type == "cuda" and self.speculative is None
