#!/usr/bin/env bash
# orcaserve vs the request-level baseline, side by side in one run of one TorchServe.
#
#   benchmarks/compare.sh                      # full sweep (about 10 min on 2 CPU cores)
#   RATES=0.5 NUM_REQUESTS=4 OUT=/tmp/cmp benchmarks/compare.sh   # quick smoke
#
# Builds both archives (orcaserve `smollm2`, baseline `smollm2-baseline`) into a scratch model
# store, starts TorchServe once on free loopback ports (token auth on, gRPC on free ports, own
# temp dir), registers both, runs benchmarks/serve.py with the same seeded Poisson sweep against
# both (systems interleaved per rate), then draws the baseline's batches. Writes into $OUT
# (default docs/): benchmark-serving.png, benchmark-serving-batches.png (the baseline's batches at
# the first rate), and the results section of benchmark-serving.md (when $OUT/benchmark-serving.md
# exists); the JSON report, benchmark-serving.json, into $RESULTS (default benchmarks/results/ when
# OUT is docs/, else $OUT).
# Settings (environment): RATES, NUM_REQUESTS (one count, or one per rate), INPUT_LEN, OUTPUT_LEN,
# SEED, BATCH_SIZE, MAX_BATCH_DELAY (baseline), DTYPE (both systems; default: their shared rule), ORCA_SET (orcaserve model-config overrides, e.g.
# "max_num_seqs=64 max_num_batched_tokens=512"), SYSTEMS (default both), OUT, RESULTS, WORK (scratch dir,
# kept), PY, EXTRA (more serve.py args).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
PY=$(command -v "$PY")
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
BIN=$(dirname "$PY")
RATES=${RATES:-0.5,1,2,4,8}
NUM_REQUESTS=${NUM_REQUESTS:-16,24,32,48,128}
INPUT_LEN=${INPUT_LEN:-8:128}
OUTPUT_LEN=${OUTPUT_LEN:-1:128}
SEED=${SEED:-0}
BATCH_SIZE=${BATCH_SIZE:-8}
MAX_BATCH_DELAY=${MAX_BATCH_DELAY:-100}
OUT=${OUT:-docs}
# JSON results live under benchmarks/results/; a scratch OUT keeps its JSON beside its pictures.
if [ "$OUT" = docs ]; then RESULTS=${RESULTS:-benchmarks/results}; else RESULTS=${RESULTS:-$OUT}; fi
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/orcaserve-compare.XXXXXX")}
EXTRA=${EXTRA:-}
ORCA_SET=${ORCA_SET:-}
# Both systems in one dtype: empty = each handler's default rule (the same: bf16 where native).
DTYPE=${DTYPE:-}
SYSTEMS=${SYSTEMS:-smollm2 smollm2-baseline}
mkdir -p "$OUT" "$RESULTS" "$WORK/tmp" "$WORK/logs"
WORK=$(cd "$WORK" && pwd)
STORE="$WORK/model-store"

echo "== building archives in $STORE"
SET_ARGS=()
for kv in $ORCA_SET; do SET_ARGS+=(--set "$kv"); done
BASE_ARGS=()
if [ -n "$DTYPE" ]; then SET_ARGS+=(--set "dtype=$DTYPE"); BASE_ARGS+=(--dtype "$DTYPE"); fi
"$PY" -m orcaserve.handler.archive --name smollm2 --export-path "$STORE" --format no-archive --force \
    "${SET_ARGS[@]}" >/dev/null
"$PY" benchmarks/baseline/archive.py --export-path "$STORE" \
    --batch-size "$BATCH_SIZE" --max-batch-delay "$MAX_BATCH_DELAY" "${BASE_ARGS[@]}" >/dev/null

read -r INF MGMT MET GRPC1 GRPC2 < <("$PY" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
EOF
)
cat > "$WORK/config.properties" <<EOF
inference_address=http://127.0.0.1:$INF
management_address=http://127.0.0.1:$MGMT
metrics_address=http://127.0.0.1:$MET
grpc_inference_port=$GRPC1
grpc_management_port=$GRPC2
model_store=$STORE
enable_model_api=true
allowed_urls=file://$STORE/[^/?#]+
default_workers_per_model=1
install_py_dep_per_model=false
job_queue_size=1000
default_response_timeout=900
vmargs=-Xmx2g -XX:+ExitOnOutOfMemoryError -Djava.io.tmpdir=$WORK/tmp
EOF

echo "== starting TorchServe (logs: $WORK/logs, $WORK/torchserve.out)"
(cd "$WORK" && TMPDIR="$WORK/tmp" LOG_LOCATION="$WORK/logs" METRICS_LOCATION="$WORK/logs" \
    exec setsid "$BIN/torchserve" --start --foreground --ncs --ts-config "$WORK/config.properties" \
    --model-store "$STORE" >"$WORK/torchserve.out" 2>&1) &
TS_PID=$!
cleanup() {
    kill -TERM -- "-$TS_PID" 2>/dev/null || true
    sleep 3
    kill -KILL -- "-$TS_PID" 2>/dev/null || true
}
trap cleanup EXIT

key() { "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]]['key'])" "$WORK/key_file.json" "$1"; }
for _ in $(seq 1 120); do
    if [ -s "$WORK/key_file.json" ] && curl -sf -o /dev/null -H "Authorization: Bearer $(key inference)" \
        "http://127.0.0.1:$INF/ping"; then
        break
    fi
    kill -0 "$TS_PID" 2>/dev/null || { tail -50 "$WORK/torchserve.out"; exit 1; }
    sleep 1
done
MODEL_ARGS=()
for name in $SYSTEMS; do
    MODEL_ARGS+=(--model "$name")
    echo "== registering $name"
    curl -sf -X POST -H "Authorization: Bearer $(key management)" \
        "http://127.0.0.1:$MGMT/models?url=$name&initial_workers=1&synchronous=true" >/dev/null \
        || { echo "registering $name failed"; tail -80 "$WORK/torchserve.out"; exit 1; }
done

CMD="benchmarks/compare.sh  # RATES=$RATES NUM_REQUESTS=$NUM_REQUESTS${ORCA_SET:+ ORCA_SET='$ORCA_SET'} INPUT_LEN=$INPUT_LEN OUTPUT_LEN=$OUTPUT_LEN SEED=$SEED BATCH_SIZE=$BATCH_SIZE MAX_BATCH_DELAY=$MAX_BATCH_DELAY${DTYPE:+ DTYPE=$DTYPE}${EXTRA:+ EXTRA='$EXTRA'}"
DOC=()
[ -f "$OUT/benchmark-serving.md" ] && DOC=(--update-doc "$OUT/benchmark-serving.md")
echo "== sweep: rates $RATES req/s, $NUM_REQUESTS requests per rate and system"
status=0
# shellcheck disable=SC2086
SERVE_BENCH_COMMAND="$CMD" "$PY" benchmarks/serve.py --url "http://127.0.0.1:$INF" --key="$(key inference)" \
    "${MODEL_ARGS[@]}" --rates "$RATES" --num-requests "$NUM_REQUESTS" \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --seed "$SEED" \
    --out "$RESULTS/benchmark-serving.json" --plot "$OUT/benchmark-serving.png" "${DOC[@]}" $EXTRA || status=$?
if [ -s "$RESULTS/benchmark-serving.json" ] && [[ " $SYSTEMS " == *" smollm2-baseline "* ]]; then
    FIRST_RATE=${RATES%%,*}
    "$PY" benchmarks/plot_schedule.py baseline "$RESULTS/benchmark-serving.json" --system smollm2-baseline \
        --rate "$FIRST_RATE" --max-requests 24 --png "$OUT/benchmark-serving-batches.png" || status=1
fi
echo "== done (exit $status): $RESULTS/benchmark-serving.json, $OUT/benchmark-serving{,-batches}.png; scratch: $WORK"
exit $status
