"""Where the time of one tiny GRPO job goes, fsdp2 against megatron: the MoE job of
``benchmarks/backends_moe.py`` (``--job moe``, the default) or the dense quickstart (``--job quickstart``:
``configs/quickstart.yaml`` with evaluation and checkpoints off) run under ``torch.profiler`` (CPU), one
process per backend.

Printed per backend: rlite's per-phase ``time/*`` medians (steps after the first), peak RSS, and the
operators with the most self CPU time over the whole run (rollout included: the same engine for both).

    python benchmarks/profile_backends.py [--job moe|quickstart] [--steps 4] [--rows 25] [--backends fsdp2,megatron]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backends_moe import QUICKSTART, overrides_for, quickstart_overrides  # noqa: E402

CHILD = r"""
import json, resource, statistics, sys, torch
torch.set_num_threads(1)
from torch.profiler import ProfilerActivity, profile
from rlite.config import load_config
from rlite.run.loop import run_training
from rlite.plugin_manager import build_plugin_manager
spec = json.loads(sys.argv[1])
pm = build_plugin_manager()
cfg = load_config(spec["config"], spec["overrides"], pm)
with profile(activities=[ProfilerActivity.CPU], profile_memory=spec["memory"]) as prof:
    run_training(cfg, pm)
rows = [json.loads(l) for l in open(spec["run_dir"] + "/metrics.jsonl") if '"reward/mean"' in l][1:]
phases = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.startswith("time/")}
print("phases", json.dumps({k: round(v, 3) for k, v in sorted(phases.items())}))
print("peak_rss_mib", round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
sort = "self_cpu_memory_usage" if spec["memory"] else "self_cpu_time_total"
print(prof.key_averages().table(sort_by=sort, row_limit=spec["rows"], max_name_column_width=60))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=["moe", "quickstart"], default="moe")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--backends", default="fsdp2,megatron")
    parser.add_argument("--memory", action="store_true", help="sort by self CPU memory instead of time")
    args = parser.parse_args()
    from rlite.tokenizer import build_tiny_model_dir

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.job == "moe":
            model_dir = build_tiny_model_dir(work / "moe", hidden=128, layers=2, heads=4, kv_heads=2,
                                             intermediate=256, num_experts=8, experts_per_token=2)
        for backend in args.backends.split(","):
            run_dir = work / backend
            if args.job == "moe":
                config, overrides = None, overrides_for(backend, model_dir, run_dir, args.steps)
            else:
                config, overrides = str(QUICKSTART), quickstart_overrides(backend, run_dir, args.steps)
            spec = {"config": config, "overrides": overrides, "run_dir": str(run_dir), "rows": args.rows,
                    "memory": args.memory}
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True,
                                 env=env, timeout=1800)
            print(f"===== {backend}\n{out.stdout}", flush=True)
            if out.returncode:
                print(out.stderr[-3000:])
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
