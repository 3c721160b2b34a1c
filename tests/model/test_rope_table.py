"""The rotary tables by position (scheduler/model/rope_table.py): bit for bit the model's
`rotary_emb` at every step size the decoder reads them for."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from orcaserve.scheduler.model.rope_table import RopeTable, rotary_rows


def _rotary(head_dim: int, **rope: object) -> LlamaRotaryEmbedding:
    cfg = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0, **rope},
    )  # fmt: skip
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_table_rows_equal_the_modules(dtype, head_dim):
    rotary = _rotary(head_dim)
    table = RopeTable.of(rotary, head_dim, dtype, torch.device("cpu"))
    assert table is not None
    like = torch.empty(0, dtype=dtype)
    g = torch.Generator().manual_seed(head_dim)
    for t in (1, 2, 7, 64, table.max_rows):
        positions = torch.randint(0, 5000, (t,), generator=g)
        cos, sin = table(positions)
        want_cos, want_sin = rotary_rows(rotary, like, positions)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert cos.view(torch.int16 if dtype == torch.bfloat16 else torch.int32).equal(
            want_cos.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        )  # bit for bit, signed zeros included
    assert table.cos.shape[0] == 8192  # grown to the next power of two past the largest position


def test_no_table_where_rows_depend_on_the_step():
    assert RopeTable.of(_rotary(64, rope_type="dynamic", factor=2.0), 64, torch.float32, torch.device("cpu")) is None
    assert RopeTable.of(_rotary(80), 80, torch.float32, torch.device("cpu")) is None  # scalar tails in the module
    assert RopeTable.of(_rotary(64), 64, torch.float32, torch.device("meta")) is None
