"""The combination matrix prints its counts at the end of the run. Its long cases (two ranks, or the
megatron backend: 10-60 s each on two CPU cores) carry the ``matrix_long`` marker: ``-m "not matrix_long"``
leaves them out for a quick pass (the whole matrix took about 3 minutes here, so CI runs all of it)."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter) -> None:
    from rlite.tools import matrix
    cases = matrix.pairwise_cases()
    terminalreporter.write_line(
        f"combination matrix: {len(cases)} cases ({sum(map(matrix.long_case, cases))} marked matrix_long), "
        f"{len(matrix.allowed_pairs())} pairs of option values covered, {len(matrix.refused_pairs())} refused "
        f"({len(matrix.refusal_cases())} refusal cases), {len(matrix.matrix_rules())} rules"
    )
