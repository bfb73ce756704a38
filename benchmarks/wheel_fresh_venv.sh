#!/usr/bin/env bash
# The README's route to a machine without the clone, as written, in fresh virtual environments with real
# dependency resolution (tests/test_packaging.py does the same offline, its dependencies borrowed):
# build the wheel in a clone (`pip install build && python -m build --wheel`), install CPU torch with the
# README's line and the wheel with an extra, then run 3 quickstart steps from a folder holding only the
# quickstart's config and warm start. Needs PyPI (and PyTorch's CPU index, or local wheels); a few minutes.
#
#   bash benchmarks/wheel_fresh_venv.sh [CLONE_SOURCE]     # default: this checkout; works in /tmp/wf
set -euxo pipefail
SOURCE="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
SRC=/tmp/wf/src; rm -rf /tmp/wf; mkdir -p /tmp/wf
git clone -q "$SOURCE" $SRC
cd $SRC
python3 -m venv /tmp/wf/build-venv
/tmp/wf/build-venv/bin/pip install -q build
/tmp/wf/build-venv/bin/python -m build --wheel          # the documented command (isolated build: setuptools from PyPI)
ls dist
python3 -m venv /tmp/wf/venv
. /tmp/wf/venv/bin/activate
time pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
time pip install -q "dist/rlite-0.1.0-py3-none-any.whl[math]"
mkdir -p /tmp/wf/work/examples/warmstart && cp -r configs /tmp/wf/work/ && cp -r examples/warmstart/addition-qwen2-1m /tmp/wf/work/examples/warmstart/
cd /tmp/wf/work
python -c "import rlite; print(rlite.__file__)"
OMP_NUM_THREADS=1 time rlite train configs/quickstart.yaml training.steps=3 logging.progress_bar=false
rlite info runs/quickstart | head -4
