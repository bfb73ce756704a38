"""A crash (or a full disk) mid-write leaves the last line of ``metrics.jsonl`` or ``samples.jsonl`` cut
short, sometimes followed by NUL bytes: the resume drops it with a warning naming file and line and goes
on. A damaged line anywhere else is no crash's doing: refused, naming file and line."""

from __future__ import annotations

import logging

import pytest

from rlite.config import ConfigError
from rlite.metrics import read_log_rows, read_metrics
from rlite.run.loop import run_training
from rlite.run.provenance import metrics_records
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir

ROWS = '{"step": 0, "provenance": {"rlite": "x"}}\n{"step": 1, "reward/mean": 0.5}\n'


@pytest.mark.parametrize("tail", ['{"step": 2, "reward/me', '{"step": 2, "rew' + "\0" * 300, "\0" * 4096,
                                  '{"step": 2, "reward/mean": 0.7}\n' + "\0" * 10],
                         ids=["cut short", "cut short, then NUL bytes", "NUL bytes", "whole, then NUL bytes"])  # fmt: skip
def test_a_torn_last_line_is_dropped_with_a_warning_naming_file_and_line(tmp_path, tail, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes((ROWS + tail).encode())
    with caplog.at_level(logging.WARNING, logger="rlite"):
        rows = [row for _, row in read_log_rows(path)]
    whole = tail.startswith('{"step": 2, "reward/mean": 0.7}')
    assert [row["step"] for row in rows] == ([0, 1, 2] if whole else [0, 1])
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert str(path) in warnings
    assert ("line 3, cut short" in warnings) == (not whole and tail.startswith('{"step": 2, "re'))
    assert ("NUL bytes" in warnings) == ("\0" in tail)
    assert [row["step"] for row in metrics_records(path)] == [0]  # rlite info reads it too
    # one reader of run logs: the tests' and the audit's go through it (the provenance row skipped)
    assert read_jsonl(path) == read_metrics(path) == [row for row in rows if "provenance" not in row]


def test_a_damaged_line_before_the_last_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text(ROWS + '{"step": 1, "rew\n{"step": 2, "reward/mean": 0.7}\n')
    with pytest.raises(ConfigError, match=r"samples.jsonl line 3 is not a JSON row .* not the last line"):
        read_log_rows(path)


def test_a_run_resumes_past_torn_last_lines_of_its_metrics_and_samples(tmp_path, caplog):
    model_dir = build_tiny_model_dir(tmp_path / "tiny")
    run_dir = tmp_path / "run"
    common = ("checkpoint.every=1", "checkpoint.resume=auto", "logging.samples_every=1")
    run_training(tiny_config(model_dir, run_dir, "training.steps=2", *common))
    # the crash: step 3's rows were being written when the disk filled
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 3, "reward/mean": 0.1')
    with open(run_dir / "samples.jsonl", "ab") as handle:
        handle.write(b'{"step": 3, "kind": "train", "prompt": "1+' + b"\0" * 512)
    with caplog.at_level(logging.WARNING, logger="rlite"):
        run_training(tiny_config(model_dir, run_dir, "training.steps=3", *common))
    warnings = [r.getMessage() for r in caplog.records]
    assert any("metrics.jsonl: dropped line" in w for w in warnings), warnings
    assert any("samples.jsonl: dropped line" in w for w in warnings), warnings
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]
    assert sorted({r["step"] for r in read_jsonl(run_dir / "samples.jsonl")}) == [0, 1, 2, 3]
