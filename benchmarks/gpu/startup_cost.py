"""What start-up pays for custom-op registration and the C++ CPU op library.

    orcaserve-bench gpu startup [--repeats 3] [--out out.json]

Each figure is taken in a fresh interpreter (median of --repeats):
- import_torch / import_transformers: wall time of `import torch`, then of transformers with the
  Llama and Qwen2 modeling modules, and within each the `torch.library.custom_op` registrations
  (`CustomOpDef._register_to_dispatcher`, those a cProfile of start-up shows: torch's own prims,
  streams and onnx ops and transformers' own), counted and timed by a hook installed before
  torch's `_library.custom_ops` module runs, so without a profiler's overhead.
- cpu_library: `kernels.cpu.build.load(build=False)` (torch.ops.load_library of the C++ library and
  the register_fake of each ISA variant), first call and a second one in the same process.
- sampler: `Sampler()` (it loads nothing; the first CPU batch looks the C++ argmax
  up) and `argmax_ops()`, the lookup `Sampler()` made before, in a fresh process each.
- engine_cpu / engine_cuda (CUDA only, bf16): `Engine.from_model` on the tiny Llama twice in one
  process, with the `torch.ops.load_library` calls (a CPU engine loads the library once per
  process, a CUDA engine never) and the custom-op registrations it made after the imports.
  engine_cpu runs only on a machine without CUDA where the library is built (`make venv` builds
  it; through gpu_check.sh's shim its sources sit at another path, so another build would be due).
Machine noise matters at these sizes: figures are medians, and the machine should be quiet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HOOK = r"""
import importlib.abc, importlib.machinery, sys, time
REG = {"n": 0, "s": 0.0}
class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch._library.custom_ops":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(mod):
            run(mod)
            orig = mod.CustomOpDef._register_to_dispatcher
            def timed(self, *a, **k):
                t = time.perf_counter()
                try:
                    return orig(self, *a, **k)
                finally:
                    REG["n"] += 1
                    REG["s"] += time.perf_counter() - t
            mod.CustomOpDef._register_to_dispatcher = timed
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _Hook())
"""

ENGINE = r"""
import sys, torch
from orcaserve.kernels.cpu import build
if "DEVICE" == "cuda" and not torch.cuda.is_available():
    out = {}
elif "DEVICE" == "cpu" and (torch.cuda.is_available() or not build.library_path().exists()):
    # A CPU engine would build the C++ library first (minutes): not a start-up figure. On a GPU
    # machine only the CUDA engine is measured.
    out = {"cpu_engine_skipped": "a GPU machine" if torch.cuda.is_available() else "C++ library not built"}
else:
    calls = []
    load = torch.ops.load_library
    torch.ops.load_library = lambda p: (calls.append(p), load(p))[1]
    from orcaserve.bench.models.tiny import tiny_model
    from orcaserve.bench.gpu.common import ByteTokenizer
    from orcaserve.scheduler import Engine
    times, n0 = [], REG["n"]
    for _ in range(2):
        m = tiny_model("llama")
        t = time.perf_counter()
        Engine.from_model(m, ByteTokenizer(), device="DEVICE", dtype="DTYPE", kv_cache_memory=1 << 24)
        if "DEVICE" == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    out = {"DEVICE_engine_first_s": times[0], "DEVICE_engine_second_s": times[1],
           "DEVICE_engine_load_library_calls": len(calls), "DEVICE_engine_custom_ops": REG["n"] - n0}
"""

PROBES = {
    "imports": HOOK
    + r"""
t = time.perf_counter(); import torch; t_torch = time.perf_counter() - t
n0, s0 = REG["n"], REG["s"]
t = time.perf_counter()
import transformers
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2
t_tf = time.perf_counter() - t
out = {"import_torch_s": t_torch, "torch_custom_ops": n0, "torch_custom_ops_s": s0,
       "import_transformers_s": t_tf, "transformers_custom_ops": REG["n"] - n0,
       "transformers_custom_ops_s": REG["s"] - s0}
""",
    "cpu_library": HOOK
    + r"""
import time, torch
from orcaserve.kernels.cpu import build
n0 = REG["n"]
t = time.perf_counter(); ok, why = build.load(build=False); first = time.perf_counter() - t
t = time.perf_counter(); build.load(build=False); second = time.perf_counter() - t
out = {"cpu_library_ok": ok, "cpu_library_custom_ops": REG["n"] - n0, "cpu_library_first_s": first,
       "cpu_library_second_s": second, "variants": list(build.machine_variants())}
""",
    "sampler": r"""
import time, torch
from orcaserve.kernels.cpu import build
from orcaserve.scheduler.model.sampler import Sampler
t = time.perf_counter(); s = Sampler(); t_new = time.perf_counter() - t
out = {"sampler_init_s": t_new, "sampler_init_loads_library": build._loaded is not None}
""",
    "argmax_ops": r"""
import time, torch
from orcaserve.scheduler.model.sampler import argmax_ops
t = time.perf_counter(); argmax_ops(); out = {"argmax_ops_s": time.perf_counter() - t}
""",
    "engine_cpu": HOOK + ENGINE.replace("DEVICE", "cpu").replace("DTYPE", "float32"),
    "engine_cuda": HOOK + ENGINE.replace("DEVICE", "cuda").replace("DTYPE", "bfloat16"),
}


def probe(code: str) -> dict:
    script = code + "\nimport json\nprint('RESULT ' + json.dumps(out))\n"
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(res.stdout[-2000:] + res.stderr[-2000:])
    return json.loads(line[len("RESULT ") :])


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) if isinstance(v, float) else v for k, v in runs[0].items()}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeats", type=int, default=3)


def run(args: argparse.Namespace) -> dict:
    result: dict = {}
    for code in PROBES.values():
        result.update(median_of([probe(code) for _ in range(args.repeats)]))
    for k, v in result.items():  # engine_cuda gives nothing without CUDA
        print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    return result
