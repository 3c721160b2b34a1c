"""The `fair` policy's prompt cap (scheduler/core/fair_policy.py, `FairPolicy.cap_sets`): while a tenant below
its share runs in a step, tenants above theirs compute at most `prefill_cap` prompt tokens in it.
On hand-made model outputs (no model), driven as tests/scheduler/test_seat_handover.py does."""

from __future__ import annotations

import random

import pytest
from test_fair_share import backlogged_run, make, req, step

from orcaserve.bench.models.tiny import TINY_VOCAB, hf_greedy, tiny_model
from orcaserve.handler.config import HandlerConfig
from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.core.fair_policy import DEFAULT_PREFILL_CAP
from orcaserve.scheduler.sampling_params import SamplingParams


def flood(policy="fair", cap=16, **kw):
    """Tenant A holds all 8 seats decoding (8-token prompts, 40 outputs) and keeps 3 requests of
    60 prompt tokens waiting (a8-a10); a budget of 128 tokens per step."""
    s = make(policy, max_num_seqs=8, budget=128, num_blocks=256, prefill_cap=cap, **kw)
    for i in range(8):
        s.add_request(req(f"a{i}", "A", 8, 40, first=100 * i))
    for _ in range(3):
        step(s)
    for i in range(8, 11):
        s.add_request(req(f"a{i}", "A", 60, 40, first=100 * i))
    return s


def prompt_tokens(out, tenant):
    """Tokens of `tenant`'s rows of more than one token (prompt chunks, in these workloads)."""
    return sum(n for rid, n in out.num_scheduled_tokens.items() if out.requests[rid].tenant == tenant and n > 1)


def finish(s, *rids):
    for rid in rids:
        s.finish_request(s.requests[rid], "abort")


def test_the_cap_holds_while_a_below_share_tenant_decodes():
    s = flood()
    s.add_request(req("b", "B", 8, 40, first=5000))
    step(s)  # B is seated by a handover, a7 suspended
    assert "b" in s.running and list(s.suspended) == ["a7"]
    finish(s, "a0", "a1")  # two seats free: a7 resumes, a8 (60 prompt tokens) may start
    out = step(s)
    assert out.num_scheduled_tokens["b"] == 1  # B decodes
    assert out.num_scheduled_tokens["a7"] == 1  # a resumed decode is not capped
    assert out.num_scheduled_tokens["a8"] == 16  # A's prompt cut to the cap, with 100 tokens of budget left
    assert out.total_tokens == 7 + 16 < s.max_num_batched_tokens and s.policy.num_capped_steps == 1
    assert all(out.num_scheduled_tokens[f"a{i}"] == 1 for i in range(2, 7))  # A's decodes all run


def test_the_below_share_tenants_own_prompt_is_not_capped():
    s = flood(cap=4)
    finish(s, "a0", "a1")  # two seats free: one for B, one for A's a8
    s.add_request(req("b", "B", 60, 40, first=5000))
    out = step(s)
    assert out.num_scheduled_tokens["b"] == 60  # its whole prompt in one step: its TTFT
    assert prompt_tokens(out, "A") == 4 and out.num_scheduled_tokens["a8"] == 4  # A's, cut to the cap
    assert s.policy.num_capped_steps == 1


def test_no_cap_when_only_the_flood_has_work():
    s = flood(cap=4)
    finish(s, "a0", "a1", "a2")
    out = step(s)
    assert out.total_tokens == s.max_num_batched_tokens and s.policy.num_capped_steps == 0  # the whole budget
    assert out.num_scheduled_tokens["a8"] == 60 and out.num_scheduled_tokens["a9"] == 60


def test_the_cap_is_lifted_when_no_below_share_tenant_gets_a_row():
    """B is below its share and waits, but cannot be seated (no handover: `max_suspended` 0): the
    cap would only leave capacity idle, so A's prompt chunk gets the whole budget again."""
    s = make(max_num_seqs=4, budget=128, num_blocks=256, prefill_cap=16, max_suspended=0)
    for i in range(3):
        s.add_request(req(f"a{i}", "A", 8, 40, first=100 * i))
    step(s)
    s.add_request(req("a3", "A", 600, 40, first=1000))
    assert step(s).num_scheduled_tokens["a3"] == 125
    s.add_request(req("b", "B", 8, 40, first=5000))
    out = step(s)
    assert "b" not in out.num_scheduled_tokens and s.num_waiting == 1
    assert out.num_scheduled_tokens["a3"] == 125 and out.total_tokens == 128 and s.policy.num_capped_steps == 0


def test_two_flooding_tenants_are_hardly_ever_capped():
    s = make(num_blocks=256, block_size=8, max_num_seqs=8, budget=64, prefill_cap=8)
    for _ in backlogged_run(s, ["A", "B"], 1500, random.Random(7), burst={"A": 6, "B": 6}):
        pass
    assert s.policy.num_capped_steps <= 15  # a tenant below half its seat share is a rare swing, not the rule


def test_the_cap_never_drains_a_flood_below_its_seat_share():
    """A's new prompts are longer than the cap lets through in a step: its decoding rows fall to
    its share of the seats (half of 8 beside B), and no further, while B keeps a request running."""
    s = make(max_num_seqs=8, budget=256, num_blocks=2048, prefill_cap=8)
    rng = random.Random(3)
    count, lowest, rows = 0, 8, []
    for i in range(1200):
        while s.shares.get("A").waiting + s.shares.get("A").running < 12:
            s.add_request(req(f"a{count}", "A", rng.randint(100, 200), rng.randint(20, 40), first=count * 1000))
            count += 1
        if not any(r.tenant == "B" for r in s.requests.values()):
            s.add_request(req(f"b{i}", "B", 20, 30, first=10**7 + i * 100))
        step(s)
        if i > 300:
            decoding = [r for r in s.running.values() if r.tenant == "A" and r.num_tokens - r.num_computed_tokens == 1]
            lowest = min(lowest, len(decoding))
            rows.append(len(decoding))
    assert s.policy.num_capped_steps > 100 and lowest >= 3 and sum(rows) / len(rows) > 4  # 6.8 without the cap


def test_fcfs_and_priority_never_cap_and_a_cap_of_none_is_the_old_fair():
    for policy in ("fcfs", "priority"):
        runs = []
        for cap in (None, 4):
            s = flood(policy, cap=cap)
            finish(s, "a0")
            s.add_request(req("b", "B", 8, 40, first=5000))
            runs.append([dict(step(s).num_scheduled_tokens) for _ in range(200)])
            assert not hasattr(s.policy, "num_capped_steps")  # no cap to count: it is the fair policy's
        assert runs[0] == runs[1], policy
    s = flood(cap=None)  # the step of the test above, without the cap: a8's whole prompt
    finish(s, "a0", "a1")
    s.add_request(req("b", "B", 60, 40, first=5000))
    out = step(s)
    assert out.num_scheduled_tokens["b"] == 60 and out.num_scheduled_tokens["a8"] == 60
    assert s.policy.num_capped_steps == 0


def test_capped_steps_keep_every_request_token_exact(engine_for):
    """Through the real engine: A's prompts cut to 8 tokens a step beside B's decodes (and B's
    request seated by a handover) give transformers' tokens, as uncut ones do."""
    model = tiny_model("llama")
    rng = random.Random(11)
    lengths = {f"a{i}": rng.randint(20, 90) for i in range(12)} | {"b": 30}
    prompts = {rid: [rng.randrange(3, TINY_VOCAB) for _ in range(n)] for rid, n in lengths.items()}
    engine = engine_for(model, max_num_seqs=8, max_num_batched_tokens=64, scheduling_policy="fair", fair_prefill_cap=8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i in range(12):
        engine.add_request(f"a{i}", prompts[f"a{i}"], params, tenant="A")
    results = {}
    for n in range(200):
        if n == 6:
            engine.add_request("b", prompts["b"], params, tenant="B")
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert engine.scheduler.policy.num_capped_steps > 0
    for rid, prompt in prompts.items():
        assert results[rid].output_token_ids == hf_greedy(model, prompt, 16), rid


def test_config_plumbing():
    assert EngineConfig().fair_prefill_cap == DEFAULT_PREFILL_CAP
    assert EngineConfig(fair_prefill_cap=None).fair_prefill_cap is None
    for bad in (0, -1, 1.5, "32", True):
        with pytest.raises(ValueError, match="fair_prefill_cap must be a positive integer"):
            EngineConfig(fair_prefill_cap=bad)
    cfg = HandlerConfig.from_dict({"model_path": "/m", "scheduling_policy": "fair", "fair_prefill_cap": 48})
    assert cfg.engine["fair_prefill_cap"] == 48
    assert HandlerConfig.from_dict({"model_path": "/m", "fair_prefill_cap": None}).engine["fair_prefill_cap"] is None
    with pytest.raises(ValueError, match="fair_prefill_cap"):
        HandlerConfig.from_dict({"model_path": "/m", "fair_prefill_cap": 0})
