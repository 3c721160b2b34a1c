"""Figures, goals, table and plot of benchmarks/fair/fairness.py (one phase's records at a time), and
the bound on tenant B's latency beside a flood: an engine decode step with 1 row against one with
`max_num_seqs` rows (docs/fair-share.md "Fair share between tenants (VTC)"). Even a request that
never waits for a seat decodes each token in a step it shares with the flood's decodes, so its
time per output token beside a full batch is at least that ratio times its time alone."""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict

from orcaserve.bench.result import markdown_table, pct, pyplot
from orcaserve.bench.serve.client import Result

# VTC's default costs, as the archives use them: a prompt token 1, an output token 2.
PROMPT_COST, OUTPUT_COST = 1.0, 2.0


def _spread(r: Result, lo: float, hi: float) -> float:
    """Output tokens of request `r` that arrived in [lo, hi), spread evenly from its first token
    to its end (the rate of decode is steady; the first token at TTFT)."""
    assert r.ttft is not None and r.e2e is not None
    first, end, n = r.sent + r.ttft, r.sent + r.e2e, r.output_tokens
    if n <= 1 or end <= first:
        return float(n) if lo <= end < hi else 0.0
    inside = max(0.0, min(hi, end) - max(lo, first))
    return (1 if lo <= first < hi else 0) + (n - 1) * inside / (end - first)


def summarize(phase: dict, records: list[Result], start: float, seconds: float, bin_s: float) -> dict:
    """One phase's figures; a request's tenant is its `system`."""
    ok = [r for r in records if r.error is None and r.e2e is not None and r.ttft is not None]
    end = start + seconds
    tenants = sorted(phase["clients"])
    tokens = {t: sum(_spread(r, start, end) for r in ok if r.system == t) for t in tenants}
    # Weighted service in the window: prompt tokens when the first token came, outputs as spread.
    prompts = {
        t: sum(r.input_len for r in ok if r.system == t and start <= r.sent + (r.ttft or 0) < end) for t in tenants
    }
    service = {t: PROMPT_COST * prompts[t] + OUTPUT_COST * tokens[t] for t in tenants}
    bins = []
    for i in range(int(seconds // bin_s)):
        lo = start + i * bin_s
        bins.append({t: round(sum(_spread(r, lo, lo + bin_s) for r in ok if r.system == t), 1) for t in tenants})
    b = [r for r in ok if r.system == "B"]
    total = sum(tokens.values())
    return {
        "name": phase["name"],
        "model": phase["model"],
        "clients": phase["clients"],
        "requests": {t: sum(r.system == t for r in ok) for t in tenants},
        "errors": sum(r.error is not None for r in records),
        "B": {
            "n": len(b),
            **{f"{m}_p{q}": pct([getattr(r, m) for r in b], q) for m in ("ttft", "e2e") for q in (50, 99)},
            "tpot_p50": pct([r.tpot for r in b if r.tpot is not None], 50),
            "output_tokens_mean": statistics.mean(r.output_tokens for r in b) if b else None,
        },
        "throughput_tok_s": round(total / seconds, 1),
        "tokens": {t: round(v, 1) for t, v in tokens.items()},
        "service": {t: round(v, 1) for t, v in service.items()},
        "share": {t: round(v / total, 4) if total else None for t, v in tokens.items()},
        "bins": bins,
        "records": [asdict(r) for r in records],
    }


def goals(phases: list[dict], bound: dict | None = None) -> dict:
    """The fair-share targets (docs/fair-share.md), from the phases' figures (None where a phase is missing); with the
    decode-step `bound` (step_bound below), what bounds the e2e ratio beside them."""
    by = {p["name"]: p for p in phases}
    alone, fcfs, fair, weighted = (by.get(n) for n in ("B alone", "fcfs", "fair", "fair 2:1"))

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    out = {}
    if alone and fair:
        r = ratio(fair["B"]["e2e_p50"], alone["B"]["e2e_p50"])
        out["B p50 e2e under fair / alone (<= 1.5)"] = {"value": r, "met": r is not None and r <= 1.5}
        r = ratio(fair["B"]["ttft_p99"], alone["B"]["ttft_p99"])
        out["B p99 TTFT under fair / alone (<= 2)"] = {"value": r, "met": r is not None and r <= 2.0}
        r = ratio(fair["B"].get("tpot_p50"), alone["B"].get("tpot_p50"))
        out["B p50 time per output token under fair / alone (no goal: the step's cost)"] = {"value": r, "met": None}
    if bound:
        out[
            f"decode step, {bound['max_num_seqs']} rows / 1 row ({bound['step_ms_full']} / {bound['step_ms_1_row']} ms;"
            " no goal: the floor of B's e2e ratio)"
        ] = {"value": bound["ratio"], "met": None}
    if weighted:
        r = ratio(weighted["service"].get("A"), weighted["service"].get("B"))
        out["A:B weighted service under weights 2:1 (2 +- 5 %)"] = {
            "value": r,
            "met": r is not None and abs(r / 2 - 1) <= 0.05,
        }
    if fair and fcfs:
        r = ratio(fair["throughput_tok_s"], fcfs["throughput_tok_s"])
        out["output tok/s fair / fcfs (>= 0.95)"] = {"value": r, "met": r is not None and r >= 0.95}
    return out


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(report: dict) -> str:
    header = ["phase", "clients", "B requests", "B p50 TTFT (s)", "B p99 TTFT (s)", "B p50 e2e (s)", "B p99 e2e (s)"]
    rows = []
    for p in report["phases"]:
        b, share = p["B"], p["share"].get("B")
        rows.append(
            [p["name"], ", ".join(f"{t} {n}" for t, n in p["clients"].items()), b["n"]]
            + [_s(b[k]) for k in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99")]
            + [f"{p['throughput_tok_s']:.1f}", "-" if share is None else f"{share:.3f}"]
        )
    lines = markdown_table([*header, "output tok/s", "B's token share"], rows)
    lines.append("")
    for goal, v in report["goals"].items():
        verdict = "" if v["met"] is None else f" ({'met' if v['met'] else 'not met'})"
        lines.append(f"- {goal}: {v['value']}{verdict}")
    return "\n".join(lines)


def plot(phases: list[dict], path: str, bin_s: float) -> None:
    plt = pyplot()
    fig, (share, rate, latency) = plt.subplots(1, 3, figsize=(16, 4.2))
    for i, p in enumerate(phases):
        xs = [(k + 0.5) * bin_s for k in range(len(p["bins"]))]
        style = {"color": f"C{i}", "label": p["name"]}
        rate.plot(xs, [sum(b.values()) / bin_s for b in p["bins"]], marker=".", **style)
        if "A" in p["clients"]:
            share.plot(xs, [b.get("B", 0) / (sum(b.values()) or 1) for b in p["bins"]], marker="o", **style)
    share.axhline(1 / 3, color="grey", linestyle=":", label="1/3 (weights 2:1)")
    share.set(xlabel="seconds into the phase", ylabel="B's share of output tokens", title="Token share over time")
    share.set_ylim(0, 0.6)
    share.legend()
    rate.set(xlabel="seconds into the phase", ylabel="output tokens/s, all tenants", title="Throughput over time")
    rate.legend()
    names = [p["name"] for p in phases]
    width = 0.2
    for j, (key, label) in enumerate(
        [("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"), ("e2e_p50", "e2e p50"), ("e2e_p99", "e2e p99")]
    ):
        xs = [i + (j - 1.5) * width for i in range(len(names))]
        latency.bar(xs, [p["B"][key] or 0 for p in phases], width, label=label)
    latency.set_xticks(range(len(names)), names)
    latency.set(ylabel="seconds", title="Tenant B's latency (B floods too in 'fair 2:1')")
    latency.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def step_bound(max_num_seqs: int = 16, context: int = 120, steps: int = 20, rounds: int = 3) -> dict:
    """Median decode step (ms) with 1 row and with `max_num_seqs` rows, and their ratio: the default
    model as the archives run it, `context` near the benchmark's mean (80 + 40 tokens decoded
    halfway); the two sizes alternate over `rounds`, so a drift of the machine falls on both."""
    from orcaserve.bench.slo.slo import decode_steps
    from orcaserve.scheduler import Engine
    from orcaserve.scheduler.model.loader import default_model_path

    engine = Engine.from_pretrained(
        default_model_path(), max_num_seqs=max_num_seqs, kv_cache_memory=256 << 20, enable_prefix_caching=False
    )
    rng = random.Random(0)
    decode_steps(engine, max_num_seqs, context, 3, rng)  # warm-up: lazy initialisation, caches
    times: dict[int, list[float]] = {1: [], max_num_seqs: []}
    for _ in range(rounds):
        for rows in times:
            times[rows] += decode_steps(engine, rows, context, steps, rng)
    one, full = (statistics.median(times[r]) * 1e3 for r in (1, max_num_seqs))
    return {
        "max_num_seqs": max_num_seqs,
        "context": context,
        "steps": steps * rounds,
        "step_ms_1_row": round(one, 2),
        "step_ms_full": round(full, 2),
        "ratio": round(full / one, 3),
    }
