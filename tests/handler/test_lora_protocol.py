"""Over HTTP the `model` field names a LoRA adapter (handler/openai/models.py), `/v1/models` lists
each adapter with its parent, and an unknown name is OpenAI's 404 `model_not_found` through the
one error path (handler/openai/errors.py)."""

from __future__ import annotations

import pytest

from orcaserve.handler.config import HandlerConfig
from orcaserve.handler.openai import protocol as P
from orcaserve.handler.openai import responses as R
from orcaserve.handler.openai.errors import http_error
from orcaserve.handler.openai.models import with_model
from orcaserve.scheduler.errors import UnknownModel


def _request(model):
    body = {"prompt": "hi"} if model is None else {"prompt": "hi", "model": model}
    parsed = P.parse_request(body, P.COMPLETIONS, request_id="r")
    return parsed, parsed.request


@pytest.mark.parametrize(
    "model, adapters, lora",
    [
        ("served", ["a", "b"], None),  # the served model's name: the base model
        (None, ["a", "b"], None),
        ("a", ["a", "b"], "a"),
        ("nope", ["a", "b"], "nope"),  # taken for an adapter: the engine refuses it (404)
        ("anything", [], None),  # a worker without adapters does not check the field
    ],
)
def test_the_model_field_names_the_adapter(model, adapters, lora):
    parsed, request = _request(model)
    assert with_model(request, parsed.model, "served", adapters).lora == lora


def test_an_unknown_model_is_openais_404_model_not_found():
    error = http_error(UnknownModel("nope", ["a", "b"]))
    assert error.status == 404
    assert error.body == {
        "error": {
            "message": "the model 'nope' does not exist (LoRA adapters served: a, b)",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert http_error(P.ProtocolError("x")).body["error"]["code"] is None  # other errors keep a null code


def test_models_lists_each_adapter_with_its_parent():
    listed = R.model_list("served", 2048, 7, ["a", "b"])["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in listed] == [
        ("served", None, "served"),
        ("a", "served", "a"),
        ("b", "served", "b"),
    ]
    assert all(m["object"] == "model" and m["max_model_len"] == 2048 and m["created"] == 7 for m in listed)
    assert R.model_list("served", 2048, 7)["data"] == listed[:1]


def test_adapter_paths_in_the_model_config_are_relative_to_the_archive(tmp_path):
    section = {"lora_adapters": {"a": "adapters/a", "b": "/abs/b"}, "max_loras": 2, "max_lora_rank": 64}
    config = HandlerConfig.from_dict(section, str(tmp_path))
    assert config.engine["lora_adapters"] == {"a": str(tmp_path / "adapters/a"), "b": "/abs/b"}
    with pytest.raises(ValueError, match="max_cpu_loras=1"):
        HandlerConfig.from_dict({**section, "max_cpu_loras": 1}, str(tmp_path))
