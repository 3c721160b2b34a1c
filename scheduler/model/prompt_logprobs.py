"""Log-probabilities of a prompt's own tokens (OpenAI's `echo` with `logprobs`).

The batched step computes logits only where a request samples (model_runner.py). A prompt's
log-probabilities come from a forward of the prompt of its own, on the engine thread, outside the
batch: the model runner's forward (the lean decoder or transformers' through the paged attention)
over the prompt in chunks, with a scratch KV cache of the prompt's size, so no block of the
engine's cache is taken or written (docs/serving.md, "Fields": what it costs the other requests).
"""

from __future__ import annotations

import torch

from orcaserve.scheduler.model.logprobs import TokenLogprob, top_k
from orcaserve.scheduler.model.model_runner import ModelRunner, StepContext, StepLayout

_ROWS = 256  # prompt tokens per chunk: [256, V] fp32 logits are 50 MB for a 49,152-token vocabulary


@torch.inference_mode()
def prompt_logprobs(runner: ModelRunner, token_ids: list[int], k: int) -> list[TokenLogprob | None]:
    """One entry per prompt token: None for the first (nothing precedes it, as in vLLM), then each
    token's log-probability after the tokens before it, with the `k` most likely tokens there
    (most likely first). Values are the model's, as for sampled tokens (`logprobs.py`)."""
    bs, device, total = runner.block_size, runner.device, len(token_ids)
    num_blocks = -(-total // bs)
    scratch = [
        (k_cache.new_zeros((num_blocks, *k_cache.shape[1:])), v_cache.new_zeros((num_blocks, *v_cache.shape[1:])))
        for k_cache, v_cache in runner.kv_caches
    ]  # per layer [num_blocks, bs, H_kv, D]
    ids = torch.tensor(token_ids, device=device)  # [P]
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]  # [1, num_blocks]
    out: list[TokenLogprob | None] = [None]
    for start in range(0, total - 1, _ROWS):
        end = min(start + _ROWS, total - 1)  # the prompt's last token predicts no prompt token
        positions = torch.arange(start, end, device=device)  # [R]: slots too (the scratch table is in order)
        cu = torch.tensor([0, end - start], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([end], dtype=torch.int32, device=device)
        plan = runner.backend.plan(cu, seq_lens, table, bs, end - start, end)
        rows = torch.arange(end - start, device=device)  # [R] every token's logits
        layout = StepLayout(cu, seq_lens, table, bs, end)
        logits = _forward(runner, ids[start:end], positions, rows, plan, scratch, layout)  # [R, V]
        lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
        targets = ids[start + 1 : end + 1]  # [R] the token each row predicts
        chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
        top_ids: list[list[int]] = [[] for _ in chosen]
        top_lps: list[list[float]] = [[] for _ in chosen]
        if k:
            values, idx = top_k(lp, min(k, lp.shape[1]))  # [R, k]
            top_ids, top_lps = idx.tolist(), values.tolist()
        for j, value in enumerate(chosen):
            out.append(TokenLogprob(token_ids[start + j + 1], value, tuple(zip(top_ids[j], top_lps[j]))))
    return out


def _forward(runner: ModelRunner, ids, positions, rows, plan, caches, layout: StepLayout) -> torch.Tensor:
    """The runner's forward (model_runner.py, `execute`) over one chunk, into `caches`."""
    if runner.decoder is not None:
        return runner.decoder.forward(ids, positions, rows, runner.backend, plan, positions, caches)
    ctx = StepContext(runner.backend, plan, positions, caches, layout)
    out = runner.model(
        input_ids=ids[None], position_ids=positions[None], use_cache=False, logits_to_keep=rows, orca_step=ctx
    )
    return out.logits[0]
