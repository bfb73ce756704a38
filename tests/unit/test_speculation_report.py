"""With a speculative draft on, its acceptance rate is in the progress line, the end-of-run summary and
``plot.png`` (a fifth panel); without one, none of them mention it."""

from __future__ import annotations

import json

import pytest

from rlite.metrics import plain_progress_line, plot_figure, read_metrics
from rlite.stages.report import summarize_metrics


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def spec_rows(rates):
    return [{"step": step, "reward/mean": 0.5, "spec/acceptance_rate": rate, "spec/estimated_speedup": 1.0 + rate,
             "draft/top1_agreement": rate / 2} for step, rate in enumerate(rates, start=1)]  # fmt: skip


def test_the_progress_line_shows_the_acceptance_rate_only_with_a_draft():
    line = plain_progress_line(3, 10, 0, 3.0, {"reward/mean": 0.5, "spec/acceptance_rate": 0.784}, None)
    assert "reward 0.500 | draft accept 0.78 |" in line
    assert "draft" not in plain_progress_line(3, 10, 0, 3.0, {"reward/mean": 0.5}, None)


def test_the_summary_gives_first_final_and_mean_acceptance_and_the_speedup(tmp_path):
    rows = spec_rows([0.2, 0.4, 0.9])
    summary = summarize_metrics(write_rows(tmp_path / "metrics.jsonl", rows), rows[-1])
    assert summary["draft_acceptance_first (step 1)"] == pytest.approx(0.2)
    assert summary["draft_acceptance_final (step 3)"] == pytest.approx(0.9)
    assert summary["draft_acceptance_mean"] == pytest.approx(0.5)
    assert summary["draft_estimated_speedup_mean"] == pytest.approx(1.5)
    plain = [{"step": 1, "reward/mean": 0.5}]
    assert not any(key.startswith("draft") for key in summarize_metrics(write_rows(tmp_path / "p.jsonl", plain), plain[0]))


def test_the_plot_gets_a_speculative_decoding_panel_only_with_a_draft(tmp_path):
    rows = read_metrics(write_rows(tmp_path / "metrics.jsonl", spec_rows([0.2, 0.4, 0.9])))
    fig = plot_figure(rows)
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert set(axes) == {"reward", "response length", "entropy", "KL", "speculative decoding"}
    curves = {line.get_label(): list(line.get_ydata()) for line in axes["speculative decoding"].lines}
    assert curves["draft acceptance rate (accepted / proposed)"] == pytest.approx([0.2, 0.4, 0.9])
    plain = plot_figure([{"step": 1, "reward/mean": 0.5}])
    assert {ax.get_title() for ax in plain.axes} == {"reward", "response length", "entropy", "KL"}
