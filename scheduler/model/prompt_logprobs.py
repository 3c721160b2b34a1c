"""Log-probabilities of a prompt's own tokens (OpenAI's `echo` with `logprobs`).

The batched step computes logits only where a request samples (model_runner.py). A prompt's
log-probabilities come from a forward of the prompt of its own, outside the batch: the model
runner's forward (the lean decoder or transformers' through the paged attention) over the prompt
in chunks, with a scratch KV cache of the prompt's size, so no block of the engine's cache is taken
or written. `PromptLogprobs` is that forward as a resumable job: the engine advances it one chunk
per step between its normal steps (core/prompt_jobs.py), so the other requests keep decoding while
it runs (docs/performance-log.md#log-probabilities-and-echo-what-they-cost: what it costs them).
"""

from __future__ import annotations

import torch

from orcaserve.scheduler.core.token_logprob import TokenLogprob
from orcaserve.scheduler.model.logprobs import top_k
from orcaserve.scheduler.model.model_runner import ModelRunner, StepContext, StepLayout

MAX_ROWS = 256  # prompt tokens per chunk: [256, V] fp32 logits are 50 MB for a 49,152-token vocabulary


class PromptLogprobs:
    """The prompt log-probabilities of `token_ids`, computed `rows` tokens per `advance()`.

    `result` (once `done`): one entry per prompt token, None for the first (nothing precedes it,
    as in vLLM), then each token's log-probability after the tokens before it, with the `k` most
    likely tokens there (most likely first). Values are the model's, as for sampled tokens
    (`logprobs.py`), under the request's LoRA adapter `lora` if any. The job is owned by the engine
    thread, like the runner it uses."""

    def __init__(
        self, runner: ModelRunner, token_ids: list[int], k: int, rows: int = MAX_ROWS, lora: str | None = None
    ) -> None:
        self.runner, self.token_ids, self.k, self.rows = runner, token_ids, k, max(1, min(rows, MAX_ROWS))
        self.lora = lora
        self.result: list[TokenLogprob | None] = [None]
        self._start = 0  # the next chunk's first row; the prompt's last token predicts no prompt token
        self._scratch: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [blocks, bs, H_kv, D]

    @property
    def done(self) -> bool:
        return self._start >= len(self.token_ids) - 1

    @torch.inference_mode()
    def advance(self) -> bool:
        """Compute the next chunk (nothing once done); returns `done`. The scratch cache exists
        only between the first chunk and the last, so queued jobs hold no memory."""
        if self.done:
            return True
        runner, ids_list = self.runner, self.token_ids
        bs, device, total = runner.block_size, runner.device, len(ids_list)
        num_blocks = -(-total // bs)
        if self._scratch is None:
            self._scratch = [
                (k.new_zeros((num_blocks, *k.shape[1:])), v.new_zeros((num_blocks, *v.shape[1:])))
                for k, v in runner.kv_caches
            ]
        start = self._start
        end = min(start + self.rows, total - 1)
        ids = torch.tensor(ids_list[start : end + 1], device=device)  # [R + 1]: the rows and what they predict
        table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]  # [1, num_blocks]
        positions = torch.arange(start, end, device=device)  # [R]: slots too (the scratch table is in order)
        cu = torch.tensor([0, end - start], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([end], dtype=torch.int32, device=device)
        plan = runner.backend.plan(cu, seq_lens, table, bs, end - start, end)
        rows = torch.arange(end - start, device=device)  # [R] every token's logits
        layout = StepLayout(cu, seq_lens, table, bs, end)
        logits = _forward(runner, ids[:-1], positions, rows, plan, self._scratch, layout, self.lora)  # [R, V]
        lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
        targets = ids[1:]  # [R] the token each row predicts
        chosen = lp.gather(1, targets[:, None])[:, 0].tolist()
        top_ids: list[list[int]] = [[] for _ in chosen]
        top_lps: list[list[float]] = [[] for _ in chosen]
        if self.k:
            values, idx = top_k(lp, min(self.k, lp.shape[1]))  # [R, k]
            top_ids, top_lps = idx.tolist(), values.tolist()
        for j, value in enumerate(chosen):
            self.result.append(TokenLogprob(ids_list[start + j + 1], value, tuple(zip(top_ids[j], top_lps[j]))))
        self._start = end
        if self.done:
            self._scratch = None
        return self.done


def prompt_logprobs(runner: ModelRunner, token_ids: list[int], k: int) -> list[TokenLogprob | None]:
    """The whole job at once (benchmarks, tests): `PromptLogprobs(...).result`."""
    job = PromptLogprobs(runner, token_ids, k)
    while not job.advance():
        pass
    return job.result


def _forward(
    runner: ModelRunner, ids, positions, rows, plan, caches, layout: StepLayout, lora: str | None = None
) -> torch.Tensor:
    """The runner's forward (model_runner.py, `execute`) over one chunk, into `caches`; every row
    under adapter `lora` if one is named (only the lean decoder serves adapters: lora/load.py)."""
    if runner.decoder is not None:
        adapted = runner.loras.uniform(lora, ids.shape[0]) if lora is not None and runner.loras is not None else None
        return runner.decoder.forward(ids, positions, rows, runner.backend, plan, positions, caches, lora=adapted)
    ctx = StepContext(runner.backend, plan, positions, caches, layout)
    out = runner.model(
        input_ids=ids[None], position_ids=positions[None], use_cache=False, logits_to_keep=rows, orca_step=ctx
    )
    return out.logits[0]
