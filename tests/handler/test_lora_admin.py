"""The routes that load and unload LoRA adapters while serving (handler/lora_admin.py) against a
real engine loop: off unless enabled, the management key checked (read fresh from the frontend's
key file, expiry included), refusals that name what is wrong and change nothing, an unknown
adapter a 404 `model_not_found`, and a loaded adapter serving its tokens at once."""

from __future__ import annotations

import asyncio
import datetime
import json

import pytest
from lora_adapters import make_adapter

from orcaserve.bench.models.tiny import tiny_family
from orcaserve.handler.lora_admin import LOAD, UNLOAD, LoraAdmin, management_key
from orcaserve.handler.openai.errors import http_error
from orcaserve.handler.openai.protocol import ProtocolError
from orcaserve.scheduler import EngineRequest, SamplingParams
from orcaserve.scheduler.serving.engine_loop import EngineLoop

KEY = "m4M-5IBY"


def _key_file(path, key=KEY, minutes=60):
    expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=minutes)
    stamp = expires.strftime("%Y-%m-%dT%H:%M:%S.%f") + "123Z"  # Java's Instant: nanoseconds, Z
    path.write_text(json.dumps({"management": {"key": key, "expiration time": stamp}, "API": {"key": "x"}}))
    return str(path)


def test_the_management_key_is_read_with_its_expiry(tmp_path):
    assert management_key(_key_file(tmp_path / "k.json")) == KEY
    assert management_key(_key_file(tmp_path / "old.json", minutes=-1)) is None
    assert management_key(str(tmp_path / "none.json")) is None


@pytest.fixture
def served(engine_for, tmp_path):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base = tiny_family("LlamaForCausalLM")
    make_adapter(base, tmp_path / "a", seed=1, r=8, alpha=16)
    reference = engine_for(base, lora_adapters={"a": str(tmp_path / "a")})
    engine = engine_for(base, enable_lora=True, max_loras=1, max_cpu_loras=1)
    loop = EngineLoop(engine).start()
    key_file = _key_file(tmp_path / "key_file.json")
    try:
        yield loop, reference, lambda enabled=True: LoraAdmin(enabled, "tiny", loop, lambda: key_file), tmp_path
    finally:
        loop.shutdown(5)
        torch.set_num_threads(threads)


def _refused(coro) -> tuple[int, dict]:
    with pytest.raises(ProtocolError) as e:
        asyncio.run(coro)
    error = http_error(e.value)
    return error.status, error.body["error"]


def test_load_serve_unload(served):
    loop, reference, make, tmp_path = served
    admin = make()
    auth = {"X-Management-Key": KEY}
    path = str(tmp_path / "a")
    assert asyncio.run(admin.serve(LOAD, {"lora_name": "a", "lora_path": path}, auth)).startswith("Success")
    assert admin.adapters == ["a"] and loop.engine.lora_names == ["a"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    stream = loop.submit(EngineRequest("r", [5, 6, 7, 8], params, lora="a"))
    got = [out for out in stream if out.finished][0].output_token_ids
    reference.add_request("r", [5, 6, 7, 8], params, lora="a")  # "a" loaded at start there
    want = None
    while reference.has_unfinished():
        want = next((o.output_token_ids for o in reference.step() if o.finished), want)
    assert got == want
    # A second adapter past max_cpu_loras=1: "a" (no request in flight) leaves host memory and stays
    # served (read back from disk when named again).
    assert asyncio.run(admin.serve(LOAD, {"lora_name": "b", "lora_path": path}, auth)).startswith("Success")
    assert admin.adapters == ["a", "b"] and loop.engine.lora_names == ["a", "b"]
    for name in ("b", "a"):
        assert asyncio.run(admin.serve(UNLOAD, {"lora_name": name}, auth)).startswith("Success")
    assert admin.adapters == [] and loop.engine.lora_names == []
    status, body = _refused(admin.serve(UNLOAD, {"lora_name": "a"}, auth))
    assert status == 404 and body["code"] == "model_not_found" and body["param"] == "lora_name"


def test_refusals_name_what_is_wrong(served):
    loop, _, make, tmp_path = served
    admin = make()
    auth = {"x-management-key": KEY}
    cases = [
        (make(False), {"lora_name": "a", "lora_path": "/x"}, auth, 404, "lora_runtime_updates"),
        (admin, {"lora_name": "a", "lora_path": "/x"}, {}, 401, "X-Management-Key"),
        (admin, {"lora_name": "a", "lora_path": "/x"}, {"x-management-key": "wrong"}, 401, "management key"),
        (admin, {"lora_path": "/x"}, auth, 400, "lora_name must be"),
        (admin, {"lora_name": "a"}, auth, 400, "lora_path must be"),
        (admin, {"lora_name": "tiny", "lora_path": "/x"}, auth, 400, "served model's name"),
        (admin, {"lora_name": "a", "lora_path": str(tmp_path / "none")}, auth, 400, "not a directory"),
        (admin, {"lora_name": "a b", "lora_path": str(tmp_path / "a")}, auth, 400, "adapter name 'a b'"),
    ]
    for who, body, headers, status, words in cases:
        got, error = _refused(who.serve(LOAD, body, headers))
        assert got == status and words in error["message"], (body, headers, error)
    assert loop.engine.lora_names == [] and loop.alive
    no_key = LoraAdmin(True, "tiny", loop, lambda: str(tmp_path / "missing.json"))
    got, error = _refused(no_key.serve(LOAD, {"lora_name": "a", "lora_path": "/x"}, auth))
    assert got == 403 and "token authorization is off" in error["message"]
