"""Run-to-run guarantee of greedy answers on the default path (SmolLM2's GGUF, int8 activations,
bf16): the same request gives the same tokens alone, again (its prompt then served from the prefix
cache), beside other requests, in chunks, and on another engine (docs/engine.md, "Run to run").

The request is the bench's copy-set prompt whose answer has a bf16 tie at its second token and
stops on EOS by one bf16 step (65 tokens; 128 where anything tips the step): a canary for any
change of arithmetic between those paths."""

from __future__ import annotations

import pytest

from orcaserve.bench.engine.speculative import copy_heavy_prompts
from orcaserve.kernels.cpu import build
from orcaserve.scheduler import Engine, SamplingParams
from orcaserve.scheduler.prompt import ChatPrompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=128)

# Where the attention runs its avx2 or avx512 variant (no AVX-512 BF16: Intel Ice Lake, Zen 2-3),
# a query's attention is not bit for bit the same in a prefill of the whole prompt and alone over
# its cached prefix, and this canary's tie tips on the prefix cache's hit (docs/engine.md, "Run to
# run": the known gap). Marked so, not skipped: it passes there once the kernels sum alike.
_ATTENTION_SPLIT_VARIES = "avx512_bf16" not in build.machine_variants()


def chat(text: str) -> ChatPrompt:
    return ChatPrompt([{"role": "user", "content": text}])


@pytest.mark.slow
@pytest.mark.xfail(
    _ATTENTION_SPLIT_VARIES,
    reason="avx2/avx512 attention: a query's sum depends on the queries beside it (docs/engine.md, 'Run to run')",
    strict=False,
)
def test_greedy_answer_is_the_same_on_every_path_and_engine(smollm2_path):
    prompts = [chat(p) for p in copy_heavy_prompts()[:4]]
    first = Engine.from_pretrained(smollm2_path, max_num_seqs=32)  # prefix caching on (the default)
    alone = first.generate([prompts[1]], GREEDY)[0]
    again = first.generate([prompts[1]], GREEDY)[0]
    assert again.num_cached_tokens > 0  # served from the cache: another split of the prefill
    beside = first.generate(prompts, GREEDY)[1]  # with three neighbours in every step
    del first
    chunked = Engine.from_pretrained(smollm2_path, enable_prefix_caching=False, max_num_batched_tokens=64)
    other = chunked.generate([prompts[1]], GREEDY)[0]
    expected = list(alone.output_token_ids)
    for out in (again, beside, other):
        assert list(out.output_token_ids) == expected
