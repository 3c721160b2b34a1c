"""Prompt log-probabilities (`echo` with `logprobs`): the engine's against transformers' own
forward of the prompt, on every choice's first and final output, and the engine's batch unchanged."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy, tiny_model

from orcaserve.scheduler import SamplingParams

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
