"""FSDP2 against megatron-core on the same tiny GRPO job: step time and peak memory.

Each backend trains the same model (``--job moe``: a Qwen3-MoE made by ``rlite.tokenizer.build_tiny_model_dir``;
``--job quickstart``: ``configs/quickstart.yaml``'s dense warm start and settings, checkpoints and periodic
evaluation off; the loop still evaluates at step 0 and at the last step) with the same config in a fresh process, one thread, alternating A B A B over ``--repeats`` pairs;
every process reports its per-phase ``time/*`` metrics (rlite's own, from ``metrics.jsonl``), the CPU
seconds of each step and policy update (``time.process_time``: on a loaded machine far steadier than wall
time) and its peak RSS (``ru_maxrss``). Printed: median seconds per step over the steps after the first, the
training phase alone, the weight sync, peak RSS, and the megatron/fsdp2 ratio of each pair.

    python benchmarks/backends_moe.py [--job moe|quickstart] [--steps 12] [--repeats 2] [--experts 8] [--hidden 128]
        [--append]
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

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.yaml"

CHILD = r"""
import json, resource, sys, time, torch
torch.set_num_threads(1)
import rlite.run.loop as loop
import rlite.run.policy as policy
from rlite.config import load_config
from rlite.plugin_manager import build_plugin_manager
from rlite.run.recorder import Recorder
# CPU seconds (one thread: the process's own work, much less sensitive to a loaded machine than wall
# time): at each metrics row logged, and of each policy update
marks, train_cpu = [], []
log_row, update_policy = Recorder.log, policy.update_policy
def timed_log_row(self, *args, **kwargs):
    marks.append(time.process_time())
    return log_row(self, *args, **kwargs)
def timed_update_policy(*args, **kwargs):
    start = time.process_time()
    try:
        return update_policy(*args, **kwargs)
    finally:
        train_cpu.append(time.process_time() - start)
Recorder.log, policy.update_policy = timed_log_row, timed_update_policy
spec = json.loads(sys.argv[1])
pm = build_plugin_manager()
cfg = load_config(spec["config"], spec["overrides"], pm)
loop.run_training(cfg, pm)
rows = [json.loads(l) for l in open(spec["run_dir"] + "/metrics.jsonl") if '"reward/mean"' in l]
# marks[0] is the step-0 evaluation's; the last step also evaluates
step_cpu = [b - a for a, b in zip(marks[1:], marks[2:])][:-1]
print("RESULT " + json.dumps({"rows": rows, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                              "step_cpu": step_cpu, "train_cpu": train_cpu[1:]}))
"""


def torch_version() -> str:
    import torch

    return torch.__version__


def megatron_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def overrides_for(backend: str, model_dir: Path, run_dir: Path, steps: int) -> list[str]:
    """The job's config: the same for both backends but ``parallelism.backend``."""
    return [
        f"model.path={model_dir}", "data.task=addition", "data.num_train=256", "data.num_eval=16",
        f"training.steps={steps}", "training.micro_batch_size=32", "training.eval_every=0", "training.num_threads=1",
        "rollout.prompts_per_step=8", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=16",
        f"parallelism.backend={backend}", f"logging.run_dir={run_dir}", "logging.progress_bar=false",
        "logging.plot=false", "logging.loggers=[jsonl]", "checkpoint.every=0", "checkpoint.save_final=false",
        "checkpoint.export_hf=false", "checkpoint.resume=never",
    ]


def quickstart_overrides(backend: str, run_dir: Path, steps: int) -> list[str]:
    """``configs/quickstart.yaml`` for ``steps`` steps: no checkpoints, plots or periodic evaluation (the loop still
    evaluates its 256 held-out prompts at step 0 and at the last step)."""
    return [
        f"model.path={ROOT / 'examples/warmstart/addition-qwen2-1m'}", f"training.steps={steps}", "training.eval_every=0",
        f"parallelism.backend={backend}", f"logging.run_dir={run_dir}", "logging.progress_bar=false",
        "logging.plot=false", "logging.loggers=[jsonl]", "checkpoint.every=0", "checkpoint.save_final=false",
        "checkpoint.export_hf=false", "checkpoint.resume=never",
    ]


def run_backend(backend: str, model_dir: Path | None, work: Path, steps: int, tag: str) -> dict:
    """One training process; ``model_dir`` None: the quickstart job."""
    run_dir = work / tag
    if model_dir is None:
        config, overrides = str(QUICKSTART), quickstart_overrides(backend, run_dir, steps)
    else:
        config, overrides = None, overrides_for(backend, model_dir, run_dir, steps)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    spec = json.dumps({"config": config, "overrides": overrides, "run_dir": str(run_dir)})
    out = subprocess.run([sys.executable, "-c", CHILD, spec], capture_output=True, text=True, env=env, timeout=1800)
    line = next((text for text in out.stdout.splitlines() if text.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"{backend} run failed:\n{out.stderr[-3000:]}")
    result = json.loads(line[len("RESULT "):])
    steady = result["rows"][1:]  # the first step pays for warm-up
    return {
        "step_cpu_s": statistics.median(result["step_cpu"]),
        "train_cpu_s": statistics.median(result["train_cpu"]),
        "step_s": statistics.median(r["time/step"] for r in steady),
        "train_s": statistics.median(r["time/train"] for r in steady),
        "sync_s": statistics.median(r["time/weight_sync"] for r in steady),
        "peak_rss_mib": result["peak_rss_mib"],
        "reward_last": result["rows"][-1]["reward/mean"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=["moe", "quickstart"], default="moe")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    from rlite.tokenizer import build_tiny_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = None
        if args.job == "moe":
            model_dir = build_tiny_model_dir(work / "moe", hidden=args.hidden, layers=2, heads=4, kv_heads=2,
                                             intermediate=2 * args.hidden, num_experts=args.experts, experts_per_token=2)
        pairs = []
        for index in range(args.repeats):
            fsdp2 = run_backend("fsdp2", model_dir, work, args.steps, f"fsdp2-{index}")
            megatron = run_backend("megatron", model_dir, work, args.steps, f"megatron-{index}")
            pairs.append((fsdp2, megatron))
            print(f"pair {index}: fsdp2 {fsdp2}  megatron {megatron}", flush=True)
    job = (f"Qwen3-MoE hidden {args.hidden}, 2 layers, {args.experts} experts top-2; GRPO, 8 prompts x 8 samples, "
           "16 new tokens, micro-batch 32" if args.job == "moe" else
           "configs/quickstart.yaml (Qwen2 1M dense; GRPO, 16 prompts x 16 samples, 6 new tokens, micro-batch 128)")
    lines = [
        f"### backends_moe.py --job {args.job}: fsdp2 vs megatron ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores; torch {torch_version()}, megatron-core {megatron_version()}",
        f"- command: `python benchmarks/backends_moe.py --job {args.job} --steps {args.steps} --repeats {args.repeats} "
        f"--experts {args.experts} --hidden {args.hidden}`",
        f"- job: {job}, one process, one thread; medians over steps 2..N",
        "",
        "- CPU s: process CPU seconds (one thread), medians over steps 2..N-1 (the last also evaluates); "
        "wall s: rlite's `time/*` medians over steps 2..N",
        "",
        "| pair | fsdp2 CPU s/step | megatron CPU s/step | ratio | fsdp2 train CPU s | megatron train CPU s | ratio "
        "| fsdp2 wall s/step | megatron wall s/step | ratio | fsdp2 sync ms | megatron sync ms "
        "| fsdp2 peak RSS MiB | megatron peak RSS MiB | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for index, (a, b) in enumerate(pairs):
        lines.append(
            f"| {index} | {a['step_cpu_s']:.3f} | {b['step_cpu_s']:.3f} | {b['step_cpu_s'] / a['step_cpu_s']:.2f} | "
            f"{a['train_cpu_s']:.3f} | {b['train_cpu_s']:.3f} | {b['train_cpu_s'] / a['train_cpu_s']:.2f} | "
            f"{a['step_s']:.3f} | {b['step_s']:.3f} | {b['step_s'] / a['step_s']:.2f} | "
            f"{a['sync_s'] * 1000:.1f} | {b['sync_s'] * 1000:.1f} | {a['peak_rss_mib']:.0f} | {b['peak_rss_mib']:.0f} | "
            f"{b['peak_rss_mib'] / a['peak_rss_mib']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.append:
        with open(RESULTS, "a") as handle:
            handle.write("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
