"""The reward runner before and after the worker pools, on a quickstart-sized batch (256 completions).

Arms, each timed on the same batch:

* ``previous``: the runner of commit b6c229f (a new thread per call, per-call timeouts one after
  another per worker slot, hung threads abandoned), loaded from git;
* ``inline``: today's runner with ``exact_match`` registered inline (the quickstart's reward);
* ``process``: today's runner with a ``python`` reward (a user's file) in 4 worker processes.

Two workloads: ``exact`` (exact match, microseconds a call) and ``hang`` (every call sleeps for
longer than the timeout; 64 calls, timeout 1 s, 4 workers). Times are medians of ``--repeats``.

    python benchmarks/reward_runner.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

USER_FILE = '''
import time


def exact(completion, sample):
    return 1.0 if completion.strip() == str(sample["answer"]) else 0.0


def hang(completion, sample):
    time.sleep(30)
    return 1.0
'''


def previous_runner_module():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "-C", root, "show", "b6c229f:trainer/reward_runner.py"], capture_output=True,
                            text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "previous_rewards.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("previous_rewards", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed(score, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        score()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from rlite.config import Choice
    from rlite.plugin_manager import RlitePluginManager
    from rlite.plugins import rewards as builtin
    from rlite.reward_runner import FailureLimits, build_reward_runner

    pm = RlitePluginManager()
    pm.register(builtin, name="rlite.plugins.rewards")
    registry = pm.registry("reward_function")
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "user_rewards.py"), "w") as f:
        f.write(USER_FILE)
    completions = [str(n) for n in range(256)]
    samples = [{"prompt": f"{n}+0=", "answer": str(n if n % 3 else n + 1)} for n in range(256)]
    tolerant = FailureLimits(1.0, 1.0)
    previous = previous_runner_module()

    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    print("| workload | arm | median s | calls |")
    print("|---|---|---|---|")
    old = previous.build_reward_runner([Choice("exact_match")], registry)
    print(f"| exact | previous (thread per call) | {timed(lambda: old.score(completions, samples), args.repeats):.4f} | 256 |")
    inline = build_reward_runner([Choice("exact_match")], registry)
    print(f"| exact | inline | {timed(lambda: inline.score(completions, samples), args.repeats):.4f} | 256 |")
    user = build_reward_runner([Choice("python", {"function": f"{folder}/user_rewards.py:exact"})], registry)
    user.score(completions[:4], samples[:4])  # the workers start once
    print(f"| exact | process (python reward, 4 workers) | {timed(lambda: user.score(completions, samples), args.repeats):.4f} | 256 |")
    user.close()

    hang_c, hang_s = completions[:64], samples[:64]
    old_registry = {"hang": (lambda c, s, cfg: time.sleep(30))}
    old_hang = previous.RewardRunner([("hang", old_registry["hang"], None, 1.0)], timeout_s=1.0, max_workers=4)
    print(f"| hang | previous (thread per call) | {timed(lambda: old_hang.score(hang_c, hang_s), 1):.2f} | 64 |")
    hang = build_reward_runner([Choice("python", {"function": f"{folder}/user_rewards.py:hang"})], registry,
                               timeout_s=1.0, workers=4, limits=tolerant)
    hang.score(completions[:1], samples[:1])
    print(f"| hang | process (python reward, 4 workers) | {timed(lambda: hang.score(hang_c, hang_s), 3):.2f} | 64 |")
    hang.close()


if __name__ == "__main__":
    main()
