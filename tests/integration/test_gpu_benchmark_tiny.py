"""``benchmarks/vs_trl.py gpu-tiny --device cpu``: the GPU side-by-side's tiny form runs end to end on CPU with
both frameworks (each in its own process, both precisions), and its report has every row with both
frameworks' numbers and their ratio; the sequences each step trained on are the job's; the budget guard
stops every process after the step under way."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlite.testing import run_in_subprocess_env

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import trl  # noqa: E402, F401  (tests/run.sh installs the bench extra: TRL must be there, not skipped)
from vs_trl_gpu import JOBS  # noqa: E402
from vs_trl_report import NO_RATIO, gpu_rows  # noqa: E402

JOB = JOBS["gpu-tiny"]
N = JOB["prompts"] * JOB["samples"]
PROMPT_TOKENS, NEW_TOKENS = JOB["prompt_tokens"], JOB["max_new_tokens"]
NUMBER = r"-?[\d,]+(?:\.\d+)?(?:e-?\d+)?%?"


def bench(out_dir: Path, *args: str) -> tuple[str, dict]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), "gpu-tiny", "--device", "cpu", "--out-dir",
         str(out_dir), *args], capture_output=True, text=True, timeout=900, env=run_in_subprocess_env(), cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (out_dir / "gpu-tiny" / "report_gpu-tiny.md").read_text()
    assert report.strip() in done.stdout  # what it prints is what it writes
    return report, json.loads((out_dir / "gpu-tiny" / "results_gpu-tiny.json").read_text())


def table(report: str, precision: str) -> dict[str, list[str]]:
    """The rows of one precision's table: label -> [rlite, TRL, ratio] cells."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {precision} | rlite "))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        label, *cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[label] = cells
    return rows


def test_both_frameworks_both_precisions_every_row_and_ratio(tmp_path):
    report, results = bench(tmp_path, "--peak-tflops", "0.5")
    assert set(results["results"]) == {"bf16", "fp32-master"} and results["failures"] == {}
    for precision in ("bf16", "fp32-master"):
        rows = table(report, precision)
        assert list(rows) == [label for label, _, _ in gpu_rows(on_gpu=False)]
        for (label, key, _), (ours, theirs, ratio) in zip(gpu_rows(on_gpu=False), rows.values()):
            assert re.fullmatch(NUMBER, ours), (precision, label, ours)
            if key == "own_mfu":  # rlite's own metric: TRL has none
                assert theirs == "-" and ratio == "-"
                continue
            assert re.fullmatch(NUMBER, theirs), (precision, label, theirs)
            if key in NO_RATIO:
                assert ratio == "-"
            else:
                assert re.fullmatch(r"\d+\.\d\dx", ratio), (precision, label, ratio)
        # MFU is the update's model TFLOP/s over the peak given
        tflops = table(report, precision)["update forward+backward model TFLOP/s"]
        mfu = rows["MFU of the update's forward+backward"]
        for flops, share in zip(tflops[:2], mfu[:2]):
            assert float(share.rstrip("%")) == pytest.approx(100 * float(flops) / 0.5, rel=0.06, abs=0.06)
        trl_run, rlite_run = results["results"][precision]["trl"], results["results"][precision]["rlite"]
        assert len(trl_run["step_times"]) == len(rlite_run["step_times"]) == JOB["steps"]
        # TRL: min_new_tokens = max_new_tokens, so every sequence is exactly prompt + new tokens
        s = PROMPT_TOKENS + NEW_TOKENS
        assert trl_run["sequence_sums"] == [[N * s, N * s * (s + 1) / 2]] * JOB["steps"]
        for (tokens, _), generated in zip(rlite_run["sequence_sums"], rlite_run["tokens"]):
            assert tokens == N * PROMPT_TOKENS + generated  # prompts + what the engine sampled
    assert "MFU against 0.5 TFLOP/s (logging.peak_tflops)" in report
    assert "not judged on a CPU" in report


def test_the_budget_stops_each_process_after_the_step_under_way(tmp_path):
    # two seconds for two processes: TRL, first, gets one, spends it before its first step ends and stops
    # after it; nothing is left for rlite, which is not started
    report, results = bench(tmp_path / "a", "--frameworks", "trl,rlite", "--precisions", "bf16", "--budget-s", "2",
                            "--steps", "20")  # fmt: skip
    trl_run = results["results"]["bf16"]["trl"]
    assert len(trl_run["step_times"]) == 1
    assert trl_run["stopped"] == "stopped after step 1: the budget of 1 s is spent"
    assert results["failures"] == {"gpu-tiny-bf16-rlite": "not run: the budget of 2 s was spent by the processes before it"}
    assert "bf16, trl: EOS: min_new_tokens=8; stopped after step 1" in report
    assert "gpu-tiny-bf16-rlite: FAILED: not run" in report
    rows = table(report, "bf16")
    assert rows["steps run (medians over steps 2..N)"] == ["-", "1", "-"]
    assert "MFU not reported" in report  # no peak on CPU
    # rlite alone with the same second
    _, results = bench(tmp_path / "b", "--frameworks", "rlite", "--precisions", "bf16", "--budget-s", "1", "--steps", "20")
    rlite_run = results["results"]["bf16"]["rlite"]
    assert len(rlite_run["step_times"]) == len(rlite_run["phases"]) == len(rlite_run["sequence_sums"]) == 1
    assert rlite_run["stopped"] == "stopped after step 1: the budget of 1 s is spent"
