"""The step timer and the end-of-run breakdown: parts of a phase are shown under it, not counted twice."""

from __future__ import annotations

import pytest

from rlite.metrics import StepTimer, breakdown_rows


def test_parts_of_a_phase_are_reported_but_not_added_to_the_step(monkeypatch):
    clock = iter([0.0, 1.0, 1.0, 4.0, 4.5, 5.0, 10.0, 12.0])  # perf_counter at each enter/exit
    monkeypatch.setattr("rlite.metrics.time.perf_counter", lambda: next(clock))
    timer = StepTimer()
    with timer.phase("generation"):  # 0 -> 1
        pass
    with timer.phase("train"):  # 1 -> 12
        with timer.phase("train/forward"):  # 4 -> 4.5
            pass
        with timer.phase("train/backward"):  # 5 -> 10
            pass
    metrics = timer.step_metrics()
    assert metrics == {"time/generation": 1.0, "time/train/forward": 0.5, "time/train/backward": 5.0,
                       "time/train": 11.0, "time/step": 12.0}
    assert timer.step_metrics() == {"time/step": 0.0}, "a new step starts from zero"
    assert timer.total["train"] == 11.0


def test_breakdown_rows_list_parts_under_their_phase_with_shares_of_the_whole():
    rows = breakdown_rows({"generation": 2.0, "train": 6.0, "train/backward": 4.0, "train/forward": 1.0,
                           "reward": 0.0})
    assert [r[0] for r in rows] == ["train", "  backward", "  forward", "generation", "reward"]
    assert [r[2] for r in rows] == pytest.approx([0.75, 0.5, 0.125, 0.25, 0.0])
