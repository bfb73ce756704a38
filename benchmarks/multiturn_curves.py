"""Run the multi-turn recipes (configs/multiturn_*.yaml) and print what their environments measured.

    python benchmarks/multiturn_curves.py [--steps 60] [--recipes multiturn_arithmetic,multiturn_calculator]
        [--model PATH] [--seeds 0] [--out runs/multiturn] [-- key=value ...]

Each run is `python -m rlite train configs/<recipe>.yaml` in its own process, one after the other, one
thread each, evaluated greedily every 20 steps on 128 held-out prompts played through the environment.
Prints, per run, the training reward and the environment's metrics (``rollout/env/*``: per-turn
correctness, tool calls) over the first and last 10 steps, and the held-out greedy reward and metrics
(``eval/greedy_*``) at step 0 and at the end: the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["multiturn_arithmetic", "multiturn_calculator"]


def run(recipe: str, steps: int, seed: int, run_dir: Path, extra: list[str], timeout: float) -> float:
    cmd = [
        sys.executable, "-m", "rlite", "train", str(ROOT / "configs" / f"{recipe}.yaml"),
        f"training.steps={steps}", f"training.seed={seed}", f"logging.run_dir={run_dir}", "checkpoint.resume=never",
        "checkpoint.every=0", "checkpoint.save_final=false", "checkpoint.export_hf=false", "logging.progress_bar=false",
        "logging.plot=false", "logging.loggers=[jsonl]", "training.eval_every=20", "training.eval_max_prompts=128",
        "data.num_eval=128", "training.num_threads=1", *extra,
    ]  # fmt: skip
    start = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=timeout, capture_output=True)
    return time.perf_counter() - start


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return sum(values) / max(len(values), 1)


def summary(run_dir: Path) -> dict[str, str]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/greedy_reward" in r]
    first, last = train[:10], train[-10:]
    keys = sorted({k for r in train for k in r if k.startswith("rollout/env/")})
    out = {"train reward": f"{mean(first, 'reward/mean'):.3f} → {mean(last, 'reward/mean'):.3f}"}
    out.update({k.removeprefix("rollout/env/"): f"{mean(first, k):.3f} → {mean(last, k):.3f}" for k in keys})
    out["eval greedy reward"] = f"{evals[0]['eval/greedy_reward']:.3f} → {evals[-1]['eval/greedy_reward']:.3f}"
    eval_keys = sorted({k for r in evals for k in r if k.startswith("eval/greedy_env/")})
    out.update({"eval " + k.removeprefix("eval/greedy_env/"): f"{evals[0][k]:.3f} → {evals[-1][k]:.3f}" for k in eval_keys})
    out["curve (train reward, 10-step means)"] = " ".join(
        f"{mean(train[i : i + 10], 'reward/mean'):.2f}" for i in range(0, len(train), 10))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--model", default=None, help="model.path for every run (default: the recipe's)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "multiturn"))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for every run")
    args = parser.parse_args()
    extra = list(args.overrides) + ([f"model.path={args.model}"] if args.model else [])
    for recipe in args.recipes.split(","):
        for seed in map(int, args.seeds.split(",")):
            run_dir = Path(args.out) / f"{recipe}-seed{seed}"
            wall = run(recipe, args.steps, seed, run_dir, extra, args.timeout)
            print(f"## {recipe}, seed {seed}, {args.steps} steps, {wall:.0f} s wall", flush=True)
            for key, value in summary(run_dir).items():
                print(f"  {key}: {value}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
