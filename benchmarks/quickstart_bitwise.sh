#!/usr/bin/env bash
# Does a change leave what the quickstart computes untouched? Trains the quickstart for a few steps on
# another commit and on this work tree, each laid out as installed (trainer/ as rlite, plugins/ as
# rlite.plugins, put on PYTHONPATH so the active environment's own rlite is not used), one thread each,
# then compares the exported weights bitwise and every metric but the timings.
#
#   bash benchmarks/quickstart_bitwise.sh COMMIT [STEPS]     # STEPS: 20 if left out
#
# Prints one line per side and the verdict; exits 1 when anything differs. A refactor that must not change
# the numbers (moving code, splitting functions) is checked with it; benchmarks/RESULTS.md has the runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BASE="${1:?usage: bash benchmarks/quickstart_bitwise.sh COMMIT [STEPS]}"
STEPS="${2:-20}"
WORK="$(mktemp -d)"
trap 'git worktree remove --force "$WORK/base-tree" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git worktree add --quiet --detach "$WORK/base-tree" "$BASE"

run_side() {  # NAME TREE: lay TREE out as installed, train the quickstart in it
    local name="$1" tree="$2"
    mkdir -p "$WORK/$name/path/rlite"
    for entry in "$tree"/trainer/*; do ln -s "$entry" "$WORK/$name/path/rlite/"; done
    ln -s "$tree/plugins" "$WORK/$name/path/rlite/plugins"
    (cd "$tree" && OMP_NUM_THREADS=1 PYTHONPATH="$WORK/$name/path" timeout 1800 python -m rlite train \
        configs/quickstart.yaml "training.steps=$STEPS" "logging.run_dir=$WORK/$name/run" \
        logging.progress_bar=false >"$WORK/$name.log" 2>&1) || { tail -20 "$WORK/$name.log"; exit 1; }
    echo "$name ($(git -C "$tree" rev-parse --short HEAD)): $(tail -1 "$WORK/$name.log")"
}
run_side base "$WORK/base-tree"
run_side this "$PWD"

python - "$WORK/base/run" "$WORK/this/run" <<'EOF'
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

base, this = (Path(p) for p in sys.argv[1:])
weights = [load_file(next((run / "hf_model").glob("*.safetensors"))) for run in (base, this)]
differ = sorted(k for k in weights[0].keys() | weights[1].keys()
                if k not in weights[0] or k not in weights[1] or not torch.equal(weights[0][k], weights[1][k]))
rows = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (base, this)]
timing = ("perf/", "time/", "provenance")
metrics = sorted({k for a, b in zip(*rows) for k in a.keys() | b.keys()
                  if not k.startswith(timing) and a.get(k) != b.get(k)})
print(f"weights: {len(weights[0])} tensors, {len(differ)} differ {differ[:5]}; metric rows: {len(rows[0])} vs "
      f"{len(rows[1])}, {len(metrics)} metrics differ {metrics[:5]}")
same = not differ and not metrics and len(rows[0]) == len(rows[1])
print("bitwise the same" if same else "DIFFERENT")
sys.exit(0 if same else 1)
EOF
