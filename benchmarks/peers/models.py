"""The model-size axis of the peer run (docs/peers.md "Two sizes"): which checkpoint and which GGUF
file each system reads at each size, and how the ones that are not shipped get made (once, cached).

- `smollm2`: SmolLM2-135M-Instruct's shipped GGUF (orcaserve dequantizes it for fp32/bf16);
  vLLM reads its fp32 HF conversion (convert_model.py).
- `1b`: random weights in Llama-3.2-1B's shapes (benchmarks/models/random_checkpoint.py); its GGUF made
  by llama.cpp's own converter and quantizer, the default model's recipe (Q4_1 layers, Q8_0
  embedding). `1b-q4_0`, `1b-q4_k_m`: the same checkpoint with Q4_0 layers, or llama-quantize's
  Q4_K_M recipe. EOS is ignored and prompts are random ids: random weights do not change the work.

Every size runs the same requests: token ids from [100, 49152) (SmolLM2's vocabulary).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from orcaserve.bench.peers.parts import ENGINE_OPTIONS, HERE, VPY, log, run_logged

CACHE = Path(os.path.expanduser("~/.cache/orcaserve"))
CONVERTER = HERE / ".llamacpp" / "convert"
QUANTIZE = HERE / ".llamacpp" / "bin" / "llama-quantize"
TOKEN_IDS = (100, 49152)  # [low, high): valid ids at every size


@dataclass(frozen=True)
class PeerModel:
    name: str  # the JSON's `model`, the served model name
    label: str
    hf_dir: Path  # vLLM's checkpoint
    gguf: Path | None  # orcaserve's `gguf` cell and llama.cpp; None: the default model's file
    orcaserve_reads_gguf: bool  # orcaserve's fp32/bf16 cells read the GGUF (dequantized) too
    quant: str = "Q4_1"  # llama-quantize's type for the layers (a GGUF this run makes)
    embedding: str | None = "q8_0"  # its --token-embedding-type; None: the type's own recipe

    def gguf_path(self) -> str:
        if self.gguf is not None:
            return str(self.gguf)
        from orcaserve.scheduler import default_model_path

        return default_model_path()

    def orcaserve_model(self, dtype: str) -> str:
        """What orcaserve loads for a cell: the GGUF file (its quantized cells), or the HF checkpoint."""
        return self.gguf_path() if dtype in ENGINE_OPTIONS or self.orcaserve_reads_gguf else str(self.hf_dir)


SHAPE_1B = "Llama-3.2-1B shape, random weights"
MODELS = {
    "smollm2": PeerModel("smollm2", "SmolLM2-135M-Instruct", HERE / "model" / "SmolLM2-135M-Instruct", None, True),
    "1b": PeerModel("1b", f"{SHAPE_1B} (1.24 B parameters)", CACHE / "random-1b", CACHE / "random-1b.Q4_1.gguf", False),
    # Q4_0 layers: llama.cpp's fast batched CPU matmul (llamafile's sgemm) takes Q8_0, Q4_0 and
    # Q5_0, not Q4_1, so Q4_1 files leave it on its generic path. Run with `--dtypes gguf`.
    "1b-q4_0": PeerModel(
        "1b-q4_0", f"{SHAPE_1B}, Q4_0 layers", CACHE / "random-1b", CACHE / "random-1b.Q4_0.gguf", False, "Q4_0"
    ),
    "1b-q4_k_m": PeerModel(
        "1b-q4_k_m", f"{SHAPE_1B}, Q4_K_M", CACHE / "random-1b", CACHE / "random-1b.Q4_K_M.gguf", False, "Q4_K_M", None
    ),
}


def prepare(model: PeerModel, systems: list[str], dtypes: list[str], work: Path) -> None:
    """Make what the cells to run will read, where it is missing."""
    if model.gguf is None:  # SmolLM2: the shipped GGUF
        if "vllm" in systems:
            from orcaserve.bench.peers.convert_model import convert

            convert(["--out", str(model.hf_dir)])
        return
    if not (model.hf_dir / "config.json").exists():
        from orcaserve.bench.models.random_checkpoint import checkpoint_path

        checkpoint_path("1b", str(model.hf_dir))
    if set(dtypes) & set(ENGINE_OPTIONS) and not model.gguf.exists():
        make_gguf(model, work)


def make_gguf(model: PeerModel, work: Path) -> None:
    """llama.cpp's converter to a bf16 GGUF, then its quantizer: layers in `model.quant`, the
    embedding in `model.embedding` (the default model's recipe: Q8_0) or the type's own."""
    assert model.gguf is not None
    if not (CONVERTER / "convert_hf_to_gguf.py").exists() or not QUANTIZE.exists():
        raise SystemExit("peers: llama.cpp's converter is missing: run benchmarks/peers/setup_llamacpp.sh")
    # The converter imports sentencepiece (for tokenizers that have a tokenizer.model); vLLM's
    # venv has it, the project's does not need it.
    py = str(VPY) if VPY.exists() else sys.executable
    env = dict(os.environ, PYTHONPATH=str(CONVERTER / "gguf-py"))
    bf16 = model.gguf.with_suffix(".bf16.tmp")
    log(f"making {model.gguf} with llama.cpp's converter and quantizer")
    run_logged(
        [py, str(CONVERTER / "convert_hf_to_gguf.py"), str(model.hf_dir), "--outtype", "bf16", "--outfile", str(bf16)],
        work / f"gguf-convert-{model.name}.log",
        env=env,
    )
    from orcaserve.bench.peers.llamacpp import llamacpp_env

    tmp = model.gguf.with_suffix(".tmp")
    run_logged(
        [str(QUANTIZE), *(["--token-embedding-type", model.embedding] if model.embedding else []), str(bf16), str(tmp)]
        + [model.quant],
        work / f"gguf-quantize-{model.name}.log",
        env=llamacpp_env(),
    )
    bf16.unlink()
    tmp.rename(model.gguf)


def describe(model: PeerModel) -> str:
    """The JSON's settings["models"] line for `model`."""
    gguf = Path(model.gguf_path())
    size = f", {gguf.stat().st_size / 2**20:.0f} MiB" if gguf.exists() else ""
    fp = "the GGUF dequantized" if model.orcaserve_reads_gguf else model.hf_dir.name
    return f"{model.label}: gguf cells {gguf.name}{size}; orcaserve fp32/bf16: {fp}; vLLM: {model.hf_dir.name}"
