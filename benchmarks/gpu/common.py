"""What the GPU check's steps share: the device (or the CPU run under Triton's interpreter), stand-ins,
the models' shapes, result files, datasheet peaks and the timers (docs/kernels.md "GPU check")."""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import time
from typing import Any

from orcaserve.bench.result import write

CONFIGS = {  # name: (max_num_seqs, max_num_batched_tokens, padded generate batch)
    "gpu": (256, 4096, 256),
    "cpu": (32, 512, 32),
}
SMOLLM2: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, hidden_act="silu", bos_token_id=1, eos_token_id=2, pad_token_id=2,
    initializer_range=0.02,
)  # fmt: skip
# Llama-3.1-8B's layers (hidden 4096, 32 layers, 32 / 8 heads x 128, MLP 14336) with SmolLM2's
# vocabulary and tied embeddings: 7.2 B parameters, 14.4 GB in bf16.
LLAMA8B = dict(SMOLLM2, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, rope_theta=500000.0)  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {"smollm2": SMOLLM2, "llama8b": LLAMA8B}
SMOKE_SHAPE = dict(SMOLLM2, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
PEAK_GBPS = {  # HBM peak, GB/s, matched as substrings of torch.cuda.get_device_name(); specific names first
    "GH200": 4000.0, "H200": 4800.0, "H100 PCIe": 2000.0, "H100": 3350.0, "H800": 3350.0, "A100-SXM4-80GB": 2039.0,
    "A100-SXM4-40GB": 1555.0, "A100 80GB PCIe": 1935.0, "A100": 1555.0, "L40S": 864.0, "L4": 300.0, "A10": 600.0,
    "RTX 4090": 1008.0,
}  # fmt: skip
PEAK_BF16_TFLOPS = {"GH200": 990.0, "H200": 990.0, "H100 PCIe": 756.0, "H100": 990.0, "H800": 990.0, "A100": 312.0}
DTYPES = ("fp16", "bf16", "fp32")


def lookup(table: dict[str, float], name: str) -> float | None:
    return next((val for key, val in table.items() if key in name), None)


def device(step: str, smoke: bool) -> Any:
    """CUDA's device; without CUDA under `smoke` the CPU with Triton's interpreter switched on (before
    any kernel module is imported: @triton.jit reads it at definition time), else the skipped result."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if not smoke:
        print(f"gpu {step}: no CUDA device; nothing to time (--smoke: the CPU plumbing run)")
        return {"step": step, "skipped": "no CUDA device"}
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    return torch.device("cpu")


def add_step_arguments(ap: argparse.ArgumentParser, shapes: str | None, tokens: str) -> None:
    """What the timed kernel steps (fused, lora, ternary) share: --dtype and --shapes (unless
    `shapes` is None), --tokens, --smoke, --time-budget."""
    if shapes is not None:
        ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
        ap.add_argument("--shapes", default=shapes, help=f"comma list of {shapes.replace(',', ', ')}")
    ap.add_argument("--tokens", default=tokens, help="step sizes T")
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1 (fp32), tiny")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds; no new shape starts after it")


def save_rows(res: Results, key: str, ok: str) -> bool:
    """The result's `key`: whether every row's `ok` holds; with the elapsed time, saved."""
    data = res.data
    data[key] = all(r[ok] for r in data["rows"])
    data["elapsed_s"] = round(time.perf_counter() - res.t0, 1)
    res.save()
    return data[key]


def finish_rows(res: Results, dev, key: str, ok: str) -> dict:
    """The step's return value: `save_rows`, printed, exit status 1 unless every row's `ok` holds."""
    good = save_rows(res, key, ok)
    print(f"{key} {good} on {device_name(dev)}")
    return {**res.data, "exit_code": 0 if good else 1}


def torch_dtype(name: str, dev) -> Any:
    """fp16 / bf16 / fp32; fp32 on the CPU, where the interpreter computes bf16 wrongly."""
    import torch

    named = {"fp16": torch.float16, "bf16": torch.bfloat16}
    return torch.float32 if dev.type == "cpu" else named.get(name, torch.float32)


def device_name(dev) -> str:
    import torch

    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (TRITON_INTERPRET=1)"


def free_cuda() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class ByteTokenizer:
    """The engine needs encode/decode/eos/pad only; prompts are token ids (no tokenizer files travel)."""

    eos_token_id = None
    pad_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i % 256 for i in ids).decode("latin-1")


class OnDevice:
    """`generate` on a GPU model for offline.run_padded_generate, which builds CPU tensors: moves
    them, and waits for the GPU so the caller's wall clock covers the work."""

    def __init__(self, model):
        self.model = model

    def generate(self, input_ids, attention_mask=None, **kwargs):
        import torch

        dev = self.model.device
        out = self.model.generate(input_ids.to(dev), attention_mask=attention_mask.to(dev), **kwargs)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return out


def shaped_model(dev, dtype, smoke: bool, shape: str = "smollm2"):
    """A random-init Llama of SmolLM2-135M's (or Llama-3.1-8B's) shape that never stops at EOS."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(dev):  # the 8B shape: 29 GB in fp32 before the cast, on a 141 GB H200
        model = LlamaForCausalLM(LlamaConfig(**(SMOKE_SHAPE if smoke else SHAPES[shape]))).to(dtype).eval()
    model.generation_config.eos_token_id = None  # ignore EOS everywhere: fixed output lengths
    return model


class Results:
    """A step's result, written (result.write) after every case, so a step cut short keeps it."""

    def __init__(self, path: str | None, dev=None, **head):
        import torch
        import transformers

        v: dict[str, str | None] = {"torch": torch.__version__, "transformers": transformers.__version__}
        try:
            import triton

            v["triton"] = triton.__version__
        except ImportError:
            v["triton"] = None
        where = {"device": str(dev), "device_name": device_name(dev)} if dev is not None else {}
        self.path, self.t0 = path, time.perf_counter()
        self.data = dict(head, **where, date=time.strftime("%Y-%m-%d %H:%M:%S"), versions=v)

    def over(self, budget: float | None) -> bool:
        """True once `budget` seconds have passed since the step began (--time-budget)."""
        return budget is not None and time.perf_counter() - self.t0 > budget

    def save(self) -> None:
        if self.path:
            write(self.path, self.data)


class Timer:
    """Median milliseconds of `fn`: CUDA events with an L2 flush before each call, or (smoke mode,
    CPU) wall time of one call after a warm-up."""

    def __init__(self, dev):
        import torch

        self.cuda = dev.type == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.int8, device=dev) if self.cuda else None

    def __call__(self, fn, max_iters: int = 20, target_ms: float = 40.0) -> float:
        import torch

        fn()  # compile + warm-up
        sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        sync()
        t = time.perf_counter()
        fn()
        sync()
        first = (time.perf_counter() - t) * 1e3
        if not self.cuda:
            return first
        iters = max(3, min(max_iters, int(target_ms / max(first, 1e-3))))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            assert self.flush is not None
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_gbps(dev, timer: Timer | None = None) -> float | None:
    """Device-to-device copy of 1 GiB, bytes read + written per second (the practical HBM ceiling)."""
    import torch

    if dev.type != "cuda":
        return None
    a = torch.empty(1 << 30, dtype=torch.int8, device=dev)
    b = torch.empty_like(a)
    ms = (timer or Timer(dev))(functools.partial(b.copy_, a))
    return 2 * (1 << 30) / ms / 1e6
