"""The README's test command on fresh clones, run after run (issue #28's "10 of 10").

Each run clones the repository at one commit into a new folder and runs `bash .ci/run` there (CI's command,
which is the README's `bash tests/run.sh`: a fresh `.venv`, CPU torch, rlite with every test extra, the whole
suite). Nothing is reused from an earlier run but pip's cache. A passing clone is deleted; a failing one is
kept with its log for reading. One line per run goes to a tab-separated log and a Markdown row is printed, in
the shape of the table in `benchmarks/RESULTS.md` ("The README's test command on fresh clones").

    python benchmarks/fresh_clone.py --runs 10                 # HEAD of this checkout
    python benchmarks/fresh_clone.py --runs 3 --commit abc1234 --workdir /tmp/fresh

Runs go one after another: two at once on a 2-core machine doubles each run's time (RESULTS shows both).
Touch `WORKDIR/STOP` to end the series after the run in progress.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^=*\s*(.*\b(passed|failed|error)\b.*?)\s*=*$")


def pytest_summary(log: Path) -> str:
    """The last pytest summary line of a log ("1387 passed, 30 skipped ... in 804.25s"), or ""."""
    found = ""
    for line in log.read_text(errors="replace").splitlines():
        match = SUMMARY.match(line.strip())
        if match and " in " in match.group(1):
            found = match.group(1)
    return found


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def one_run(source: Path, commit: str, folder: Path, log: Path, timeout_s: int) -> tuple[int, float]:
    """Clone `source` at `commit` into `folder` and run `bash .ci/run` there; returns (exit code, seconds)."""
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(source), str(folder)], check=True)
    subprocess.run(["git", "-C", str(folder), "checkout", "-q", commit], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    start = time.monotonic()
    with log.open("w") as out:
        try:
            rc = subprocess.run(["bash", ".ci/run"], cwd=folder, env=env, stdout=out,
                                stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\nfresh_clone.py: stopped after {timeout_s} s\n")
            rc = 124
    return rc, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="how many fresh clones to run, one after another")
    parser.add_argument("--commit", default="HEAD",
                        help="commit to clone, resolved at each run's start (default: this checkout's HEAD)")
    parser.add_argument("--source", type=Path, default=REPO, help="repository to clone (default: this one)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/rlite-fresh"),
                        help="where the clones, logs and results.tsv go")
    parser.add_argument("--timeout-s", type=int, default=90 * 60, help="per-run limit (CI's is 90 minutes)")
    args = parser.parse_args(argv)

    args.workdir.mkdir(parents=True, exist_ok=True)
    results = args.workdir / "results.tsv"
    failures = 0
    for i in range(1, args.runs + 1):
        if (args.workdir / "STOP").exists():
            print("STOP file found: ending the series", file=sys.stderr)
            break
        # resolved per run: a series on HEAD follows the commits made while it runs
        commit = subprocess.run(["git", "-C", str(args.source), "rev-parse", args.commit], check=True,
                                capture_output=True, text=True).stdout.strip()
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
        name = f"{commit[:7]}-{stamp}"
        folder, log = args.workdir / name, args.workdir / f"{name}.log"
        load0 = load_average()
        rc, seconds = one_run(args.source, commit, folder, log, args.timeout_s)
        load1 = load_average()
        summary = pytest_summary(log) or f"no pytest summary (exit {rc}); see {log}"
        if rc == 0:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            failures += 1
        with results.open("a") as out:
            out.write(f"{name}\t{commit[:7]}\t{stamp}\t{rc}\t{seconds:.0f}s\tload {load0}->{load1}\t{summary}\n")
        when = dt.datetime.strptime(stamp, "%Y%m%dT%H%M%S").strftime("%m-%d %H:%M")
        result = summary.split(" in ")[0] if rc == 0 else f"**exit {rc}**: {summary.split(' in ')[0]}"
        print(f"| {when} | `{commit[:7]}` | {result} | {seconds / 60:.0f} min (whole run) | "
              f"load {load0}->{load1} |", flush=True)
        print(f"run {i}/{args.runs}: exit {rc} in {seconds:.0f} s", file=sys.stderr, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
