"""A step of a few decodes written request by request (step_buffers.py `_prepare_decodes`): the
same staging entries and shape as the whole-array path writes."""

from array import array
from types import SimpleNamespace

import pytest
import torch

from orcaserve.scheduler.model import step_buffers
from orcaserve.scheduler.model.step_buffers import StepBuffers


def _step(g: torch.Generator, b: int, bs: int, placeholders: bool):
    reqs, tables = {}, {}
    for i in range(b):
        n = int(torch.randint(1, 200, (1,), generator=g))  # tokens; the last one is this step's
        ids = torch.randint(0, 49152, (n,), generator=g).tolist()
        if placeholders and i % 2:
            ids[-1] = -1
        reqs[f"r{i}"] = SimpleNamespace(num_computed_tokens=n - 1, all_token_ids=ids, pending_row=b - 1 - i)
        blocks = torch.randperm(500, generator=g)[: -(-n // bs)].tolist()
        tables[f"r{i}"] = array("q", blocks)
    sched = SimpleNamespace(
        num_scheduled_tokens=dict.fromkeys(reqs, 1), requests=reqs, sampling=list(reqs.values()), spec={}
    )
    kv = SimpleNamespace(tables_of=lambda ids: [tables[r] for r in ids])
    return sched, kv


@pytest.mark.parametrize("b", [1, 3, 8])
@pytest.mark.parametrize("placeholders", [False, True])
def test_decodes_written_as_the_general_path(b, placeholders, monkeypatch):
    g = torch.Generator().manual_seed(b)
    for _ in range(5):
        sched, kv = _step(g, b, 16, placeholders)
        bufs = [StepBuffers(64, 8, 16, 16, torch.device("cpu")) for _ in range(2)]
        for buf in bufs:  # stale entries from a larger step, which each path must overwrite
            buf.host_bytes.fill_(0x5A)
        fast = bufs[0].prepare(sched, kv)
        monkeypatch.setattr(step_buffers, "PER_REQUEST", 0)
        general = bufs[1].prepare(sched, kv)
        monkeypatch.undo()
        assert fast == general
        t = bufs[0].tensors(fast.num_tokens, fast.num_seqs, fast.num_samples, fast.width)
        u = bufs[1].tensors(general.num_tokens, general.num_seqs, general.num_samples, general.width)
        for name in ("input_ids", "positions", "slot_mapping", "sample_rows", "cu_seqlens_q", "seq_lens"):
            assert torch.equal(getattr(t, name), getattr(u, name)), name
        assert torch.equal(t.block_tables, u.block_tables)
        p = fast.num_placeholders
        for name in ("ph_pos", "ph_src"):
            assert torch.equal(bufs[0].host[name][:p], bufs[1].host[name][:p]), name
