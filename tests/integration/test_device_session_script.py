"""``tests/gpu/device_session.sh``, the one script a lent GPU runs: without a GPU it skips every part,
says so and exits 0; its bookkeeping (a part that fails, one that outlives its timeout, an unknown part:
each in the summary, the exit status their count) checked on CPU with an interpreter that answers the
script's GPU probe and is the real Python for everything else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rlite.testing import run_in_subprocess_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "device_session.sh"


def session(out: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=run_in_subprocess_env(OUT=str(out), **env))  # fmt: skip


def test_without_a_gpu_every_part_is_skipped_and_the_summary_says_why(tmp_path):
    done = session(tmp_path / "out", CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["session.log", "summary.md"]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"- every part skipped: no CUDA GPU visible to {sys.executable}" in summary
    assert summary in done.stdout


def test_a_failed_a_timed_out_and_an_unknown_part_are_each_counted(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(f"""#!/usr/bin/env bash
# the device session's GPU probe gets a GPU name; everything else runs on the real interpreter
if [ "${{1:-}}" = "-c" ] && [[ "${{2:-}}" == *"get_device_name() + ', torch '"* ]]; then echo "Pretend GPU"; exit 0; fi
exec {sys.executable} "$@"
""")
    fake.chmod(0o755)
    # bench fails at once on a CPU (the gpu job refuses it); the checks get one second; "nonsense" is no part
    done = session(tmp_path / "out", PYTHON=str(fake), PARTS="bench checks nonsense", CHECKS_S="1")
    assert done.returncode == 3, done.stdout[-2000:] + done.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "Pretend GPU" in summary
    assert "- bench: FAILED (exit 1) in " in summary
    assert "- checks: TIMED OUT after " in summary and "(limit 1 s)" in summary
    assert "- nonsense: unknown part (PARTS takes checks, profile, bench)" in summary
    log = (tmp_path / "out" / "session.log").read_text()
    assert "vs_trl: the gpu job needs a CUDA GPU" in log  # every part's output lands in session.log
    assert not (tmp_path / "out" / "bench_report.md").exists()  # nothing measured, nothing copied
