#!/usr/bin/env bash
# The GPU checks of rlite (tests/gpu) in one command, with a short markdown report.
#
#   bash tests/gpu/run.sh [REPORT.md] [extra pytest arguments...]
#
# The report goes to REPORT.md, else to $OUT/gpu_report.md when OUT is set, else to stdout only.
# Without a CUDA GPU (or without torch) it writes a report saying so and exits 0.
# Wheels in .whl/*.whl (made by tests/gpu/fetch_wheels.sh: omegaconf, antlr4-python3-runtime,
# liger-kernel, ...) are installed into a temporary folder first, without network or dependencies.
# The checks run this checkout's rlite (a copy of trainer/ + plugins/ laid out as the package is
# installed), whatever rlite the Python may have installed. PYTHON picks the interpreter.
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${PYTHON:-python3}
report=""
if [ $# -gt 0 ] && [[ "$1" != -* ]]; then report=$1; shift; fi
if [ -z "$report" ] && [ -n "${OUT:-}" ]; then report=$OUT/gpu_report.md; fi
work=$(mktemp -d "${TMPDIR:-/tmp}/rlite-gpu-checks.XXXXXX")
out_args=()
[ -n "$report" ] && out_args=(--out "$report")

if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    "$python" "$repo/tests/gpu/report.py" --skipped "no CUDA GPU visible to $python (or no torch)" "${out_args[@]}"
    echo "rlite GPU checks: skipped (no CUDA GPU)"
    exit 0
fi

site=$work/site
mkdir -p "$site"
shopt -s nullglob
wheels=("$repo"/.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
    echo "installing ${#wheels[@]} carried wheels into $site"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" || exit 1
fi
# this checkout's rlite, laid out as installed: rlite = trainer/, rlite.plugins = plugins/
cp -r "$repo/trainer" "$site/rlite"
cp -r "$repo/plugins" "$site/rlite/plugins"
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
export RLITE_GPU_METRICS=$work/metrics.jsonl PYTHONUNBUFFERED=1

cd "$repo"
"$python" -c "import rlite, sys; print('rlite from', rlite.__file__)" || exit 1
"$python" -m pytest tests/gpu -v -rA -p no:cacheprovider --junitxml="$work/junit.xml" "$@" 2>&1 | tee "$work/pytest.log"
status=${PIPESTATUS[0]}
"$python" "$repo/tests/gpu/report.py" --junit "$work/junit.xml" --metrics "$work/metrics.jsonl" "${out_args[@]}"
rm -rf "$work"
exit "$status"
