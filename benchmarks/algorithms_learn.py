"""Does every algorithm learn the quickstart task? Held-out greedy accuracy before and after training.

    flock /tmp/rlite-bench.lock python benchmarks/algorithms_learn.py [--steps 40] [--recipes remax,opo,...]
    python benchmarks/algorithms_learn.py --lock /tmp/rlite-bench.lock     # take the lock per recipe instead

Each recipe's ``algorithm`` section (and its ``rewards`` list, which DAPO and GDPO change) is put into
``configs/quickstart.yaml`` unchanged otherwise: the quickstart's warm-started ~1M Qwen2, 2-digit
addition, 16 prompts x 16 samples, lr 1e-4, seeds. So every algorithm trains on the same task, model,
data order and settings, for the same number of steps, and only the algorithm differs. Each recipe runs
as ``python -m rlite train`` in its own process, one thread, one after the other; the held-out greedy
accuracy (256 prompts) is evaluated at step 0, halfway and at the last step. Prints a Markdown table
(and writes ``results.json`` into ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo", "reinforce_pp", "ppo", "remax", "opo", "gpg", "gdpo",
           "sapo", "gmpo", "reinforce_tis", "vespo"]


def recipe_config(recipe: str) -> dict:
    """configs/quickstart.yaml with the recipe's algorithm section and reward functions."""
    config = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    recipe_cfg = yaml.safe_load((ROOT / "configs" / f"{recipe}.yaml").read_text())
    config["algorithm"] = recipe_cfg["algorithm"]
    config["rewards"] = recipe_cfg.get("rewards", config["rewards"])
    return config


def run_recipe(recipe: str, steps: int, out: Path, lock: str | None, timeout: float) -> dict:
    run_dir = out / recipe
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = out / f"{recipe}.yaml"
    config_file.write_text(yaml.safe_dump(recipe_config(recipe), sort_keys=False))
    cmd = [
        sys.executable, "-m", "rlite", "train", str(config_file),
        f"training.steps={steps}", f"training.eval_every={max(steps // 2, 1)}", f"logging.run_dir={run_dir}",
        "checkpoint.resume=never", "checkpoint.every=0", "checkpoint.save_final=false", "checkpoint.export_hf=false",
        "logging.progress_bar=false", "logging.plot=false", "logging.loggers=[jsonl]", "training.num_threads=1",
    ]
    if lock:
        cmd = ["flock", lock, *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"recipe": recipe, "error": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "provenance" not in r]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    evals = [(r["step"], r["eval/greedy_accuracy"]) for r in rows if "eval/greedy_accuracy" in r]
    algo = recipe_config(recipe)["algorithm"]
    return {"recipe": recipe, "advantage": algo["advantage"], "policy_loss": algo["policy_loss"],
            "loss_agg_mode": algo.get("loss_agg_mode"), "evals": evals, "rewards": rewards, "wall_s": wall}


def name_of(choice) -> str:
    return choice if isinstance(choice, str) else choice["name"]


def table(results: list[dict]) -> str:
    lines = ["| recipe | advantage / policy loss | held-out greedy accuracy by step | change | train reward, first 5 → last 5 steps | wall s |",
             "|---|---|---|---:|---|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['recipe']} | | failed: {r['error']} | | | |")
            continue
        accuracy = " → ".join(f"{acc:.3f} ({step})" for step, acc in r["evals"])
        change = r["evals"][-1][1] - r["evals"][0][1]
        first, last = (sum(part) / len(part) for part in (r["rewards"][:5], r["rewards"][-5:]))
        lines.append(f"| {r['recipe']} | {name_of(r['advantage'])} / {name_of(r['policy_loss'])} | {accuracy} | "
                     f"{change:+.3f} | {first:.3f} → {last:.3f} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--out", default=str(ROOT / "runs" / "algorithms_learn"))
    parser.add_argument("--lock", default=None, help="run each recipe under `flock LOCK` (shared machines)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per recipe")
    parser.add_argument("--table-only", action="store_true", help="print the table of an earlier results.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "results.json"
    if args.table_only:
        print(table(json.loads(results_file.read_text())))
        return 0
    results = []
    for recipe in args.recipes.split(","):
        results.append(run_recipe(recipe, args.steps, out, args.lock, args.timeout))
        results_file.write_text(json.dumps(results, indent=1))
        r = results[-1]
        print(r.get("error") and f"{recipe}: {r['error']}" or f"{recipe}: {r['evals']} ({r['wall_s']:.0f} s)", flush=True)
    print(f"\n{args.steps} steps, quickstart task and settings, one thread per run\n")
    print(table(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
