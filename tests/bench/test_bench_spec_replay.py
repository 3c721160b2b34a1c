"""`orcaserve-bench spec --replay` without a model: prompt lookup and the policy replayed over given
answers, each step priced from a table (benchmarks/engine/spec_replay.py)."""

from __future__ import annotations

from orcaserve.bench.engine.spec_replay import price, replay

TABLE = {1: 3.0, 4: 4.5, 8: 6.5}


def test_price_interpolates_and_extends_the_table():
    assert price(TABLE, 1) == 3.0 and price(TABLE, 8) == 6.5
    assert price(TABLE, 2) == 3.5 and price(TABLE, 6) == 5.5
    assert price(TABLE, 10) == 7.5  # past the end: the last segment's slope


def test_an_answer_that_copies_its_prompt_is_replayed_in_runs():
    """An answer that quotes its prompt's 40 distinct tokens: every row proposing K = 4 checks five
    rows a step and all its proposals are accepted; the policy, pricing rows from the table, also
    speculates and gains over one token a step."""
    text = list(range(100, 140))
    work = [([1, 2, *text, 3], text)]
    every = replay(work, 4, TABLE, every_row=True)
    # 39 tokens after the first (the prefill's): 7 steps of 4 + 1, the last of 3 + 1 (the answer's end)
    assert every["unmatched"] == 0 and every["steps"] == 8
    assert every["tokens_per_step"] == every["rows_per_step"] == 39 / 8
    assert every["priced_speedup"] > 1.5
    policy = replay(work, 4, TABLE)
    assert policy["tokens_per_step"] > 2.0 and policy["priced_speedup"] > 1.0
