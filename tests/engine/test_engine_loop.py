"""The background loop: requests from other threads and asyncio, streaming, deadlines, errors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from orcaserve.bench.models.tiny import hf_greedy, tiny_model
from orcaserve.scheduler import (
    Engine,
    EngineLoop,
    InternalError,
    InvalidRequest,
    Overloaded,
    SamplingParams,
    ShuttingDown,
    TimedOut,
)
from orcaserve.scheduler.engine_request import EngineRequest


@pytest.fixture
def loop_and_model(engine_for):
    model = tiny_model("llama")
    loop = EngineLoop(engine_for(model, max_num_seqs=8, max_num_batched_tokens=64)).start()
    yield loop, model
    loop.shutdown()
    assert not loop.alive


def test_threads_stream_tokens_and_match_transformers(loop_and_model):
    loop, model = loop_and_model
    prompts = [[3 + i] * (5 + 9 * i) for i in range(12)]
    results: dict[int, list] = {}

    def client(i: int) -> None:
        time.sleep(0.01 * i)  # staggered: later requests join a running batch
        stream = loop.submit(
            EngineRequest(f"t{i}", prompts[i], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        )
        results[i] = list(stream)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, outs in results.items():
        assert len(outs) == 10 and outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert [t for o in outs for t in o.new_token_ids] == hf_greedy(model, prompts[i], 10)
    assert len(results) == 12
    assert loop.engine.kv.pool.num_used == 0


def test_asyncio_errors_and_deadlines(loop_and_model):
    loop, _ = loop_and_model
    engine = loop.engine
    steps = []

    def slow_third_step(sched):  # deterministic deadline: step 3 outlasts the request's timeout
        steps.append(list(sched.requests))
        if len(steps) == 3:
            time.sleep(2.2)

    async def main():
        ev = asyncio.get_running_loop()
        for prompt, needle in (([], "empty"), ("\ud800 unpaired", "tokenized"), ([10**9], "token ids")):
            bad = loop.submit(EngineRequest(f"bad-{needle}", prompt, SamplingParams()), event_loop=ev)
            with pytest.raises(InvalidRequest) as err:
                async for _ in bad:
                    pass
            assert needle in err.value.message and err.value.param == "prompt"

        # Expired before its first token: 408 naming the field, not an empty 200.
        late = loop.submit(EngineRequest("late", [5, 6], SamplingParams(max_tokens=5), timeout=0.0), event_loop=ev)
        with pytest.raises(TimedOut) as err:
            async for _ in late:
                pass
        assert err.value.timeout == 0.0

        # Expired after some tokens: the tokens so far, finish_reason "timeout"; blocks come back.
        engine.fault_hook = slow_third_step
        slow = loop.submit(
            EngineRequest("slow", [5] * 50, SamplingParams(max_tokens=1000, ignore_eos=True), timeout=2.0),
            event_loop=ev,
        )
        outs = [o async for o in slow]
        engine.fault_hook = None
        assert outs[-1].finish_reason == "timeout" and 1 <= outs[-1].completion_tokens < 1000

        ok = loop.submit(EngineRequest("ok", [7, 8], SamplingParams(temperature=0, max_tokens=3)), event_loop=ev)
        outs = [o async for o in ok]
        assert outs[-1].finish_reason == "length"
        # Outputs are snapshots: the engine thread's later writes do not show in earlier ones.
        assert outs[0].times is not outs[-1].times and outs[0].times.finished is None

    asyncio.run(main())
    loop.shutdown()  # joins the thread: everything below is final
    assert engine.kv.pool.num_used == 0
    assert engine.stats.num_aborted == 2  # "slow", and "late", whose deadline passed in admission


def test_abort_is_not_a_timeout(loop_and_model):
    loop, _ = loop_and_model
    gate = threading.Event()
    loop.engine.fault_hook = lambda sched: gate.wait(10)  # hold the first step
    before = loop.submit(EngineRequest("before", [9] * 20, SamplingParams(max_tokens=1000, ignore_eos=True)))
    loop.abort("before")  # aborted before its first token: a final output, not a 408
    gate.set()
    outs = list(before)
    assert outs[-1].finish_reason == "abort" and outs[-1].completion_tokens == 0
    loop.engine.fault_hook = None
    stream = loop.submit(EngineRequest("x", [9] * 20, SamplingParams(max_tokens=1000, ignore_eos=True)))
    it = iter(stream)
    assert not next(it).finished
    loop.abort("x")
    rest = list(it)
    assert rest[-1].finish_reason == "abort" and rest[-1].completion_tokens < 1000


def test_first_tokens_are_handed_over_first(loop_and_model, monkeypatch):
    """In a step's outputs a request's first token comes before the other streams' next tokens:
    the event loop writes frames in that order, and time to first token is what a new request
    waits for. Each flush of the loop is one step's outputs."""
    from orcaserve.scheduler.serving import engine_loop

    loop, _ = loop_and_model
    flushes: list[list[tuple[str, int]]] = []

    real = engine_loop.deliver

    def spy(items):
        flushes.append([(s.request_id, getattr(o, "completion_tokens", -1)) for s, o in items])
        real(items)

    monkeypatch.setattr(engine_loop, "deliver", spy)
    # The early ones run until aborted, so they are still running whenever the late one joins
    # (with a fixed length they could finish first on a fast step).
    early = [
        loop.submit(EngineRequest(f"early{i}", [5 + i] * 6, SamplingParams(max_tokens=1000, ignore_eos=True)))
        for i in range(3)
    ]
    it = iter(early[0])
    next(it), next(it)  # the three run
    late = loop.submit(EngineRequest("late", [7] * 6, SamplingParams(max_tokens=3, ignore_eos=True)))
    assert len(list(late)) == 3
    for i, stream in enumerate(early):
        loop.abort(f"early{i}")
        assert list(stream)[-1].finish_reason == "abort"
    step = next(f for f in flushes if ("late", 1) in f)
    assert step[0] == ("late", 1) and len(step) == 4, step


def test_shutdown_answers_in_flight_and_queued_and_refuses_new(loop_and_model):
    loop, _ = loop_and_model
    gate = threading.Event()
    running = loop.submit(EngineRequest("running", [9] * 20, SamplingParams(max_tokens=1000, ignore_eos=True)))
    next(iter(running))
    loop.engine.fault_hook = lambda sched: gate.wait(10)  # the loop is busy in a step ...
    time.sleep(0.05)
    queued = loop.submit(
        EngineRequest("queued", [9] * 20, SamplingParams(max_tokens=5))
    )  # ... so this stays in the inbox
    stopper = threading.Thread(target=loop.shutdown)
    stopper.start()
    gate.set()
    stopper.join(30)
    for stream in (running, queued):
        with pytest.raises(ShuttingDown) as err:
            list(stream)
        assert err.value.retry_after
    with pytest.raises(ShuttingDown):
        loop.submit(EngineRequest("after", [1, 2], SamplingParams()))
    assert not loop.alive


def test_waiting_queue_is_bounded(engine_for):
    model = tiny_model("llama")
    engine = engine_for(model, max_num_seqs=1, max_num_batched_tokens=64)
    entered, gate = threading.Event(), threading.Event()

    def hold(sched):
        entered.set()
        gate.wait(10)

    engine.fault_hook = hold
    refused = []
    loop = EngineLoop(engine, max_waiting=2, on_refused=refused.append).start()
    try:
        a = loop.submit(EngineRequest("a", [5, 6], SamplingParams(max_tokens=2)))
        entered.wait(10)  # "a" is in its first step; nothing is published as running yet
        # One seat (a's) and two places to wait: b and c are accepted, d is the overflow.
        b = loop.submit(EngineRequest("b", [5, 6], SamplingParams(max_tokens=2)))
        c = loop.submit(EngineRequest("c", [5, 6], SamplingParams(max_tokens=2)))
        assert loop.num_waiting == 3  # nothing published as running yet: every one of them waits
        with pytest.raises(Overloaded) as err:
            loop.submit(EngineRequest("d", [5, 6], SamplingParams(max_tokens=2)))
        assert err.value.retry_after and "max_waiting_requests=2" in err.value.message
        assert "2 sequences are already waiting" in err.value.message
        assert refused == [err.value] and loop.refused == {"overloaded": 1}
        engine.fault_hook = None
        gate.set()
        assert list(a)[-1].finished and list(b)[-1].finished and list(c)[-1].finished
        assert list(loop.submit(EngineRequest("e", [5, 6], SamplingParams(max_tokens=2))))[-1].finished  # room again
        assert loop.num_in_flight == 0 and loop.num_waiting == 0
    finally:
        gate.set()
        loop.shutdown()


def test_a_failing_request_fails_alone_and_its_batch_goes_on(engine_for):
    model = tiny_model("llama")
    engine = engine_for(model, max_num_seqs=8, max_num_batched_tokens=64)
    batches = []

    def hook(sched):
        batches.append(sorted(sched.requests))
        if "bad" in sched.requests:
            raise RuntimeError("injected")

    engine.fault_hook = hook
    loop = EngineLoop(engine)
    prompts = {f"good{i}": [5 + i, 6, 7] for i in range(3)}
    bad = loop.submit(EngineRequest("bad", [5, 6, 7], SamplingParams(max_tokens=4)))
    good = {
        rid: loop.submit(EngineRequest(rid, p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
        for rid, p in prompts.items()
    }
    loop.start()  # all four are in the inbox: they share the first step
    try:
        with pytest.raises(InternalError) as err:
            list(bad)
        assert "injected" in err.value.message
        for rid, stream in good.items():
            assert [t for o in stream for t in o.new_token_ids] == hf_greedy(model, prompts[rid], 4)
        assert batches[0] == ["bad", "good0", "good1", "good2"]  # then halves until "bad" stands alone
        assert ["bad"] in batches and loop.alive
    finally:
        loop.shutdown()
    assert engine.kv.pool.num_used == 0 and engine.stats.num_failed == 1


class _Boom(BaseException):
    pass


def test_a_dead_loop_answers_everyone_and_reports(engine_for):
    model = tiny_model("llama")
    engine = engine_for(model, max_num_seqs=8, max_num_batched_tokens=64)
    died = []

    def hook(sched):
        if "killer" in sched.requests:
            raise _Boom("a bug in the loop")

    engine.fault_hook = hook
    loop = EngineLoop(engine, on_death=died.append).start()
    victim = loop.submit(EngineRequest("victim", [5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True)))
    next(iter(victim))
    killer = loop.submit(EngineRequest("killer", [5, 6], SamplingParams(max_tokens=4)))
    for stream in (victim, killer):
        with pytest.raises(InternalError):
            list(stream)
    loop._thread.join(10)
    assert not loop.alive and len(died) == 1 and isinstance(died[0], _Boom)
    with pytest.raises(ShuttingDown):
        loop.submit(EngineRequest("after", [1, 2], SamplingParams()))


def test_launch_builds_the_engine_on_the_loop_thread(engine_for):
    """All torch work, loading included, happens on one thread (one OpenMP team), and a failing
    build surfaces on the caller's thread."""
    model = tiny_model("llama")
    built_on = []

    def build() -> Engine:
        built_on.append(threading.current_thread().name)
        return engine_for(model, max_num_seqs=4, max_num_batched_tokens=32)

    loop = EngineLoop.launch(build)
    try:
        assert built_on == ["orcaserve-engine"] and loop.engine is not None
        outs = list(
            loop.submit(EngineRequest("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
        )
        assert [t for o in outs for t in o.new_token_ids] == hf_greedy(model, [5, 6, 7], 4)
    finally:
        loop.shutdown()

    def broken() -> Engine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        EngineLoop.launch(broken)


def test_a_burst_fills_the_seats_and_the_queue_before_any_step(engine_for):
    """Submitted at once, before the engine has seated anyone: max_num_seqs + max_waiting
    sequences (choices counted) are all accepted and exact, and only the overflow is refused,
    counted by reason; what waits is counted wherever it waits, and is 0 at the end."""
    model = tiny_model("llama")
    args = {"max_num_seqs": 3, "max_num_batched_tokens": 64}
    engine = engine_for(model, **args)
    reference = engine_for(model, **args)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = reference.generate([[5, 6, 7]], params)[0].output_token_ids
    entered, gate = threading.Event(), threading.Event()
    engine.fault_hook = lambda sched: (entered.set(), gate.wait(10))
    loop = EngineLoop(engine, max_waiting=4).start()
    try:
        first = loop.submit(EngineRequest("first", [5, 6, 7], params))
        entered.wait(10)  # the engine is in its first step: nobody is published as running
        pair = loop.submit(
            EngineRequest("pair", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2))
        )
        rest = [loop.submit(EngineRequest(f"r{i}", [5, 6, 7], params)) for i in range(4)]  # 7 of 3 + 4
        with pytest.raises(Overloaded):
            loop.submit(EngineRequest("two-more", [5, 6, 7], SamplingParams(max_tokens=2, n=2)))  # 8 and 9: over
        with pytest.raises(Overloaded):
            loop.submit(EngineRequest("one-more", [5, 6, 7], params))  # 8: over
        assert loop.num_waiting == 7 and loop.refused == {"overloaded": 2}
        engine.fault_hook = None
        gate.set()
        for stream in [first, *rest]:
            assert [o for o in stream if o.finished][-1].output_token_ids == expected
        assert [o.output_token_ids for o in pair if o.finished] == [expected, expected]
        assert loop.num_in_flight == 0 and loop.num_waiting == 0 and loop.refused == {"overloaded": 2}
    finally:
        gate.set()
        loop.shutdown()


def test_refusals_before_the_first_token_are_counted_by_reason(engine_for):
    engine = engine_for(tiny_model("llama"), max_num_seqs=2, max_model_len=32)
    loop = EngineLoop(engine, max_waiting=2).start()
    try:
        with pytest.raises(InvalidRequest):
            list(loop.submit(EngineRequest("long", list(range(3, 40)), SamplingParams(max_tokens=2))))
        assert list(loop.submit(EngineRequest("ok", [5, 6], SamplingParams(max_tokens=2))))[-1].finished
    finally:
        loop.shutdown()
    with pytest.raises(ShuttingDown):
        loop.submit(EngineRequest("late", [5, 6], SamplingParams(max_tokens=2)))
    assert loop.refused == {"too_long": 1, "shutting_down": 1}
