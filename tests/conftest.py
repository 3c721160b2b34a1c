"""Shared fixtures: the real SmolLM2 tokenizer and engines over private copies of tiny models."""

from __future__ import annotations

import copy
import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from orcaserve.scheduler import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))


@pytest.fixture
def engine_for(tokenizer):
    """engine_for(model, **engine_args): an engine over a private copy of `model`, in fp32 unless
    `dtype` says otherwise (transformers' fp32 answer is the reference, token for token)."""
    from orcaserve.scheduler import Engine

    def make(model, **engine_args):
        return Engine.from_model(copy.deepcopy(model), tokenizer, **{"dtype": "float32", **engine_args})

    return make
