"""The project's C++ CPU library: its sources, compile flags, build directory, loading, and which
ops it carries.

One library (`kernels/*.cpp`) registers every `torch.ops.orcaserve` CPU op: the paged attention
(`cpu_attention.cpp`, used through `cpu_attention.CpuBackend`), the lean decoder's fused
element-wise ops (`cpu_fused.cpp`: `add_rms_norm`, `silu_mul`; see `fused_ops`), its rotary + K/V
write (`cpu_rope_store.cpp`: `rope_store_kv`), the sampler's argmax (`cpu_argmax.cpp`:
`argmax_rows`), on AVX2 and AVX-512 builds a GEMM over pre-packed fp32 or bf16 weights
(`cpu_gemm.cpp`: `pack_linear_weight`, `linear_packed`) and, with AVX-512 BF16, a `vdpbf16ps` GEMM
(`cpu_gemm_bf16.cpp`: `pack_linear_weight_bf16`, `linear_packed_bf16`); see `has_op`.

Nothing is compiled on import. `load_cpu_ops(build=True)` compiles on first use (JIT through
`torch.utils.cpp_extension`, ninja) and loads the library; `python -m orcaserve.kernels.cpu.build
--build` does the same from the command line (the Makefile's set-up step).

Build directory: `$ORCASERVE_EXTENSIONS_DIR` if set, else `<sys.prefix>/var/cache/orcaserve` (the
venv: a TorchServe worker runs the same interpreter, so it finds the library the set-up step built,
whatever its HOME; and the library is tied to the venv's torch, deleted with it), else
`~/.cache/orcaserve` when the venv is read-only. Each build lives in a subdirectory keyed by a hash
of the sources, torch version, Python version and compile flags, so an edited source or an
upgraded torch never loads a stale library.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(
    CSRC / n
    for n in (
        "attention/paged_attention.cpp",
        "fused/norm_silu.cpp",
        "fused/rope_store.cpp",
        "fused/argmax.cpp",
        "gemm/gemm_fp32.cpp",
        "gemm/gemm_bf16.cpp",
    )
)
HEADERS = tuple(
    CSRC / n
    for n in (
        "attention/amx.h",
        "attention/common.h",
        "attention/decode.h",
        "attention/tile.h",
        "rows.h",
        "gemm/panels.h",
    )
)

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
                f"not built ({lib} missing or being built); run python -m orcaserve.kernels.cpu.build --build",
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
                extra_include_paths=[str(CSRC)],
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


def has_op(name: str) -> bool:
    """True when the library is loaded (or loads now without building) with
    `torch.ops.orcaserve.<name>`: callers use the op, else the PyTorch they replace."""
    return load_cpu_ops(build=False)[0] is not None and hasattr(torch.ops.orcaserve, name)


def fused_ops() -> bool:
    """The lean decoder's fused bf16 element-wise ops (`add_rms_norm`, `silu_mul`) are there."""
    return has_op("add_rms_norm") and has_op("silu_mul")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build (if asked) and load orcaserve's C++ CPU ops.")
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
