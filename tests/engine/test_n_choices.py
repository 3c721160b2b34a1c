"""`n` choices of one request in the engine: greedy choices equal the single answer (and
transformers'), seeded choices are reproducible and differ, the prompt's blocks are shared through
the prefix cache, and an abort ends every choice."""

from __future__ import annotations

import pytest

from orcaserve.bench.models.tiny import hf_greedy, tiny_model
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.errors import InternalError, Overloaded
from orcaserve.scheduler.serving.engine_loop import EngineLoop

PROMPT = list(range(11, 11 + 37))  # 2 full blocks of 16 and a partial one


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_choices_each_equal_the_single_answer(engine_for, caching):
    model = tiny_model("llama")
    want = hf_greedy(model, PROMPT, 12)
    engine = engine_for(model, enable_prefix_caching=caching, max_num_batched_tokens=32)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = engine.generate(
        [PROMPT, [5, 6, 7]], [SamplingParams(temperature=0, max_tokens=12, n=4, ignore_eos=True), greedy]
    )
    assert [o.index for o in outs[:4]] == [0, 1, 2, 3] and {o.request_id for o in outs[:4]} == {outs[0].request_id}
    for out in outs[:4]:
        assert out.output_token_ids == want and out.prompt_tokens == len(PROMPT)
    assert outs[4].output_token_ids == hf_greedy(model, [5, 6, 7], 12)
    # choices after the first found the prompt's two full blocks in the cache (chunked prefill here)
    assert [o.num_cached_tokens for o in outs[:4]] == ([0, 32, 32, 32] if caching else [0, 0, 0, 0])
    assert engine.kv.pool.num_free == engine.stats.num_blocks and not engine.choices._groups


def test_seeded_choices_are_reproducible_and_differ(engine_for):
    model = tiny_model("qwen2")
    engine = engine_for(model)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=7, n=3, ignore_eos=True)
    first = [o.output_token_ids for o in engine.generate([PROMPT], params)]
    again = [o.output_token_ids for o in engine.generate([PROMPT], params)]
    assert first == again and len({tuple(t) for t in first}) == 3
    # choice i is seeded seed + i: choice 0 is the n=1 answer, choice 1 that of seed 8
    single = engine.generate(
        [PROMPT, PROMPT], [SamplingParams(temperature=1.0, max_tokens=16, seed=s, ignore_eos=True) for s in (7, 8)]
    )
    assert [o.output_token_ids for o in single] == first[:2]


def test_abort_ends_every_choice_and_frees_blocks(engine_for):
    engine = engine_for(tiny_model("llama"))
    engine.add_request("g", PROMPT, SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("g", PROMPT, SamplingParams())
    engine.step()  # the first choice computes the prompt; the others are released after it
    outs = engine.abort_all("g", "timeout")
    assert sorted(o.index for o in outs) == [0, 1, 2] and all(o.finished and o.request_id == "g" for o in outs)
    assert {o.finish_reason for o in outs} == {"timeout"}
    assert not engine.has_unfinished() and engine.kv.pool.num_free == engine.stats.num_blocks
    engine.add_request("h", PROMPT, SamplingParams(max_tokens=5, n=2))  # aborted before the release
    assert len(engine.abort_all("h")) == 2 and engine.abort_all("h") == []
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=17)


def test_the_loop_counts_choices_and_fails_the_request_with_one_choice(engine_for):
    engine = engine_for(tiny_model("llama"), max_num_seqs=4)
    loop = EngineLoop(engine, max_waiting=4).start()
    try:
        with pytest.raises(Overloaded):  # nine sequences never fit four seats and four places to wait
            loop.submit(EngineRequest("big", PROMPT, SamplingParams(max_tokens=2, n=9)))
        outs = list(
            loop.submit(EngineRequest("g", PROMPT, SamplingParams(temperature=0, max_tokens=3, n=3, ignore_eos=True)))
        )
        finals = sorted((o for o in outs if o.finished), key=lambda o: o.index)
        assert [o.index for o in finals] == [0, 1, 2] and outs[-1].finished
        assert len({tuple(o.output_token_ids) for o in finals}) == 1 and loop.num_in_flight == 0

        def fail_choice_one(sched):  # one choice's model run fails: the request fails, the others end
            if "f#1" in sched.num_scheduled_tokens:
                raise RuntimeError("boom")

        engine.fault_hook = fail_choice_one
        with pytest.raises(InternalError, match="boom"):
            list(loop.submit(EngineRequest("f", PROMPT, SamplingParams(max_tokens=20, n=3, ignore_eos=True))))
        engine.fault_hook = None
        assert list(loop.submit(EngineRequest("after", [5, 6], SamplingParams(max_tokens=2))))[
            -1
        ].finished  # the engine goes on
        assert loop.num_in_flight == 0
    finally:
        loop.shutdown()
    assert engine.kv.pool.num_free == engine.stats.num_blocks and not engine.choices._groups
