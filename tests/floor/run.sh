#!/usr/bin/env bash
# The floor probe: rlite's core tests against the lowest versions pyproject.toml admits.
#
# pyproject.toml's ">=" bounds are a promise that `pip install rlite` beside those releases works; the main
# suite runs on the newest ones. This script builds (once; reused while it and constraints.txt are
# unchanged) a venv holding exactly the floors of tests/floor/constraints.txt, rlite installed editable
# (its entry points are how the built-ins register), and runs the tests that touch each dependency's API
# most: the engine's decodes over transformers' cache classes, log-probs, weight sync and LoRA adapters
# (peft), FSDP2 training and a bitwise resume (torch's DCP), data (datasets), the config (omegaconf),
# rewards (math-verify), safe checkpoint reads.
#
#   bash tests/floor/run.sh                        # venv in ${TMPDIR:-/tmp}/rlite-floor-venv
#   RLITE_FLOOR_TORCH=2.11.0 bash tests/floor/run.sh  # torch's floor too (a CUDA build from PyPI, ~3 GB)
#   RLITE_FLOOR_VENV=/path/venv  PYTHON=python3.11  bash tests/floor/run.sh [pytest arguments...]
#
# By default torch is the CPU wheel the main suite uses (2.13.0; torch's own floor, 2.11.0, is tested by
# hand with RLITE_FLOOR_TORCH: its PyPI build is several GB, too much for every CI run).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${RLITE_FLOOR_VENV:-${TMPDIR:-/tmp}/rlite-floor-venv}"
PYTHON="${PYTHON:-python3}"
TORCH="${RLITE_FLOOR_TORCH:-2.13.0}"
STAMP="$(cat "$HERE/constraints.txt" "$0" | sha256sum | cut -c1-16)-$TORCH"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ "$(cat "$VENV/.rlite-stamp" 2>/dev/null || true)" != "$STAMP" ]; then
    start=$(date +%s)
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    if [ "$TORCH" = 2.13.0 ]; then  # the CPU build, as README installs it (local wheels where the index is unreachable)
        "$VENV/bin/pip" install -q "torch==$TORCH" --index-url https://download.pytorch.org/whl/cpu
    else
        "$VENV/bin/pip" install -q "torch==$TORCH"
    fi
    "$VENV/bin/pip" install -q -c "$HERE/constraints.txt" "torch==$TORCH" -e "$REPO[math]" "pytest>=8" "pytest-timeout>=2.3"
    echo "$STAMP" > "$VENV/.rlite-stamp"
    echo "floor venv built in $(( $(date +%s) - start )) s at $VENV"
fi
"$VENV/bin/python" - "$HERE/constraints.txt" <<'EOF'
import sys
from importlib.metadata import version

pins = dict(line.split("==") for line in open(sys.argv[1]).read().split("\n") if "==" in line and not line.startswith("#"))
wrong = {name: (want, version(name)) for name, want in pins.items() if version(name) != want}
assert not wrong, f"the floor venv does not hold the floors (name: (floor, installed)): {wrong}"
print("floor venv:", ", ".join(f"{name} {want}" for name, want in pins.items()), "| torch", version("torch"))
EOF

cd "$REPO"
OMP_NUM_THREADS=1 timeout 1200 "$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout 300 \
    tests/unit/test_static_decode.py tests/unit/test_hf_engine.py tests/unit/test_logprobs.py \
    tests/unit/test_weight_sync.py tests/unit/test_lora_adapter_sync.py tests/unit/test_process_engine.py \
    tests/unit/test_safe_pickle.py tests/unit/test_data.py tests/unit/test_rewards.py tests/unit/test_tokenizer.py \
    tests/test_config.py tests/integration/test_train_loop.py "$@"
