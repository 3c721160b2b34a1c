"""Shared fixtures: the real SmolLM2 tokenizer and engines over private copies of tiny models."""

from __future__ import annotations

import copy
import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

TEST_KV_BYTES = 64 << 20  # the KV cache of `engine_for`'s engines


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
    `dtype` says otherwise (transformers' fp32 answer is the reference, token for token).

    Its KV cache is TEST_KV_BYTES unless `kv_cache_memory` says otherwise: the CPU default (1 GiB)
    took most of a tiny engine's build in zero-filling, while a tiny model (benchmarks/models/
    tiny.py) fits 16k tokens (GLM-4's heads of 128) to 131k in 64 MiB, far above its 1,024-token
    limit: `max_model_len` and every test's answers are unchanged."""
    from orcaserve.scheduler import Engine

    def make(model, **engine_args):
        defaults = {"dtype": "float32", "kv_cache_memory": TEST_KV_BYTES}
        return Engine.from_model(copy.deepcopy(model), tokenizer, **{**defaults, **engine_args})

    return make
