"""End to end: a real TorchServe serving the default model with two LoRA adapters (made here with
PEFT), through the real `openai` client: `/v1/models` lists the adapters with their parent,
requests of both adapters and of the base model run together and each gets the offline engine's
answer under its adapter, and an unknown model is a 404 `model_not_found`. Adapters loaded and
unloaded over HTTP while a stream runs (`v1/load_lora_adapter`, `v1/unload_lora_adapter`, behind
the management key)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from lora_adapters import make_adapter

from orcaserve.bench.serve.harness import serving
from orcaserve.scheduler import Engine, SamplingParams, default_model_path

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

MODEL = "smollm2"
ENGINE_ARGS = {"kv_cache_memory": 64 << 20, "max_num_seqs": 16, "max_num_batched_tokens": 256, "dtype": "float32"}
PROMPTS = ["The capital of France is", "Once upon a time", "The best way to learn is", "Water boils at"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    import torch

    from orcaserve.scheduler.model.loader import load_model_and_tokenizer

    root = tmp_path_factory.mktemp("adapters")
    base, _ = load_model_and_tokenizer(default_model_path(), torch.float32, torch.device("cpu"))
    make_adapter(base, root / "a", seed=1, r=8, alpha=16, std=0.05)
    make_adapter(base, root / "b", seed=2, r=16, alpha=16, rslora=True, std=0.05, targets=("q_proj", "v_proj"))
    del base
    return {"a": str(root / "a"), "b": str(root / "b")}


@pytest.fixture(scope="module")
def ts(tmp_path_factory, adapters):
    config = {**ENGINE_ARGS, "lora_adapters": adapters, "max_cpu_loras": 3, "lora_runtime_updates": True}
    with serving(tmp_path_factory.mktemp("torchserve"), MODEL, config) as server:
        yield server


@pytest.fixture(scope="module")
def client(ts):
    return openai.OpenAI(base_url=ts.url(f"/predictions/{MODEL}/1.0/v1"), api_key=ts.keys["inference"])


@pytest.fixture(scope="module")
def offline(adapters):
    """Each (prompt, adapter)'s greedy answer from the offline engine with the same arguments."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside the server's worker on a small shared machine
    try:
        engine = Engine.from_pretrained(default_model_path(), **ENGINE_ARGS, lora_adapters=adapters)
        answers = {}
        for i, prompt in enumerate(PROMPTS):
            for lora in (None, "a", "b"):
                engine.add_request(f"{i}-{lora}", prompt, SamplingParams(temperature=0, max_tokens=12), lora=lora)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    answers[out.request_id] = out.text
        return answers
    finally:
        torch.set_num_threads(threads)


def test_models_lists_each_adapter_with_its_parent(client):
    models = client.models.list().data
    assert [(m.id, m.parent) for m in models] == [(MODEL, None), ("a", MODEL), ("b", MODEL)]


def test_two_adapters_and_the_base_model_served_together_match_offline(client, offline):
    asks = [(i, lora) for i in range(len(PROMPTS)) for lora in (None, "a", "b")]
    # The adapters change the answers (else nothing would be proven).
    for i in range(len(PROMPTS)):
        assert len({offline[f"{i}-{lora}"] for lora in (None, "a", "b")}) > 1, PROMPTS[i]

    def one(ask):
        i, lora = ask
        c = client.completions.create(model=lora or MODEL, prompt=PROMPTS[i], max_tokens=12, temperature=0)
        return c.model, c.choices[0].text

    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(one, asks))
    for (i, lora), (_, text) in zip(asks, got):
        assert text == offline[f"{i}-{lora}"], (PROMPTS[i], lora)


def test_a_streamed_answer_under_an_adapter_matches_offline(client, offline):
    pieces = client.completions.create(model="b", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in pieces if chunk.choices) == offline["0-b"]


def test_an_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="c", prompt=PROMPTS[0], max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert e.value.body["param"] == "model" and "'c' does not exist" in e.value.body["message"]


def _admin(ts, route: str, body: dict, key: str | None = "management") -> requests.Response:
    headers = {**ts.auth("inference"), **({"X-Management-Key": ts.keys[key]} if key else {})}
    return requests.post(ts.url(f"/predictions/{MODEL}/1.0/v1/{route}"), json=body, headers=headers, timeout=120)


def test_load_and_unload_over_http_while_a_stream_runs(ts, client, offline, adapters):
    """ "c" loaded from "a"'s files serves "a"'s answers; "b" unloaded while its stream runs lets
    it finish with its answer, then is a 404; refusals name what is wrong and change nothing."""
    assert _admin(ts, "load_lora_adapter", {"lora_name": "c", "lora_path": adapters["a"]}, key=None).status_code == 401
    assert _admin(ts, "load_lora_adapter", {"lora_name": "c", "lora_path": "/nowhere"}).status_code == 400
    stream = client.completions.create(model="b", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks).choices[0].text  # "b" is running now
    loaded = _admin(ts, "load_lora_adapter", {"lora_name": "c", "lora_path": adapters["a"]})
    assert loaded.status_code == 200, loaded.text
    unloaded = _admin(ts, "unload_lora_adapter", {"lora_name": "b"})
    assert unloaded.status_code == 200, unloaded.text
    assert first + "".join(c.choices[0].text for c in chunks if c.choices) == offline["1-b"]
    c = client.completions.create(model="c", prompt=PROMPTS[2], max_tokens=12, temperature=0)
    assert c.choices[0].text == offline["2-a"] and c.model == MODEL
    assert [m.id for m in client.models.list().data] == [MODEL, "a", "c"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="b", prompt=PROMPTS[0], max_tokens=2)
    assert e.value.code == "model_not_found"
    again = _admin(ts, "unload_lora_adapter", {"lora_name": "b"})
    assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
    a = client.completions.create(model="a", prompt=PROMPTS[3], max_tokens=12, temperature=0)
    assert a.choices[0].text == offline["3-a"]  # the others kept serving
    for _ in range(40):  # the worker emits its metrics at most every quarter second while busy
        metrics = ts.metrics()
        if "orca_lora_loads_total" in metrics and 'Adapter="c"' in metrics:
            break
        time.sleep(0.25)
    assert "orca_lora_loads_total" in metrics and 'Adapter="c"' in metrics, metrics[-3000:]
