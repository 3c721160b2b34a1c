"""A burst through real TorchServe: every sequence the engine can seat or queue is answered, only
the overflow is refused (503, Retry-After), and /metrics shows the queue and the refusals as the
clients saw them (docs/serving.md, "Limits and refusals")."""

from __future__ import annotations

import json
import threading
import time

import openai_http
import pytest
from openai_http import COMPLETIONS, EXACT

from orcaserve.bench.serve.harness import serving
from orcaserve.scheduler import Engine, SamplingParams, default_model_path

pytestmark = pytest.mark.slow

MODEL = "burst"
SEATS, QUEUE = 4, 4
ENGINE_ARGS = {"kv_cache_memory": 64 << 20, "max_num_seqs": SEATS, "max_num_batched_tokens": 256, **EXACT}
PROMPT, MAX_TOKENS = "The quick brown fox", 24


@pytest.fixture(scope="module")
def ts(tmp_path_factory):
    # A deadline far beyond the burst's length, on a loaded machine too: one that passed would
    # cut an answer short (finish_reason "length") and break the exactness check.
    overrides = {**ENGINE_ARGS, "max_waiting_requests": QUEUE, "default_timeout": 1800}
    with serving(tmp_path_factory.mktemp("torchserve"), MODEL, overrides) as server:
        yield server


@pytest.fixture(scope="module")
def expected_text():
    engine = Engine.from_pretrained(default_model_path(), **ENGINE_ARGS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return engine.generate([PROMPT], params)[0].text


def _series(text: str, name: str) -> dict[str, float]:
    """The last value of each series of `name` for this model, keyed by its labels."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and f'ModelName="{MODEL}"' in line:
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


def _refused(text: str) -> float:
    return sum(v for k, v in _series(text, "orca_requests_refused_total").items() if 'Reason="overloaded"' in k)


def _burst(ts, ns: list[int]) -> list:
    """One streamed completion per entry of `ns` (its `n`), all sent at once; the responses."""
    barrier = threading.Barrier(len(ns))
    responses: list = [None] * len(ns)

    def send(i: int) -> None:
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "n": ns[i]}
        barrier.wait()
        responses[i] = openai_http.call(ts, MODEL, COMPLETIONS, {**body, "stream": True}, stream=True)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(ns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return responses


class _WaitingGauge(threading.Thread):
    """Scrapes the waiting gauge while a burst runs; `seen` holds every value read."""

    def __init__(self, ts) -> None:
        super().__init__(daemon=True)
        self.ts, self.seen, self.stop = ts, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                self.seen.extend(_series(self.ts.metrics(), "orca_num_requests_waiting").values())
            except OSError:  # the server is gone: the test has failed already
                return


def test_the_refusal_series_is_announced_at_zero(ts):
    """Before any refusal, so that a dashboard or an alert finds the series from the start."""
    assert _refused(ts.metrics()) == 0


@pytest.mark.parametrize("ns", [[1] * (SEATS + QUEUE + 1), [2] * ((SEATS + QUEUE) // 2) + [2]], ids=["n1", "n2"])
def test_a_burst_is_served_up_to_seats_plus_queue_and_only_the_overflow_refused(ts, expected_text, ns):
    refused_before = _refused(ts.metrics())
    gauge = _WaitingGauge(ts)
    gauge.start()
    try:
        responses = _burst(ts, ns)
        refused = [r for r in responses if r.status_code == 503]
        # One request more than the seats and the queue hold: exactly it is refused, with a hint.
        assert len(refused) == 1, [r.status_code for r in responses]
        assert refused[0].headers["Retry-After"] == "1"
        assert refused[0].json()["error"]["type"] == "server_error"
        for r in responses:
            if r.status_code != 503:
                texts, finish = {}, set()
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                            finish.add(c.get("finish_reason"))
                assert sorted(texts) == list(range(ns[0])) and set(texts.values()) == {expected_text}, finish
        deadline = time.time() + 30
        while True:  # metrics travel through the frontend's log parser: allow a moment
            m = ts.metrics()
            waiting = _series(m, "orca_num_requests_waiting")
            if _refused(m) == refused_before + 1 and waiting and max(waiting.values()) == 0:
                break
            assert time.time() < deadline, m[-3000:]
            time.sleep(0.5)
    finally:
        gauge.stop.set()
        gauge.join(10)
    assert max(gauge.seen) > 0, "the waiting gauge never showed the queue"
