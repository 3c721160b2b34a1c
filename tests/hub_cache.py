"""A Hugging Face hub cache laid out in a temporary directory, the way `hf download` leaves it.

    models--org--name/
        blobs/<sha256 of the file>          the file's bytes
        refs/main                           the commit the branch points at
        snapshots/<commit>/<file>           a relative symlink to the blob

`huggingface_hub` resolves ids against exactly this (file_download.py, `_cache_commit_hash_for_
specific_revision` and `snapshot_download(local_files_only=True)`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def commit_of(repo: str) -> str:
    """A made-up commit hash (40 hex digits), fixed per repository."""
    return hashlib.sha1(repo.encode()).hexdigest()


def add_to_cache(cache: Path, repo: str, files: dict[str, Path], branch: str = "main") -> Path:
    """Put `files` (name in the repository -> file on disk; the blob links to it, so large files
    cost nothing) into the cache as one commit of `repo` on `branch`; returns the snapshot dir."""
    root = cache / ("models--" + repo.replace("/", "--"))
    commit = commit_of(repo)
    snapshot = root / "snapshots" / commit
    for name, source in files.items():
        digest = hashlib.sha256(str(source.resolve()).encode()).hexdigest()  # a stand-in etag
        blob = root / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.symlink_to(source.resolve())
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / branch).write_text(commit)
    return snapshot


def add_model_dir(cache: Path, repo: str, model_dir: Path) -> Path:
    """Every file of a saved transformers model directory as one cached commit of `repo`."""
    files = {p.relative_to(model_dir).as_posix(): p for p in model_dir.rglob("*") if p.is_file()}
    return add_to_cache(cache, repo, files)
