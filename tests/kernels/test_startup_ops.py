"""Start-up and the op library: an engine on a GPU never loads the C++ CPU op
library, a CPU engine loads it once per process, and nothing registers custom ops at engine
start. Each probe runs in a fresh interpreter (benchmarks/gpu/startup_cost.py's, which also times
them; docs/performance-log.md, "2026-12-04: start-up and the op registrations")."""

import pytest

from orcaserve.bench.gpu.startup_cost import PROBES, probe

LAZY_SAMPLER = r"""
import torch
from orcaserve.kernels.cpu import build
from orcaserve.scheduler.model.sampler import Sampler
s = Sampler()
after_init = build._loaded is not None
x = torch.randn(3, 50, device="meta")
s._argmax(x)  # a non-CPU batch (meta stands in for CUDA here): ATen's argmax, no library
after_meta = build._loaded is not None
y = torch.randn(3, 50)
same = torch.equal(s._argmax(y), y.argmax(-1))
out = {"after_init": after_init, "after_meta": after_meta, "after_cpu": build._loaded is not None, "same": same}
"""


def test_sampler_loads_the_cpu_library_only_for_a_cpu_batch():
    r = probe(LAZY_SAMPLER)
    assert r == {"after_init": False, "after_meta": False, "after_cpu": True, "same": True}, r


@pytest.mark.slow  # two engines built in a fresh interpreter; the full suite runs it
def test_cpu_engines_load_the_library_once_and_register_no_custom_op():
    r = probe(PROBES["engine_cpu"])
    if "cpu_engine_skipped" in r:
        pytest.skip(r["cpu_engine_skipped"])
    assert r["cpu_engine_load_library_calls"] == 1, r  # two engines, one process
    assert r["cpu_engine_custom_ops"] == 0, r
