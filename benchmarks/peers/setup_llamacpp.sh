#!/usr/bin/env bash
# llama.cpp's server built from source, as the third peer for benchmarks/peers/run.py.
#
#   benchmarks/peers/setup_llamacpp.sh            # idempotent: does nothing once its stamp exists
#   FORCE=1 benchmarks/peers/setup_llamacpp.sh    # rebuild
#   LLAMACPP_SRC=/path/to/llama.cpp benchmarks/peers/setup_llamacpp.sh   # build that tree instead
#
# Makes, next to this script (git-ignored): .llamacpp/bin/{llama-server,llama-quantize} and their
# shared libraries, and .llamacpp/convert/ (llama.cpp's own convert_hf_to_gguf.py with its
# conversion/ and gguf-py/, which run.py uses to turn the random 1B checkpoint into a GGUF the way
# llama.cpp users make theirs). Source: PyPI's llama-cpp-python sdist, which vendors the whole
# llama.cpp tree (vendor/llama.cpp); about 8 minutes of 2 cores to build.
#
# Trap (docs/peers.md "llama.cpp recipe"): with GGML_NATIVE=ON the server died with SIGILL in
# libggml-cpu on the Sapphire Rapids VM, so the ISA flags are set from /proc/cpuinfo instead and
# AMX stays off (say so beside its figures on AMX machines).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-python3}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
OUT="$HERE/.llamacpp"
STAMP="$OUT/.peers-setup-done"

say() { echo "setup_llamacpp: $*"; }
has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
flags="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)"
flags+=" -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512_vbmi) -DGGML_AVX512_VNNI=$(has avx512_vnni)"
flags+=" -DGGML_AVX512_BF16=$(has avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
WANT="llama-cpp-python==$VERSION $flags"

built=""
if [ -z "${FORCE:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$OUT/bin/llama-server" ]; then
    built=1
    if [ -f "$OUT/convert/convert_hf_to_gguf.py" ]; then
        say "already set up (stamp $STAMP): nothing to do"
        exit 0
    fi
    say "built already; fetching the source once more for its GGUF converter only"
fi

SRC=${LLAMACPP_SRC:-}
if [ -z "$SRC" ]; then
    tmp=$(mktemp -d)
    say "downloading llama-cpp-python==$VERSION (sdist) into $tmp"
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp" 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    SRC=$(echo "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
fi
copy_converter() {
    rm -rf "$OUT/convert"
    mkdir -p "$OUT/convert"
    cp -a "$SRC/convert_hf_to_gguf.py" "$SRC/gguf-py" "$OUT/convert/"
    if [ -d "$SRC/conversion" ]; then cp -a "$SRC/conversion" "$OUT/convert/"; fi
    say "converter: $OUT/convert/convert_hf_to_gguf.py"
}
if [ -n "$built" ]; then
    copy_converter
    exit 0
fi
say "building $SRC with: $flags"
# shellcheck disable=SC2086 # $flags is a list of cmake options
cmake -S "$SRC" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON $flags >/dev/null
ninja -C "$SRC/build" -j"$(nproc)" llama-server llama-quantize
rm -rf "$OUT"
mkdir -p "$OUT"
cp -a "$SRC/build/bin" "$OUT/bin"
copy_converter
"$OUT/bin/llama-server" --version 2>&1 | head -2
echo "$WANT" >"$STAMP"
say "done: $OUT/bin/llama-server"
