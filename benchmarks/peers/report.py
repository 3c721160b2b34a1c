"""Table, chart and doc section (docs/peers.md) of benchmarks/peers/run.py (orcaserve vs vLLM's
CPU backend and llama.cpp's server)."""

from __future__ import annotations

import os
import statistics

from orcaserve.bench.result import markdown_table, pyplot, update_doc
from orcaserve.bench.serve import engine_counts
from orcaserve.bench.serve.cpu_probe import table as cpu_table

BEGIN, END = "<!-- peers-results:begin -->", "<!-- peers-results:end -->"
SYSTEMS = ("orcaserve", "vllm", "llamacpp")
PEERS = SYSTEMS[1:]  # a cell has one peer: vLLM for fp32/bf16, llama.cpp for gguf (parts.applies)
LABEL = {"orcaserve": "orcaserve", "vllm": "vLLM", "llamacpp": "llama.cpp", None: "-"}
WORKLOADS = ("offline", "http")
DTYPES = ("fp32", "bf16", "gguf", "gguf-a8", "gguf-a8-bf16")
# orcaserve's gguf-a8 cells (the GGUF with int8 activations; -bf16: the rest of the model in bf16)
# are compared with their peer's gguf cell: llama.cpp computes with 8-bit activations on the file too.
PEER_DTYPE = {"gguf-a8": "gguf", "gguf-a8-bf16": "gguf"}


def _f(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def _tps(r: dict | None) -> str:
    if r is None:
        return "-"
    if r.get("error"):
        return f"error: {r['error'][:60]}"
    runs = r.get("runs_tok_s")
    return _f(r.get("output_tok_s")) + (f" ({', '.join(_f(v) for v in runs)})" if runs else "")


def _lat(r: dict | None, workload: str) -> str:
    if r is None or r.get("error") or workload != "http":
        return "-"
    return f"{_f(r.get('ttft_p50'), '.2f')} / {_f(r.get('e2e_p50'), '.2f')}"


MEDIANS = ("output_tok_s", "ttft_p50", "e2e_p50", "tpot_p50", "ttft_p99", "e2e_p99")


def model_of(r: dict) -> str:
    return r.get("model", "smollm2")  # runs before the size axis were all SmolLM2


def models_in(results: list[dict]) -> list[str]:
    """The sizes in `results`, in the order they first appear."""
    return list(dict.fromkeys(model_of(r) for r in results))


def find(results: list[dict], system: str, dtype: str, workload: str, model: str = "smollm2") -> dict | None:
    """The cell's result; over repeated runs, the medians of each figure (`runs_tok_s`: every
    run's tok/s) or the first failed run."""
    cell = (model, system, dtype, workload)
    runs = [r for r in results if (model_of(r), r["system"], r["dtype"], r["workload"]) == cell]
    if len(runs) <= 1:
        return runs[0] if runs else None
    failed = [r for r in runs if r.get("error")]
    if failed:
        return failed[0]
    agg = dict(runs[0])
    for key in MEDIANS:
        values = [r[key] for r in runs if r.get(key) is not None]
        agg[key] = statistics.median(values) if values else None
    agg["runs_tok_s"] = [r.get("output_tok_s") for r in runs]
    return agg


def peer_of(results: list[dict], dtype: str, workload: str, model: str = "smollm2") -> tuple[str | None, dict | None]:
    """The cell's peer system and its result (PEER_DTYPE: gguf-a8's is the gguf cell); None where
    no peer ran."""
    for peer in PEERS:
        if (r := find(results, peer, PEER_DTYPE.get(dtype, dtype), workload, model)) is not None:
            return peer, r
    return None, None


def ratios(results: list[dict]) -> dict:
    """orcaserve / the cell's peer, output tok/s per size, workload and dtype ("1b/http/gguf"),
    where both ran without error."""
    out = {}
    for m in models_in(results):
        for w in WORKLOADS:
            for d in DTYPES:
                a, (_, b) = find(results, "orcaserve", d, w, m), peer_of(results, d, w, m)
                if a and b and a.get("output_tok_s") and b.get("output_tok_s"):
                    out[f"{m}/{w}/{d}"] = a["output_tok_s"] / b["output_tok_s"]
    return out


def markdown(report: dict) -> str:
    s, results = report["settings"], report["results"]
    limits = ", ".join(f"{k} {v}" for k, v in s["engine"].items())
    lines = [f"Measured {report['date']} on {report['machine']['summary']}; {report['versions_summary']}."]
    lines += ["", "```", report["command"], "```", ""]
    lines += [
        f"offline: {s['offline']['num_prompts']} prompts; http: {s['http']['num_requests']} requests, "
        f"{s['http']['concurrency']} closed-loop clients. Engine limits: {limits}.",
        "",
    ]
    header = ["model", "workload", "dtype", "orcaserve tok/s", "peer", "peer tok/s", "orcaserve / peer"]
    header += ["orcaserve p50 TTFT / e2e (s)", "peer p50 TTFT / e2e (s)"]
    rows, rat = [], ratios(results)
    for m in models_in(results):
        for w in WORKLOADS:
            for d in DTYPES:
                a, (peer, b) = find(results, "orcaserve", d, w, m), peer_of(results, d, w, m)
                if a is None and (b is None or d in PEER_DTYPE):  # no row for a peer's figure only
                    continue
                ratio = rat.get(f"{m}/{w}/{d}")
                ratio_s = _f(ratio, ".2f") + "x" if ratio else "-"
                rows.append([m, w, d, _tps(a), LABEL[peer], _tps(b), ratio_s, _lat(a, w), _lat(b, w)])
    lines += markdown_table(header, rows)
    if any(r["dtype"] in PEER_DTYPE for r in results):
        lines += [
            "",
            "gguf-a8: orcaserve on the GGUF with `activations: int8` (dtype fp32); gguf-a8-bf16: the same with "
            "dtype bf16 (attention, element-wise work and KV cache in bf16); their peer is the gguf cell's.",
        ]
    for r in results:  # where each HTTP server spent its CPU (benchmark-serving.md, "Where the serving path...")
        if r.get("workload") == "http" and r.get("cpu"):
            lines += ["", f"**{model_of(r)} {r['system']} {r['dtype']}**", "", cpu_table(r["cpu"], top=8)]
            lines += ["", engine_counts.line(r["engine"])] if r.get("engine") else []
    if errors := [
        f"{model_of(r)} {r['system']} {r['dtype']} {r['workload']}: {r['error'][:200]}"
        for r in results
        if r.get("error")
    ]:
        lines += ["", "Errors: " + "; ".join(errors)]
    if report.get("png"):
        lines += ["", f"![orcaserve vs its peers]({os.path.basename(report['png'])})"]
    return "\n".join(lines) + "\n"


def _bars(ax, results: list[dict], rat: dict, m: str, w: str, colors: dict, width: float) -> None:
    if not any(find(results, system, d, w, m) for system in SYSTEMS for d in DTYPES):
        ax.text(0.5, 0.5, "not run", transform=ax.transAxes, ha="center", va="center", color="dimgray")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    for system in SYSTEMS:
        xs, ys = [], []
        for i, d in enumerate(DTYPES):
            r = find(results, system, d, w, m)
            if r and r.get("output_tok_s"):
                xs.append(i + (-0.5 if system == "orcaserve" else 0.5) * width)
                ys.append(r["output_tok_s"])
        if xs:
            bars = ax.bar(xs, ys, width, color=colors[system], label=LABEL[system])
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
    for i, d in enumerate(DTYPES):
        if ratio := rat.get(f"{m}/{w}/{d}"):
            ax.annotate(
                f"{ratio:.2f}x",
                (i, 0),
                xytext=(0, -28),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                color="dimgray",
            )
    ax.set_xticks(range(len(DTYPES)), DTYPES, fontsize=8)  # five cells: "gguf-a8-bf16" the longest
    ax.set_ylabel("output tokens/s")
    ax.margins(y=0.15)
    ax.grid(True, axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a workload no system ran has no bars
        ax.legend(fontsize=8)


def plot(report: dict, path: str) -> None:
    plt = pyplot()
    models = models_in(report["results"]) or ["smollm2"]
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 4 * len(models)), dpi=100, squeeze=False)
    colors = {"orcaserve": "tab:blue", "vllm": "tab:orange", "llamacpp": "tab:green"}
    width = 0.38  # two bars a cell: orcaserve and the cell's one peer
    rat = ratios(report["results"])
    for row, m in zip(axes, models):
        for ax, w in zip(row, WORKLOADS):
            _bars(ax, report["results"], rat, m, w, colors, width)
            where = {"offline": "offline (all prompts at once)", "http": "HTTP streaming (closed loop)"}[w]
            ax.set_title(f"{m}: {where}", fontsize=10)
    fig.suptitle(
        f"orcaserve vs vLLM CPU and llama.cpp, {report['machine'].get('cores')} CPU cores (grey: orcaserve / peer)",
        fontsize=10,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def write_doc(path: str, text: str) -> None:
    """Write `text` between the markers of the doc at `path`."""
    update_doc(path, text, BEGIN, END)
