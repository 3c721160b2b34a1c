"""What the GPU steps share: stand-ins, result files, device names, the run without CUDA."""

from __future__ import annotations

import gc
import os
import time

from orcaserve.bench.result import write


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


def versions() -> dict:
    import torch
    import transformers

    v: dict[str, str | None] = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = None
    return v


def skip_or_interpret(script: str, smoke: bool) -> dict | None:
    """Without CUDA: the skipped result, or under `smoke` None with Triton's interpreter switched on
    (before any kernel module is imported: @triton.jit reads it at definition time). With CUDA: None."""
    import torch

    if torch.cuda.is_available():
        return None
    if not smoke:
        print(f"benchmarks/{script}: no CUDA device; nothing to time (GPU figures not measured).")
        return {"skipped": "no CUDA device"}
    os.environ["TRITON_INTERPRET"] = "1"
    return None


def free_cuda() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Results:
    """A step's result, written (result.write) after every case, so a step cut short keeps it."""

    def __init__(self, path: str | None, **head):
        self.path = path
        self.data = dict(head, date=time.strftime("%Y-%m-%d %H:%M:%S"), versions=versions())

    def save(self) -> None:
        if self.path:
            write(self.path, self.data)


def device_name(dev) -> str:
    import torch

    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (TRITON_INTERPRET=1)"


CONFIGS = {  # name: (max_num_seqs, max_num_batched_tokens, padded generate batch)
    "gpu": (256, 4096, 256),
    "cpu": (32, 512, 32),
}
