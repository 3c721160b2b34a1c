"""The C++ CPU paged-attention operator: build, load, and the "cpu" `AttentionBackend`.

`cpu_attention.cpp` registers `torch.ops.orcaserve.paged_attention(q, k_cache, v_cache,
cu_seqlens_q, seq_lens, block_tables, scale, out)`, the same computation as
`torch_attention.unified_attention`, reading K/V blocks in place instead of gathering a padded copy.
The same library carries the lean decoder's fused element-wise ops (`cpu_fused.cpp`:
`add_rms_norm`, `silu_mul`; see `fused_ops`), its rotary + K/V write (`cpu_rope_store.cpp`:
`rope_store_kv`), the sampler's argmax (`cpu_argmax.cpp`: `argmax_rows`), on AVX2 and AVX-512
builds a GEMM over pre-packed fp32 or bf16 weights (`cpu_gemm.cpp`: `pack_linear_weight`,
`linear_packed`) and, with AVX-512 BF16, a `vdpbf16ps` GEMM (`cpu_gemm_bf16.cpp`:
`pack_linear_weight_bf16`, `linear_packed_bf16`); see `has_op`.

Nothing is compiled on import. `load_cpu_ops(build=True)` compiles on first use (JIT through
`torch.utils.cpp_extension`, ninja) and loads the library; `python -m orcaserve.kernels.cpu_attention
--build` does the same from the command line (the Makefile's set-up step).

Build directory: `$ORCASERVE_EXTENSIONS_DIR` if set, else `<sys.prefix>/var/cache/orcaserve` (the
venv: a TorchServe worker runs the same interpreter, so it finds the library the set-up step built,
whatever its HOME; and the library is tied to the venv's torch, deleted with it), else
`~/.cache/orcaserve` when the venv is read-only. Each build lives in a subdirectory keyed by a hash
of the source, torch version, Python version and compile flags, so an edited source or an upgraded
torch never loads a stale library.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import torch_attention
from .backend import AttentionBackend, TorchBackend

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cpp")
SOURCES = (
    SOURCE,
    *(
        Path(__file__).with_name(n)
        for n in ("cpu_fused.cpp", "cpu_rope_store.cpp", "cpu_argmax.cpp", "cpu_gemm.cpp", "cpu_gemm_bf16.cpp")
    ),
)
HEADERS = tuple(
    Path(__file__).with_name(n)
    for n in ("cpu_attention_common.h", "cpu_attention_decode.h", "cpu_rows.h", "cpu_gemm_panels.h")
)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # the template instances in the .cpp
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out) -> None, writes out.
PagedAttentionOp = Callable[..., None]

_loaded: tuple[PagedAttentionOp | None, str] | None = None  # once per process: ops register once


def arch_flags(cap: str | None = None, bf16: bool | None = None) -> list[str]:
    """ISA flags for the machine that builds and runs the library (torch's own CPU detection), or
    for the capability `cap` ("AVX512", "AVX2", "DEFAULT") and AVX-512 BF16 `bf16` given.

    CPU_CAPABILITY_* selects the matching `at::vec::Vectorized` implementation, as torch's own
    kernels are compiled; explicit flags instead of -march=native keep the library usable on any
    machine of the same capability level.
    """
    cap = cap or torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        flags = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
        if torch.cpu._is_avx512_bf16_supported() if bf16 is None else bf16:  # vdpbf16ps: bf16 caches as stored
            flags.append("-mavx512bf16")
        return [*flags, "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if cap == "AVX2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []  # generic Vectorized: loops the compiler vectorises for whatever -O3 targets


def compile_flags() -> list[str]:
    # -fopenmp: at::parallel_for is inlined from ATen's OpenMP header; without it the loop runs
    # on one thread. libgomp.so.1 then resolves to the copy torch has already loaded (same
    # soname), so the operator shares torch's OpenMP team. -ffp-contract=off: a * b + c stays two
    # roundings, as in ATen's separate ops (rope_store_kv is bit for bit the unfused fp32 path);
    # the kernels' FMAs are written out as intrinsics and stay FMAs.
    return ["-O3", "-fopenmp", "-ffp-contract=off", *arch_flags()]


def _cache_root() -> Path:
    env = os.environ.get("ORCASERVE_EXTENSIONS_DIR")
    if env:
        return Path(env)
    venv = Path(sys.prefix) / "var" / "cache" / "orcaserve"
    probe = venv if venv.exists() else Path(sys.prefix)
    if os.access(probe, os.W_OK):
        return venv
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "orcaserve"


def build_key() -> str:
    """Hash of everything the compiled library depends on."""
    h = hashlib.sha256()
    for header in (*SOURCES, *HEADERS):
        h.update(header.read_bytes())
    for part in (torch.__version__, sys.version, platform.machine(), " ".join(compile_flags())):
        h.update(part.encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    """Where the library for this source, torch and machine is (or will be) built."""
    name = f"orcaserve_cpu_attention_{build_key()}"
    return _cache_root() / name / f"{name}.so"


def _ensure_ninja() -> None:
    # `.venv/bin/python` without an activated venv leaves pip's ninja off PATH.
    if shutil.which("ninja"):
        return
    dirs = [str(Path(sys.executable).parent)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except ImportError:
        pass
    os.environ["PATH"] = os.pathsep.join([*dirs, os.environ.get("PATH", "")])


def _register_fake() -> None:
    """Shape-only twin for torch.compile: the op only writes into `out`."""

    @torch.library.register_fake("orcaserve::paged_attention")
    def _fake(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        return None


def _load(build: bool, verbose: bool) -> tuple[PagedAttentionOp | None, str]:
    missing = [str(p) for p in (*SOURCES, *HEADERS) if not p.exists()]
    if missing:
        return None, f"source {', '.join(missing)} missing"
    lib = library_path()
    try:
        # cpp_extension holds `lock` while it builds: a library next to it may be half-written.
        if lib.exists() and not (lib.parent / "lock").exists():
            torch.ops.load_library(str(lib))
        elif not build:
            return (
                None,
                f"not built ({lib} missing or being built); run python -m orcaserve.kernels.cpu_attention --build",
            )
        else:
            from torch.utils import cpp_extension

            _ensure_ninja()
            lib.parent.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name=lib.stem,
                sources=[str(p) for p in SOURCES],
                extra_cflags=compile_flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(lib.parent),
                is_python_module=False,
                verbose=verbose,
            )
        op = torch.ops.orcaserve.paged_attention.default
        _register_fake()
    except Exception as exc:  # noqa: BLE001 - any build or load failure means "use PyTorch"
        return None, f"{type(exc).__name__}: {str(exc)[-1500:]}"
    return op, f"loaded {lib}"


def load_cpu_ops(build: bool = True, verbose: bool = False) -> tuple[PagedAttentionOp | None, str]:
    """The operator, or None and why not; builds it first when `build` and it is missing.

    The outcome is cached for the process: an op library registers its schema once.
    """
    global _loaded
    if _loaded is None or (_loaded[0] is None and build):
        _loaded = _load(build, verbose)
    return _loaded


def paged_attention(
    q: torch.Tensor,  # [T, H, D], head dim contiguous
    k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D], contiguous, q's dtype
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
) -> torch.Tensor:
    """`torch_attention.unified_attention` through the C++ operator (which must load)."""
    op, reason = load_cpu_ops(build=True)
    if op is None:
        raise RuntimeError(f"orcaserve CPU attention unavailable: {reason}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    op(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q.int().contiguous(),
        seq_lens.int().contiguous(),
        block_tables.int().contiguous(),
        float(scale),
        out,
    )
    return out


@dataclass
class CpuAttentionPlan:
    """Step metadata in the operator's layout (contiguous int32, CPU), converted once per step."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    block_size: int
    fallback: torch_attention.TorchAttentionPlan | None = None  # built only if a layer cannot use the op


class CpuBackend(AttentionBackend):
    """Paged attention through the C++ operator; K/V stored by the PyTorch `store_kv`.

    Work items are derived inside the operator (a loop over B, microseconds), so the plan is
    only the metadata in its final dtype and layout.
    """

    name = "cpu"

    def __init__(self, op: PagedAttentionOp) -> None:
        self.op = op
        self._warned = False

    def plan(
        self,
        cu_seqlens_q: torch.Tensor,  # [B + 1]
        seq_lens: torch.Tensor,  # [B]
        block_tables: torch.Tensor,  # [B, max_blocks]
        block_size: int,
        max_seqlen_q: int,
        max_seqlen_k: int,
    ) -> CpuAttentionPlan:
        def prep(t: torch.Tensor) -> torch.Tensor:
            return t.to(device="cpu", dtype=torch.int32).contiguous()

        return CpuAttentionPlan(prep(cu_seqlens_q), prep(seq_lens), prep(block_tables), int(block_size))

    def store_kv(
        self,
        key: torch.Tensor,  # [T, H_kv, D]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        torch_attention.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        plan: CpuAttentionPlan,
        q: torch.Tensor,  # [T, H, D], any strides
        k_cache: torch.Tensor,  # [num_blocks, block_size, H_kv, D]
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,  # [T, H, D]
    ) -> torch.Tensor:
        cache_dtype = k_cache.dtype
        if q.shape[-1] not in SUPPORTED_HEAD_DIMS or cache_dtype not in SUPPORTED_DTYPES or q.device.type != "cpu":
            return self._fallback(plan, q, k_cache, v_cache, scale, out)
        # The operator reads q and writes out through their strides; only the head dim must be dense.
        qc = q if q.dtype == cache_dtype and q.stride(-1) == 1 else q.to(cache_dtype).contiguous()
        direct = out is not None and out.dtype == cache_dtype and out.stride(-1) == 1
        res = out if out is not None and direct else torch.empty(qc.shape, dtype=cache_dtype)  # [T, H, D]
        self.op(qc, k_cache, v_cache, plan.cu_seqlens_q, plan.seq_lens, plan.block_tables, float(scale), res)
        if out is not None and not direct:
            return out.copy_(res)
        return res if q.dtype == cache_dtype else res.to(q.dtype)

    def _fallback(
        self,
        plan: CpuAttentionPlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """Shapes the operator was not compiled for go through the PyTorch path, said once."""
        if not self._warned:
            log.warning(
                "attention_backend 'cpu': head dim %d, %s on %s not supported by the C++ operator; "
                "using the PyTorch path for it",
                q.shape[-1],
                k_cache.dtype,
                q.device,
            )
            self._warned = True
        if plan.fallback is None:
            dev = q.device
            plan.fallback = torch_attention.TorchAttentionPlan(
                plan.cu_seqlens_q.to(dev), plan.seq_lens.to(dev), plan.block_tables.to(dev), plan.block_size
            )
        return plan.fallback.attend(q, k_cache, v_cache, scale, out)


def has_op(name: str) -> bool:
    """True when the library is loaded (or loads now without building) with
    `torch.ops.orcaserve.<name>`: callers use the op, else the PyTorch they replace."""
    return load_cpu_ops(build=False)[0] is not None and hasattr(torch.ops.orcaserve, name)


def fused_ops() -> bool:
    """The lean decoder's fused bf16 element-wise ops (`add_rms_norm`, `silu_mul`) are there."""
    return has_op("add_rms_norm") and has_op("silu_mul")


def make_cpu_backend(build: bool = True) -> AttentionBackend:
    """`CpuBackend` if the operator loads, else `TorchBackend` after one warning saying why."""
    op, reason = load_cpu_ops(build=build)
    if op is None:
        log.warning("attention_backend 'cpu': C++ operator unavailable, using the PyTorch path (%s)", reason)
        return TorchBackend()
    return CpuBackend(op)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="compile if missing, then load")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    parser.add_argument("--strict", action="store_true", help="exit 1 if the operator does not load")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    op, reason = load_cpu_ops(build=args.build, verbose=args.verbose)
    print(f"library: {library_path()}")
    print(f"flags:   {' '.join(compile_flags())}")
    status = "loaded" if op is not None else "NOT loaded (engine falls back to PyTorch attention)"
    print(f"status:  {status} in {time.perf_counter() - start:.1f} s: {reason}")
    return 1 if op is None and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
