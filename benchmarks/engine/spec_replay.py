"""Prompt lookup replayed: the proposer and the policy over the greedy answers of a run with
speculation off, each step priced from a table of step times by rows, so the figures are the same
on a quiet machine and a loaded one (docs/speculative-decoding.md "Prompt lookup", "When it pays";
dated runs in docs/performance-log.md).

    orcaserve-bench spec --replay                            # K = 2..8, 12, 16; copy and open sets
    orcaserve-bench spec --replay --replay-ks 4,7 --row-ms 1:3.29,4:4.24,8:5.63,16:8.61
    orcaserve-bench spec --replay --replay-answers answers.json   # the same answers for every run

Each set's `--requests` prompts (default 4, the one-client run's) are decoded greedily with
speculation off, one after another (`--replay-answers FILE`: read from FILE where it exists, else
written there: the answers are the same run to run only for the same prompts, which quote the
project's docstrings, and the same kernels (docs/engine.md, "Run to run"), so compare proposers and
policies on one file). Then, for each K, every answer is replayed one request after another as
one stream decodes it: each step asks the proposer for its kind of proposal (`kinds`), the policy
for its K (`plan`, over a step of one decode row) and the proposer for the tokens; the proposals
the answer agrees with are accepted, plus the target's own token, and the policy observes the
outcome and the step's price (`--row-ms`: milliseconds a step at so many rows, interpolated;
default the two-thread prices on an AMD Zen 5 measured by `orcaserve-bench latency --breakdown`,
performance-log.md "2026-12-07 (forenoon)"). One pass teaches the policy's cost model first, as
the engine's bench does. `every row` replays the same proposals at K every step they exist (no
policy). Printed per K: tokens a decode step, verified rows a step, steps without a proposal, and
the priced speed-up (off: one row a token), which leaves out prefill and host time: an upper bound
of what the engine gets, to compare proposers and policies by, not a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from orcaserve.scheduler import Engine, SamplingParams
from orcaserve.scheduler.core.step_cost import StepShape, row_context
from orcaserve.scheduler.prompt import ChatPrompt
from orcaserve.scheduler.spec.config import SpeculativeConfig
from orcaserve.scheduler.spec.policy import SpecPolicy
from orcaserve.scheduler.spec.proposers import NgramProposer

ROW_MS = "1:3.29,4:4.24,8:5.63,16:8.61"


@dataclass
class _Row:
    """What the proposer and the policy read of a decoding request."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int


@dataclass
class _Step:
    """What the policy reads of a step: one decode row."""

    shape: StepShape
    sampling: list[Any] = field(default_factory=list)


def answers(engine: Engine, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Each prompt's tokens and greedy answer, speculation off, one request at a time (the
    one-client run's answers: decoded beside others, a prompt's chunks and so its answer may differ)."""
    engine.spec = None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    work = []
    for i, text in enumerate(prompts):
        rid = f"replay{i}"
        engine.add_request(rid, ChatPrompt([{"role": "user", "content": text}]), params)
        prompt: list[int] | None = None
        answer: list[int] | None = None
        while answer is None:
            req = engine.scheduler.requests.get(rid)
            if prompt is None and req is not None:
                prompt = list(req.all_token_ids[: req.num_prompt_tokens])
            answer = next((list(o.output_token_ids) for o in engine.step() if o.finished), None)
        assert prompt is not None
        work.append((prompt, answer))
    return work


def price(table: dict[int, float], rows: int) -> float:
    """Milliseconds of a step of `rows` rows, interpolated in `table` (held past its ends)."""
    points = sorted(table)
    if rows <= points[0]:
        return table[points[0]]
    for a, b in zip(points, points[1:]):
        if rows <= b:
            return table[a] + (table[b] - table[a]) * (rows - a) / (b - a)
    return table[points[-1]] + (table[points[-1]] - table[points[-2]]) * (rows - points[-1]) / (points[-1] - points[-2])


def replay(
    work: list[tuple[list[int], list[int]]], k: int, table: dict[int, float], every_row: bool = False
) -> dict[str, float]:
    """One stream through `work` at K = k (see the module's docstring)."""
    cfg = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": k})
    assert cfg is not None
    policy, proposer = SpecPolicy(cfg), NgramProposer(cfg)
    for counted in (False, True):  # the first pass teaches the policy's cost model
        steps = tokens = proposed = unmatched = 0
        on_ms = off_ms = 0.0
        for i, (prompt, answer) in enumerate(work):
            req = _Row(f"{counted}{i}", [*prompt, answer[0]], len(prompt))
            t = 1
            while t < len(answer):
                kinds = proposer.kinds([req])
                step = _Step(StepShape(0, 1, row_context(req.num_computed_tokens, 1)), [req])
                cap = 0
                if req.request_id not in kinds:
                    unmatched += 1
                elif every_row:
                    cap = k
                else:
                    cap = next((c for _, c in policy.plan(step, [req], kinds)), 0)
                cap = min(cap, len(answer) - t - 1)
                drafts = proposer.propose_batch([(req, cap)])[0] if cap > 0 else []
                a = 0
                while a < len(drafts) and drafts[a] == answer[t + a]:
                    a += 1
                if drafts:
                    policy.observe(req.request_id, len(drafts), a, kinds.get(req.request_id, 0))
                rows = 1 + len(drafts)
                ms = price(table, rows)
                policy.observe_step(StepShape(0, rows, row_context(req.num_computed_tokens, rows)), ms / 1000)
                req.all_token_ids += answer[t : t + a + 1]
                req.num_computed_tokens += a + 1
                t += a + 1
                steps, tokens, proposed = steps + 1, tokens + a + 1, proposed + len(drafts)
                on_ms, off_ms = on_ms + ms, off_ms + price(table, 1) * (a + 1)
            proposer.drop(req.request_id)
            policy.drop(req.request_id)
    return {
        "k": k,
        "tokens_per_step": round(tokens / steps, 3),
        "rows_per_step": round((steps + proposed) / steps, 3),
        "steps": steps,
        "unmatched": unmatched,
        "priced_speedup": round(off_ms / on_ms, 3),
    }


def run_replay(args: argparse.Namespace, engine: Engine, sets: dict[str, list[str]]) -> dict:
    table = {int(r): float(ms) for r, ms in (p.split(":") for p in args.row_ms.split(","))}
    out: dict = {"row_ms": table, "sets": {}}
    print(
        f"{'set':<6}{'K':>4}{'policy: tok/step':>18}{'rows/step':>11}{'priced':>9}"
        f"{'every row: tok/step':>21}{'priced':>9}{'no proposal':>13}",
        file=sys.stderr,
    )
    cached: dict[str, list] = {}
    if args.replay_answers and os.path.exists(args.replay_answers):
        with open(args.replay_answers) as f:
            cached = json.load(f)
    for name in args.sets.split(","):
        work = cached.get(name) or answers(engine, sets[name][: args.requests or 4], args.max_tokens)
        cached[name] = work
        rows = []
        for k in map(int, args.replay_ks.split(",")):
            pol, every = replay(work, k, table), replay(work, k, table, every_row=True)
            rows.append({"policy": pol, "every_row": every})
            print(
                f"{name:<6}{k:>4}{pol['tokens_per_step']:>18.2f}{pol['rows_per_step']:>11.2f}"
                f"{pol['priced_speedup']:>8.2f}x{every['tokens_per_step']:>21.2f}{every['priced_speedup']:>8.2f}x"
                f"{pol['unmatched']:>7}/{pol['steps']}",
                file=sys.stderr,
            )
        out["sets"][name] = {"answer_tokens": [len(a) for _, a in work], "rows": rows}
    if args.replay_answers:
        with open(args.replay_answers, "w") as f:
            json.dump(cached, f)
    return out
