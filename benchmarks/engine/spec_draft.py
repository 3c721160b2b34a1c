"""Draft-model speculation's economics: speed-up against acceptance with a synthetic target/draft
pair whose agreement is set (docs/speculative-decoding.md "Draft model"; dated runs in
docs/performance-log.md).

    orcaserve-bench spec --method draft --agreement 0,0.5,0.7,0.8,0.9,1
    orcaserve-bench spec --method draft --agreement 0.8 --draft-model DIR --max-tokens 64
    orcaserve-bench spec --method draft --agreement 0,0.5,0.8,1 --model ~/.cache/orcaserve/random-1b
    orcaserve-bench spec --method draft --agreement 0.8 --model ~/.cache/orcaserve/random-1b --draft-vocab 128256,32768

The target is `--model` (SmolLM2-135M-Instruct by default). The draft is a real model that runs
its real forwards, K per speculated step for all rows, with its own paged KV (by default a random
checkpoint chosen by the target's vocabulary, benchmarks/models/random_checkpoint.py `DRAFTS`:
"smollm2-draft", SmolLM2's width with 4 layers of its 30; "1b-draft" for the 1B shape); only its
proposals are replaced: each becomes the target's own greedy token at
that position (from a run with speculation off) with probability `agreement`, else another token.
So the draft costs what such a draft costs, and a proposal is accepted with probability close to
`agreement` (its tokens past a rejection are the off run's, not the new ones: one per mille may
differ where the target's bf16 numerics flip a near-tie). Every decode row proposes K tokens
every step (the policy that decides when speculation pays is bypassed: this measures what a
speculated step costs and brings at each acceptance). At each agreement `--repeats` off and draft
runs alternate on one engine (medians, by the wall clock and by the process's CPU time); the
outputs are compared token for token.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from collections.abc import Sequence

import torch

from orcaserve.scheduler import Engine
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.spec.decoding import SpecDecoding
from orcaserve.scheduler.spec.proposers import Proposer


class SetAgreement:
    """A draft whose proposals are replaced by the target's own tokens, each with probability
    `agreement` (else the token after it in the vocabulary); the draft still runs."""

    def __init__(self, draft: Proposer, answers: dict[str, list[int]], agreement: float, vocab: int):
        """`answers`: request id -> the target's greedy output (every run names its requests alike)."""
        self.draft, self.answers, self.agreement, self.vocab = draft, answers, agreement, vocab
        self.rng = random.Random(0)

    def propose_batch(self, rows: Sequence[tuple[Request, int]]) -> list[list[int]]:
        out = []
        for (req, _), own in zip(rows, self.draft.propose_batch(rows)):
            truth = self.answers.get(req.request_id, [])
            at = len(req.output_token_ids)
            proposals = []
            for i, token in enumerate(own):
                t = truth[at + i] if at + i < len(truth) else token
                proposals.append(t if self.rng.random() < self.agreement else (t + 1) % self.vocab)
            out.append(proposals)
        return out

    def kinds(self, reqs: Sequence[Request]) -> dict[str, int]:
        return self.draft.kinds(reqs)

    def distributions(self) -> dict[str, torch.Tensor]:
        return {}  # greedy runs: point masses

    def drop(self, request_id: str) -> None:
        self.draft.drop(request_id)


def cut_head(draft: Proposer, rows: int) -> None:
    """The draft's lm_head cut to its first `rows` rows: a step then pays what a draft whose head
    covers only part of the vocabulary pays (docs/speculative-decoding.md "Draft model"). Its own
    proposals come from those ids; the synthetic pair replaces them. A head served from codes is
    quantized again, in its format, from the model's dense head (the kernel's layout keeps no rows)."""
    from orcaserve.kernels.linear import Linear
    from orcaserve.kernels.quant import QuantLinear, quantize

    decoder = getattr(getattr(draft, "runner", None), "decoder", None)
    if decoder is None or not isinstance(decoder.lm_head, Linear | QuantLinear):
        raise SystemExit("--draft-vocab cuts the lm_head of a draft model's lean decoder")
    model = draft.runner.model
    weight = model.lm_head.weight  # a quantized head keeps no dense weight: a tied one has the embedding's
    if weight.dim() != 2 and getattr(model.config, "tie_word_embeddings", False):
        weight = model.get_input_embeddings().weight
    if weight.dim() != 2:
        raise SystemExit("--draft-vocab: the draft's quantized lm_head has no dense weight to cut")
    head, weight = decoder.lm_head, weight[:rows].contiguous()
    if isinstance(head, QuantLinear):
        decoder.lm_head = QuantLinear(quantize(weight.float(), head.fmt), None, activations=head.activations)
    else:
        decoder.lm_head = Linear(weight, None, pack=True)


def run_synthetic(args: argparse.Namespace, engine: Engine, spec: SpecDecoding, prompts: list, run_set) -> dict:
    """Off, then at each agreement `args.repeats` off/draft pairs alternated (medians kept, by the
    wall clock and by the process's CPU time), one stream by default."""
    from orcaserve.bench.engine.spec_pairs import summary
    from orcaserve.scheduler.spec.policy import SpecPolicy
    from orcaserve.scheduler.spec.stats import SpecStats

    k = spec.config.num_speculative_tokens
    clients = int(args.clients.split(",")[0])
    n = args.requests or max(4, clients)
    draft = spec.proposer
    # --draft-vocab: the head's rows for each block of agreements, in turn (a cut from the full head)
    vocabs = [int(v) for v in str(getattr(args, "draft_vocab", "") or "").split(",") if v] or [engine.vocab_size]
    engine.spec = None
    answers = run_set(engine, prompts, clients, n, args.max_tokens)["outputs"]
    results: dict = {"runs": [], "k": k, "clients": clients, "requests": n, "draft": spec.config.model}
    print(
        f"{'head rows':>10}{'agreement':>10}{'off tok/s':>11}{'draft tok/s':>13}{'speed-up':>10}{'by CPU':>8}"
        f"{'accept':>8}{'mean len':>10}{'same':>6}",
        file=sys.stderr,
    )
    for vocab, agreement in itertools.product(vocabs, map(float, args.agreement.split(","))):
        if vocab != engine.vocab_size or len(vocabs) > 1:
            cut_head(draft, vocab)
        spec.proposer = SetAgreement(draft, answers, agreement, engine.vocab_size)
        spec.stats, spec.policy = SpecStats(method="draft"), SpecPolicy(spec.config)
        spec.policy.plan = lambda sched, candidates, kinds=None: [(r, k) for r in candidates]  # every row, K each
        offs, ons = [], []
        for _ in range(args.repeats):
            engine.spec = None
            offs.append(run_set(engine, prompts, clients, n, args.max_tokens))
            engine.spec = spec
            ons.append(run_set(engine, prompts, clients, n, args.max_tokens))
        stats = spec.stats.to_dict()
        off_med, on_med = summary(offs), summary(ons)
        off, on = off_med["tok_s"], on_med["tok_s"]
        row = {
            "draft_vocab": vocab,
            "agreement": agreement,
            "off_tok_s": round(off, 2),
            "draft_tok_s": round(on, 2),
            "off_runs": [round(r["tok_s"], 2) for r in offs],
            "draft_runs": [round(r["tok_s"], 2) for r in ons],
            "speedup": round(on / off, 3),
            "speedup_cpu": round(on_med["tok_cpu_s"] / off_med["tok_cpu_s"], 3),
            "same_tokens": off_med["all_outputs"] == on_med["all_outputs"],
            "spec": stats,
        }
        results["runs"].append(row)
        print(
            f"{vocab:>10}{agreement:>10.2f}{off:>11.1f}{on:>13.1f}{row['speedup']:>9.2f}x{row['speedup_cpu']:>7.2f}x"
            f"{stats['acceptance_rate']:>8.2f}{stats['mean_accepted_length']:>10.2f}{str(row['same_tokens']):>6}",
            file=sys.stderr,
        )
    engine.spec = None
    spec.proposer = draft
    return results
