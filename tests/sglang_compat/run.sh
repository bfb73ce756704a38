#!/usr/bin/env bash
# Run rlite's SGLang contract tests against SGLang 0.5.23's own deserializer, on CPU.
#
# Builds (once; reused while this script and requirements.txt are unchanged) a small venv:
# CPU torch 2.13.0, sglang 0.5.23 with --no-deps, the dozen light packages in requirements.txt, and a
# stub for triton. rlite itself is put on the path through links laid out as installed (trainer/ as
# rlite, plugins/ as rlite/plugins, where the SGLang engine lives; no install, so the main venv's
# editable install is left alone), and tests/workers, which holds the SGLang stand-in. Then runs
# tests/unit/test_sglang_contract.py in it, where a failed SGLang import is a failure, not a skip.
#
#   bash tests/sglang_compat/run.sh            # venv in ${TMPDIR:-/tmp}/rlite-sglang-compat-venv
#   RLITE_SGLANG_VENV=/path/venv bash tests/sglang_compat/run.sh
#   PYTHON=python3.11 ...                      # the interpreter that builds the venv
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${RLITE_SGLANG_VENV:-${TMPDIR:-/tmp}/rlite-sglang-compat-venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
SGLANG_VERSION=0.5.23
STAMP="$(cat "$HERE/requirements.txt" "$0" | sha256sum | cut -c1-16)"

quiet_pip() {  # pip's complaints about sglang's unmet pins are expected here; show them only on failure
    local log
    log="$(mktemp)"
    if ! "$VENV/bin/pip" install --quiet "$@" >"$log" 2>&1; then
        cat "$log"
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

if [ "$(cat "$VENV/.rlite-stamp" 2>/dev/null || true)" != "$STAMP" ]; then
    start=$(date +%s)
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    quiet_pip "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu  # the CPU build, as README installs it
    quiet_pip --no-deps "sglang==$SGLANG_VERSION"
    quiet_pip -r "$HERE/requirements.txt"
    echo "$STAMP" > "$VENV/.rlite-stamp"
    echo "sglang compat venv built in $(( $(date +%s) - start )) s: $(du -sh "$VENV" | cut -f1) at $VENV"
fi

SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
mkdir "$SHIM/rlite"
for entry in "$REPO"/trainer/*; do
    ln -s "$entry" "$SHIM/rlite/"
done
ln -s "$REPO/plugins" "$SHIM/rlite/plugins"

cd "$REPO"
PYTHONPATH="$HERE/stubs:$SHIM:$REPO/tests/workers" \
RLITE_SGLANG_NARROW_IMPORT=1 \
RLITE_REQUIRE_SGLANG=1 \
OMP_NUM_THREADS=1 \
    timeout 600 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    --confcutdir="$REPO/tests/unit" "$REPO/tests/unit/test_sglang_contract.py" "$@"
