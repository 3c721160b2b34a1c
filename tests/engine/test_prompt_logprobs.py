"""Prompt log-probabilities (`echo` with `logprobs`): the engine's against transformers' own
forward of the prompt, on every choice's first and final output, and the engine's batch unchanged."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from orcaserve.bench.models.tiny import hf_greedy, tiny_model
from orcaserve.scheduler import EngineLoop, SamplingParams, TimedOut
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.model.prompt_logprobs import PromptLogprobs

PROMPT = [7, 300, 21, 5, 99, 42, 17, 256, 3, 8, 77, 12, 500, 6, 40, 41, 2, 9, 31]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prompt_logprobs_match_transformers(engine_for, arch):
    model = tiny_model(arch)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)  # [P, V]
    engine = engine_for(model, max_num_batched_tokens=8)  # chunked prefill beside it
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3, n=2, ignore_eos=True)
    outs = engine.generate([PROMPT, [5, 6, 7]], [params, SamplingParams(temperature=0, max_tokens=6)])
    for out in outs[:2]:
        plp = out.prompt_logprobs
        assert out.prompt_token_ids == PROMPT and len(plp) == len(PROMPT) and plp[0] is None
        for i, entry in enumerate(plp[1:], start=1):
            assert entry.token_id == PROMPT[i]
            assert entry.logprob == pytest.approx(ref[i - 1, PROMPT[i]].item(), abs=1e-4)
            top = ref[i - 1].topk(3)
            assert [t for t, _ in entry.top] == top.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert out.output_token_ids == hf_greedy(model, PROMPT, 6)  # the model's attention is back
    assert outs[2].prompt_logprobs is None and outs[2].output_token_ids == hf_greedy(model, [5, 6, 7], 6)


def test_prompt_logprobs_ride_on_first_and_final_outputs(engine_for):
    engine = engine_for(tiny_model("llama"))
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=0, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, True]
    assert all(e.top == () for e in outs[0].prompt_logprobs[1:])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def _reference(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [P, V]


def test_a_long_prompt_job_leaves_other_requests_decoding(engine_for):
    """600 prompt tokens under max_num_batched_tokens 64: the job takes a chunk of 64 rows per
    step, and a running request gets its token on every one of those steps."""
    model = tiny_model("llama")
    engine = engine_for(model, max_num_batched_tokens=64)
    long_prompt = [(i * 37 + 11) % 500 + 1 for i in range(600)]
    engine.add_request("other", [5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    other = [t for out in engine.step() for t in out.new_token_ids]  # its prefill and first token
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, n=2))
    job_steps, final = 0, {}
    while engine.has_unfinished():
        held = "long" in engine.prompt_jobs
        outs = engine.step()
        if held:
            job_steps += 1
            assert [o.request_id for o in outs] == ["other"]  # one token on each step of the job
            assert engine.stats.num_waiting == ("long" in engine.prompt_jobs)  # the held request counts
        other += [t for o in outs if o.request_id == "other" for t in o.new_token_ids]
        final.update({(o.request_id, o.index): o for o in outs if o.finished})
    assert job_steps == -(-599 // 64)  # the prompt's last token predicts nothing
    assert other == hf_greedy(model, [5, 6, 7], 40)
    ref = _reference(model, long_prompt)
    for i in range(2):
        out = final["long", i]
        assert [e.token_id for e in out.prompt_logprobs[1:]] == long_prompt[1:]
        got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
        want = ref[:-1].gather(1, torch.tensor(long_prompt[1:])[:, None])[:, 0]
        assert torch.allclose(got, want, atol=1e-4)
        assert [[t for t, _ in e.top] for e in out.prompt_logprobs[1:]] == ref[:-1].topk(2).indices.tolist()
        assert out.output_token_ids == hf_greedy(model, long_prompt, 4)


def test_aborting_a_held_request_drops_its_job(engine_for):
    engine = engine_for(tiny_model("llama"), max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=3, prompt_logprobs=1, ignore_eos=True)
    engine.add_request("single", PROMPT, params)
    engine.add_request("three", PROMPT, dataclasses.replace(params, n=3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("single", PROMPT, params)
    engine.step()
    assert [o.finish_reason for o in engine.abort_all("three")] == ["abort"] * 3
    assert engine.abort("single").finish_reason == "abort"
    assert not engine.has_unfinished() and len(engine.prompt_jobs) == 0 and engine.stats.num_waiting == 0
    assert engine.step() == [] and "three" not in engine.choices
    assert engine.kv.pool.num_used == 0


def test_a_failing_job_fails_its_request_alone(engine_for, monkeypatch):
    model = tiny_model("llama")
    engine = engine_for(model)

    def boom(self):
        raise RuntimeError("chunk failed")

    monkeypatch.setattr(PromptLogprobs, "advance", boom)
    engine.add_request("bad", PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=0, n=2))
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    bad = [o for o in outs if o.request_id == "bad"]
    assert [(o.index, o.finish_reason, o.error) for o in bad] == [
        (i, "error", "RuntimeError: chunk failed") for i in (0, 1)
    ]
    assert [o.output_token_ids for o in outs if o.request_id == "good" and o.finished] == [
        hf_greedy(model, [5, 6, 7], 3)
    ]
    assert "bad" not in engine.choices and engine.kv.pool.num_used == 0


def test_the_loop_ends_held_requests_by_deadline_and_abort(engine_for, monkeypatch):
    """Through EngineLoop: a request held by a job that never ends is answered TimedOut at its
    deadline, another is aborted (a client leaving), and a plain request is served meanwhile."""
    model = tiny_model("llama")
    engine = engine_for(model, max_num_batched_tokens=64)

    def endless(self):
        time.sleep(0.01)
        return False

    monkeypatch.setattr(PromptLogprobs, "advance", endless)
    loop = EngineLoop(engine).start()
    try:
        echo = SamplingParams(max_tokens=3, prompt_logprobs=1)
        late = loop.submit(EngineRequest("late", PROMPT, echo, timeout=0.5))
        left = loop.submit(EngineRequest("left", PROMPT, dataclasses.replace(echo, n=2)))
        plain = loop.submit(
            EngineRequest("plain", [5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        )
        assert [t for o in plain for t in o.new_token_ids] == hf_greedy(model, [5, 6, 7], 5)
        loop.abort("left")
        assert [(o.index, o.finish_reason) for o in left] == [(0, "abort"), (1, "abort")]
        with pytest.raises(TimedOut):
            list(late)
    finally:
        loop.shutdown()
    assert not engine.has_unfinished() and len(engine.prompt_jobs) == 0 and engine.kv.pool.num_used == 0
