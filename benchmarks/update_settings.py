"""The policy update on one device, setting by setting: forward + backward + optimizer step of rlite's fsdp2
backend on a fixed batch, with the trainer settings of issue 41 switched one at a time (each setting in its
own process, so that peak memory is its own).

The ``qwen25`` shape is the GPU issue's job: a randomly initialised Qwen2 of Qwen2.5-0.5B's shape (494M
parameters, vocabulary 151,936, tied embeddings; built locally, nothing downloaded), 128 sequences in groups
of 8 sharing a prompt of 195-215 tokens, 256 response tokens each, micro-batches of 32, AdamW, no KL, one
optimizer step per batch. The ``tiny`` shape runs the same code in seconds on a CPU (a smoke test).

    python benchmarks/update_settings.py --shape qwen25 --precision bf16 [--settings auto,fsdp2,...] [--steps 5]
    python benchmarks/update_settings.py --shape tiny --settings auto,fsdp2   # CPU, seconds

Settings (each is the defaults plus its overrides; ``auto`` is the defaults):
``fsdp2`` forces FSDP2 at world size 1, ``no-lean`` turns lean activations off, ``reshard-off`` keeps gathered
parameters between forward and backward, ``liger`` / ``no-liger`` force the output layer, ``no-share`` runs every
prompt once per sample, ``compile`` compiles the decoder blocks (with ``no-share``), ``budget`` cuts
micro-batches by a token budget of micro-batch size x the longest sequence. Precisions: ``bf16`` (weights,
gradients and AdamW in bf16), ``fp32-masters`` (fp32 weights, bf16 compute), ``fp32``.

Printed per setting: median seconds per step over the timed steps (the first ``--warmup`` are left out; on a
GPU each step ends with a device synchronize), trained tokens per second (prompt and response tokens of every
sequence, as the issue counts them), 6 x parameters x tokens / s in TFLOP/s (a rough model-FLOPs rate,
attention left out), and peak memory (``torch.cuda.max_memory_allocated``, or the process's peak RSS on a CPU).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "qwen25": dict(model=dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab_size=151936,
                              tie_word_embeddings=True, max_position_embeddings=2048),
                   prompts=16, group=8, prompt=(195, 215), response=256, micro=32),
    "tiny": dict(model=dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab_size=512,
                            max_position_embeddings=512),
                 prompts=4, group=4, prompt=(10, 14), response=12, micro=8),
}
PRECISIONS = {
    "bf16": ("model.dtype=bfloat16", "parallelism.param_dtype=bfloat16"),
    "fp32-masters": ("model.dtype=float32", "parallelism.param_dtype=bfloat16"),
    "fp32": ("model.dtype=float32", "parallelism.param_dtype=float32"),
}
SETTINGS = {
    "auto": (),
    "fsdp2": ("parallelism.shard_single_process=true",),
    "no-lean": ("parallelism.lean_activations=false",),
    "reshard-off": ("parallelism.reshard_after_forward=false", "parallelism.shard_single_process=true"),
    "liger": ("training.liger_fused_logprobs=true",),
    "no-liger": ("training.liger_fused_logprobs=false",),
    "no-share": ("training.share_prompt_prefix=false",),
    "compile": ("training.compile=true", "training.share_prompt_prefix=false"),
    "budget": ("training.max_tokens_per_micro_batch={budget}",),
}


def fixed_job(shape: dict, vocab: int, seed: int = 0):
    """The job's batch and its targets: ``prompts`` prompts of random length, ``group`` completions of exactly
    ``response`` tokens each, GRPO advantages of random rewards (every sequence in the loss)."""
    import torch

    from rlite.algorithms import AdvantageInput
    from rlite.plugin_manager import build_plugin_manager
    from rlite.rollout import Completion, TrainTargets, build_rollout_batch

    g = torch.Generator().manual_seed(seed)
    low, high = shape["prompt"]
    prompts = [torch.randint(3, vocab, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g).tolist()
               for _ in range(shape["prompts"])]
    completions = [Completion(p, torch.randint(3, vocab, (shape["response"],), generator=g).tolist(),
                              [0.0] * shape["response"], "length", 0)
                   for p in range(len(prompts)) for _ in range(shape["group"])]
    batch = build_rollout_batch(prompts, completions, [{}] * len(prompts), 0, pad_token_id=0)
    scores = torch.rand(len(batch), generator=g, dtype=torch.float64)
    grpo = build_plugin_manager(autoload=False).registry("advantage_estimator").get("grpo")
    advantages, returns = grpo.implementation(AdvantageInput(scores, batch.group_ids, batch.response_mask),
                                              grpo.config_cls())
    return batch, TrainTargets(advantages, returns, batch.response_mask.clone())


def child(spec: dict) -> dict:
    """One setting: build the backend, run warm-up and timed update steps, report."""
    import torch
    import torch.distributed as dist

    from rlite.config import load_config
    from rlite.distributed import init_distributed
    from rlite.plugin_manager import build_plugin_manager
    from rlite.plugins.fsdp2.backend import FSDP2Backend
    from rlite.run.policy import forward_spec
    from rlite.stages.update import LossSpec, update_policy
    from rlite.tokenizer import build_tiny_model_dir

    torch.set_num_threads(spec["threads"])
    shape = SHAPES[spec["shape"]]
    ctx = init_distributed()
    pm = build_plugin_manager(autoload=False)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model_dir(Path(tmp) / "model", **shape["model"])
        longest = shape["prompt"][1] + shape["response"]
        overrides = [f"model.path={model_dir}", "data.task=addition", f"training.micro_batch_size={shape['micro']}",
                     "training.lr=1e-6", "algorithm.kl.coef=0", *PRECISIONS[spec["precision"]],
                     *(o.format(budget=shape["micro"] * longest) for o in SETTINGS[spec["setting"]])]
        cfg = load_config(None, overrides, pm)
        backend = FSDP2Backend.build(cfg.model, cfg.parallelism, cfg.training, ctx.device, total_optimizer_steps=100)
    fwd = forward_spec(cfg, ctx.device.type, backend.capabilities)
    ppo = pm.registry("policy_loss").get("ppo_clip")
    loss = LossSpec(ppo.implementation, ppo.config_cls(), "token-mean", float(shape["response"]), None, 0.0, 0.0)
    batch, targets = fixed_job(shape, shape["model"]["vocab_size"])
    tokens = int(batch.prompt_mask.sum() + batch.response_mask.sum())
    cuda = ctx.device.type == "cuda"
    seconds = []
    for step in range(spec["warmup"] + spec["steps"]):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = update_policy(backend, batch, targets, fwd, loss, minibatches=1, epochs=1, dp_size=1).metrics
        if cuda:
            torch.cuda.synchronize()
        if step >= spec["warmup"]:
            seconds.append(time.perf_counter() - start)
    params = sum(p.numel() for p in backend.model.parameters())
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    median = statistics.median(seconds)
    if dist.is_initialized():
        dist.destroy_process_group()
    return dict(setting=spec["setting"], precision=spec["precision"], device=str(ctx.device),
                plain=type(backend.model).__name__ == "PolicyModel", liger=fwd.use_liger,
                s_per_step=round(median, 4), tokens_per_s=round(tokens / median), tokens=tokens,
                tflops=round(6 * params * tokens / median / 1e12, 1), peak_gib=round(peak / 2**30, 2),
                grad_norm=round(metrics["actor/grad_norm"], 6))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16")
    parser.add_argument("--settings", default="auto,fsdp2", help=f"comma-separated, of: {', '.join(SETTINGS)}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (a CPU run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    rows = []
    for setting in args.settings.split(","):
        if setting not in SETTINGS:
            parser.error(f"--settings: unknown {setting!r}; known: {', '.join(SETTINGS)}")
        spec = dict(shape=args.shape, precision=args.precision, setting=setting, steps=args.steps,
                    warmup=args.warmup, threads=args.threads)
        done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
        result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not result:
            print(f"{setting}: failed (exit {done.returncode})\n{done.stderr[-3000:]}", file=sys.stderr)
            rows.append(dict(setting=setting, failed=done.returncode))
            continue
        rows.append(json.loads(result[0][len("RESULT "):]))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n| setting | path | liger | s/step | tokens/s | 6PT TFLOP/s | peak GiB |  ({args.shape}, {args.precision})")
    print("|---|---|---|---:|---:|---:|---:|")
    for row in rows:
        if "failed" in row:
            print(f"| {row['setting']} | failed | | | | | |")
            continue
        print(f"| {row['setting']} | {'plain' if row['plain'] else 'fsdp2'} | {row['liger']} | {row['s_per_step']} | "
              f"{row['tokens_per_s']} | {row['tflops']} | {row['peak_gib']} |")
    return 0 if all("failed" not in row for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
