"""A pytest plugin (``tests/conftest.py`` loads it): a test, or a test module's import, that leaves a variable
choosing CPU/GPU kernels, thread counts or determinism changed in ``os.environ`` fails, naming the variable.

Such a change outlives the test: every process the session starts later (spawned ranks, ``rlite train``
subprocesses) inherits it, while the pytest process keeps the kernels torch picked at its first kernel. Tests
that compare a spawned run with an in-process one then differ at rounding, and only in some orders. It
happened once (issue #28: importing ``examples/warmstart/make_warmstart.py`` set ``ATEN_CPU_CAPABILITY=avx2``;
the ZeRO-1 bf16 test failed 500 tests later, see benchmarks/RESULTS.md). ``monkeypatch.setenv`` is restored
before this check runs, so tests that set these on purpose that way pass.

Lives in ``tests/workers/`` because that folder is on ``sys.path`` for the test process and spawned ranks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

KERNEL_ENV = (
    "ATEN_CPU_CAPABILITY",  # torch's CPU kernel set (default: the best the CPU has)
    "MKL_CBWR",  # MKL's conditional numerical reproducibility (code path)
    "MKL_ENABLE_INSTRUCTIONS",
    "DNNL_MAX_CPU_ISA",  # oneDNN's instruction set (both spellings)
    "ONEDNN_MAX_CPU_ISA",
    "OMP_NUM_THREADS",  # threads change reduction order
    "MKL_NUM_THREADS",
    "CUBLAS_WORKSPACE_CONFIG",  # cuBLAS determinism
    "NVIDIA_TF32_OVERRIDE",
)


def kernel_env() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in KERNEL_ENV}


def changes(before: dict[str, str | None], after: dict[str, str | None]) -> str:
    return ", ".join(f"{name}: {before[name]!r} -> {after[name]!r}" for name in KERNEL_ENV if before[name] != after[name])


_AT_START = kernel_env()  # when the plugin is imported: before any test module is


def pytest_collection_finish(session: pytest.Session) -> None:
    changed = changes(_AT_START, kernel_env())
    if changed:
        raise pytest.UsageError(
            f"importing the test modules changed the kernel environment of every later process ({changed}); "
            "set it only where a script runs (under `if __name__ == '__main__'`) or with monkeypatch.setenv"
        )


@pytest.fixture(autouse=True)
def _kernel_environment_left_alone() -> Iterator[None]:
    before = kernel_env()
    yield
    changed = changes(before, kernel_env())
    if changed:
        pytest.fail(
            f"this test left the kernel environment changed for every later process ({changed}); "
            "use monkeypatch.setenv, or restore it",
            pytrace=False,
        )
