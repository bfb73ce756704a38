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

Each arm then trains the same policy in a fresh process (one thread), once per training seed, the
arms of a seed one after the other: ``none`` (plain decoding), ``frozen`` (the draft as prepared,
``args.train=false``), ``online`` (the same draft, trained every step on the step's rollouts) and
``ngram`` (prompt lookup). The samples of a speculative arm have the policy's distribution, but not
the same random draws as ``none``, so their reward curves are other samples of the same process;
the seeds show how far two samples of it lie apart. Printed per arm and seed: rollout tokens/s
(generated tokens over ``time/generation``, steps 2..N), its ratio to the ``none`` run of the same
seed, the engine's own no-draft estimate, acceptance and tokens per target forward at the start and
the end of the run, train reward and held-out greedy accuracy at the start and the end. ``--plot``
draws reward, held-out accuracy, acceptance and tokens/s against step.

    python benchmarks/speculative.py [--steps 200] [--arms none,frozen,online,ngram] [--seeds 0,1]
                                     [--work runs/spec_bench] [--plot benchmarks/speculative.png] [--append]

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
SFT_MAX_STEPS, DRAFT_STEPS, TARGET_ACCURACY = 600, 600, 0.3
"""The policy is supervised until its held-out greedy accuracy reaches TARGET_ACCURACY: partly competent,
so that RL has something to learn and the policy moves."""

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


def fit(*args, **kwargs) -> int:
    """:func:`rlite.drafts.fit_on_completions` (``examples/drafts/make_draft.py`` fits its drafts with it too)."""
    from rlite.drafts import fit_on_completions

    return fit_on_completions(*args, report=lambda line: print(line, flush=True), **kwargs)


def generate(model, tokenizer, prompts, n: int, greedy: bool, seed: int):
    from rlite.engines.base import SamplingParams
    from rlite.plugins.transformers.engine import TransformersEngine

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
    held_out = [encode(format_prompt(r["prompt"], tokenizer, True)) for r in eval_rows]

    def accuracy() -> float:
        answers = generate(policy, tokenizer, held_out, 1, greedy=True, seed=0)
        return sum(tokenizer.decode(c.token_ids, skip_special_tokens=True).strip() == eval_rows[i]["answer"]
                   for i, c in answers) / len(eval_rows)

    def competent(step: int) -> bool:
        if step < 100:
            return False
        reached = accuracy()
        print(f"  step {step}: held-out greedy accuracy {reached:.3f}", flush=True)
        return reached >= TARGET_ACCURACY

    print(f"policy: supervised until its held-out greedy accuracy is {TARGET_ACCURACY}", flush=True)
    policy = qwen2(tokenizer, 64, 16)
    sft_steps = fit(policy, examples, SFT_MAX_STEPS, tokenizer.pad_token_id, lr=2e-3, seed=0, stop=competent)
    policy_accuracy = accuracy()
    print(f"policy: {sft_steps} steps, held-out greedy accuracy {policy_accuracy:.3f}", flush=True)
    policy.save_pretrained(models / "policy")
    tokenizer.save_pretrained(models / "policy")
    print("draft: fit to 4 samples of the starting policy per training prompt (1000 prompts)", flush=True)
    samples = generate(policy, tokenizer, prompts[:1000], 4, greedy=False, seed=1)
    own = [(prompts[i], c.token_ids) for i, c in samples]
    draft = qwen2(tokenizer, 64, 1)
    fit(draft, own, DRAFT_STEPS, tokenizer.pad_token_id, lr=3e-3, seed=1, every=100)
    draft.save_pretrained(models / "draft")
    tokenizer.save_pretrained(models / "draft")
    (models / "prepare.json").write_text(json.dumps({"policy_greedy_accuracy": policy_accuracy, "sft_steps": sft_steps,
                                                     "draft_steps": DRAFT_STEPS}))


# --------------------------------------------------------------------------------------------------
# the arms
# --------------------------------------------------------------------------------------------------

CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from rlite.config import load_config
from rlite.run.loop import run_training
from rlite.plugin_manager import build_plugin_manager
spec = json.loads(sys.argv[1])
pm = build_plugin_manager()
run_training(load_config(None, spec["overrides"], pm), pm)
"""

PROMPTS, SAMPLES, LR = 4, 8, 1e-4


def arm_overrides(arm: str, models: Path) -> list[str]:
    model = ["rollout.draft=draft_model", f"rollout.draft.args.path={models / 'draft'}"]
    k = "rollout.draft.args.num_speculative_tokens=4"
    return {
        "none": ["rollout.draft=none"],
        "frozen": [*model, k, "rollout.draft.args.train=false"],
        "online": [*model, k, "rollout.draft.args.lr=1e-3"],
        "ngram": ["rollout.draft=ngram", k],
    }[arm]


def run_arm(arm: str, seed: int, models: Path, work: Path, steps: int) -> list[dict]:
    run_dir = work / f"{arm}-seed{seed}"
    overrides = [
        f"model.path={models / 'policy'}", f"data.task={TASK['task']}", f"data.num_train={TASK['num_train']}",
        f"data.num_eval={TASK['num_eval']}", f"data.seed={TASK['seed']}", f"training.seed={seed}",
        f"rollout.prompts_per_step={PROMPTS}", f"rollout.samples_per_prompt={SAMPLES}", "rollout.max_new_tokens=48",
        "rollout.temperature=1.0",
        f"training.steps={steps}", f"training.lr={LR}", "training.warmup_steps=5", "training.micro_batch_size=32",
        "training.eval_every=25", "training.eval_max_prompts=128", "training.num_threads=1",
        f"logging.run_dir={run_dir}", "logging.progress_bar=false", "logging.plot=false", "logging.loggers=[jsonl]",
        "checkpoint.every=0", "checkpoint.save_final=false", "checkpoint.resume=never",
        f"checkpoint.export_hf={str(arm == 'online').lower()}",  # the end's policy and draft, for measure_generation
        *arm_overrides(arm, models),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    start = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps({"overrides": overrides})], capture_output=True,
                         text=True, env=env, timeout=6 * 3600)
    if out.returncode != 0:
        raise SystemExit(f"arm {arm} (seed {seed}) failed:\n{out.stderr[-4000:]}")
    print(f"  {arm}, seed {seed}: {time.time() - start:.0f} s", flush=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(rows: list[dict]) -> dict:
    trained = [r for r in rows if "reward/mean" in r]
    steady = trained[1:]  # the first step pays for warm-up
    tail = max(len(trained) // 5, 1)
    evals = [r["eval/greedy_accuracy"] for r in rows if "eval/greedy_accuracy" in r]
    out = {
        "tokens_per_s": sum(r["response/length"] * PROMPTS * SAMPLES for r in steady) / sum(r["time/generation"] for r in steady),
        "reward_first": statistics.mean(r["reward/mean"] for r in trained[:tail]),
        "reward_last": statistics.mean(r["reward/mean"] for r in trained[-tail:]),
        "tail": tail,
        "eval_first": evals[0] if evals else float("nan"),
        "eval_last": statistics.mean(evals[-3:]) if evals else float("nan"),
    }
    if "spec/acceptance_rate" in trained[0]:
        for key, name in (("spec/acceptance_rate", "acceptance"), ("spec/tokens_per_target_forward", "tokens_per_forward")):
            out[f"{name}_first"] = statistics.mean(r[key] for r in trained[:tail])
            out[f"{name}_last"] = statistics.mean(r[key] for r in trained[-tail:])
        estimated = sum(r["spec/no_draft_estimate_s"] for r in steady)
        out["estimated_speedup"] = estimated / sum(r["spec/rollout_s"] for r in steady)
    return out


def measure_generation(policy_dir: Path, drafts: dict[str, Path | None], repeats: int = 3) -> dict[str, dict]:
    """Generation alone, in this process, by CPU time: the same 64 held-out prompts x 8 samples (16 calls
    of 4 prompts, fixed seeds) with each draft (``None``: no draft; ``"ngram"``: prompt lookup), the drafts
    interleaved ``repeats`` times; CPU time is what a shared machine's load disturbs least."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlite.data import format_prompt
    from rlite.engines.base import DraftSpec, SamplingParams
    from rlite.plugins.transformers.engine import TransformersEngine
    from rlite.tasks import make_task

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    _, held_out = make_task(TASK["task"], TASK["num_train"], TASK["num_eval"], seed=TASK["seed"])
    prompts = [tokenizer(format_prompt(r["prompt"], tokenizer, True), add_special_tokens=False)["input_ids"]
               for r in held_out[:64]]
    engines = {}
    for name, path in drafts.items():
        if path is None:
            spec, draft_model = None, None
        elif path == "ngram":
            spec, draft_model = DraftSpec("ngram", 4), None
        else:
            spec, draft_model = DraftSpec("model", 4, model_path=str(path)), AutoModelForCausalLM.from_pretrained(path)
        engines[name] = TransformersEngine(policy, pad_token_id=tokenizer.pad_token_id,
                                           eos_token_ids=[tokenizer.eos_token_id], draft=spec, draft_model=draft_model)
    calls = [(prompts[i : i + PROMPTS], SamplingParams(n=SAMPLES, max_new_tokens=48, seed=1000 + i))
             for i in range(0, len(prompts), PROMPTS)]
    times: dict[str, list[float]] = {name: [] for name in engines}
    counts: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, engine in engines.items():
            engine.generate(*calls[0])  # warm
            start, accepted, proposed, emitted, forwards = time.process_time(), 0, 0, 0, 0
            for batch, params in calls:
                engine.generate(batch, params)
                if engine.speculator is not None:
                    stats = engine.speculation_stats()
                    accepted, proposed = accepted + stats.accepted, proposed + stats.proposed
                    emitted, forwards = emitted + stats.emitted, forwards + stats.verifications
            times[name].append(time.process_time() - start)
            counts[name] = [accepted / max(proposed, 1), emitted / max(forwards, 1)]
    base = statistics.median(times["none"])
    return {name: {"cpu_s": statistics.median(t), "vs_none": base / statistics.median(t),
                   "acceptance": counts[name][0] if engines[name].speculator else None,
                   "tokens_per_forward": counts[name][1] if engines[name].speculator else None}
            for name, t in times.items()}


COLORS = {"none": "black", "frozen": "tab:blue", "online": "tab:red", "ngram": "tab:green"}


def plot(series: dict[tuple[str, int], list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values, k=20):
        return [statistics.mean(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    seeds = sorted({seed for _, seed in series})
    for (arm, seed), rows in series.items():
        trained = [r for r in rows if "reward/mean" in r]
        steps = [r["step"] for r in trained]
        style = dict(color=COLORS.get(arm), linestyle=("-", "--", ":", "-.")[seeds.index(seed) % 4],
                     label=f"{arm}, seed {seed}", alpha=0.85)
        axes[0].plot(steps, smooth([r["reward/mean"] for r in trained]), **style)
        evals = [(r["step"], r["eval/greedy_accuracy"]) for r in rows if "eval/greedy_accuracy" in r]
        axes[1].plot(*zip(*evals), marker="o", markersize=3, **style)
        if "spec/acceptance_rate" in trained[0]:
            axes[2].plot(steps, smooth([r["spec/acceptance_rate"] for r in trained]), **style)
        tokens = [r["response/length"] * PROMPTS * SAMPLES / r["time/generation"] for r in trained]
        axes[3].plot(steps[1:], smooth(tokens[1:]), **style)
    titles = ("train reward (mean of 20 steps)", "held-out greedy accuracy", "draft acceptance rate (mean of 20 steps)",
              "rollout tokens/s (mean of 20 steps)")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--arms", default="none,frozen,online,ngram")
    parser.add_argument("--seeds", default="0,1", help="training seeds; every arm runs once per seed, arms interleaved")
    parser.add_argument("--work", type=Path, default=Path("runs/spec_bench"))
    parser.add_argument("--plot", type=Path, default=None, help="write reward, accuracy, acceptance and tokens/s curves here")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    models = args.work / "models"
    prepare(models)
    arms, seeds = args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    series = {}
    for seed in seeds:  # arms side by side in time, so that a change of load on the machine hits them all
        for arm in arms:
            print(f"arm {arm}, seed {seed}", flush=True)
            series[arm, seed] = run_arm(arm, seed, models, args.work, args.steps)
    summary = {key: summarize(rows) for key, rows in series.items()}
    prepared = json.loads((models / "prepare.json").read_text())
    lines = [
        f"### speculative.py: drafts during GRPO on spell_digits ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores (shared), one thread per run; torch {torch_version()}",
        f"- command: `python benchmarks/speculative.py --steps {args.steps} --arms {args.arms} --seeds {args.seeds}`",
        f"- job: policy Qwen2 hidden 64 x 16 layers (0.8M parameters; supervised {prepared['sft_steps']} steps, held-out "
        f"greedy accuracy {prepared['policy_greedy_accuracy']:.2f}); draft Qwen2 hidden 64 x 1 layer fit to the starting "
        f"policy's samples; GRPO, lr {LR}, {PROMPTS} prompts x {SAMPLES} samples, temperature 1, up to 48 tokens "
        "(answers 30-40), k = 4 proposals, transformers engine in-process; one run per arm and seed, arms interleaved",
        "- rollout tokens/s: generated tokens / `time/generation` over steps 2..N; `vs none`: against the run of the "
        "same seed; first/last: means over the first and last fifth of the steps; held-out accuracy: step 0 and the "
        "mean of the last three evaluations (128 prompts)",
        "",
        "| arm | seed | rollout tokens/s | vs none | engine's estimate | acceptance first -> last "
        "| tokens/target forward first -> last | train reward first -> last | held-out greedy acc. first -> last |",
        "|---|---:|---:|---:|---:|---|---|---|---|",
    ]
    for (arm, seed), s in summary.items():
        base = summary.get(("none", seed), {}).get("tokens_per_s")
        ratio = f"{s['tokens_per_s'] / base:.2f}x" if base else "-"
        acceptance = f"{s['acceptance_first']:.3f} -> {s['acceptance_last']:.3f}" if "acceptance_first" in s else "-"
        per_forward = (f"{s['tokens_per_forward_first']:.2f} -> {s['tokens_per_forward_last']:.2f}"
                       if "tokens_per_forward_first" in s else "-")
        estimate = f"{s['estimated_speedup']:.2f}x" if "estimated_speedup" in s else "-"
        lines.append(
            f"| {arm} | {seed} | {s['tokens_per_s']:.0f} | {ratio} | {estimate} | {acceptance} | {per_forward} | "
            f"{s['reward_first']:.3f} -> {s['reward_last']:.3f} | {s['eval_first']:.3f} -> {s['eval_last']:.3f} |"
        )
    if {"online", "none"} <= set(arms):  # the same rollouts generated at the start and at the end of a run
        seed = seeds[0]
        print("generation alone, by CPU time", flush=True)
        start = measure_generation(models / "policy", {"none": None, "draft": models / "draft", "ngram": "ngram"})
        online = args.work / f"online-seed{seed}"
        end = measure_generation(online / "hf_model", {"none": None, "frozen": models / "draft",
                                                       "online": online / "hf_draft", "ngram": "ngram"})
        lines += [
            "",
            f"Generation alone (`measure_generation`: the same 64 held-out prompts x {SAMPLES} samples in calls of "
            f"{PROMPTS} prompts, fixed seeds, CPU time, median of 3 interleaved repeats), with the starting policy and "
            f"with the policy at the end of the online run of seed {seed} (its draft: `hf_draft` of that run):",
            "",
            "| policy | draft | CPU s | speed-up vs none | acceptance | tokens/target forward |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for label, table in (("start", start), (f"end of online, seed {seed}", end)):
            for name, m in table.items():
                acc = "-" if m["acceptance"] is None else f"{m['acceptance']:.3f}"
                tpf = "-" if m["tokens_per_forward"] is None else f"{m['tokens_per_forward']:.2f}"
                lines.append(f"| {label} | {name} | {m['cpu_s']:.2f} | {m['vs_none']:.2f}x | {acc} | {tpf} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (args.work / "summary.json").write_text(json.dumps({f"{a}-seed{s}": v for (a, s), v in summary.items()}, indent=1))
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
