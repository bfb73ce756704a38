"""The long cases of the combination matrix (two ranks, or the megatron backend: 15-60 s each on two CPU
cores) carry the ``matrix_long`` marker and are skipped unless it is selected: ``pytest -m matrix_long
tests/matrix`` runs them (CI does), ``pytest tests/matrix`` the quick ones, the generator and the refusals."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "matrix_long" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="a long matrix case: run with -m matrix_long")
    for item in items:
        if item.get_closest_marker("matrix_long"):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter) -> None:
    from rlite import matrix
    from rlite.config.compat import RULES

    cases = matrix.pairwise_cases()
    long = sum(map(matrix.long_case, cases))
    terminalreporter.write_line(
        f"combination matrix: {len(cases)} cases ({long} long: -m matrix_long), "
        f"{len(matrix.allowed_pairs())} pairs of option values covered, {len(matrix.refused_pairs())} refused "
        f"({len(matrix.refusal_cases())} refusal cases), {len(RULES)} rules"
    )
