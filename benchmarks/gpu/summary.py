"""The GPU check's summary (summary.json, engine.json in the results folder): per step pass /
fail / timeout / skipped, the key figures of each step's JSON, the SM-busy samples of
`nvidia-smi dmon` over the engine's end-to-end windows; rewritten
after every step, so a run cut short still leaves one (docs/kernels.md "GPU check")."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import xml.etree.ElementTree as ET
from typing import Any


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--results", required=True, help="the check's results folder")
    ap.add_argument("--work", required=True, help="its scratch folder (preflight.json, steps.tsv, step JSONs)")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--budget", type=int, required=True, help="seconds")
    ap.add_argument("--elapsed", type=int, required=True, help="seconds so far")


def run(args: argparse.Namespace) -> dict:
    results, work, dry, budget, elapsed = args.results, args.work, args.dry, args.budget, args.elapsed

    def load(path):
        try:
            with open(path) as f:
                return json.load(f)
        except Exception:
            return None

    def pick(d: dict, keys: str) -> dict:
        return {k: d.get(k) for k in keys.split()}

    pre = load(os.path.join(work, "preflight.json")) or {}
    steps = {}
    for line in open(os.path.join(work, "steps.tsv")):
        name, status, rc, secs, limit, reason = (line.rstrip("\n").split("\t") + [""] * 6)[:6]
        steps[name] = {
            "status": status,
            "rc": int(rc) if rc.lstrip("-").isdigit() else None,
            "seconds": int(secs) if secs.isdigit() else None,
            "timeout_s": int(limit) if limit.isdigit() else None,
            "reason": reason or None,
        }
    fig: dict[str, Any] = {}
    xml = os.path.join(work, "tests.xml")
    if os.path.exists(xml):
        try:
            root = ET.parse(xml).getroot()
            cases = root.iter("testcase")
            t: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "failed_sections": []}
            for case in cases:
                if case.find("failure") is not None or case.find("error") is not None:
                    t["failed"] += 1
                    t["failed_sections"].append(case.get("name"))
                elif case.find("skipped") is not None:
                    t["skipped"] += 1
                else:
                    t["passed"] += 1
            fig["tests"] = t
        except Exception as e:
            fig["tests"] = {"error": f"{type(e).__name__}: {e}"}
    k = load(os.path.join(results, "kernels.json"))
    if k:
        fig["kernels"] = pick(k, "device dtype copy_gbps_measured peak_gbps_datasheet num_sms elapsed_s")
        fig["kernels"]["layouts"] = {
            f"{r.get('heads')}x{r.get('kv_heads')}x{r.get('head_dim')}": dict(
                r.get("summary", {}), truncated=r.get("truncated", False)
            )
            for r in k.get("runs", [])
        }
    fu = load(os.path.join(results, "gpu-fused.json"))
    if fu:
        fig["fused"] = pick(fu, "device dtype all_ok truncated elapsed_s per_layer skipped")
    lo = load(os.path.join(results, "gpu-lora.json"))
    if lo:
        fig["lora"] = pick(lo, "device dtype adapters rank all_ok truncated elapsed_s per_step skipped")
    le = load(os.path.join(results, "gpu-lora-engine.json"))
    if le:
        fig["lora_engine"] = pick(le, "device dtype adapters rank all_equal tokens_equal_required elapsed_s skipped")
        fig["lora_engine"]["tok_s"] = {k: s.get("tok_s") for k, s in le.get("sides", {}).items()}
    te = load(os.path.join(results, "gpu-ternary.json"))
    if te:
        fig["ternary"] = pick(te, "device all_exact truncated elapsed_s skipped")
        fig["ternary"]["gbps"] = {f"{r['projection']}/T={r['tokens']}": r.get("gbps") for r in te.get("rows", [])}
    sp = load(os.path.join(results, "gpu-spec.json"))
    if sp:
        fig["spec"] = pick(sp, "device dtype all_equal speedup elapsed_s skipped")
        fig["spec"]["tok_s"] = {k: s.get("tok_s") for k, s in sp.get("sides", {}).items()}
    engine = {}
    for part in "exact throughput generate_batch real graphs graphs_8b generate_batch_8b startup".split():
        d = load(os.path.join(work, f"{part}.json"))
        if d is not None:
            engine[part] = d
    if engine:
        with open(os.path.join(results, "engine.json"), "w") as f:
            json.dump(engine, f, indent=1)
    if "exact" in engine:
        keys = "arch dtype backend verdict exact_sequences requests first_token_agreement steps_by_num_splits"
        fig["engine_exact"] = [pick(c, keys) for c in engine["exact"].get("cases", [])]
    tp = {}
    for part in ("throughput", "generate_batch"):
        for r in (engine.get(part) or {}).get("runs", []):
            key = f"{r['config']}/{r['system']}"
            tp[key] = {
                k: r.get(k)
                for k in ("useful_tok_s", "useful_tok_s_excl_startup", "wall_s", "startup_s", "error")
                if r.get(k) is not None
            }
    if tp:
        for other, key in (("generate", "vs_padded_generate"), ("generate_batch", "vs_generate_batch")):
            base = {c.split("/")[0]: v.get("useful_tok_s") for c, v in tp.items() if c.endswith("/" + other)}
            for c, v in tp.items():
                b = base.get(c.split("/")[0])
                if b and v.get("useful_tok_s") and not c.endswith("/" + other):
                    v[key] = round(v["useful_tok_s"] / b, 2)
        fig["throughput_useful_tok_s"] = tp
        w = (engine.get("throughput") or {}).get("workload")
        if w:
            fig["throughput_workload"] = w
    if "graphs" in engine:  # CUDA graphs on vs off (gpu/graphs.py)
        g = engine["graphs"]
        fig["graphs"] = pick(g, "speedup_end_to_end speedup_decode exact_fp32 skipped")
        for side in ("on", "off"):
            d = g.get(side) or {}
            fig["graphs"][side] = pick(d, "startup_s graphs_captured end_to_end")
            fig["graphs"][side]["decode_median_ms"] = {str(r["batch"]): r["median_ms"] for r in d.get("decode", [])}
    samples: list[tuple[float, float]] = []  # (epoch second, SM busy %) from nvidia-smi dmon -o DT
    if os.path.exists(os.path.join(work, "dmon.txt")):
        for line in open(os.path.join(work, "dmon.txt")):
            cols = line.split()
            try:
                samples.append((time.mktime(time.strptime(cols[0] + " " + cols[1], "%Y%m%d %H:%M:%S")), float(cols[3])))
            except (IndexError, ValueError):
                continue

    def busy(window):
        xs = sorted(sm for t, sm in samples if window and int(window[0]) <= t <= window[1])
        return (
            {"samples": len(xs), "mean_pct": round(sum(xs) / len(xs), 1), "median_pct": xs[len(xs) // 2]}
            if xs
            else None
        )

    def orca_window(part):
        r = next((r for r in (engine.get(part) or {}).get("runs", []) if r.get("system") == "orcaserve"), None)
        return r and r.get("window")

    # How busy the SMs were (nvidia-smi dmon) over the engine's end-to-end windows.
    g_on = (engine.get("graphs") or {}).get("on") or {}
    g8 = (engine.get("graphs_8b") or {}).get("on") or {}
    fig["sm_busy"] = {
        "throughput": busy(orca_window("throughput")),
        "graphs_end_to_end": busy((g_on.get("end_to_end") or {}).get("window")),
        "8b_end_to_end": busy((g8.get("end_to_end") or {}).get("window")),
    }
    if "real" in engine:
        r = engine["real"]
        keys = "dtype verdict exact_sequences first_answer"
        fig["real_model"] = r.get("skipped") or [pick(c, keys) for c in r.get("cases", [])]
    summary = {
        "gpu": pre.get("gpu", "none (dry run on CPU)" if dry else None),
        "dry_run": dry,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "elapsed_s": elapsed,
        "budget_s": budget,
        **pick(pre, "python versions capability sms gpu_mem_gib"),
        "api_probes": pre.get("probes"),
        "ready": pre.get("ready"),
        "not_ready_reason": pre.get("not_ready_reason") or None,
        "steps": steps,
        "figures": fig,
        # the correctness steps passed (tests, engine exactness; the real model where it ran)
        "correctness_pass": all(steps.get(n, {}).get("status") == "pass" for n in ("tests", "engine_exact"))
        and steps.get("engine_real", {}).get("status") in ("pass", "skipped", None),
        # every step ran to its end; only the real model may be skipped (it cannot travel)
        "all_steps_completed": bool(steps)
        and all(s["status"] == "pass" or (n == "engine_real" and s["status"] == "skipped") for n, s in steps.items()),
    }
    with open(os.path.join(results, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: summary[k] for k in ("gpu", "correctness_pass", "all_steps_completed", "steps")}))
    return summary


def kernels_summary(run: dict) -> dict:
    """Key figures of one layout of `gpu kernels`: decode share of peak at contexts >= 4k, the split-K verdict."""
    dec = [r for r in run.get("decode", []) if "heuristic_ms" in r]
    pcts = sorted(r["pct_peak"] for r in dec if r["context"] >= 4096 and r.get("pct_peak") is not None)
    s: dict = {"decode_shapes": len(dec)}
    if pcts:
        s.update(
            decode_pct_peak_ctx4k_median=statistics.median(pcts),
            decode_pct_peak_ctx4k_max=pcts[-1],
            decode_pct_peak_ctx4k_min=pcts[0],
            decode_ctx4k_shapes_at_70pct=sum(p >= 70 for p in pcts),
            decode_ctx4k_shapes=len(pcts),
        )
    if dec:
        ratios = [r["heuristic_over_best"] for r in dec]
        w = max(dec, key=lambda r: r["heuristic_over_best"])
        keys = ("batch", "context", "programs", "heuristic_splits", "best_splits", "heuristic_over_best")
        s.update(
            max_diff_across_splits=max(r.get("max_diff_across_splits", 0.0) for r in dec),
            split_heuristic_within_5pct=sum(x <= 1.05 for x in ratios),
            split_heuristic_within_10pct=sum(x <= 1.10 for x in ratios),
            split_heuristic_worst_ratio=w["heuristic_over_best"],
            split_heuristic_worst_shape=f"B={w['batch']} ctx={w['context']} heuristic {w['heuristic_splits']} "
            f"best {w['best_splits']}",
            # Where the heuristic and the measurement disagree by > 10%: the tuning input.
            split_disagreements=[{k: r[k] for k in keys} for r in dec if r["heuristic_over_best"] > 1.10],
        )
    pre = run.get("prefill", [])
    if pre:
        s["prefill_tflops_max"] = max(r["tflops"] for r in pre)
        if any(r.get("sdpa_ms") for r in pre):
            s["prefill_vs_sdpa"] = {r["label"]: r["sdpa_ms"] / r["ms"] for r in pre if r.get("sdpa_ms")}
    return s
