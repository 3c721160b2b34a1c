"""A draft model proposing: a smaller model with the target's tokenizer runs K cheap steps ahead
and the target checks them in one forward (docs/speculative-decoding.md "Draft model").

The draft loads beside the target with the target's device, dtype and block size (its weights'
quantization chosen for its file as the engine's are, or `speculative.quantization`), and is
refused at load when its vocabulary or tokenizer differs from the target's: its ids would mean
other text. It keeps its own paged KV (its own `KVCacheManager` and pool, the same block scheme,
sized as the target's pool plus K tokens for each of `max_num_seqs` rows) and its own
`ModelRunner` (the same packed forward and attention backends as the target's).

Per step, `propose_batch` runs the draft over all speculating rows at once, one forward per
proposal position: the first feeds each row what its draft K/V lacks (the target's tokens since
the draft last ran: one or two after an accepted run, the whole sequence after a drop, chunked to
the step's token budget), every next one the previous proposal. Each takes the draft's argmax for a
greedy row; a sampled row draws from the draft's distribution under the request's own settings
and random stream (the sampler's processing, `processed_probs`), and that distribution is kept
for the target's check (`distributions`, the general rejection rule in verify.py).

Its K/V follows what the target accepted without being told: each request's shadow sequence holds
the tokens the draft computed, and before it proposes again the draft keeps the longest run of
them that equals the request's tokens (the accepted proposals and the target's own token) and
moves its computed count back to there; the K/V past it is overwritten. A request's draft state
is dropped (its blocks freed) when it finishes or is preempted, and rebuilt by a prefill of the
draft when it speculates again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from orcaserve.kernels import get_backend
from orcaserve.scheduler.config import EngineConfig
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.step_output import SchedulerOutput
from orcaserve.scheduler.engine_request import EngineRequest
from orcaserve.scheduler.model.build import allocate_kv_caches, prepare_model
from orcaserve.scheduler.model.defaults import choose_weights
from orcaserve.scheduler.model.hub import resolve_model
from orcaserve.scheduler.model.loader import load_model_and_tokenizer, model_dims
from orcaserve.scheduler.model.model_runner import ModelRunner
from orcaserve.scheduler.model.sampler import processed_probs
from orcaserve.scheduler.spec.config import SpeculativeConfig
from orcaserve.scheduler.spec.target import Target


@dataclass
class _Draft:
    """One request's draft state: its shadow sequence (the tokens the draft holds, its own block
    table and computed count), the leading tokens known to be the request's, and the request's
    preemptions when it was built (a preemption since then drops it)."""

    seq: Request
    verified: int
    preemptions: int


def check_vocabulary(name: str, model: Any, tokenizer: Any, target: Target) -> None:
    """Refuse a draft whose ids would mean other text than the target's."""
    vocab = model.config.vocab_size
    if vocab != target.vocab_size:
        raise ValueError(
            f"speculative.model {name!r}: the draft's vocabulary has {vocab} tokens and the target's "
            f"{target.vocab_size}: a draft model must share the target's tokenizer"
        )
    if target.tokenizer is not None and tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(
            f"speculative.model {name!r}: the draft's tokenizer differs from the target's (its token ids "
            "would mean other text): a draft model must share the target's tokenizer"
        )


class DraftProposer:
    """Proposals from a draft model (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, target: Target) -> None:
        if config.model is None:
            raise ValueError("speculative.model (the draft's HF directory or .gguf file) is required")
        tc = target.config
        path = resolve_model(config.model)
        dcfg = EngineConfig(
            max_num_seqs=tc.max_num_seqs,
            max_num_batched_tokens=tc.max_num_batched_tokens,
            block_size=tc.block_size,
            dtype=tc.dtype,
            device=tc.device,
            attention_backend=tc.attention_backend,
            enable_prefix_caching=False,
            allow_unverified_architecture=tc.allow_unverified_architecture,
            quantization=config.quantization,
            # Quantized as asked, the draft's codes take the target's activations (int8 where the
            # engine chose them): the fp32 GEMM over codes costs a narrow draft more than its reads.
            activations=tc.activations if config.quantization not in (None, "none") else None,
            max_model_len=target.max_model_len,
        )
        dcfg = choose_weights(dcfg, path)
        model, tokenizer = load_model_and_tokenizer(
            path, dcfg.resolved_dtype(), dcfg.resolved_device(), dcfg.quantized()
        )
        check_vocabulary(config.model, model, tokenizer, target)
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and limit < target.max_model_len:
            raise ValueError(
                f"speculative.model {config.model!r}: the draft takes sequences of up to {limit} tokens, "
                f"the engine serves {target.max_model_len} (set max_model_len to at most {limit})"
            )
        bs = tc.block_size
        # The draft holds at most what the target holds (a preempted request's draft state goes),
        # plus up to K proposals per row: the target's pool and K tokens for each row.
        self.num_blocks = target.num_blocks + tc.max_num_seqs * (-(-config.num_speculative_tokens // bs) + 1)
        layers, n_kv, head_dim = model_dims(model.config)
        block_bytes = 2 * layers * bs * n_kv * head_dim * torch.finfo(dcfg.resolved_dtype()).bits // 8
        dcfg = dataclasses.replace(dcfg, kv_cache_memory=self.num_blocks * block_bytes)
        prepare_model(model, dcfg)  # checks, quantization, device and dtype
        self.kv = KVCacheManager(self.num_blocks, bs, enable_prefix_caching=False)
        self.max_tokens = tc.max_num_batched_tokens
        self.runner = ModelRunner(
            model,
            allocate_kv_caches(model, dcfg, self.num_blocks),
            bs,
            get_backend(dcfg.resolved_backend()),
            dcfg.resolved_device(),
            max_num_seqs=tc.max_num_seqs,
            max_num_batched_tokens=self.max_tokens,
            max_model_len=target.max_model_len,
        )
        self.runner.warm_up(self.max_tokens, tc.max_num_seqs)
        self._drafts: dict[str, _Draft] = {}
        self._probs: dict[str, list[torch.Tensor]] = {}  # a sampled row's q at each proposal, this step

    def propose_batch(self, rows: Sequence[tuple[Request, int]]) -> list[list[int]]:
        """The draft's continuation of each request, `k` tokens each ([] where its blocks cannot
        grow), greedy or sampled as the request samples: one forward per proposal position over
        all rows."""
        out: list[list[int]] = [[] for _ in rows]
        self._probs = {}
        owner = {req.request_id: req for req, _ in rows}
        live: list[tuple[int, _Draft, int]] = []  # (row, its draft state, k)
        for i, (req, k) in enumerate(rows):
            draft = self._sync(req)
            seq = draft.seq
            # What it lacks, and its first k - 1 proposals (the k-th is sampled, not fed).
            if self.kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens + k - 1):
                live.append((i, draft, k))
        while live:
            sched = SchedulerOutput()
            budget = self.max_tokens
            for _, draft, _ in live:
                seq = draft.seq
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if n <= 0:
                    break
                sched.num_scheduled_tokens[seq.request_id] = n
                sched.requests[seq.request_id] = seq
                budget -= n
            sched.seal(False)  # a row samples once it has fed all it lacked
            logits = self.runner.execute(sched, self.kv)  # [S, V]
            ids = self._pick(logits, [owner[seq.request_id] for seq in sched.sampling]) if sched.sampling else []
            for seq, n in zip(sched.requests.values(), sched.num_scheduled_tokens.values()):
                seq.num_computed_tokens += n
            for seq, token in zip(sched.sampling, ids):
                seq.all_token_ids.append(token)
            still = []
            for i, draft, k in live:
                if draft.seq.num_tokens - draft.verified < k:
                    still.append((i, draft, k))
                else:
                    out[i] = draft.seq.all_token_ids[draft.verified :]
            live = still
        return out

    def _pick(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:  # logits [S, V]
        """Each row's proposal: the argmax for a greedy request; for a sampled one a draw from
        the draft's processed distribution q (the exponential race, as the sampler draws, from
        the request's generator where it has one), q kept for the check."""
        ids = logits.argmax(-1).tolist()
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if not sampled:
            return ids
        q = processed_probs(logits[sampled], [reqs[i] for i in sampled])  # [R, V]
        noise = torch.empty_like(q)
        for j, i in enumerate(sampled):
            gen = reqs[i].generator
            noise[j].exponential_(generator=gen) if gen is not None else noise[j].exponential_()
            self._probs.setdefault(reqs[i].request_id, []).append(q[j])
        for i, token in zip(sampled, (q / noise).argmax(-1).tolist()):
            ids[i] = token
        return ids

    def distributions(self) -> dict[str, torch.Tensor]:
        """The last `propose_batch`'s sampled rows: the draft's q at each proposal, [K, V]."""
        return {rid: torch.stack(qs) for rid, qs in self._probs.items()}

    def _sync(self, req: Request) -> _Draft:
        """The request's draft state, its computed count moved back to the longest run of its
        tokens that are still the request's, and the request's newer tokens appended."""
        rid = req.request_id
        draft = self._drafts.get(rid)
        if draft is not None and draft.preemptions != req.num_preemptions:
            self.drop(rid)
            draft = None
        tokens = req.all_token_ids
        if draft is None:  # rebuilt: a prefill of the draft
            seq = Request(EngineRequest(rid, list(req.prompt_token_ids)))
            seq.all_token_ids = list(tokens)
            draft = self._drafts[rid] = _Draft(seq, len(tokens), req.num_preemptions)
            return draft
        seq = draft.seq
        mine = seq.all_token_ids
        c = min(draft.verified, seq.num_computed_tokens)
        limit = min(seq.num_computed_tokens, len(tokens))
        while c < limit and mine[c] == tokens[c]:
            c += 1
        seq.num_computed_tokens = c  # rejected proposals' K/V past here is written over
        del mine[c:]
        mine.extend(tokens[c:])
        draft.verified = len(tokens)
        return draft

    def kinds(self, reqs: Sequence[Request]) -> dict[str, int]:
        """Every request gets a proposal, of one kind (the draft's acceptance is not told apart)."""
        return {req.request_id: 0 for req in reqs}

    def drop(self, request_id: str) -> None:
        draft = self._drafts.pop(request_id, None)
        if draft is not None:
            self.kv.free(draft.seq)

    @property
    def num_requests(self) -> int:
        """Requests the draft holds state (and blocks) for."""
        return len(self._drafts)
