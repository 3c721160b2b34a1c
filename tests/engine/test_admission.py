"""Admission: prompts are tokenized off the engine thread, in order, and every request is answered."""

from __future__ import annotations

import copy
import functools
import random
import string
import threading
import time

import pytest

from orcaserve.bench.models.tiny import tiny_model
from orcaserve.scheduler import EngineLoop, InvalidRequest, SamplingParams, ShuttingDown
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.prompt import ChatPrompt, encode_prompt

MIB = 1 << 20


@pytest.fixture
def loop(engine_for):
    engine = engine_for(tiny_model("llama"), max_num_seqs=8, max_num_batched_tokens=64)
    loop = EngineLoop(engine).start()
    yield loop
    loop.shutdown()


@functools.cache
def _huge_text() -> str:
    rng = random.Random(0)  # random printable text: the slowest to tokenize measured here
    return "".join(rng.choice(string.printable) for _ in range(MIB))


def _huge(kind: str, max_model_len: int = 1024) -> str | ChatPrompt:
    text = _huge_text()  # the same 1 MiB for every test: drawn once
    if kind == "chat":  # the most messages that are rendered at all
        n = max_model_len - 1
        return ChatPrompt([{"role": "user", "content": text[i * MIB // n : (i + 1) * MIB // n]} for i in range(n)])
    return text


# The text case is the heavier (a 1 MiB string tokenized whole): slow; the chat case keeps the
# admission thread's behaviour in the fast run.
@pytest.mark.parametrize("kind", [pytest.param("text", marks=pytest.mark.slow), "chat"])
def test_a_huge_prompt_does_not_stall_other_streams(loop, kind):
    """A 1 MiB prompt takes seconds to tokenize (and is refused in the end); a running stream
    keeps getting tokens meanwhile. On the engine thread it got none until the 400 was out."""
    prompt = _huge(kind, loop.engine.max_model_len)
    victim = loop.submit(EngineRequest("victim", [5] * 8, SamplingParams(max_tokens=1000, ignore_eos=True)))
    arrivals: list[float] = []
    first = threading.Event()

    def read() -> None:
        for out in victim:
            arrivals.extend([time.monotonic()] * len(out.new_token_ids))
            first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(30)
    submitted = time.monotonic()
    with pytest.raises(InvalidRequest) as err:
        list(loop.submit(EngineRequest("huge", prompt, SamplingParams())))
    answered = time.monotonic()
    reader.join(60)
    assert "max_model_len" in err.value.message
    during = [t for t in arrivals if submitted < t < answered]
    assert answered - submitted > 0.3, "tokenizing 1 MiB took less than expected: the test proves nothing"
    assert len(during) >= 20, f"{len(during)} victim tokens in the {answered - submitted:.1f} s of tokenizing"
    assert len(arrivals) == 1000 and loop.engine.kv.pool.num_used == 0


def test_an_abort_never_overtakes_its_request(loop):
    """`b` waits in admission behind a slow prompt; its abort, sent at once, must still end it."""
    slow = loop.submit(EngineRequest("slow", _huge("text"), SamplingParams()))
    b = loop.submit(EngineRequest("b", [7] * 4, SamplingParams(max_tokens=900, ignore_eos=True)))
    loop.abort("b")
    outs = list(b)
    assert outs[-1].finish_reason == "abort" and outs[-1].completion_tokens < 900
    with pytest.raises(InvalidRequest):
        list(slow)


def test_shutdown_answers_what_admission_still_holds(loop):
    streams = [loop.submit(EngineRequest("huge", _huge("text"), SamplingParams()))]
    streams += [loop.submit(EngineRequest(f"q{i}", [5, 6], SamplingParams(max_tokens=4))) for i in range(3)]
    started = time.monotonic()
    loop.shutdown()
    assert time.monotonic() - started < 15  # at most the one tokenization under way
    for stream in streams:
        try:
            assert list(stream)[-1].finished  # served before the stop reached it
        except (InvalidRequest, ShuttingDown):
            pass
    assert loop.num_in_flight == 0


def test_admission_runs_at_lower_cpu_priority(loop):
    admission = loop._admission._thread  # this loop's, whatever other loops the process holds
    assert admission.name == "orcaserve-admission" and admission.is_alive()

    def nice(tid: int) -> int:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19, counted after the name

    assert admission.native_id is not None
    assert nice(admission.native_id) == nice(threading.get_native_id()) + 10


def test_a_refused_chat_template_is_a_400_naming_messages(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequest) as err:
        encode_prompt(tok, ChatPrompt([{"role": "user", "content": "x"}]), 512, 1024)
    assert "alternate" in str(err.value)
    assert err.value.param == "messages"


def test_a_chat_longer_than_the_context_in_messages_is_refused_before_rendering(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{{ raise_exception('rendered') }}"  # reached only if the count passed
    with pytest.raises(ValueError, match="messages has 1024 entries"):
        encode_prompt(tok, ChatPrompt([{"role": "user", "content": "x"}] * 1024), 512, 1024)
    with pytest.raises(ValueError, match="rendered"):
        encode_prompt(tok, ChatPrompt([{"role": "user", "content": "x"}] * 1023), 512, 1024)


def test_ids_are_checked_for_length_before_the_vocabulary(tokenizer):
    """A client's token list of any length costs one len(), not a pass, when it cannot fit."""
    with pytest.raises(ValueError, match="max_model_len"):
        encode_prompt(tokenizer, [10**9] * 100_000, 512, 1024)
    with pytest.raises(ValueError, match=r"in \[0, 512\)"):
        encode_prompt(tokenizer, [1, 2, 600], 512, 1024)
