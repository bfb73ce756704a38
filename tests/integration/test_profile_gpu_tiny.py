"""``benchmarks/profile_gpu.py``: its analysis of a trace (GPU busy time per phase, host gaps, top kernels)
against hand-built intervals, and the script end to end on CPU (tiny shape, CPU activities only) for the
fsdp2 backend and the megatron backend on a MoE model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlite.testing import run_in_subprocess_env

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from profile_gpu import PHASES, gap_summary, merge, phase_table, top_kernels  # noqa: E402

# two streams: k1 [0, 10] and k2 [5, 20] overlap; k3 [50, 60]; k1 again [100, 130] (times in us)
KERNELS = [("k1", 0.0, 10.0), ("k2", 5.0, 20.0), ("k3", 50.0, 60.0), ("k1", 100.0, 130.0)]


def test_merge_joins_overlapping_activities():
    assert merge([(s, e) for _, s, e in KERNELS]) == [(0.0, 20.0), (50.0, 60.0), (100.0, 130.0)]
    assert merge([(0.0, 1.0), (1.0, 2.0)]) == [(0.0, 2.0)]  # touching: one busy stretch


def test_host_gaps_by_hand():
    gaps = gap_summary(KERNELS, window=(0.0, 200.0), longest=2)
    assert gaps["busy_us"] == 20 + 10 + 30
    assert gaps["idle_us"] == 200 - 60 and gaps["idle_fraction"] == pytest.approx(140 / 200)
    # the gaps: [20, 50] 30 us, [60, 100] 40 us, [130, 200] 70 us
    by_bucket = {(b["from_us"], b["to_us"]): (b["gaps"], b["idle_us"]) for b in gaps["buckets"]}
    assert by_bucket[(10.0, 100.0)] == (3, 140.0)
    assert sum(b["gaps"] for b in gaps["buckets"]) == 3
    assert gaps["longest"] == [
        {"start_us": 130.0, "length_us": 70.0, "after": "k1", "before": "(step edge)"},
        {"start_us": 60.0, "length_us": 40.0, "after": "k3", "before": "k1"},
    ]
    # a window that cuts activities: only what lies inside counts
    inner = gap_summary(KERNELS, window=(10.0, 110.0))
    assert inner["busy_us"] == 10 + 10 + 10 and inner["idle_us"] == 70


def test_top_kernels_rank_by_total_time():
    top = top_kernels(KERNELS, 2)
    assert [(k["name"], k["calls"], k["total_ms"], k["mean_us"]) for k in top] == [("k1", 2, 0.04, 20.0), ("k2", 1, 0.015, 15.0)]
    assert top[0]["share"] == pytest.approx(40 / 65)


def test_phase_table_charges_each_phase_its_own_device_time():
    annotations = [("rlite/generation", 0.0, 30.0), ("rlite/train/forward", 40.0, 70.0), ("rlite/train/forward", 90.0, 140.0)]
    metrics = {"time/generation": 3e-5, "time/train/forward": 8e-5}
    rows = {r["phase"]: r for r in phase_table(annotations, KERNELS, metrics)}
    assert list(rows) == list(PHASES)
    assert rows["generation"]["gpu_busy_s"] == pytest.approx(20e-6) and rows["generation"]["kernels"] == 2
    assert rows["generation"]["gpu_idle_fraction"] == pytest.approx(1 / 3)
    assert rows["train/forward"]["traced_s"] == pytest.approx(80e-6)
    assert rows["train/forward"]["gpu_busy_s"] == pytest.approx((10 + 30) * 1e-6) and rows["train/forward"]["kernels"] == 2
    assert rows["train/forward"]["wall_s"] == 8e-5
    assert rows["reward"]["traced_s"] == 0 and rows["reward"]["gpu_idle_fraction"] is None
    on_cpu = {r["phase"]: r for r in phase_table(annotations, [], metrics)}
    assert on_cpu["generation"]["gpu_busy_s"] is None and on_cpu["generation"]["kernels"] is None


def test_profile_runs_tiny_on_cpu_for_fsdp2_and_megatron_moe(tmp_path):
    pytest.importorskip("megatron.core")  # tests/run.sh installs it (the megatron extra)
    out = tmp_path / "profile"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "profile_gpu.py"), "--device", "cpu", "--runs",
         "fsdp2:dense,megatron:moe", "--steps", "2", "--top", "6", "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=run_in_subprocess_env(), cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["profile_gpu.json", "profile_gpu.md"]
    runs = json.loads((out / "profile_gpu.json").read_text())
    assert list(runs) == ["fsdp2:dense", "megatron:moe"]
    for tag, run in runs.items():
        assert (run["backend"], run["model"], run["device"], run["step"]) == (*tag.split(":"), "cpu", 2)
        phases = {r["phase"]: r for r in run["phases"]}
        assert list(phases) == list(PHASES)
        for name, row in phases.items():
            assert row["wall_s"] == run["metrics"][f"time/{name}"]  # rlite's own time/* of the profiled step
            assert row["traced_s"] > 0, name  # every phase ran inside the profiled window, annotated
            assert row["gpu_busy_s"] is None  # a CPU run: no device activity
        assert run["gaps"] is None and run["top_kernels"] == []
        assert len(run["top_cpu_ops"]) == 6 and not any(op["name"].startswith("rlite/") for op in run["top_cpu_ops"])
        assert run["metrics"]["perf/model_tflops"] > 0
    report = (out / "profile_gpu.md").read_text()
    assert "## fsdp2:dense: " in report and "## megatron:moe: " in report
    assert report.count("| phase | wall s (time/*) |") == 2 and "no CUDA activity (a CPU run)" in report
    assert report in done.stdout
