#!/usr/bin/env bash
# rlite's test command: the one README.md gives and the one CI runs (.ci/run calls exactly this).
#
#   bash tests/run.sh [pytest arguments...]
#
# Installs what the tests need into the active virtual environment (or a fresh .venv when none is
# active): CPU torch (the README's line, word for word: PyTorch's CPU index; where pip also has local
# wheels, as on rlite's CI machine, pip takes torch from them when the index cannot be reached), rlite
# editable with every extra the tests exercise (megatron-core included; TRL, from the bench extra, for the
# GPU benchmark's tiny CPU form), then checks rlite's weight payloads against SGLang 0.5.23's own
# deserializer (in a small separate venv, tests/sglang_compat/run.sh), runs the core tests against the
# lowest releases pyproject.toml admits (another venv, tests/floor/run.sh), then runs the whole suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    . .venv/bin/activate
fi
pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
pip install -q -e ".[test,math,tensorboard,megatron,wandb,bench]"
RLITE_SGLANG_VENV="$PWD/.venv-sglang-compat" bash tests/sglang_compat/run.sh
RLITE_FLOOR_VENV="$PWD/.venv-floor" bash tests/floor/run.sh
python -m pytest -q "$@"
