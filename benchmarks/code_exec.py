"""Sandboxed executions per second: the ``code_exec`` reward through the reward runner's pool of
``--workers`` threads (each waiting on one sandbox) against one at a time (``workers=1``).

The batch is ``--batch`` completions (a GRPO step's worth), each a small program run against one
stdin/stdout test case; ``--hostile`` of them are ``while True: pass`` (killed at ``cpu_s=1``) to show
what a batch with runaway programs costs. Each arm is timed ``--repeats`` times; the median is reported.

    python benchmarks/code_exec.py [--batch 64] [--workers 1,2,4,8] [--hostile 0] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from rlite.config import Choice
from rlite.plugin_manager import RlitePluginManager
from rlite.plugins import code_exec as plugin
from rlite.rewards import FailureLimits, build_reward_runner
from rlite.sandbox import probe_isolation

PROGRAM = "n = int(input())\nprint(sum(i * i for i in range(n)))\n"
LOOP = "while True:\n    pass\n"


def batch(size: int, hostile: int) -> tuple[list[str], list[dict]]:
    completions = [LOOP if i < hostile else PROGRAM for i in range(size)]
    samples = [{"tests": [{"stdin": f"{i}\n", "stdout": str(sum(k * k for k in range(i)))}]} for i in range(size)]
    return completions, samples


def measure(workers: int, completions: list[str], samples: list[dict], repeats: int) -> tuple[float, dict]:
    pm = RlitePluginManager()
    pm.register(plugin, name="rlite.plugins.code_exec")
    choice = Choice("code_exec", {"extract": "whole", "timeout_s": 30, "cpu_s": 1})
    runner = build_reward_runner([choice], pm.registry("reward_function"), timeout_s=600, workers=workers,
                                 limits=FailureLimits(1.0, 1.0))
    times, stats = [], {}
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            result = runner.score(completions, samples)
            times.append(time.perf_counter() - start)
            stats = result.stats
    finally:
        runner.close()
    return statistics.median(times), stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--hostile", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, isolation: {probe_isolation().summary}")
    completions, samples = batch(args.batch, args.hostile)
    print(f"batch {args.batch} ({args.hostile} hostile), median of {args.repeats}")
    print("| workers | s per batch | executions / s | vs one at a time | passed | n_ok | n_cpu |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    serial = None
    for workers in [int(w) for w in args.workers.split(",")]:
        seconds, stats = measure(workers, completions, samples, args.repeats)
        rate = args.batch / seconds
        serial = serial or rate
        passed = stats["reward/code_exec"] * args.batch
        print(f"| {workers} | {seconds:.2f} | {rate:.1f} | {rate / serial:.2f}x | {passed:.0f} | "
              f"{stats['reward/code_exec/n_ok']:.0f} | {stats['reward/code_exec/n_cpu']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
