"""vLLM's CPU LoRA on `orcaserve-bench lora`'s workload, from the bench itself
(`orcaserve-bench lora --peer vllm`; docs/lora.md "What it costs"): the adapters the bench wrote,
given to benchmarks/peers/vllm_lora.py in vLLM's venv with its tuned environment (`vllm_env`:
tcmalloc and its libiomp5 preloaded, threads bound to this process's cores, 2 GiB of KV cache), on
the converted checkpoint (benchmarks/peers/setup_vllm.sh, convert_model.py), after orcaserve's
runs of the same arguments, so that one command gives both under the same load."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from orcaserve.bench.peers.parts import HERE, VPY, log, run_logged, vllm_env

MODEL = HERE / "model" / "SmolLM2-135M-Instruct"  # the default model, converted for vLLM


def vllm_lora(adapter_dirs: list[str], rank: int, args: Any) -> dict:
    """vLLM's base and mixed throughputs (request i on adapter i mod N) on `args`' workload."""
    if not (MODEL / "config.json").exists():
        raise SystemExit(f"lora --peer vllm: no converted model at {MODEL}: run benchmarks/peers/setup_vllm.sh")
    env = vllm_env()
    with tempfile.TemporaryDirectory(prefix="orca-lora-vllm-") as tmp:
        out = Path(tmp) / "vllm.json"
        cmd = [str(VPY), str(HERE / "vllm_lora.py"), "--model", str(MODEL), "--adapters", ",".join(adapter_dirs),
               "--rank", str(rank), "--dtype", args.dtype or "bfloat16", "--clients", str(args.clients),
               "--requests", str(args.requests), "--input-len", str(args.input_len),
               "--output-len", str(args.output_len), "--repeats", str(args.repeats), "--out", str(out)]  # fmt: skip
        log(f"vLLM LoRA: {len(adapter_dirs)} adapters of rank {rank} (start-up compiles: a minute or two)")
        run_logged(cmd, Path(tmp) / "vllm.log", env=env, timeout=1800, cwd=Path(tmp))
        got = json.loads(out.read_text())
    return {"vllm_base_tok_s": got["base_tok_s"], "vllm_mixed_tok_s": got["mixed_tok_s"], "vllm_ratio": got["ratio"]}
