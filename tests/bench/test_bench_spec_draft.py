"""`orcaserve-bench spec --method draft --agreement` (benchmarks/engine/spec_draft.py,
`run_synthetic`) on a tiny target and a noised copy of it as the draft: the draft runs, its
proposals are the target's greedy tokens with the set probability, the answers equal speculation
off's, and the accepted run per step grows with the agreement, with the draft's head cut to part of
the vocabulary (`--draft-vocab`)."""

from __future__ import annotations

import argparse

from spec_workload import draft_dir, draft_setting, noised, spec_prompts

from orcaserve.bench.engine.spec_draft import run_synthetic
from orcaserve.bench.engine.speculative import run_set
from orcaserve.bench.models.tiny import tiny_model


def test_the_accepted_run_follows_the_set_agreement(engine_for, tokenizer, tmp_path_factory):
    model = tiny_model("llama")
    path = draft_dir(tmp_path_factory, tokenizer, noised(model, 0.05), "synthetic-draft")
    engine = engine_for(model, max_num_seqs=8, speculative=draft_setting(path, 4))
    # --draft-vocab: the draft's head cut to half the vocabulary (its cost; the pair sets the proposals)
    args = argparse.Namespace(clients="1", requests=3, max_tokens=24, agreement="0,0.5,1", repeats=1, draft_vocab="256")
    spec = engine.spec
    got = run_synthetic(args, engine, spec, spec_prompts(seed=5, n=3), run_set)
    assert [row["draft_vocab"] for row in got["runs"]] == [256] * 3
    assert spec.proposer.runner.decoder.lm_head.out_features == 256
    rows = {row["agreement"]: row["spec"] for row in got["runs"]}
    assert all(row["same_tokens"] for row in got["runs"]), "greedy answers differ from speculation off's"
    assert rows[0.0]["proposed"] > 0 and rows[0.0]["accepted"] == 0 and rows[0.0]["mean_accepted_length"] == 1.0
    assert 0.25 < rows[0.5]["acceptance_by_position"][0] < 0.75, rows[0.5]  # the first proposal: about half
    # K = 4: every proposal accepted makes 5 tokens a step, fewer only where an answer ends
    assert rows[1.0]["acceptance_rate"] > 0.9 and rows[1.0]["mean_accepted_length"] > 3.5, rows[1.0]
    assert 1.0 < rows[0.5]["mean_accepted_length"] < rows[1.0]["mean_accepted_length"]
