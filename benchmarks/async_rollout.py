"""Synchronous, one-step-off and asynchronous rollouts on the quickstart job: steps/s and reward curves.

Each mode trains the quickstart model (``configs/quickstart.yaml``: 2-digit addition, exact match,
GRPO) for ``--steps`` steps in a fresh process, the modes alternating over ``--repeats`` rounds, with
the same seed and the same engine (the in-process transformers engine with its own copy of the
weights, ``share_weights=false``, which the overlapping modes need; the sync run uses it too, so only
the mode differs). Reported per mode: steps per second over the steps after the first (wall clock
between the ends of the first and the last step, from an ``on_metrics`` hook), the mean time waiting for a rollout batch, the mean
and max staleness, the fraction of samples whose tokens span a weight sync (partial rollouts), mismatch KL,
and the reward curve (mean reward over windows of the run's steps).
``--plot`` writes the reward curves to benchmarks/async_rollout.png.

    flock /tmp/rlite-bench.lock python benchmarks/async_rollout.py [--steps 40] [--repeats 1] [--modes 2,3] [--append]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import cpu_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
MODES = {
    "sync": ["rollout.mode=sync"],
    "one_step_off": ["rollout.mode=one_step_off"],
    "async (max_staleness 2)": ["rollout.mode=async", "rollout.max_staleness=2"],
    "async + partial segments of 2 tokens": ["rollout.mode=async", "rollout.max_staleness=2",
                                             "rollout.partial_segment_tokens=2"],
}

CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from rlite import hookimpl
from rlite.config import load_config
from rlite.run.loop import run_training
from rlite.plugin_manager import build_plugin_manager
spec = json.loads(sys.argv[1])
ends = {}
class Clock:
    @hookimpl
    def on_metrics(self, step, metrics):
        ends[step] = time.perf_counter()
pm = build_plugin_manager(autoload=False)
pm.register(Clock(), name="clock")
cfg = load_config(spec["config"], spec["overrides"], pm)
run_training(cfg, pm)
rows = [json.loads(l) for l in open(spec["run_dir"] + "/metrics.jsonl") if '"reward/mean"' in l]
for row in rows:
    row["wall_end"] = ends[row["step"]]
print("RESULT " + json.dumps(rows))
"""


def run_mode(mode: str, steps: int, extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"training.steps={steps}", "training.eval_every=0", "checkpoint.every=0", "checkpoint.resume=never",
            "checkpoint.save_final=false", "checkpoint.export_hf=false", "logging.progress_bar=false",
            "logging.plot=false", "logging.loggers=[jsonl]", f"logging.run_dir={tmp}",
            "rollout.engine.args.share_weights=false", *MODES[mode], *extra,
        ]  # fmt: skip
        spec = {"config": str(ROOT / "configs" / "quickstart.yaml"), "overrides": overrides, "run_dir": tmp}
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                             cwd=ROOT, timeout=3600, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")
        return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])


def summarize(rows: list[dict], windows: int) -> dict:
    rewards = [r["reward/mean"] for r in rows]
    size = max(1, len(rewards) // windows)
    return {  # wall clock between the ends of the first and the last step (the first pays start-up costs)
        "steps_per_s": (len(rows) - 1) / (rows[-1]["wall_end"] - rows[0]["wall_end"]),
        "wait_s": statistics.mean(r.get("time/rollout_wait", 0.0) for r in rows[1:]),
        "staleness_mean": statistics.mean(r.get("rollout/staleness_mean", 0.0) for r in rows),
        "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in rows),
        "mismatch_kl": statistics.mean(abs(r.get("mismatch/kl", 0.0)) for r in rows[1:]),
        "partial": statistics.mean(r.get("rollout/partial_fraction", 0.0) for r in rows),
        "curve": [statistics.mean(rewards[i : i + size]) for i in range(0, len(rewards), size)],
        "rewards": rewards,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--plot", action="store_true", help="write benchmarks/async_rollout.png")
    parser.add_argument("--modes", default="", help="comma-separated indices into the modes (default: all)")
    parser.add_argument("extra", nargs="*", help="more key=value overrides for every mode")
    args = parser.parse_args()
    chosen = [list(MODES)[int(i)] for i in args.modes.split(",")] if args.modes else list(MODES)
    results: dict[str, list[dict]] = {mode: [] for mode in chosen}
    started = time.strftime("%Y-%m-%d %H:%M")
    for _ in range(args.repeats):
        for mode in chosen:
            results[mode].append(summarize(run_mode(mode, args.steps, args.extra), args.windows))
    lines = [
        f"### async_rollout.py: quickstart job, {args.steps} steps, {args.repeats} round(s) ({started}, {cpu_model()})",
        "",
        f"| mode | steps/s | rollout wait (s/step) | staleness mean / max | partial fraction | mismatch KL | mean reward over {args.windows} windows of the run |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, runs in results.items():
        curve = [statistics.mean(r["curve"][i] for r in runs) for i in range(min(len(r["curve"]) for r in runs))]
        lines.append(
            f"| {mode} | {statistics.mean(r['steps_per_s'] for r in runs):.3f} | "
            f"{statistics.mean(r['wait_s'] for r in runs):.3f} | "
            f"{statistics.mean(r['staleness_mean'] for r in runs):.2f} / {max(r['staleness_max'] for r in runs):g} | "
            f"{statistics.mean(r['partial'] for r in runs):.2f} | "
            f"{statistics.mean(r['mismatch_kl'] for r in runs):.2e} | {' → '.join(f'{c:.3f}' for c in curve)} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for mode, runs in results.items():
            ax.plot(range(1, len(runs[0]["rewards"]) + 1), runs[0]["rewards"], label=mode)
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.legend()
        fig.tight_layout()
        fig.savefig(ROOT / "benchmarks" / "async_rollout.png", dpi=100)
    if args.append:
        with RESULTS.open("a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
