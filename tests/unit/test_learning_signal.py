"""When most groups' rewards are all equal (GRPO advantages all zero), the run says so: a
rate-limited warning naming the likely cause, the progress line, and the end-of-run summary."""

from __future__ import annotations

import json
import logging

import pytest

from rlite.metrics import LearningSignalWatch, plain_progress_line
from rlite.stages.report import summarize_metrics

SILENT = {"advantage/zero_variance_groups": 1.0, "reward/mean": 0.0, "reward/std": 0.0, "reward/accuracy": 0.0}
LEARNING = {"advantage/zero_variance_groups": 0.25, "reward/mean": 0.4, "reward/std": 0.5, "reward/accuracy": 0.4}


def warned_steps(watch: LearningSignalWatch, sequence: list[dict]) -> list[int]:
    return [step for step, metrics in enumerate(sequence, start=1) if watch.observe(step, metrics)]


def test_the_first_warning_waits_for_steps_in_a_row_then_they_are_rate_limited(caplog):
    watch = LearningSignalWatch(after_steps=5, every_steps=50)
    with caplog.at_level(logging.WARNING, logger="rlite.metrics"):
        assert warned_steps(watch, [SILENT] * 120) == [5, 55, 105]
    assert len(caplog.records) == 3


def test_a_step_with_signal_restarts_the_count_and_a_flicker_does_not_spam():
    watch = LearningSignalWatch(after_steps=3, every_steps=20)
    flicker = [SILENT, SILENT, LEARNING] * 3 + [SILENT] * 3 + [LEARNING, SILENT, SILENT, SILENT] * 6
    # never 3 in a row until steps 10-12; then the restarts reach 3 in a row every 4 steps, but at most every 20
    assert warned_steps(watch, flicker) == [12, 32]


def test_no_warning_when_groups_have_variance_or_the_metric_is_missing_or_off_rank_0():
    assert warned_steps(LearningSignalWatch(after_steps=1), [LEARNING] * 10) == []
    assert warned_steps(LearningSignalWatch(after_steps=1), [{"reward/mean": 0.0}] * 10) == []
    assert warned_steps(LearningSignalWatch(enabled=False, after_steps=1), [SILENT] * 10) == []


@pytest.mark.parametrize(
    ("metrics", "cause"),
    [
        (SILENT, "No sample earned a reward: check that the reward function fires"),
        ({**SILENT, "reward/mean": 1.0, "reward/accuracy": 1.0}, "Every sample is right: the prompts are too easy"),
        ({**SILENT, "reward/mean": 0.5, "reward/std": 0.5, "reward/accuracy": 0.5}, "rollout.temperature may be too low"),
    ],
    ids=["reward never fires", "all correct", "groups internally alike"],
)
def test_the_warning_names_the_likely_cause_and_the_metric_to_watch(metrics, cause):
    message = LearningSignalWatch(after_steps=1).observe(1, metrics)
    assert cause in message
    assert "100% of the groups" in message
    assert "advantage/zero_variance_groups" in message


def test_the_progress_line_shows_the_share_of_groups_without_signal():
    silent_line = plain_progress_line(3, 10, 0, 3.0, SILENT, None)
    assert "reward 0.000 | no signal in 100% of groups" in silent_line
    assert "no signal" not in plain_progress_line(3, 10, 0, 3.0, LEARNING, None)


def test_the_summary_counts_the_steps_without_signal(tmp_path):
    metrics_file = tmp_path / "metrics.jsonl"
    rows = [{"step": s, **(SILENT if s in (2, 3, 5) else LEARNING)} for s in range(1, 7)]
    metrics_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = summarize_metrics(metrics_file, rows[-1])
    assert summary["steps_without_learning_signal"].startswith("3 of 6 ")
    assert "advantage/zero_variance_groups" in summary["steps_without_learning_signal"]
    healthy = tmp_path / "healthy.jsonl"
    healthy.write_text(json.dumps({"step": 1, **LEARNING}) + "\n")
    assert "steps_without_learning_signal" not in summarize_metrics(healthy, LEARNING)


@pytest.mark.parametrize(
    ("overrides", "watched"),
    [(["algorithm.advantage=grpo"], True), (["algorithm.advantage=rloo"], True),
     (["algorithm.advantage=gae", "algorithm.critic.enabled=true"], False), (["algorithm.advantage=remax"], False)],
)  # fmt: skip
def test_only_group_relative_estimators_are_watched(pm, tmp_path, overrides, watched):
    from rlite.run.recorder import group_relative
    from rlite.testing import tiny_config

    cfg = tiny_config(tmp_path / "model", tmp_path / "run", *overrides, pm=pm)
    assert group_relative(cfg, pm) is watched
