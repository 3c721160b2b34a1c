"""The project's C++ CPU library: its sources, its ISA variants, the build, and loading.

One library registers every `torch.ops.orcaserve` CPU op (the schemas and registrations are all in
`csrc/bindings.cpp`). Its sources are grouped by family under `csrc/`: the paged attention
(`attention/`), the linear layers' GEMMs (`gemm/`) and the decoder's fused element-wise ops
(`fused/`: add + RMSNorm, SiLU * up, rotary + K/V write, the sampler's argmax).

Each family is compiled once per ISA variant, as PyTorch compiles its `CPU_CAPABILITY` kernels:

| variant     | flags                                  | families                      |
| ----------- | -------------------------------------- | ----------------------------- |
| generic     | none (the compiler's baseline)         | attention, fused              |
| avx2        | AVX2, FMA, F16C                        | attention, fused, GEMM fp32 * |
| avx512      | AVX-512 F/BW/VL/DQ                     | attention, fused, GEMM fp32 * |
| avx512_bf16 | avx512 + AVX-512 BF16                  | + GEMM bf16 (vdpbf16ps) **    |
| amx         | avx512_bf16, bf16 prefill tiles on AMX | + GEMM bf16 **                |

(* with it the GEMM over GGUF block codes, `gemm/gemm_quant.cpp` (packing: `gemm/pack_quant.cpp`), which
widens them to fp32, and the one against int8 activations, `gemm/gemm_int8.cpp` (`gemm/pack_int8.cpp`);
** that one built with AVX-512 VNNI, docs/int8-activations.md.)

Every variant the building CPU can execute is built into the library, and each op is registered
once per variant as an overload named after it (`torch.ops.orcaserve.paged_attention.avx2`). One
op is compiled once, like the bindings: `fused/decoder_layer.cpp`, a decoder layer in one call,
which calls the other ops in the variants its caller names (with `fused/layer_region.cpp`, a
GEMV-shaped step's layers in one OpenMP region); and `probe/read_sweep.cpp`, the read
bandwidth behind the benchmarks' DRAM roof. Which
variant the engine runs, and what it falls back to, is the table in `kernels/dispatch.py`.

Nothing is compiled on import. `load(build=True)` compiles on first use (ninja, the compiler
`torch.utils.cpp_extension` would use) and loads the library; `python -m
orcaserve.kernels.cpu.build --build` does the same from the command line (the Makefile's set-up).

Build directory: `$ORCASERVE_EXTENSIONS_DIR` if set, else `<sys.prefix>/var/cache/orcaserve` (the
venv: a TorchServe worker runs the same interpreter, so it finds the library the set-up step built,
whatever its HOME; and the library is tied to the venv's torch, deleted with it), else
`~/.cache/orcaserve` when the venv is read-only. Each build lives in a subdirectory keyed by a hash
of the sources, torch version, Python version, variants and flags, so an edited source, an
upgraded torch or another CPU never loads a stale library.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
ATTENTION = ("attention/paged_attention.cpp",)
FUSED = ("fused/norm_silu.cpp", "fused/rope_store.cpp", "fused/argmax.cpp")
# and GGUF codes widened to fp32, and LoRA adapters' update (docs/lora.md)
GEMM_FP32 = ("gemm/gemm_fp32.cpp", "gemm/gemm_quant.cpp", "gemm/pack_quant.cpp", "gemm/lora.cpp")
GEMM_BF16 = ("gemm/gemm_bf16.cpp",)
# GGUF codes against int8 activations (docs/int8-activations.md); with VNNI where the variant's CPUs have it.
GEMM_INT8 = ("gemm/gemm_int8.cpp", "gemm/pack_int8.cpp", "gemm/gemm_ternary.cpp")
_VNNI = tuple((src, ("-mavx512vnni",)) for src in GEMM_INT8)
BINDINGS = "bindings.cpp"
# Compiled once like the bindings (no ISA flags, each built variant's ops in reach): a decoder layer in
# one call, each of its ops in the variant the caller names.
COMPOSITE = ("fused/decoder_layer.cpp", "fused/layer_region.cpp")
# Compiled once too: the read-bandwidth probe behind a decode step's DRAM roof (orcaserve.bench.cpu.dram).
PROBE = ("probe/read_sweep.cpp",)


@dataclass(frozen=True)
class Variant:
    name: str  # the overload name of its ops, and its C++ namespace (orcaserve::<name>)
    flags: tuple[str, ...]  # ISA flags and the ATen vector implementation it selects
    sources: tuple[str, ...]  # under csrc/
    # (source, flags) added to the variant's for one source: the int8 GEMM's vpdpbusd on the
    # variants whose CPUs all have AVX-512 VNNI (Cooper Lake, Sapphire Rapids, Zen 4), kept off
    # the others' code.
    extra: tuple[tuple[str, tuple[str, ...]], ...] = ()


_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512")
VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("generic", (), ATTENTION + FUSED),
        Variant(
            "avx2", ("-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"), ATTENTION + FUSED + GEMM_FP32 + GEMM_INT8
        ),
        Variant("avx512", _AVX512, ATTENTION + FUSED + GEMM_FP32 + GEMM_INT8),
        Variant(
            "avx512_bf16", (*_AVX512, "-mavx512bf16"), ATTENTION + FUSED + GEMM_FP32 + GEMM_BF16 + GEMM_INT8, _VNNI
        ),
        Variant(
            "amx",
            (*_AVX512, "-mavx512bf16", "-DORCA_AMX"),
            ATTENTION + FUSED + GEMM_FP32 + GEMM_BF16 + GEMM_INT8,
            _VNNI,
        ),
    )
}


@cache
def machine_variants() -> tuple[str, ...]:
    """The variants this CPU can execute, lowest first (torch's own CPU detection, which
    `ATEN_CPU_CAPABILITY` does not lower). Off x86-64, generic only."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("generic",)
    found = ["generic"]
    if torch.cpu._is_avx2_supported():
        found.append("avx2")
    if torch.cpu._is_avx512_supported():
        found.append("avx512")
        if torch.cpu._is_avx512_bf16_supported():
            found.append("avx512_bf16")
            if torch.cpu._is_amx_tile_supported():
                found.append("amx")
    return tuple(found)


def variant_flags(name: str) -> list[str]:
    """Compile flags of one variant's family sources. CPU_CAPABILITY names ATen's vector namespace
    (at::vec::<it>), ORCA_ISA ours: distinct per variant, and distinct from libtorch's own."""
    return [*VARIANTS[name].flags, f"-DCPU_CAPABILITY=orca_{name}", f"-DORCA_ISA={name}"]


def common_flags() -> list[str]:
    # -fopenmp: at::parallel_for is inlined from ATen's OpenMP header; without it the loop runs
    # on one thread. libgomp.so.1 then resolves to the copy torch has already loaded (same
    # soname), so the operator shares torch's OpenMP team. -ffp-contract=off: a * b + c stays two
    # roundings, as in ATen's separate ops (rope_store_kv is bit for bit the unfused fp32 path);
    # the kernels' FMAs are written out as intrinsics and stay FMAs.
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-isystem{p}" for p in cpp_extension.include_paths()]
    return ["-fPIC", "-std=c++20", "-O3", "-fopenmp", "-ffp-contract=off", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{CSRC}", *includes]  # fmt: skip


def _all_files() -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h"))


def build_key(variants: tuple[str, ...] | None = None) -> str:
    """Hash of everything the compiled library depends on."""
    variants = variants or machine_variants()
    h = hashlib.sha256()
    for f in _all_files():
        h.update(f.relative_to(CSRC).as_posix().encode())
        h.update(f.read_bytes())
    parts = [torch.__version__, sys.version, platform.machine(), " ".join(common_flags())]
    parts += [f"{v}: {' '.join(variant_flags(v))} {VARIANTS[v].extra}" for v in variants]
    for part in parts:
        h.update(part.encode())
    return h.hexdigest()[:16]


def library_path(variants: tuple[str, ...] | None = None) -> Path:
    """Where the library for these sources, torch and variants is (or will be) built."""
    name = f"orcaserve_cpu_ops_{build_key(variants)}"
    return _cache_root() / name / f"{name}.so"


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


def _ninja() -> str:
    # `.venv/bin/python` without an activated venv leaves pip's ninja off PATH.
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja

        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError:
        return str(Path(sys.executable).parent / "ninja")


def ninja_file(lib: Path, variants: tuple[str, ...]) -> str:
    """build.ninja: each variant's family sources with its flags, the bindings, one shared library."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    lines = [
        "ninja_required_version = 1.3",
        f"cflags = {' '.join(common_flags())}",
        "rule compile",
        f"  command = {cxx} -MMD -MF $out.d $cflags $vflags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "rule link",
        # Linked under a temporary name and renamed: a library that exists is a whole one, for a
        # process that loads without building while another builds.
        f"  command = {cxx} $in -shared -fopenmp $ldflags -o $out.tmp && mv -f $out.tmp $out",
    ]
    objects = []
    for v in variants:
        for src in VARIANTS[v].sources:
            obj = f"{v}/{src.replace('/', '_').removesuffix('.cpp')}.o"
            flags = [*variant_flags(v), *dict(VARIANTS[v].extra).get(src, ())]
            lines += [f"build {obj}: compile {CSRC / src}", f"  vflags = {' '.join(flags)}"]
            objects.append(obj)
    built = " ".join(f"-DORCA_BUILT_{v.upper()}" for v in variants)
    for src in (*COMPOSITE, *PROBE, BINDINGS):
        obj = f"{src.replace('/', '_').removesuffix('.cpp')}.o"
        lines += [f"build {obj}: compile {CSRC / src}", f"  vflags = {built}"]
        objects.append(obj)
    libdirs = " ".join(f"-L{p}" for p in cpp_extension.library_paths())
    lines += [
        f"build {lib.name}: link {' '.join(objects)}",
        f"  ldflags = {libdirs} -lc10 -ltorch_cpu -ltorch",
        f"default {lib.name}",
    ]
    return "\n".join(lines) + "\n"


def _compile(lib: Path, variants: tuple[str, ...], verbose: bool) -> None:
    lib.parent.mkdir(parents=True, exist_ok=True)
    # One builder per directory: TorchServe workers started together may all find it missing.
    with open(lib.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not lib.exists():  # built by another process while this one waited
            _build(lib, variants, verbose)


def _build(lib: Path, variants: tuple[str, ...], verbose: bool) -> None:
    (lib.parent / "build.ninja").write_text(ninja_file(lib, variants))
    jobs = str(max(1, os.cpu_count() or 1))
    cmd = [_ninja(), "-C", str(lib.parent), "-j", jobs, *(["-v"] if verbose else [])]
    res = subprocess.run(cmd, capture_output=not verbose, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"build failed ({' '.join(cmd)}):\n{(res.stdout or '')[-3000:]}")


_loaded: tuple[bool, str] | None = None  # once per process: ops register once


def _load(build: bool, verbose: bool) -> tuple[bool, str]:
    variants = machine_variants()
    lib = library_path(variants)
    try:
        if not lib.exists():
            if not build:
                return False, f"not built ({lib} missing); run python -m orcaserve.kernels.cpu.build --build"
            _compile(lib, variants, verbose)
        torch.ops.load_library(str(lib))
        _register_fakes(variants)
    except Exception as exc:  # noqa: BLE001 - any build or load failure means "use PyTorch"
        return False, f"{type(exc).__name__}: {str(exc)[-1500:]}"
    return True, f"loaded {lib} (variants {', '.join(variants)})"


def _register_fakes(variants: tuple[str, ...]) -> None:
    """Shape-only twins of the attention for torch.compile: the op only writes into `out`."""
    for v in variants:

        def _fake(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, out) -> None:
            return None

        torch.library.register_fake(f"orcaserve::paged_attention.{v}")(_fake)


def load(build: bool = True, verbose: bool = False) -> tuple[bool, str]:
    """Whether the library is loaded, and why not; builds it first when `build` and it is missing.

    The outcome is cached for the process: an op library registers its schemas once.
    """
    global _loaded
    if _loaded is None or (not _loaded[0] and build):
        _loaded = _load(build, verbose)
    return _loaded


def built_variants() -> tuple[str, ...]:
    """The variants whose ops are loaded in this process (builds nothing): every variant this CPU
    executes once the library is loaded, none before."""
    return machine_variants() if load(build=False)[0] else ()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build (if asked) and load orcaserve's C++ CPU ops.")
    parser.add_argument("--build", action="store_true", help="compile if missing, then load")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    parser.add_argument("--strict", action="store_true", help="exit 1 if the library does not load")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    ok, reason = load(build=args.build, verbose=args.verbose)
    print(f"library:  {library_path()}")
    print(f"variants: {', '.join(machine_variants())}")
    status = "loaded" if ok else "NOT loaded (the engine falls back to PyTorch ops)"
    print(f"status:   {status} in {time.perf_counter() - start:.1f} s: {reason}")
    return 1 if not ok and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
