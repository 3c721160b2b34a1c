"""The report of benchmarks/serve/bench.py: per-run summaries, the verdict on ORCA's two claims,
the Markdown table and the latency-throughput plot."""

from __future__ import annotations

import os

from orcaserve.bench.result import markdown_table, pct, pyplot

BEGIN, END = "<!-- serve-results:begin -->", "<!-- serve-results:end -->"


def summarize(results: list, rate: float | None, concurrency: int | None) -> dict:
    ok = [r for r in results if r.error is None]
    out: dict = {
        "system": results[0].system if results else None,
        "rate": rate,
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
    }
    if not ok:
        return out
    first = min(r.sent for r in ok)
    last = max(r.sent + r.e2e for r in ok)
    span = max(last - first, 1e-9)
    tokens = sum(r.output_tokens for r in ok)
    out.update(
        duration_s=span,
        request_throughput=len(ok) / span,
        output_tokens_per_s=tokens / span,
        output_tokens=tokens,
        input_tokens=sum(max(r.input_len, 0) for r in ok),
    )
    for name in ("ttft", "tpot", "e2e"):
        vals = [getattr(r, name) for r in ok if getattr(r, name) is not None]
        out[name] = {"mean": sum(vals) / len(vals) if vals else None, **{f"p{q}": pct(vals, q) for q in (50, 90, 99)}}
    # Saturated: the server no longer keeps up with the offered load (throughput falls behind the
    # rate, or latency keeps growing over the run as the queue builds up).
    # Unsaturated, the run lasts about (arrival span + a typical latency): the server completes
    # requests as fast as they arrive. Saturated, a queue builds: the run drains long after the
    # last arrival and later requests wait longer than early ones.
    if rate is not None:
        out["saturated"] = None  # too few requests to tell
    if rate is not None and len(ok) >= 8:
        arrivals = sorted(ok, key=lambda r: r.sent)
        third = max(len(arrivals) // 3, 1)
        early = pct([r.e2e for r in arrivals[:third]], 50)
        late = pct([r.e2e for r in arrivals[-third:]], 50)
        assert early is not None and late is not None  # 8 or more answered requests
        arrival_span = max(arrivals[-1].sent - arrivals[0].sent, 1e-9)
        realized = (len(ok) - 1) / arrival_span
        served = (len(ok) - 1) / max(span - out["e2e"]["p50"], 1e-9)
        out.update(
            offered_rate=rate,
            realized_rate=realized,
            served_rate=served,
            latency_growth=late / early if early else None,
        )
        out["saturated"] = bool(served < 0.8 * realized or (early and late > 2.0 * early))
    return out


# ---- verdict, table, plot --------------------------------------------------------------------
def verdict(summaries: list[dict], ours: str, baseline: str) -> dict | None:
    """ORCA's claim on this run: peak tokens/s ratio; p50 e2e at the baseline's unsaturated rates."""
    a = [s for s in summaries if s["system"] == ours and s.get("completed")]
    b = [s for s in summaries if s["system"] == baseline and s.get("completed")]
    if not a or not b:
        return None
    peak_a = max(s["output_tokens_per_s"] for s in a)
    peak_b = max(s["output_tokens_per_s"] for s in b)
    rows = []
    for sb in b:  # the rates where the baseline kept up
        sa = next((s for s in a if s.get("rate") == sb["rate"]), None)
        if sb.get("rate") is not None and sb.get("saturated") is False and sa is not None:
            x, y = sa["e2e"]["p50"], sb["e2e"]["p50"]
            rows.append({"rate": sb["rate"], ours: x, baseline: y, "lower": x < y})
    errors = sum(s["errors"] for s in summaries)
    return {
        "system": ours,
        "baseline": baseline,
        "peak_output_tokens_per_s": {ours: peak_a, baseline: peak_b},
        "peak_ratio": peak_a / peak_b if peak_b else None,
        "peak_ratio_at_least_3x": peak_b > 0 and peak_a >= 3 * peak_b,
        "p50_e2e_at_unsaturated_baseline_rates": rows,
        "p50_e2e_lower_at_all_unsaturated": bool(rows) and all(r["lower"] for r in rows),
        "errors": errors,
    }


_SAT = {True: "yes", False: "no"}


def _f(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(report: dict) -> str:
    rows = []
    for s in report["summaries"]:
        load = s["rate"] if s["rate"] is not None else f"c={s['concurrency']}"
        if not s.get("completed"):
            rows.append([s["system"], load, 0, s["errors"], *["-"] * 6])
            continue
        ttft, e2e = (
            " / ".join(_f(s[m][q]) for q in qs) for m, qs in (("ttft", ("p50", "p99")), ("e2e", ("p50", "p90", "p99")))
        )
        done = f"{s['completed']}/{s['requests']}"
        rows.append(
            [s["system"], load, done, s["errors"], _f(s["request_throughput"]), _f(s["output_tokens_per_s"], ".1f")]
        )
        rows[-1] += [ttft, _f(s["tpot"]["p50"], ".3f"), e2e, _SAT.get(s.get("saturated"), "-")]
    header = ["system", "rate (req/s)", "done", "errors", "req/s", "output tok/s", "TTFT p50 / p99 (s)"]
    header += ["TPOT p50 (s)", "e2e p50 / p90 / p99 (s)", "saturated"]
    lines = [f"Measured {report['date']} on {report['machine']['summary']}.", "", "```", report["command"], "```", ""]
    lines += [f"Workload: {report['workload']['description']}.", "", *markdown_table(header, rows)]
    v = report.get("verdict")
    if v:
        ours, base = v["system"], v["baseline"]
        peak = v["peak_output_tokens_per_s"]
        lines += [
            "",
            f"Peak output tokens/s: {ours} {peak[ours]:.1f}, {base} {peak[base]:.1f}: "
            f"**{_f(v['peak_ratio'])}x** (target >= 3x: {'met' if v['peak_ratio_at_least_3x'] else 'NOT met'}).",
        ]
        parts = [
            f"{r['rate']} req/s: {r[ours]:.2f} s vs {r[base]:.2f} s" for r in v["p50_e2e_at_unsaturated_baseline_rates"]
        ]
        lower = "yes" if v["p50_e2e_lower_at_all_unsaturated"] else "NO"
        where = f"p50 e2e where {base} is not saturated ({ours} vs {base}): "
        lines.append(
            f"{where}{'; '.join(parts)} (lower at every such rate: {lower})."
            if parts
            else f"{base} was saturated (or had too few requests to tell) at every rate: no p50 comparison below it."
        )
        lines.append(f"Errors: {v['errors']}.")
    if report.get("plot"):
        lines += ["", f"![latency vs throughput]({os.path.basename(report['plot'])})"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    colors = ["tab:blue", "tab:red", "tab:green", "tab:purple"]
    systems = list(dict.fromkeys(s["system"] for s in report["summaries"]))
    for ax, metric, title in ((axes[0], "e2e", "end-to-end latency"), (axes[1], "ttft", "time to first token")):
        for color, system in zip(colors, systems):
            pts = sorted(
                (s["output_tokens_per_s"], s[metric]["p50"], s[metric]["p99"], s["rate"] or s["concurrency"])
                for s in report["summaries"]
                if s["system"] == system and s.get("completed")
            )
            if not pts:
                continue
            x = [p[0] for p in pts]
            ax.plot(x, [p[1] for p in pts], "o-", color=color, label=f"{system} p50")
            ax.plot(x, [p[2] for p in pts], "s--", color=color, alpha=0.6, label=f"{system} p99")
            for p in pts:
                ax.annotate(
                    f"{p[3]:g}", (p[0], p[1]), textcoords="offset points", xytext=(3, 3), fontsize=7, color=color
                )
        ax.set_xlabel("achieved output tokens/s")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("orcaserve vs request-level batching (labels: offered req/s)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # plotted before --out is written
    fig.savefig(path)
    plt.close(fig)


def command_line(argv: list[str]) -> str:
    """This run's command, with the inference key replaced by `$KEY`."""
    shown = [
        "$KEY" if prev == "--key" else "--key=$KEY" if a.startswith("--key=") else a
        for prev, a in zip(["", *argv], argv)
    ]
    return "orcaserve-bench " + " ".join(a if " " not in a else repr(a) for a in shown)
