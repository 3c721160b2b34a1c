"""The background loop: requests from other threads and asyncio, streaming, deadlines, errors."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest

from conftest import hf_greedy, tiny_model
from orcaserve.scheduler import Engine, EngineLoop, SamplingParams
from orcaserve.scheduler.engine_loop import RequestError


@pytest.fixture
def loop_and_model(tokenizer):
    model = tiny_model("llama")
    loop = EngineLoop(Engine.from_model(copy.deepcopy(model), tokenizer, max_num_seqs=8, max_num_batched_tokens=64)).start()
    yield loop, model
    loop.shutdown()
    assert not loop.alive


def test_threads_stream_tokens_and_match_transformers(loop_and_model):
    loop, model = loop_and_model
    prompts = [[3 + i] * (5 + 9 * i) for i in range(12)]
    results: dict[int, list] = {}

    def client(i: int) -> None:
        time.sleep(0.01 * i)  # staggered: later requests join a running batch
        stream = loop.submit(f"t{i}", prompts[i], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
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

    async def main():
        ev = asyncio.get_running_loop()
        bad = loop.submit("bad", [], SamplingParams(), loop=ev)
        with pytest.raises(RequestError) as err:
            async for _ in bad:
                pass
        assert err.value.status == 400 and "empty" in err.value.message

        # Deadline: a long request is aborted at its timeout and gives its blocks back.
        slow = loop.submit("slow", [5] * 50, SamplingParams(max_tokens=100000 // 100, ignore_eos=True), timeout=0.3, loop=ev)
        outs = [o async for o in slow]
        assert outs[-1].finish_reason == "abort" and outs[-1].completion_tokens < 1000

        ok = loop.submit("ok", [7, 8], SamplingParams(temperature=0, max_tokens=3), loop=ev)
        outs = [o async for o in ok]
        assert outs[-1].finish_reason == "length"

    asyncio.run(main())
    time.sleep(0.2)
    assert loop.engine.kv.pool.num_used == 0
    assert loop.engine.stats.num_aborted >= 1


def test_explicit_abort_and_shutdown_fail_nothing_silently(loop_and_model):
    loop, _ = loop_and_model
    stream = loop.submit("x", [9] * 20, SamplingParams(max_tokens=1000, ignore_eos=True))
    it = iter(stream)
    first = next(it)
    assert not first.finished
    loop.abort("x")
    rest = list(it)
    assert rest[-1].finish_reason == "abort"
    pending = loop.submit("y", [9] * 20, SamplingParams(max_tokens=1000, ignore_eos=True))
    next(iter(pending))
    loop.shutdown()
    with pytest.raises(RequestError) as err:
        list(pending)
    assert err.value.status == 503


def test_launch_builds_the_engine_on_the_loop_thread(tokenizer):
    """All torch work, loading included, happens on one thread (one OpenMP team), and a failing
    build surfaces on the caller's thread."""
    model = tiny_model("llama")
    built_on = []

    def build() -> Engine:
        built_on.append(threading.current_thread().name)
        return Engine.from_model(copy.deepcopy(model), tokenizer, max_num_seqs=4, max_num_batched_tokens=32)

    loop = EngineLoop.launch(build)
    try:
        assert built_on == ["orcaserve-engine"] and loop.engine is not None
        outs = list(loop.submit("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
        assert [t for o in outs for t in o.new_token_ids] == hf_greedy(model, [5, 6, 7], 4)
    finally:
        loop.shutdown()

    def broken() -> Engine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        EngineLoop.launch(broken)
