"""The bound on tenant B's end-to-end latency beside a flood (docs/fair-share.md, "Fair share between
tenants (VTC)"): an engine decode step with 1 row against one with `max_num_seqs` rows.

Even a request that never waits for a seat decodes each token in a step it shares with the
flood's decodes, so its time per output token beside a full batch is at least the ratio printed
here times its time alone: no order of admission changes that, only a cheaper step. The default
model and dtype as the TorchServe archives of benchmarks/fairness.py run them, torch's default
threads as their worker's; `context` near the benchmark's mean (prompts and outputs U[32, 128]:
80 + 40 tokens decoded halfway). The two sizes alternate over `--rounds`, so a drift of the
machine falls on both; the median step of each is reported. fairness.py runs this after its
phases (the server stopped) and puts the figures beside B's latency ratios.
"""

from __future__ import annotations

import random
import statistics
import time

from orcaserve.scheduler import Engine, SamplingParams
from orcaserve.scheduler.model.loader import default_model_path


def _decode_steps(engine: Engine, rows: int, context: int, steps: int, rng: random.Random) -> list[float]:
    """Seconds of each of `steps` whole engine steps while `rows` requests of `context` tokens
    decode; their prefill runs first, untimed, and they are aborted after."""
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"r{rng.randrange(1 << 30)}-{i}" for i in range(rows)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(1000, 40000) for _ in range(context)], params)
    started: set[str] = set()
    while len(started) < rows:  # prefill (chunked by the token budget), one token each
        started.update(out.request_id for out in engine.step())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for rid in ids:
        engine.abort(rid)
    return times


def step_bound(max_num_seqs: int = 16, context: int = 120, steps: int = 20, rounds: int = 3) -> dict:
    """Median decode step (ms) with 1 row and with `max_num_seqs` rows, and their ratio."""
    engine = Engine.from_pretrained(
        default_model_path(), max_num_seqs=max_num_seqs, kv_cache_memory=256 << 20, enable_prefix_caching=False
    )
    rng = random.Random(0)
    _decode_steps(engine, max_num_seqs, context, 3, rng)  # warm-up: lazy initialisation, caches
    times: dict[int, list[float]] = {1: [], max_num_seqs: []}
    for _ in range(rounds):
        for rows in times:
            times[rows] += _decode_steps(engine, rows, context, steps, rng)
    one, full = (statistics.median(times[r]) * 1e3 for r in (1, max_num_seqs))
    return {
        "max_num_seqs": max_num_seqs,
        "context": context,
        "steps": steps * rounds,
        "step_ms_1_row": round(one, 2),
        "step_ms_full": round(full, 2),
        "ratio": round(full / one, 3),
    }
