"""Shared setup of the GPU checks: the ``measure`` fixture and the folder of the spawn workers.

``measure(name, value, unit="", note="")`` records a number a check measured (sync GB/s, the largest
bf16-vs-fp32 log-prob error, ...). The numbers go, one JSON object a line, to the file named by
``RLITE_GPU_METRICS`` (``tests/gpu/run.sh`` sets it and puts them into its report) and are printed.
They are measurements for the report, never asserted on.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

GPU_TESTS_DIR = Path(__file__).resolve().parent
# gpu_workers.py holds the functions that spawned engine processes import by name; spawn hands the
# parent's sys.path to the child, so putting the folder here makes it importable on both sides
if str(GPU_TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(GPU_TESTS_DIR))


@pytest.fixture
def measure(request: pytest.FixtureRequest) -> Callable[..., None]:
    path = os.environ.get("RLITE_GPU_METRICS")

    def record(name: str, value: float | int | str, unit: str = "", note: str = "") -> None:
        row = {"test": request.node.nodeid, "name": name, "value": value, "unit": unit, "note": note}
        print(f"[measure] {name} = {value} {unit} {note}".rstrip())
        if path:
            with open(path, "a") as handle:
                handle.write(json.dumps(row) + "\n")

    return record
