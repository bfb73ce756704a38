"""Speculative drafts during RL, on CPU: rollout tokens/s with no draft, a frozen draft, a draft trained
online and prompt lookup, side by side on the same GRPO job, with acceptance over the run and the
reward curves.

The task is ``spell_digits`` ("Spell out the digits: 40712" -> "four zero seven one two", 30-40 byte
tokens per answer). ``prepare`` makes the two models once, deterministically (seeded, one thread), in
``<work>/models``:

* the policy: a Qwen2 of hidden size 64 and 16 layers (0.8M parameters), supervised on the task's
  training split until it is partly competent;
* the draft: a Qwen2 of hidden size 64 and 1 layer with the same byte tokenizer, trained on the
  starting policy's own samples (temperature 1): a draft made for the policy as RL finds it.

Each arm then trains the same policy with the same seeds in a fresh process (one thread): ``none``
(plain decoding), ``frozen`` (the draft as prepared, ``args.train=false``), ``online`` (the same draft,
trained every step on the step's rollouts) and ``ngram`` (prompt lookup). Printed: rollout tokens/s
(generated tokens over ``time/generation``, steps 2..N), its ratio to ``none``, acceptance and tokens
per target forward at the start and the end of the run, the engine's no-draft estimate, and the mean
reward of the last steps. ``--plot`` draws reward, acceptance and tokens/s against step.

    python benchmarks/speculative.py [--steps 150] [--arms none,frozen,online,ngram] [--work runs/spec_bench]
                                     [--plot benchmarks/speculative.png] [--append]

Why such a narrow, deep policy: one CPU core decodes a batch at the speed of its arithmetic, and a
forward that checks k + 1 tokens per row costs about k + 1 times one that makes one, unless the
forward's cost is mostly per-layer overhead. That is the regime of a deep, narrow model and a
rollout of a few dozen rows here, and of every LLM decoding step on a GPU (memory-bound), which is
where speculative decoding pays.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import cpu_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
TASK = dict(task="spell_digits", num_train=4000, num_eval=128, seed=0)
SFT_STEPS, DRAFT_STEPS = 700, 600

# --------------------------------------------------------------------------------------------------
# prepare: the policy (supervised to partial competence) and its draft (fit to the policy's samples)
# --------------------------------------------------------------------------------------------------


def qwen2(tokenizer, hidden: int, layers: int):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return model


def batches(examples, batch: int, steps: int, pad_id: int, seed: int):
    """``steps`` random batches of (prompt, answer) pairs: ids, labels (answer and eos only), mask."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        chosen = [examples[i] for i in torch.randint(len(examples), (batch,), generator=generator).tolist()]
        width = max(len(p) + len(a) for p, a in chosen)
        ids = torch.full((batch, width), pad_id)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for row, (prompt, answer) in enumerate(chosen):
            seq = prompt + answer
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, len(prompt) : len(seq)] = torch.tensor(answer)
            mask[row, : len(seq)] = 1
        yield ids, labels, mask


def fit(model, examples, steps: int, pad_id: int, lr: float, seed: int, log_every: int = 100) -> None:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * (1 - s / steps))
    model.train()
    for step, (ids, labels, mask) in enumerate(batches(examples, 64, steps, pad_id, seed), start=1):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if step % log_every == 0:
            print(f"  step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()


def generate(model, tokenizer, prompts, n: int, greedy: bool, seed: int):
    from rlite.engines.base import SamplingParams
    from rlite.engines.transformers.engine import TransformersEngine

    engine = TransformersEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id])
    params = SamplingParams(n=n, max_new_tokens=48, greedy=greedy, seed=seed)
    out = []
    for start in range(0, len(prompts), 32):
        out += [(start + c.prompt_index, c) for c in engine.generate(prompts[start : start + 32], params)]
    for p in model.parameters():
        p.requires_grad_(True)
    return out


def prepare(models: Path) -> None:
    """Make ``models/policy`` and ``models/draft`` unless they are there."""
    if (models / "draft" / "config.json").is_file():
        return
    import torch

    from rlite.data import format_prompt
    from rlite.tasks import make_task
    from rlite.tokenizer import build_byte_tokenizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = build_byte_tokenizer()
    train_rows, eval_rows = make_task(TASK["task"], TASK["num_train"], TASK["num_eval"], seed=TASK["seed"])
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [encode(format_prompt(r["prompt"], tokenizer, True)) for r in train_rows]
    examples = [(p, encode(r["answer"]) + [tokenizer.eos_token_id]) for p, r in zip(prompts, train_rows)]
    print(f"policy: supervised, {SFT_STEPS} steps", flush=True)
    policy = qwen2(tokenizer, 64, 16)
    fit(policy, examples, SFT_STEPS, tokenizer.pad_token_id, lr=2e-3, seed=0)
    held_out = [encode(format_prompt(r["prompt"], tokenizer, True)) for r in eval_rows]
    answers = generate(policy, tokenizer, held_out, 1, greedy=True, seed=0)
    accuracy = sum(tokenizer.decode(c.token_ids, skip_special_tokens=True).strip() == eval_rows[i]["answer"]
                   for i, c in answers) / len(eval_rows)
    print(f"policy: held-out greedy accuracy {accuracy:.3f}", flush=True)
    policy.save_pretrained(models / "policy")
    tokenizer.save_pretrained(models / "policy")
    print("draft: fit to 4 samples of the starting policy per training prompt (1000 prompts)", flush=True)
    samples = generate(policy, tokenizer, prompts[:1000], 4, greedy=False, seed=1)
    own = [(prompts[i], c.token_ids) for i, c in samples]
    draft = qwen2(tokenizer, 64, 1)
    fit(draft, own, DRAFT_STEPS, tokenizer.pad_token_id, lr=3e-3, seed=1)
    draft.save_pretrained(models / "draft")
    tokenizer.save_pretrained(models / "draft")
    (models / "prepare.json").write_text(json.dumps({"policy_greedy_accuracy": accuracy, "sft_steps": SFT_STEPS,
                                                     "draft_steps": DRAFT_STEPS}))


# --------------------------------------------------------------------------------------------------
# the arms
# --------------------------------------------------------------------------------------------------

CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from rlite.config import load_config
from rlite.loop import run_training
from rlite.plugin_manager import build_plugin_manager
spec = json.loads(sys.argv[1])
pm = build_plugin_manager()
run_training(load_config(None, spec["overrides"], pm), pm)
"""

PROMPTS, SAMPLES = 4, 8


def arm_overrides(arm: str, models: Path) -> list[str]:
    model = ["rollout.draft=draft_model", f"rollout.draft.args.path={models / 'draft'}"]
    k = "rollout.draft.args.num_speculative_tokens=4"
    return {
        "none": ["rollout.draft=none"],
        "frozen": [*model, k, "rollout.draft.args.train=false"],
        "online": [*model, k, "rollout.draft.args.lr=1e-3"],
        "ngram": ["rollout.draft=ngram", k],
    }[arm]


def run_arm(arm: str, models: Path, work: Path, steps: int) -> list[dict]:
    run_dir = work / arm
    overrides = [
        f"model.path={models / 'policy'}", f"data.task={TASK['task']}", f"data.num_train={TASK['num_train']}",
        f"data.num_eval={TASK['num_eval']}", f"data.seed={TASK['seed']}",
        f"rollout.prompts_per_step={PROMPTS}", f"rollout.samples_per_prompt={SAMPLES}", "rollout.max_new_tokens=48",
        "rollout.temperature=1.0",
        f"training.steps={steps}", "training.lr=3e-4", "training.warmup_steps=5", "training.micro_batch_size=32",
        "training.eval_every=25", "training.eval_max_prompts=64", "training.num_threads=1",
        f"logging.run_dir={run_dir}", "logging.progress_bar=false", "logging.plot=false", "logging.loggers=[jsonl]",
        "checkpoint.every=0", "checkpoint.save_final=false", "checkpoint.export_hf=false", "checkpoint.resume=never",
        *arm_overrides(arm, models),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    start = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"overrides": overrides})], capture_output=True,
                         text=True, env=env, timeout=6 * 3600)
    if out.returncode != 0:
        raise SystemExit(f"arm {arm} failed:\n{out.stderr[-4000:]}")
    print(f"  {arm}: {time.time() - start:.0f} s", flush=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(rows: list[dict]) -> dict:
    trained = [r for r in rows if "reward/mean" in r]
    steady = trained[1:]  # the first step pays for warm-up
    tokens = [r["response/length"] * PROMPTS * SAMPLES for r in steady]
    tail = max(len(trained) // 5, 1)
    out = {
        "tokens_per_s": sum(tokens) / sum(r["time/generation"] for r in steady),
        "reward_last": statistics.mean(r["reward/mean"] for r in trained[-tail:]),
        "reward_last_se": statistics.stdev([r["reward/mean"] for r in trained[-tail:]]) / tail ** 0.5 if tail > 1 else 0.0,
        "tail": tail,
        "eval_final": next((r["eval/greedy_accuracy"] for r in reversed(rows) if "eval/greedy_accuracy" in r), float("nan")),
        "length": statistics.mean(r["response/length"] for r in trained),
    }
    if "spec/acceptance_rate" in trained[0]:
        for key, name in (("spec/acceptance_rate", "acceptance"), ("spec/tokens_per_target_forward", "tokens_per_forward")):
            out[f"{name}_first"] = statistics.mean(r[key] for r in trained[:tail])
            out[f"{name}_last"] = statistics.mean(r[key] for r in trained[-tail:])
        estimated = sum(r["spec/no_draft_estimate_s"] for r in steady)
        out["estimated_speedup"] = estimated / sum(r["spec/rollout_s"] for r in steady)
    return out


def plot(series: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values, k=10):
        return [statistics.mean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for arm, rows in series.items():
        trained = [r for r in rows if "reward/mean" in r]
        steps = [r["step"] for r in trained]
        axes[0].plot(steps, smooth([r["reward/mean"] for r in trained]), label=arm)
        if "spec/acceptance_rate" in trained[0]:
            axes[1].plot(steps, smooth([r["spec/acceptance_rate"] for r in trained]), label=arm)
        tokens = [r["response/length"] * PROMPTS * SAMPLES / r["time/generation"] for r in trained]
        axes[2].plot(steps[1:], smooth(tokens[1:]), label=arm)
    for ax, title in zip(axes, ("train reward (mean of 10 steps)", "draft acceptance rate (mean of 10 steps)",
                                "rollout tokens/s (mean of 10 steps)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--arms", default="none,frozen,online,ngram")
    parser.add_argument("--work", type=Path, default=Path("runs/spec_bench"))
    parser.add_argument("--plot", type=Path, default=None, help="write reward, acceptance and tokens/s curves here")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    models = args.work / "models"
    prepare(models)
    series = {}
    for arm in args.arms.split(","):
        print(f"arm {arm}", flush=True)
        series[arm] = run_arm(arm, models, args.work, args.steps)
    summary = {arm: summarize(rows) for arm, rows in series.items()}
    base = summary.get("none", {}).get("tokens_per_s")
    prepared = json.loads((models / "prepare.json").read_text())
    lines = [
        f"### speculative.py: drafts during GRPO on spell_digits ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores (shared), one thread per run; torch {torch_version()}",
        f"- command: `python benchmarks/speculative.py --steps {args.steps} --arms {args.arms}`",
        f"- job: policy Qwen2 hidden 64 x 16 layers (supervised {prepared['sft_steps']} steps, held-out greedy accuracy "
        f"{prepared['policy_greedy_accuracy']:.2f}); draft Qwen2 hidden 64 x 1 layer fit to the starting policy's "
        f"samples; GRPO, {PROMPTS} prompts x {SAMPLES} samples, temperature 1, up to 48 tokens, k = 4 proposals",
        "",
        "| arm | rollout tokens/s | vs none | acceptance start -> end | tokens/target forward start -> end "
        "| engine's estimate vs none | reward, last steps | held-out greedy acc. (end) | mean length |",
        "|---|---:|---:|---|---|---:|---|---:|---:|",
    ]
    for arm, s in summary.items():
        ratio = f"{s['tokens_per_s'] / base:.2f}x" if base else "-"
        acceptance = f"{s['acceptance_first']:.3f} -> {s['acceptance_last']:.3f}" if "acceptance_first" in s else "-"
        per_forward = (f"{s['tokens_per_forward_first']:.2f} -> {s['tokens_per_forward_last']:.2f}"
                       if "tokens_per_forward_first" in s else "-")
        estimate = f"{s['estimated_speedup']:.2f}x" if "estimated_speedup" in s else "-"
        lines.append(
            f"| {arm} | {s['tokens_per_s']:.0f} | {ratio} | {acceptance} | {per_forward} | {estimate} | "
            f"{s['reward_last']:.3f} +- {s['reward_last_se']:.3f} (last {s['tail']}) | {s['eval_final']:.3f} | "
            f"{s['length']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    (args.work / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot(series, args.plot)
    if args.append:
        with open(RESULTS, "a") as handle:
            handle.write("\n" + text)
    return 0


def torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    raise SystemExit(main())
