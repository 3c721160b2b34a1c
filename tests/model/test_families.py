"""Every architecture orcaserve serves is token-exact against transformers; the others are refused
at load, never mid-request; a sliding-window model is served only as far as its window."""

from __future__ import annotations

import random

import pytest

from orcaserve.bench.models.tiny import FAMILY_CONFIGS, TINY_VOCAB, hf_greedy, tiny_family
from orcaserve.scheduler import SamplingParams
from orcaserve.scheduler.model.families import LEAN, PROVEN, UnsupportedArchitecture
from orcaserve.scheduler.prompt import ChatPrompt, encode_prompt

# Lengths across block (16) and chunk (64-token budget) boundaries, served together.
_LENGTHS = [(1, 8), (17, 12), (200, 16), (70, 20), (33, 5)]


def _workload(seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, TINY_VOCAB) for _ in range(n)], m) for n, m in _LENGTHS]


def _serve(engine, work):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    return [o.output_token_ids for o in engine.generate([p for p, _ in work], params)]


def test_every_served_family_has_a_test():
    """The lists in families.py are what this file proves: nothing is added without a model here."""
    assert set(PROVEN) <= set(FAMILY_CONFIGS)


@pytest.mark.parametrize("name", PROVEN)
def test_family_matches_transformers(name, engine_for):
    model = tiny_family(name)
    work = _workload()
    expected = [hf_greedy(model, prompt, n) for prompt, n in work]
    engine = engine_for(model, max_num_seqs=4, max_num_batched_tokens=64, block_size=16)
    assert (engine.runner.decoder is not None) == (name in LEAN), "lean decoder or transformers' forward"
    assert _serve(engine, work) == expected


@pytest.mark.parametrize("name", ["StableLmForCausalLM", "Gemma2ForCausalLM"])
def test_unproven_family_is_refused_at_load(name, engine_for):
    """StableLM's forward through the paged cache is not transformers' (found by this file), and
    Gemma 2 caps attention scores, which the kernels do not; both are refused, naming why."""
    with pytest.raises(UnsupportedArchitecture, match=name):
        engine_for(tiny_family(name))


def test_unverified_family_loads_when_allowed(engine_for):
    """At the user's risk: StableLM's forward does not even pass the step to its attention, and
    each request then fails alone, with the error, while the engine goes on."""
    engine = engine_for(tiny_family("StableLmForCausalLM"), allow_unverified_architecture=True)
    out = engine.generate([[5, 6, 7]], [SamplingParams(temperature=0, max_tokens=2)])[0]
    assert out.finished and out.error
    assert not engine.has_unfinished()


def test_soft_capped_attention_is_refused_even_when_allowed(engine_for):
    with pytest.raises(UnsupportedArchitecture, match="attn_logit_softcapping"):
        engine_for(tiny_family("Gemma2ForCausalLM"), allow_unverified_architecture=True)


def test_sliding_window_applied_through_transformers_forward(engine_for):
    """Gemma 3's local layers see the last `sliding_window` positions: the attention hook gets
    the window and attends through a windowed plan once a step reaches past it. Prompts and
    answers far longer than the window, chunked and decoding: each token's log-probability is
    transformers' own over the same sequence (a tiny random model's greedy tokens soon repeat one
    token whatever the window, so tokens alone would not show a window ignored; with the window
    ignored these differ by up to 0.28)."""
    import torch

    model = tiny_family("Gemma3ForCausalLM", sliding_window=24)
    engine = engine_for(model, max_num_seqs=4, max_num_batched_tokens=64, block_size=16)
    assert engine.max_model_len == 1024, "no cap: the window is applied"
    work = _workload(seed=2)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0)] * len(work)
    for (prompt, _), out in zip(work, engine.generate([p for p, _ in work], params)):
        seq = torch.tensor([prompt + out.output_token_ids])
        with torch.inference_mode():
            ref = torch.log_softmax(model(seq).logits[0].float(), dim=-1)  # [L, V]
        rows = torch.arange(len(prompt) - 1, seq.shape[1] - 1)
        want = ref[rows, seq[0, rows + 1]]
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_sliding_window_caps_the_lean_decoder(engine_for):
    """The lean decoder attends to whole sequences, the same computation only while a sequence
    fits the window: a windowed Mistral is served exactly up to there; a longer max_model_len is
    refused at load, a longer prompt per request."""
    model = tiny_family("MistralForCausalLM", sliding_window=48)
    engine = engine_for(model, max_num_seqs=4, max_num_batched_tokens=64, block_size=16)
    assert engine.max_model_len == 48
    work = [(prompt[:40], 8) for prompt, _ in _workload(seed=2)]
    assert _serve(engine, work) == [hf_greedy(model, prompt, n) for prompt, n in work]
    with pytest.raises(ValueError, match="prompt has 48 tokens"):
        engine.add_request("long", list(range(3, 51)))
    with pytest.raises(ValueError, match="sliding attention window of 48"):
        engine_for(model, max_model_len=64)


def test_text_prompts_get_the_tokenizers_special_tokens():
    """A completion's text is tokenized as `tokenizer(text)` is (with the BOS a Gemma or Llama
    tokenizer adds); a chat's rendered template already holds its BOS, so none is added."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<bos>": 0, "<unk>": 1, "the": 2, "capital": 3, "user": 4, ":": 5}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", unk_token="<unk>")
    tok.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}{% endfor %}"

    assert encode_prompt(tok, "the capital", 6, 64) == tok("the capital").input_ids == [0, 2, 3]
    chat = ChatPrompt(messages=[{"role": "user", "content": "the capital"}])
    assert encode_prompt(tok, chat, 6, 64) == [0, 4, 5, 2, 3]


def test_proven_list_names_real_architectures():
    import transformers

    for name in PROVEN:
        assert hasattr(transformers, name), name
