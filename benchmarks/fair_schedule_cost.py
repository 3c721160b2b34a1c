"""What the `fair` policy costs the scheduler per step, against `fcfs` (docs/engine.md, "Fair
share between tenants (VTC)"): `Scheduler.schedule()` + `update_after_step()` with 256 requests
waiting, kept at 256 as requests finish, no model (a fake step samples token 1).

    python benchmarks/fair_schedule_cost.py [--steps 2000] [--tenants 1,2,16,256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from orcaserve.scheduler.core.fair_share import TenantShares
from orcaserve.scheduler.core.kv_cache_manager import KVCacheManager
from orcaserve.scheduler.core.request import Request
from orcaserve.scheduler.core.scheduler import Scheduler
from orcaserve.scheduler.sampling_params import SamplingParams


def measure(policy: str, tenants: int, waiting: int, steps: int, seqs: int, budget: int) -> dict:
    """Median and p99 microseconds of one step's scheduling work, and of one `add_request`."""
    s = Scheduler(KVCacheManager(8192, 16), seqs, budget, policy, TenantShares())
    rng = random.Random(0)
    count = 0
    adds: list[float] = []

    def top_up() -> None:
        nonlocal count
        while s.num_waiting < waiting:
            prompt = [rng.randrange(1000, 40000) for _ in range(rng.randint(32, 128))]
            req = Request(f"r{count}", prompt, SamplingParams(max_tokens=rng.randint(32, 128)), 0.0)
            req.tenant = f"t{count % tenants}"
            t0 = time.perf_counter()
            s.add_request(req)
            adds.append(time.perf_counter() - t0)
            count += 1

    times: list[float] = []
    for i in range(steps + 200):  # the first 200 fill the batch
        top_up()
        t0 = time.perf_counter()
        out = s.schedule()
        s.update_after_step(out)
        elapsed = time.perf_counter() - t0
        for r in out.sampling:
            r.append_token(1)
            if len(r.output_token_ids) >= r.params.max_tokens:
                s.finish_request(r, "length")
        if i >= 200:
            times.append(elapsed)
    times.sort()
    return {
        "policy": policy,
        "tenants": tenants,
        "step_us_p50": round(statistics.median(times) * 1e6, 1),
        "step_us_p99": round(times[int(0.99 * (len(times) - 1))] * 1e6, 1),
        "add_request_us_p50": round(statistics.median(adds) * 1e6, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--waiting", type=int, default=256)
    p.add_argument("--tenants", default="1,2,16,256")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = p.parse_args()
    print("| policy | tenants | schedule + update p50 (us) | p99 (us) | add_request p50 (us) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for tenants in (int(t) for t in args.tenants.split(",")):
        for policy in ("fcfs", "fair"):
            r = measure(policy, tenants, args.waiting, args.steps, args.max_num_seqs, args.max_num_batched_tokens)
            print(
                f"| {policy} | {tenants} | {r['step_us_p50']} | {r['step_us_p99']} | {r['add_request_us_p50']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
