"""Run every algorithm recipe in configs/ on the quickstart task and plot their learning curves.

    python benchmarks/recipe_curves.py [--steps 100] [--recipes grpo,dapo,...] [--out runs/recipes]

Each recipe runs as `python -m rlite train configs/<recipe>.yaml` in its own process, one after the
other, one thread each. Writes docs/images/recipes.png (smoothed training reward and held-out greedy
accuracy per recipe) and prints a table for benchmarks/RESULTS.md.
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
RECIPES = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "ppo"]


def run_recipe(recipe: str, steps: int, out: Path, timeout: float) -> float:
    run_dir = out / recipe
    cmd = [
        sys.executable, "-m", "rlite", "train", str(ROOT / "configs" / f"{recipe}.yaml"),
        f"training.steps={steps}", f"logging.run_dir={run_dir}", "checkpoint.resume=never", "checkpoint.every=0",
        "checkpoint.save_final=false", "checkpoint.export_hf=false", "logging.progress_bar=false",
        "logging.plot=false", "training.eval_every=20", "training.num_threads=1",
    ]
    start = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=timeout, capture_output=True)
    return time.perf_counter() - start


def load(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def smooth(values: list[float], window: int = 10) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--out", default=str(ROOT / "runs" / "recipes"))
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    out = Path(args.out)
    recipes = args.recipes.split(",")
    walls = {}
    if not args.plot_only:
        for recipe in recipes:
            walls[recipe] = run_recipe(recipe, args.steps, out, args.timeout)
            print(f"{recipe}: {walls[recipe]:.0f} s", flush=True)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_reward, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.5))
    print("| recipe | train reward, first 10 steps → last 10 | held-out greedy accuracy, step 0 → last | wall s |")
    print("|---|---|---|---:|")
    for recipe in recipes:
        rows = load(out / recipe)
        trained = [r for r in rows if "reward/mean" in r]
        evals = [r for r in rows if "eval/greedy_accuracy" in r]
        rewards = [r["reward/mean"] for r in trained]
        ax_reward.plot([r["step"] for r in trained], smooth(rewards), label=recipe)
        ax_eval.plot([r["step"] for r in evals], [r["eval/greedy_accuracy"] for r in evals], marker="o", label=recipe)
        first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
        acc0, acc1 = evals[0]["eval/greedy_accuracy"], evals[-1]["eval/greedy_accuracy"]
        wall = f"{walls[recipe]:.0f}" if recipe in walls else "-"
        print(f"| {recipe} | {first:.3f} → {last:.3f} | {acc0:.3f} → {acc1:.3f} | {wall} |")
    ax_reward.set(title="training reward (10-step moving average)", xlabel="step", ylabel="reward")
    ax_eval.set(title="held-out greedy accuracy (64 prompts)", xlabel="step", ylabel="accuracy")
    for ax in (ax_reward, ax_eval):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    target = ROOT / "docs" / "images" / "recipes.png"
    fig.savefig(target, dpi=110)
    print(f"plot: {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
