"""Models named by a Hugging Face hub id, found offline in the local Hugging Face cache.

    resolve_model("Qwen/Qwen2.5-0.5B-Instruct")                 # -> .../snapshots/<commit>
    resolve_model("Qwen/Qwen2.5-0.5B-Instruct@v1.0")            # a branch, tag or commit
    resolve_model("bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_K_M.gguf")

A path that exists is returned unchanged. Anything else shaped like a hub id is looked up with
`huggingface_hub.snapshot_download(..., local_files_only=True)`: the standard cache layout
(`models--org--name/refs/<revision>`, `snapshots/<commit>/`) under `HF_HUB_CACHE`, else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`. Nothing is downloaded: a serving worker must not
reach the network at load time (docs/deploy.md, "Models from the Hugging Face cache").
"""

from __future__ import annotations

import os
import re

# org/name, then optionally @revision (a branch, tag or commit; no slash), then optionally
# /file.gguf inside the repository (a path that may have folders).
_HUB_ID = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[\w.-]+))?(?:/(?P<file>[^@]+\.gguf))?$")


def hub_cache_dir() -> str:
    """The cache huggingface_hub reads, from the environment as it is now (huggingface_hub's
    own constants are read once at import, before a test or a worker may set them)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def parse_hub_id(name: str) -> tuple[str, str | None, str | None] | None:
    """(repo id, revision, .gguf file in the repo) if `name` is shaped like a hub id, else None."""
    if os.path.isabs(name) or name.startswith((".", "~")):
        return None
    m = _HUB_ID.match(name)
    return (m["repo"], m["rev"], m["file"]) if m else None


def resolve_model(name: str) -> str:
    """A local path for `name`: the path itself if it exists, else the cached snapshot (or the
    .gguf file in it) of the hub id `name`. FileNotFoundError names the id and the cache searched."""
    if os.path.exists(name):
        return name
    parsed = parse_hub_id(name)
    if parsed is None:
        raise FileNotFoundError(f"no such model directory or GGUF file: {name}")
    repo, revision, filename = parsed
    cache = hub_cache_dir()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        rev = f" at revision {revision!r}" if revision else ""
        raise FileNotFoundError(
            f"{name!r} is neither a local path nor a model in the Hugging Face cache: no snapshot of "
            f"{repo}{rev} under {cache} (searched offline; download it there first, e.g. "
            f"`hf download {repo}`, or point HF_HUB_CACHE / HF_HOME at the cache that has it)"
        ) from None
    if filename is not None:
        path = os.path.join(snapshot, filename)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{filename!r} is not in the cached snapshot {snapshot} of {repo}")
        return path
    return _model_in_snapshot(snapshot, repo)


def _model_in_snapshot(snapshot: str, repo: str) -> str:
    """The snapshot itself for a transformers repository (config.json), or its one .gguf file."""
    if os.path.isfile(os.path.join(snapshot, "config.json")):
        return snapshot
    ggufs = sorted(
        os.path.relpath(os.path.join(d, f), snapshot)
        for d, _, files in os.walk(snapshot)
        for f in files
        if f.endswith(".gguf")
    )
    if len(ggufs) == 1:
        return os.path.join(snapshot, ggufs[0])
    if ggufs:
        choices = ", ".join(f"{repo}/{f}" for f in ggufs)
        raise FileNotFoundError(f"{repo} holds several GGUF files; name one: {choices}")
    raise FileNotFoundError(f"the cached snapshot {snapshot} of {repo} has no config.json and no .gguf file")
