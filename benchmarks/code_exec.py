"""Sandboxed executions per second: the ``code_exec`` reward through the reward runner's pool of
``--workers`` threads (each waiting on one sandbox) against one at a time (``workers=1``).

The batch is ``--batch`` completions (a GRPO step's worth), each a small program run against one
stdin/stdout test case; ``--hostile`` of them are ``while True: pass`` (killed at ``cpu_s=1``) to show
what a batch with runaway programs costs. Each arm is timed ``--repeats`` times; the median is reported.

    python benchmarks/code_exec.py [--batch 64] [--workers 1,2,4,8] [--hostile 0] [--repeats 3]

``--campaign N`` instead runs each hostile program of :data:`HOSTILE` N times through ``code_exec``
and counts, per program, the failure kinds seen, the runs scored 0, and the runs contained: no
process of the run's uid left afterwards and the trainer's stand-in child (a ``sleep``) alive.

    python benchmarks/code_exec.py --campaign 10
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import subprocess
import time

from rlite import sandbox
from rlite.config import Choice
from rlite.plugin_manager import RlitePluginManager
from rlite.plugins import code_exec as plugin
from rlite.reward_runner import FailureLimits, build_reward_runner
from rlite.sandbox import probe_isolation

PROGRAM = "n = int(input())\nprint(sum(i * i for i in range(n)))\n"
LOOP = "while True:\n    pass\n"


HOSTILE = {
    "infinite loop": "while True:\n    pass\n",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "memory hog": "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n",
    "disk filler": "import itertools\nfor n in itertools.count():\n    open('/tmp/f%d' % n, 'wb').write(b'x' * (1 << 20))\n",
    "write outside": "open('/etc/rlite-escaped', 'w').write('out')\n",
    "socket to 127.0.0.1": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=5)\n",
    "read run folder": "print(open('benchmarks/RESULTS.md').read()[:10])\n",
    "kill parent, kill -1": "import os\nfor t in (os.getppid(), -1):\n    try:\n        os.kill(t, 9)\n    except OSError:\n"
                            "        pass\nos.kill(0, 9)\n",
    "sleeper with children": "import os, time\nfor _ in range(5):\n    if os.fork() == 0:\n        os.setsid()\n"
                             "        time.sleep(1000)\ntime.sleep(1000)\n",
    "print gigabytes": "import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))\n",
}
"""The hostile programs of tests/faults/test_sandbox_containment.py (the run-folder reader reads a
file of the trainer's working folder; run from the repository root)."""
CAMPAIGN_LIMITS = {"timeout_s": 5, "cpu_s": 1, "memory_mb": 256, "nproc": 16, "disk_mb": 8, "output_bytes": 1 << 16}


def campaign(trials: int) -> None:
    results: list[sandbox.SandboxResult] = []

    def recording(*args, **kwargs):
        results.append(sandbox.run_untrusted(*args, **kwargs))
        return results[-1]

    plugin.run_untrusted = recording
    cfg = plugin.CodeExecConfig(extract="whole", **CAMPAIGN_LIMITS)
    print(f"{trials} trials each; limits {CAMPAIGN_LIMITS}")
    print("| program | runs | scored 0 | contained | kinds |")
    print("|---|---:|---:|---:|---|")
    for name, program in HOSTILE.items():
        kinds: collections.Counter = collections.Counter()
        zero = contained = 0
        for _ in range(trials):
            stand_in = subprocess.Popen(["sleep", "600"])
            results.clear()
            outcome = plugin.code_exec(program, {"tests": [{"stdout": "never printed"}]}, cfg)
            (result,) = results
            kinds[result.kind] += 1
            zero += outcome.value == 0.0
            left = result.uid is not None and any(
                entry.name.isdigit() and _uid_of(entry.path) == result.uid for entry in os.scandir("/proc"))
            contained += stand_in.poll() is None and not left and not os.path.exists("/etc/rlite-escaped")
            stand_in.kill()
            stand_in.wait(timeout=10)
        print(f"| {name} | {trials} | {zero} | {contained} | {', '.join(f'{k} {n}' for k, n in kinds.items())} |", flush=True)


def _uid_of(path: str) -> int | None:
    try:
        return os.stat(path).st_uid
    except OSError:
        return None


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
    parser.add_argument("--campaign", type=int, default=0)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, isolation: {probe_isolation().summary}")
    if args.campaign:
        campaign(args.campaign)
        return
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
