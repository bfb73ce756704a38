#!/usr/bin/env bash
# Download, here (with PyPI reachable), the wheels the lent GPU machine lacks into .whl/ for
# tests/gpu/run.sh to install there: that machine has torch, transformers, peft, pluggy, rich,
# safetensors and pyarrow, but not omegaconf (rlite needs >= 2.4: 2.3 refuses rlite's schema with
# "Unions of containers are not supported"), its antlr4 runtime, datasets (and dill, multiprocess),
# liger-kernel, megatron-core, math-verify (the GPU recipe's reward; its latex2sympy2_extended needs the
# antlr4 runtime above and sympy, which the machine has) or TRL (for the GPU benchmark, benchmarks/vs_trl.py
# gpu: its wheel is pure Python; what else it needs, accelerate, huggingface_hub, jinja2, numpy, packaging,
# pandas, psutil, pyarrow, pyyaml and transformers, is on that machine, datasets travels here). Python 3.12,
# x86-64, as on the lent H100 and H200 of 2026-11.
#
#   bash tests/gpu/fetch_wheels.sh        # then carry .whl (git-ignored through .git/info/exclude)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exclude=$(git rev-parse --git-path info/exclude)  # .git is a file in a worktree
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
mkdir -p .whl
for spec in omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
            liger-kernel==0.8.5 megatron-core==0.16.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
            trl==1.16.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "$spec"
done
ls -l .whl
