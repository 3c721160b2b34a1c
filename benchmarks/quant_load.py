"""Peak RSS and wall time of loading a model with `quantization` set, one fresh process per case
(docs/serving.md "Quantized weights", "Memory at load").

`--way old`: what Engine.from_pretrained did before the streamed load: the whole model loaded in
fp32, then quantize_model attaches the codes and frees the dense weights, then the cast to dtype.
`--way new`: load_model_and_tokenizer(..., quantization=mode), which fills a weightless model one
tensor at a time (stream_load.py). Each child prints one JSON line; ru_maxrss is its peak RSS.

    .venv/bin/python benchmarks/quant_load.py --way old new
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

CACHE = os.path.expanduser("~/.cache/orcaserve")


def cases() -> list[tuple[str, str, str | None]]:
    from orcaserve.scheduler.model.loader import default_model_path

    one_b = os.path.join(CACHE, "random-1b")
    return [
        ("1b-hf int4", one_b, "int4"),
        ("1b-hf null", one_b, None),
        ("1b Q4_1 gguf", one_b + ".Q4_1.gguf", "gguf"),
        ("1b Q4_0 gguf", one_b + ".Q4_0.gguf", "gguf"),
        ("SmolLM2 Q4_1 gguf", default_model_path(), "gguf"),
    ]


def child(path: str, mode: str | None, way: str, dtype_name: str) -> None:
    import torch

    from orcaserve.scheduler.model.loader import load_model_and_tokenizer
    from orcaserve.scheduler.model.quantized import quantize_model

    dtype = getattr(torch, dtype_name)
    cpu = torch.device("cpu")
    start = time.perf_counter()
    if way == "old" or mode is None:
        model, _ = load_model_and_tokenizer(path, torch.float32 if mode else dtype, cpu)
        if mode:
            quantize_model(model, mode, dtype)
        model.to(dtype=dtype)
    else:
        model, _ = load_model_and_tokenizer(path, dtype, cpu, quantization=mode)
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": round(seconds, 1), "peak_rss_mb": round(peak_mb)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--way", nargs="+", choices=["old", "new"], default=["old", "new"])
    parser.add_argument("--dtype", default="float32", help="the engine's dtype (fp32: the Zen 2 default)")
    parser.add_argument("--only", default=None, help="run the cases whose label contains this")
    parser.add_argument("--child", nargs=3, metavar=("PATH", "MODE", "WAY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, mode, way = args.child
        child(path, None if mode == "null" else mode, way, args.dtype)
        return
    for label, path, mode in cases():
        if args.only and args.only not in label:
            continue
        for way in args.way:
            if mode is None and way == "new":
                continue  # quantization null: one path, unchanged
            cmd = [sys.executable, __file__, "--dtype", args.dtype, "--child", path, mode or "null", way]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            print(f"{label:20} {way:4} {json.loads(out)}", flush=True)


if __name__ == "__main__":
    main()
