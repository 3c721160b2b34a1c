"""Pictures of the schedule: orcaserve's iterations vs the baseline's request-level batches.

    # 1. run the engine offline on a Poisson workload (same generator and seed as serve.py),
    #    record its per-step trace, and draw it
    python benchmarks/plot_schedule.py trace --rate 1 --num-requests 24 --input-len 8:64 \\
        --output-len 1:64 --json benchmarks/results/schedule-orcaserve.json --png docs/schedule-orcaserve.png
    # 2. redraw a saved trace (a list of StepTrace.to_dict(), or the JSON written by step 1)
    python benchmarks/plot_schedule.py orca benchmarks/results/schedule-orcaserve.json --png docs/schedule-orcaserve.png
    # 3. draw the baseline's batches from a serve.py report (per-request timestamps + batch info)
    python benchmarks/plot_schedule.py baseline bench.json --system smollm2-baseline --rate 1 \\
        --png docs/schedule-baseline.png

orcaserve picture: one row per request, one column per engine step (`--x time`: x = wall time,
so a long prefill step is a wide column); orange = prefill tokens in that step, blue = one decode token,
grey line = waiting in the queue, red x = preempted. Requests join and leave the running batch
between any two steps (ORCA's "bus stop"). Top strip: requests per step and KV blocks in use.

Baseline picture: one row per request; grey = queued in TorchServe until its batch starts;
a coloured bar per batch from batch start to batch end: dark = the share of the batch's decode
that the request's own max_tokens needed (approximate), light = held until the longest request
of the batch is done. Everyone in a batch gets on and off together.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PREFILL, DECODE, WAIT, PREEMPT = "tab:orange", "tab:blue", "0.75", "tab:red"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---- offline trace ---------------------------------------------------------------------------
def record_trace(rate: float, num_requests: int, input_len, output_len, seed: int, engine_args: dict) -> dict:
    """Run the engine on a Poisson workload in real time; returns {"trace", "requests", ...}."""
    from serve_workload import make_workload, poisson_offsets

    from orcaserve.scheduler import Engine, SamplingParams, default_model_path

    engine = Engine.from_pretrained(default_model_path(), trace=True, **engine_args)
    engine.generate([[1000, 1001, 1002, 1003]], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    engine.trace.clear()
    specs = make_workload(num_requests, seed, input_len, output_len, (1000, 40000))
    offsets = poisson_offsets(num_requests, rate, seed)
    reqs: dict[str, dict] = {}
    start = time.time()
    pending = list(zip(specs, offsets))
    while pending or engine.has_unfinished():
        now = time.time()
        while pending and start + pending[0][1] <= now:
            spec, off = pending.pop(0)
            rid = f"r{spec.index:03d}"
            engine.add_request(
                rid,
                spec.prompt,
                SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True),
                arrival_time=start + off,
            )
            reqs[rid] = {"arrival": start + off, "input_len": spec.input_len, "max_tokens": spec.max_tokens}
        if engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    reqs[out.request_id].update(first_token=out.times.first_token, finished=out.times.finished)
        elif pending:
            time.sleep(max(0.0, start + pending[0][1] - time.time()))
    return {
        "trace": [t.to_dict() for t in engine.trace],
        "requests": reqs,
        "t0": start,
        "workload": {
            "rate": rate,
            "num_requests": num_requests,
            "input_len": list(input_len),
            "output_len": list(output_len),
            "seed": seed,
            "engine_args": engine_args,
            "num_blocks": engine.stats.num_blocks,
        },
    }


# ---- orcaserve picture -----------------------------------------------------------------------
def plot_orca(data, png: str, title: str | None = None, x_axis: str = "step") -> None:
    plt = _plt()
    from matplotlib.patches import Patch

    trace = data["trace"] if isinstance(data, dict) else data
    reqs = data.get("requests", {}) if isinstance(data, dict) else {}
    if not trace:
        raise ValueError("the trace is empty")
    t0 = data.get("t0") if isinstance(data, dict) and data.get("t0") else trace[0]["start"]
    ids = list(reqs) if reqs else []
    for step in trace:
        for rid in step["requests"]:
            if rid not in ids:
                ids.append(rid)
    if reqs:
        ids.sort(key=lambda r: reqs.get(r, {}).get("arrival", 0.0))
    row = {rid: i for i, rid in enumerate(ids)}
    fig, (top, ax) = plt.subplots(
        2,
        1,
        figsize=(11, 1.6 + 0.22 * len(ids)),
        dpi=90,
        sharex=True,
        gridspec_kw={"height_ratios": [1, max(3, len(ids) / 5)]},
    )
    starts = [s["start"] for s in trace]

    def xpos(t: float) -> float:
        """Wall time -> x: seconds since t0, or the (fractional) iteration running at time t."""
        if x_axis == "time":
            return t - t0
        i = bisect.bisect_right(starts, t) - 1
        if i < 0:
            return -0.5
        step = trace[i]
        return i + min(1.0, (t - step["start"]) / max(step["end"] - step["start"], 1e-9))

    for rid, info in reqs.items():  # queueing: arrival -> first step that ran it
        first = next((s["start"] for s in trace if rid in s["requests"]), None)
        if first is not None and "arrival" in info:
            ax.plot([xpos(info["arrival"]), xpos(first)], [row[rid]] * 2, color=WAIT, lw=1.5, zorder=1)
            ax.plot(xpos(info["arrival"]), row[rid], "|", color="0.4", ms=7, zorder=2)
    bars: dict[str, list] = {PREFILL: [], DECODE: []}
    for i, step in enumerate(trace):
        if x_axis == "time":
            x, w = step["start"] - t0, max(step["end"] - step["start"], 1e-4)
        else:
            x, w = i, 1.0
        for rid, (pre, _) in step["requests"].items():
            bars[PREFILL if pre else DECODE].append((row[rid], x, w))
        for rid in step.get("preempted", []):
            if rid in row:
                ax.plot(x, row[rid], "x", color=PREEMPT, ms=6, mew=2, zorder=4)
    for color, items in bars.items():
        for y, x, w in items:
            ax.barh(y, w, left=x, height=0.7, color=color, edgecolor="white", linewidth=0.3, zorder=3)
    ax.set_yticks(range(len(ids)))
    ax.set_yticklabels(ids, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("seconds" if x_axis == "time" else "iteration (engine step)")
    ax.set_ylabel("request (by arrival)")
    ax.legend(
        handles=[
            Patch(color=PREFILL, label="prefill step"),
            Patch(color=DECODE, label="decode step"),
            Patch(color=WAIT, label="queued"),
            plt.Line2D([], [], marker="x", color=PREEMPT, ls="", label="preempted"),
        ],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
    )
    xs = [s["start"] - t0 for s in trace] if x_axis == "time" else list(range(len(trace)))
    top.step(xs, [len(s["requests"]) for s in trace], where="post", color="tab:green", label="requests in step")
    top.set_ylabel("batch", fontsize=8)
    kv = top.twinx()
    kv.step(xs, [s["kv_blocks_used"] for s in trace], where="post", color="tab:purple", alpha=0.7)
    kv.set_ylabel("KV blocks", fontsize=8, color="tab:purple")
    top.set_title(
        title
        or f"orcaserve: {len(trace)} iterations, {len(ids)} requests (requests join and leave between iterations)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, bbox_inches="tight")
    plt.close(fig)


# ---- baseline picture ------------------------------------------------------------------------
def plot_baseline(
    report: dict, png: str, system: str, rate: float | None, max_requests: int, title: str | None = None
) -> None:
    plt = _plt()
    from matplotlib.patches import Patch

    rows = [
        r
        for r in report["requests"]
        if r["system"] == system and r.get("batch") and (rate is None or r["rate"] == rate)
    ]
    if not rows:
        raise ValueError(f"no requests of {system!r} with batch info at rate {rate} in the report")
    if rate is None:  # several rates: take the first one present
        rate = rows[0]["rate"]
        rows = [r for r in rows if r["rate"] == rate]
    rows = sorted(rows, key=lambda r: r["sent"])[:max_requests]
    t0 = rows[0]["sent"]
    colors = ["tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:cyan", "tab:olive"]
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.22 * len(rows)), dpi=90)
    for y, r in enumerate(rows):
        b = r["batch"]
        color = colors[b["id"] % len(colors)]
        ax.plot([r["sent"] - t0, b["start"] - t0], [y, y], color=WAIT, lw=1.5, zorder=1)
        ax.plot(r["sent"] - t0, y, "|", color="0.4", ms=7)
        span = b["end"] - b["start"]
        own = span * min(1.0, r["max_tokens"] / max(b["max_new_tokens"], 1))
        ax.barh(y, own, left=b["start"] - t0, height=0.7, color=color, zorder=3)
        ax.barh(y, span - own, left=b["start"] - t0 + own, height=0.7, color=color, alpha=0.3, zorder=3)
        ax.text(b["end"] - t0, y, f" b{b['id']}", fontsize=6, va="center")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"r{r['index']:03d}" for r in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_ylabel("request (by arrival)")
    ax.legend(
        handles=[
            Patch(color=WAIT, label="queued in TorchServe"),
            Patch(color="tab:blue", label="batch running (own tokens, approx.)"),
            Patch(color="tab:blue", alpha=0.3, label="held for the batch's longest request"),
        ],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
    )
    n_batches = len({r["batch"]["id"] for r in rows})
    ax.set_title(
        title
        or f"request-level baseline ({system}) at {rate} req/s: {len(rows)} requests in "
        f"{n_batches} batches (all join and leave together)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, bbox_inches="tight")
    plt.close(fig)


def _range(text: str):
    a, _, b = text.partition(":")
    return int(a), int(b or a)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace", help="run the engine offline, save its trace, draw it")
    t.add_argument("--rate", type=float, default=1.0)
    t.add_argument("--num-requests", type=int, default=24)
    t.add_argument("--input-len", type=_range, default=(8, 64))
    t.add_argument("--output-len", type=_range, default=(1, 64))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-num-seqs", type=int, default=32)
    t.add_argument("--max-num-batched-tokens", type=int, default=512)
    t.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (small values show preemption)")
    t.add_argument("--threads", type=int, default=None, help="torch threads")
    t.add_argument("--json", required=True)
    t.add_argument("--png", required=True)
    t.add_argument("--x", choices=["step", "time"], default="step", help="x axis: iterations or seconds")
    o = sub.add_parser("orca", help="draw a saved trace JSON")
    o.add_argument("json")
    o.add_argument("--png", required=True)
    o.add_argument("--x", choices=["step", "time"], default="step", help="x axis: iterations or seconds")
    b = sub.add_parser("baseline", help="draw the baseline's batches from a serve.py report")
    b.add_argument("json")
    b.add_argument("--system", default="smollm2-baseline")
    b.add_argument("--rate", type=float, default=None)
    b.add_argument("--max-requests", type=int, default=40)
    b.add_argument("--png", required=True)
    args = p.parse_args(argv)

    if args.cmd == "trace":
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        engine_args = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
        if args.kv_cache_memory:
            engine_args["kv_cache_memory"] = args.kv_cache_memory
        data = record_trace(args.rate, args.num_requests, args.input_len, args.output_len, args.seed, engine_args)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=None, separators=(",", ":"))
        plot_orca(data, args.png, x_axis=args.x)
        print(f"{len(data['trace'])} steps, {len(data['requests'])} requests -> {args.json}, {args.png}")
    elif args.cmd == "orca":
        with open(args.json) as f:
            plot_orca(json.load(f), args.png, x_axis=args.x)
    else:
        with open(args.json) as f:
            plot_baseline(json.load(f), args.png, args.system, args.rate, args.max_requests)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
