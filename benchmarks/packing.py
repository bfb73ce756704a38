"""Padded vs packed vs packed + token-budget micro-batches on a batch whose lengths vary widely.

One optimizer step of the real FSDP2 backend (one process, world size 1) on a fixed synthetic batch:
64 sequences whose prompts have 8-40 tokens and whose responses have 4-40 tokens (three in four) or
120-200 tokens (one in four), as a batch mixing short answers with long reasoning traces does. Each
mode runs in its own child process (so each peak RSS is that mode's own), the modes interleaved
A B C A B C over ``--repeats`` rounds; a child times ``--steps`` steps after one warm-up step and
reports the median step time (CPU time of the process and wall time: on a shared machine the CPU
time is the one to compare), its peak RSS and the padding fraction of what it computed.

Modes:
- ``padded``: fixed-size micro-batches of ``--micro`` sequences, padded rectangles (rlite's default);
- ``packed``: the same micro-batches, each run padding-free (``training.pack_sequences=true``);
- ``packed+budget``: padding-free micro-batches of at most ``--budget`` real-plus-padding positions
  (``training.max_tokens_per_micro_batch``), sequences grouped by length.

    OMP_NUM_THREADS=1 python benchmarks/packing.py [--repeats 3] [--steps 3] [--micro 16] [--budget 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("padded", "packed", "packed+budget")


def varied_batch(seed: int = 0):
    import torch

    from rlite.engines.base import Completion
    from rlite.rollout import ScoredBatch, Scores, build_rollout_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 250, (int(torch.randint(8, 41, (1,), generator=g)),), generator=g).tolist()
               for _ in range(16)]
    completions = []
    for p in range(16):
        for _ in range(4):
            long = torch.rand(1, generator=g).item() < 0.25
            length = int(torch.randint(120, 201, (1,), generator=g)) if long else int(torch.randint(4, 41, (1,), generator=g))
            ids = torch.randint(3, 250, (length,), generator=g).tolist()
            completions.append(Completion(p, ids, [0.0] * length, "stop", 0))
    batch = build_rollout_batch(prompts, completions, [{"answer": ""}] * 16, 0, pad_token_id=0)
    scores = torch.randint(0, 3, (len(completions),), generator=g).float()
    return ScoredBatch.of(batch, Scores(scores=scores, correct=scores > 0, reward_components=scores[:, None]))


def child(mode: str, steps: int, micro: int, budget: int, hidden: int, layers: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from rlite.algorithms import AdvantageInput
    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.plugin_manager import build_plugin_manager
    from rlite.plugins.fsdp2.backend import FSDP2Backend
    from rlite.rollout import TrainTargets
    from rlite.stages.update import LossSpec, update_policy
    from rlite.tokenizer import build_tiny_model_dir
    from rlite.training.backend import ForwardSpec

    model_dir = build_tiny_model_dir(Path(tempfile.mkdtemp()) / "m", hidden=hidden, layers=layers,
                                     intermediate=4 * hidden, max_position_embeddings=512)
    backend = FSDP2Backend.build(ModelConfig(path=str(model_dir)), ParallelismConfig(shard_single_process=False),
                                 TrainingConfig(lr=1e-5, micro_batch_size=micro), torch.device("cpu"),
                                 total_optimizer_steps=steps + 1)
    pm = build_plugin_manager(autoload=False)
    grpo, ppo_clip = pm.registry("advantage_estimator").get("grpo"), pm.registry("policy_loss").get("ppo_clip")
    batch = varied_batch()
    advantages, returns = grpo.implementation(AdvantageInput(batch.scores, batch.group_ids, batch.response_mask),
                                              grpo.config_cls())
    targets = TrainTargets(advantages, returns, batch.response_mask.clone())
    spec = ForwardSpec(micro_batch_size=micro, temperature=1.0, chunk_size=256, exact_layout=False,
                       pack_sequences=mode != "padded", max_tokens_per_micro_batch=budget if mode == "packed+budget" else 0)
    loss = LossSpec(ppo_clip.implementation, ppo_clip.config_cls(), "token-mean", None, None, 0.0, 0.0)
    times, cpu, metrics = [], [], {}
    for step in range(steps + 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        metrics = update_policy(backend, batch, targets, spec, loss, minibatches=1, epochs=1, dp_size=1).metrics
        if step:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    dist.destroy_process_group()
    return {"mode": mode, "step_s": statistics.median(times), "cpu_s": statistics.median(cpu), "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "padding_fraction": metrics["batching/padding_fraction"], "micro_batches": metrics["batching/micro_batches"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.micro, args.budget, args.hidden, args.layers)))
        return
    rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(args.repeats):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--micro",
                                  str(args.micro), "--budget", str(args.budget), "--hidden", str(args.hidden),
                                  "--layers", str(args.layers)], env=env, capture_output=True, text=True,
                                 timeout=1800, check=True)
            rows[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = statistics.median(r["step_s"] for r in rows["padded"])
    base_cpu = statistics.median(r["cpu_s"] for r in rows["padded"])
    base_rss = statistics.median(r["peak_rss_gib"] for r in rows["padded"])
    print(f"model: Qwen2, hidden {args.hidden}, {args.layers} layers; batch: 64 sequences, 8-40 prompt tokens, "
          f"responses 4-40 (3 in 4) or 120-200 tokens; micro-batch {args.micro}, budget {args.budget}; "
          f"{args.repeats} rounds x {args.steps} steps\n")
    print("| mode | CPU s/step | vs padded | wall s/step | vs padded | peak RSS GiB | vs padded | padding fraction | "
          "micro-batches |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in MODES:
        step = statistics.median(r["step_s"] for r in rows[mode])
        cpu = statistics.median(r["cpu_s"] for r in rows[mode])
        rss = statistics.median(r["peak_rss_gib"] for r in rows[mode])
        last = rows[mode][-1]
        print(f"| {mode} | {cpu:.3f} | {cpu / base_cpu:.2f}x | {step:.3f} | {step / base:.2f}x | {rss:.3f} | {rss / base_rss:.2f}x | "
              f"{last['padding_fraction']:.3f} | {last['micro_batches']:.0f} |")


if __name__ == "__main__":
    main()
