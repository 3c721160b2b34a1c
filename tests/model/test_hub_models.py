"""Models named by a Hugging Face hub id, resolved offline from a cache laid out in a temporary
directory (tests/hub_cache.py), and served token for token as transformers generates."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hub_cache import add_model_dir, add_to_cache, commit_of

from orcaserve.bench.models.tiny import hf_greedy, tiny_model
from orcaserve.handler.archive import model_config
from orcaserve.handler.config import resolve_model_path
from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.model.hub import hub_cache_dir, parse_hub_id, resolve_model

REPO = "orca-test/tiny-llama"
GGUF_REPO = "orca-test/SmolLM2-GGUF"


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """The tiny Llama and the SmolLM2 tokenizer saved as a transformers model directory."""
    model = tiny_model("llama")
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, path


@pytest.fixture
def cache(tmp_path, monkeypatch, saved):
    """A hub cache holding REPO (a transformers directory) and GGUF_REPO (the default GGUF and a
    second GGUF name for it), read offline through HF_HUB_CACHE."""
    hub = tmp_path / "hub"
    add_model_dir(hub, REPO, saved[1])
    gguf = Path(default_model_path())
    add_to_cache(hub, GGUF_REPO, {gguf.name: gguf})
    add_to_cache(hub, "orca-test/two-ggufs", {"a.gguf": gguf, "sub/b.gguf": gguf})
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_hub_id_resolves_offline_and_serves_token_exact(cache, saved):
    model, _ = saved
    snapshot = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit_of(REPO)
    for name in (REPO, f"{REPO}@main", f"{REPO}@{commit_of(REPO)}"):
        assert resolve_model(name) == str(snapshot), name
    engine = Engine.from_pretrained(REPO, dtype="float32", kv_cache_memory=4 << 20)
    prompts = [[5, 77, 301, 12, 9], [400, 3, 3, 18, 250, 61, 7]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.output_token_ids == hf_greedy(model, prompt, 12)


def test_gguf_inside_a_hub_repository(cache):
    snapshot = cache / f"models--{GGUF_REPO.replace('/', '--')}" / "snapshots" / commit_of(GGUF_REPO)
    name = os.path.basename(default_model_path())
    assert resolve_model(f"{GGUF_REPO}/{name}") == str(snapshot / name)
    assert resolve_model(GGUF_REPO) == str(snapshot / name)  # the repository's one GGUF
    assert resolve_model("orca-test/two-ggufs/sub/b.gguf").endswith("/sub/b.gguf")
    with pytest.raises(FileNotFoundError, match="several GGUF files; name one: orca-test/two-ggufs/a.gguf"):
        resolve_model("orca-test/two-ggufs")
    with pytest.raises(FileNotFoundError, match="'missing.gguf' is not in the cached snapshot"):
        resolve_model(f"{GGUF_REPO}/missing.gguf")


def test_absent_id_names_the_id_and_the_cache(cache):
    with pytest.raises(FileNotFoundError) as e:
        Engine.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct", dtype="float32")
    msg = str(e.value)
    assert "'Qwen/Qwen2.5-0.5B-Instruct'" in msg and str(cache) in msg and "offline" in msg
    with pytest.raises(FileNotFoundError, match=f"{REPO} at revision 'v9' under {cache}"):
        resolve_model(f"{REPO}@v9")
    with pytest.raises(FileNotFoundError, match="no such model directory or GGUF file: /no/such/dir"):
        resolve_model("/no/such/dir")


def test_cache_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == str(tmp_path / "home" / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == str(tmp_path / "elsewhere")


def test_what_counts_as_a_hub_id():
    assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None, None)
    assert parse_hub_id("org/name@v1.0/dir/f.gguf") == ("org/name", "v1.0", "dir/f.gguf")
    for not_an_id in ("/abs/org/name", "./org/name", "~/org/name", "name", "org/name/config.json", "a/b/c"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_archives_and_handler_config_take_ids(tmp_path):
    # An id stays an id in the archive: the serving machine's cache resolves it.
    assert model_config(REPO)["handler"]["model_path"] == REPO
    assert model_config(str(tmp_path))["handler"]["model_path"] == str(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a hub id: ./nope"):
        model_config("./nope")
    # In the worker: a relative path inside the extracted archive wins, else the id is kept.
    (tmp_path / "org" / "inside").mkdir(parents=True)
    assert resolve_model_path("org/inside", str(tmp_path)) == str(tmp_path / "org" / "inside")
    assert resolve_model_path(REPO, str(tmp_path)) == REPO
    assert resolve_model_path("weights", str(tmp_path)) == str(tmp_path / "weights")
