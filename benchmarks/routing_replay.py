"""Rollout routing replay (R3) on a tiny MoE task: routing agreement and mismatch KL per step, FP8
rollouts with and without replay.

The model is a tiny random Qwen3-MoE (hidden 64, 2 layers, 8 experts, top-2) whose experts are
scaled up 4x so that they carry the signal, as in a trained MoE (``tests/integration/
test_routing_replay.py`` builds the same); the reward is the share of digits in the completion,
which such a model learns in a few dozen steps. Two runs of ``configs/quickstart.yaml``'s GRPO with
``rollout.quantization=fp8_blockwise`` (the engine samples with FP8-rounded projection and expert
weights, routers exact), same seed:

* ``replay``      ``algorithm.routing_replay=rollout``: the trainer's forwards use the engine's experts
* ``no_replay``   ``algorithm.routing_replay=none``: the trainer's routers choose

Every step of both runs logs, measured on the step's batch before the update,
``routing/agreement_without_replay`` (trainer's natural top-k sets equal to the engine's),
``routing/agreement_with_replay`` (1 by construction, measured), and the mismatch k3 KL of a
natural and of a replayed forward against the engine's log-probs. The script plots them per step
with the training reward (``benchmarks/routing_replay.png``) and prints a table; ``--append``
adds it to ``benchmarks/RESULTS.md``.

    OMP_NUM_THREADS=1 python benchmarks/routing_replay.py [--steps 40] [--out runs/routing_replay] [--append]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


class DigitsReward:
    def register_reward_functions(self, register):
        register("digits_fraction", lambda completion, sample, cfg: sum(c.isdigit() for c in completion) / max(len(completion), 1))


def strong_experts_moe(path: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from rlite.tokenizer import build_tiny_model_dir

    model_dir = build_tiny_model_dir(path, hidden=64, layers=2, num_experts=8, experts_per_token=2)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.mul_(4.0)
    model.save_pretrained(model_dir)
    return model_dir


def run(model_dir: Path, out: Path, name: str, replay: str, steps: int) -> list[dict]:
    from rlite import hookimpl
    from rlite.config import load_config
    from rlite.plugin_manager import build_plugin_manager
    from rlite.run.loop import run_training
    from rlite.testing import read_jsonl

    class Plugin(DigitsReward):
        register_reward_functions = hookimpl(DigitsReward.register_reward_functions)

    pm = build_plugin_manager(autoload=False)
    pm.register(Plugin(), name="digits-reward")
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={model_dir}", "rewards=[digits_fraction]", "data.num_train=256", "data.num_eval=8",
        f"training.steps={steps}", "training.lr=3e-3", "training.warmup_steps=0", "training.eval_every=0",
        "rollout.prompts_per_step=8", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=12",
        "rollout.temperature=1.0", "rollout.quantization=fp8_blockwise", f"algorithm.routing_replay={replay}",
        f"logging.run_dir={out / name}", "logging.progress_bar=false", "logging.plot=false", "logging.loggers=[jsonl]",
        "checkpoint.every=0", "checkpoint.save_final=false", "checkpoint.export_hf=false", "checkpoint.resume=never",
    ], pm)
    run_training(cfg, pm)
    return [r for r in read_jsonl(out / name / "metrics.jsonl") if "reward/mean" in r]


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, rows in results.items():
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["routing/agreement_without_replay"] for r in rows], label=f"{name}: natural routing")
        axes[1].semilogy(steps, [r["routing/mismatch_k3_kl_without_replay"] for r in rows], label=f"{name}: without replay")
        axes[1].semilogy(steps, [r["routing/mismatch_k3_kl_with_replay"] for r in rows], "--", label=f"{name}: with replay")
        axes[2].plot(steps, [r["reward/mean"] for r in rows], label=name)
    axes[0].set(title="trainer top-k set = engine's (FP8 rollouts)", xlabel="step", ylabel="fraction of (token, layer)")
    axes[1].set(title="mismatch k3 KL vs the engine's log-probs", xlabel="step")
    axes[2].set(title="training reward (digit share)", xlabel="step")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: dict[str, list[dict]]) -> str:
    lines = ["| run | agreement without replay (mean, min over steps) | with replay | k3 KL without replay | k3 KL with replay | ratio | reward first 5 → last 5 |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, rows in results.items():
        agree = [r["routing/agreement_without_replay"] for r in rows]
        with_replay = [r["routing/agreement_with_replay"] for r in rows]
        k3_natural = statistics.mean(r["routing/mismatch_k3_kl_without_replay"] for r in rows)
        k3_replay = statistics.mean(r["routing/mismatch_k3_kl_with_replay"] for r in rows)
        rewards = [r["reward/mean"] for r in rows]
        lines.append(
            f"| {name} | {statistics.mean(agree):.4f}, {min(agree):.4f} | {min(with_replay):.4f} (min) | {k3_natural:.2e} | "
            f"{k3_replay:.2e} | {k3_natural / k3_replay:.2f}x | {statistics.mean(rewards[:5]):.3f} → {statistics.mean(rewards[-5:]):.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("runs/routing_replay"))
    parser.add_argument("--append", action="store_true", help="add the table to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = strong_experts_moe(args.out / "model")
    results = {name: run(model_dir, args.out, name, replay, args.steps)
               for name, replay in (("replay", "rollout"), ("no_replay", "none"))}
    plot(results, HERE / "routing_replay.png")
    text = table(results)
    print(text)
    if args.append:
        command = "OMP_NUM_THREADS=1 python benchmarks/routing_replay.py " + " ".join(sys.argv[1:])
        with open(HERE / "RESULTS.md", "a") as handle:
            handle.write(
                f"\n## MoE routing replay with FP8 rollouts (`benchmarks/routing_replay.py`, {datetime.date.today()})\n\n"
                f"Machine: {platform.machine()} CPU, torch {torch.__version__}, one thread. Command: `{command}`.\n"
                f"Plot: `benchmarks/routing_replay.png`. Means over the {args.steps} steps of each run.\n\n{text}\n"
            )


if __name__ == "__main__":
    main()
