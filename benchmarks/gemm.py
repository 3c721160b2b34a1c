"""The decoder's GEMM shapes on this CPU: first call against later calls, pre-packed against plain.

    python benchmarks/gemm.py [--dtype bfloat16] [--rows 32,128,256,384,512]

Uses SmolLM2-135M's shapes (hidden 576, q/k/v 960, intermediate 1536 x 2) with random weights, the
calls the lean decoder makes (`orcaserve.scheduler.decoder.Linear`): oneDNN's inner product on a
pre-packed weight (`torch.ops.mkldnn._linear_pointwise`) and `F.linear` on the plain one. Prints,
per row count, the first call (oneDNN compiles a kernel per new shape) and the median of 7 rounds
of 10 calls for both variants, alternated round by round (docs/engine.md, "Fourth round").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (out, in)


def _ms(f, calls: int = 10) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="1,32,128,256,384,512")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = {n: torch.randn(shape, dtype=dtype) for n, shape in SHAPES.items()}
    packed = {n: torch.ops.mkldnn._reorder_linear_weight(w, None) for n, w in weights.items()}
    print(f"{args.dtype}, {torch.get_num_threads()} threads; ms per call: first | pre-packed | F.linear")
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            cells = []
            for name, w in weights.items():
                x = torch.randn(m, w.shape[1], dtype=dtype)
                pw = packed[name]

                def pre(x=x, pw=pw):
                    return torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")

                def plain(x=x, w=w):
                    return F.linear(x, w)

                first = _ms(pre, 1)
                plain()
                times: dict[str, list[float]] = {"pre": [], "plain": []}
                for r in range(args.rounds):
                    for key, f in (("pre", pre), ("plain", plain)) if r % 2 == 0 else (("plain", plain), ("pre", pre)):
                        times[key].append(_ms(f))
                pre_ms, plain_ms = (statistics.median(times[k]) for k in ("pre", "plain"))
                cells.append(f"{name} {first:.2f} | {pre_ms:.2f} | {plain_ms:.2f}")
            print(f"M={m:4d}: " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
