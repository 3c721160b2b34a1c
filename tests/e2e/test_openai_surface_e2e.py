"""End to end through the real `openai` client over a real TorchServe: `GET v1/models`,
OpenAI fields accepted and ignored (named in a header), `echo` with the prompt's
log-probabilities, and `n` choices, streamed and not, seeded and reproducible.

On the suites' shared server (conftest.py); greedy answers are held to the offline engine's with the
same engine arguments, the prompt's log-probabilities to transformers' own forward."""

from __future__ import annotations

import pytest
import requests
from openai_http import SHARED_MODEL, render

from orcaserve.handler.openai.fields import IGNORED_HEADER
from orcaserve.scheduler import SamplingParams

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

MODEL = SHARED_MODEL
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "Name a primary color."}]


@pytest.fixture(scope="module")
def ts(shared_ts):
    return shared_ts


@pytest.fixture(scope="module")
def client(ts):
    return openai.OpenAI(base_url=ts.url(f"/predictions/{MODEL}/1.0/v1"), api_key=ts.keys["inference"])


def test_models_list(ts, client, offline):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].object == "model" and models[0].owned_by == "orcaserve"
    assert models[0].max_model_len == offline.max_model_len and models[0].created > 0
    raw = requests.get(ts.url(f"/predictions/{MODEL}/1.0/v1/models"), headers=ts.auth(), timeout=60)
    assert raw.status_code == 200 and raw.json()["object"] == "list"


def test_fields_not_acted_on_are_accepted_and_named(client):
    extra = {"store": True, "metadata": {"app": "x"}, "user": "u1", "service_tier": "auto", "prompt_cache_key": "k"}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, max_tokens=4, temperature=0, **extra
    )
    assert raw.headers[IGNORED_HEADER] == "metadata,prompt_cache_key,service_tier,store,user"
    assert raw.parse().choices[0].message.content
    streamed = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, user="u2", stream=True
    )
    assert streamed.headers[IGNORED_HEADER] == "user" and list(streamed.parse())
    plain = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert IGNORED_HEADER not in plain.headers
    with pytest.raises(openai.BadRequestError, match="max_token"):  # not OpenAI's: a typo is a 400
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"max_token": 5})
    with pytest.raises(openai.BadRequestError, match="temperature"):  # implemented: still checked
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1, user="u")


def test_echo_with_prompt_logprobs(client, offline):
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2, logprobs=2))[0]
    prompt_ids = offline.tokenizer.encode(PROMPT)
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=2)
    lp = c.choices[0].logprobs
    assert c.choices[0].text == PROMPT + want.text
    assert lp.tokens == [offline.tokenizer.decode([t]) for t in prompt_ids + want.output_token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes it (vLLM's)
    values = [e.logprob for e in want.prompt_logprobs[1:]] + [e.logprob for e in want.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(values, abs=1e-3)
    assert all(len(top) in (2, 3) for top in lp.top_logprobs[1:])
    assert lp.text_offset[: len(prompt_ids)] == [
        len(offline.tokenizer.decode(prompt_ids[:i])) for i in range(len(prompt_ids))
    ]
    pieces = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=2, stream=True
        )
    )
    assert "".join(p.choices[0].text for p in pieces if p.choices) == PROMPT + want.text
    assert pieces[0].choices[0].text == PROMPT and pieces[0].choices[0].logprobs.tokens == lp.tokens[: len(prompt_ids)]
    plain = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None


def _streamed(pieces, chat: bool) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for p in pieces:
        usage = p.usage or usage
        for ch in p.choices:
            texts[ch.index] = texts.get(ch.index, "") + ((ch.delta.content or "") if chat else ch.text)
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    return texts, reasons, usage


def test_n_choices(client, offline):
    greedy = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, n=3)
    assert [ch.index for ch in c.choices] == [0, 1, 2] and {ch.text for ch in c.choices} == {greedy.text}
    assert c.usage.prompt_tokens == greedy.prompt_tokens  # the prompt counted once
    assert c.usage.completion_tokens == 3 * greedy.completion_tokens

    ask = dict(model=MODEL, messages=QUESTION, max_tokens=12, temperature=1.0, seed=11, n=4)
    first = client.chat.completions.create(**ask)
    again = client.chat.completions.create(**ask)
    texts = [ch.message.content for ch in first.choices]
    assert texts == [ch.message.content for ch in again.choices] and len(set(texts)) == 4
    single = client.chat.completions.create(**{**ask, "n": 1})  # choice 0 is seed's own answer
    assert single.choices[0].message.content == texts[0]
    # the offline engine samples the same four answers from the same seed (choice i: seed + i)
    want = offline.generate(
        [render(offline, QUESTION[0]["content"])], SamplingParams(temperature=1.0, max_tokens=12, seed=11, n=4)
    )
    assert texts == [o.text for o in want]
    assert first.usage.prompt_tokens == want[0].prompt_tokens
    assert first.usage.completion_tokens == sum(o.completion_tokens for o in want)

    pieces = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    streamed, reasons, usage = _streamed(pieces, chat=True)
    assert [streamed[i] for i in range(4)] == texts and set(reasons) == {0, 1, 2, 3}
    assert usage.prompt_tokens == first.usage.prompt_tokens and usage.completion_tokens == first.usage.completion_tokens
    indices = [ch.index for p in pieces for ch in p.choices]
    assert indices != sorted(indices)  # interleaved as they were sampled, not one choice after another

    pieces = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, n=2, stream=True)
    streamed, reasons, _ = _streamed(pieces, chat=False)
    assert streamed == {0: greedy.text, 1: greedy.text} and reasons == {0: "length", 1: "length"}
