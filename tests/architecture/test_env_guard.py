"""The test session's kernel-environment guard (``tests/workers/env_guard.py``) fails the test or the module
import that leaves a kernel-choosing variable changed, and lets monkeypatched or restored ones pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).resolve().parents[1] / "workers"

TESTS = '''
import os

def test_leaks():
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"

def test_monkeypatched(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")

def test_restored():
    before = os.environ.pop("OMP_NUM_THREADS", None)
    os.environ["OMP_NUM_THREADS"] = "3"
    if before is None:
        del os.environ["OMP_NUM_THREADS"]
    else:
        os.environ["OMP_NUM_THREADS"] = before
'''


def run_pytest(folder: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = str(WORKERS)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "env_guard", "-p", "no:cacheprovider", "-p", "no:randomly", "-rA", "-q", "."],
        cwd=folder, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_leaking_test_fails_and_names_the_variable(tmp_path):
    (tmp_path / "test_leaks.py").write_text(TESTS)
    result = run_pytest(tmp_path)
    out = result.stdout
    assert result.returncode == 1, out
    assert "3 passed, 1 error" in out, out
    assert "ERROR test_leaks.py::test_leaks" in out, out
    assert "ATEN_CPU_CAPABILITY: None -> 'avx2'" in out, out
    assert "PASSED test_leaks.py::test_monkeypatched" in out and "PASSED test_leaks.py::test_restored" in out, out


def test_a_test_module_that_leaks_at_import_stops_the_session(tmp_path):
    (tmp_path / "test_import_leak.py").write_text('import os\nos.environ["MKL_CBWR"] = "COMPATIBLE"\n\ndef test_x():\n    pass\n')
    result = run_pytest(tmp_path)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "importing the test modules changed" in result.stderr and "MKL_CBWR: None -> 'COMPATIBLE'" in result.stderr
