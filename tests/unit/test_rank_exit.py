"""How a rank's process ends: through ``os._exit`` with the command's status, after its streams are flushed.

The interpreter's teardown of a finished two-rank gloo run aborted a rank about once in ten runs here
(SIGABRT, "terminate called without an active exception"), which a launcher reads as a failed run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from rlite import distributed as rlite_distributed
from rlite.tools import cli


class _Left(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@pytest.fixture
def leaving(monkeypatch):
    """``os._exit`` raising :class:`_Left` instead of ending pytest."""

    def fake_exit(code: int) -> None:
        raise _Left(code)

    monkeypatch.setattr(rlite_distributed.os, "_exit", fake_exit)


def _run_rlite(monkeypatch, *argv: str, world_size: str) -> int:
    monkeypatch.setattr(sys, "argv", ["rlite", *argv])
    monkeypatch.setenv("WORLD_SIZE", world_size)
    try:
        return cli.main()
    except _Left as left:
        return -1000 - left.code  # distinguishable from a returned status


def test_a_rank_of_a_multi_rank_launch_leaves_through_os_exit_with_the_commands_status(
    monkeypatch, leaving, tmp_path: Path, capsys
):
    missing = tmp_path / "missing.yaml"
    assert _run_rlite(monkeypatch, "config", str(missing), world_size="2") == -1000 - cli.EXIT_USAGE
    assert "missing.yaml" in capsys.readouterr().err  # the one-line error was printed before leaving


def test_a_single_process_returns_its_status_to_the_interpreter(monkeypatch, leaving, tmp_path: Path):
    assert _run_rlite(monkeypatch, "config", str(tmp_path / "missing.yaml"), world_size="1") == cli.EXIT_USAGE


def test_an_unexpected_error_in_a_rank_prints_its_traceback_and_leaves_with_1(monkeypatch, leaving, capsys):
    def broken(args):
        raise RuntimeError("a bug in a command")

    monkeypatch.setattr(cli, "cmd_config", broken)  # build_parser reads the name when main runs
    assert _run_rlite(monkeypatch, "config", "x.yaml", world_size="2") == -1001
    err = capsys.readouterr().err
    assert "Traceback" in err and "a bug in a command" in err


def _writes_then_returns(rank: int, folder: str) -> None:
    Path(folder, f"rank{rank}").write_text(str(os.getpid()))


def _raises_on_rank_1(rank: int, folder: str) -> None:
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")


def test_spawned_ranks_run_their_function_and_a_raising_rank_fails_the_call(tmp_path: Path):
    rlite_distributed.spawn_local_ranks(_writes_then_returns, (str(tmp_path),), nprocs=2, timeout_s=120)
    pids = {(tmp_path / f"rank{r}").read_text() for r in range(2)}
    assert len(pids) == 2 and str(os.getpid()) not in pids
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        rlite_distributed.spawn_local_ranks(_raises_on_rank_1, (str(tmp_path),), nprocs=2, timeout_s=120)
