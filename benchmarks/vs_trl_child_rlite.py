"""The rlite child of ``vs_trl.py``: train the job with rlite and read where its time went.

rlite is run as a user runs it (``load_config`` with overrides, ``run_training``) with one extra
plugin, :class:`HookClock`, registered on the run's plugin manager. Nothing of rlite is replaced.

Where the numbers come from:

* **Wall time per phase**: rlite's own ``time/*`` metrics, one row per step in the run's
  ``metrics.jsonl``: ``time/generation``, ``time/reward``, ``time/logprobs`` (old log-probs and
  advantages), ``time/train`` with its parts ``time/train/forward`` (forward and loss),
  ``time/train/backward`` and ``time/train/optimizer`` (clipping and the optimizer step), and
  ``time/weight_sync``.
* **Step times and CPU time**: :class:`HookClock` reads the wall and CPU clocks at rlite's hooks:
  a step runs from the previous ``on_metrics`` (``on_run_start`` for step 1) to its own, and the
  hooks in between (``after_rollout``, ``after_rewards``, ``before_optimizer_step``,
  ``after_optimizer_step``, ``after_weight_sync``) delimit generation, reward, the log-probs and
  training stretch, the optimizer step, weight sync, and step metrics with logging. The CPU time of
  generation, reward and weight sync is measured between their hooks. No hook divides the stretch
  from ``after_rewards`` to ``after_optimizer_step`` (``before_optimizer_step`` fires after the
  clipping, inside ``time/train/optimizer``), so its CPU time is shared out over ``time/logprobs``
  and the parts of ``time/train`` in proportion to their wall times. The step metrics and logging
  (``after_weight_sync`` to ``on_metrics``) are not a ``time/*`` phase; their row is timed by hooks.
* **Memory per phase** (``--memory-phases``): samples are charged to the stretch between hooks they
  fall in, so the forward and the backward of training share one label.
* **The trained model**: rlite's own export (``checkpoint.export_hf=true``, written to
  ``<run_dir>/hf_model`` when training ends). The peak RSS is read at the last step's
  ``on_metrics``, before the export's copy of the weights.

The breakdown assumes the job's settings: one optimizer step per rollout, no evaluation during
training and no checkpoints (``--rlite-set`` can change that; such time then shows up in the row of
the hooks around it, or in "rest of the loop").

The ``gpu`` and ``gpu-tiny`` jobs (kind ``rlite-gpu``, :func:`train_rlite_gpu`) run rlite with its
defaults but for the job's own settings (:func:`gpu_overrides`: the model, data, reward, batch shape,
learning rate, precision); on CUDA every ``time/*`` phase starts and ends with a
``torch.cuda.synchronize()`` (:func:`synchronized_phases`, as the TRL child's phases do), so that a phase
holds its own kernels; the peak GPU memory is torch's ``max_memory_allocated``/``reserved`` of this process.

Run by ``vs_trl.py`` as ``python benchmarks/vs_trl_child_rlite.py rlite SPEC_JSON RESULT_JSON`` (or ``rlite-gpu``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from vs_trl_common import (
    Deadline,
    StepClock,
    child_main,
    device_memory_gib,
    digit_fraction,
    max_rss_mib,
    read_jsonl,
    setup_threads,
    synchronize,
)

# the stretches between rlite's hooks (also the labels of --memory-phases)
GENERATION = "generation"
REWARD = "reward"
TRAINING = "log-probs, advantages, train forward + backward, clip"
OPTIMIZER = "optimizer step"
WEIGHT_SYNC = "weight sync"
METRICS = "step metrics + logging"

PHASE_NOTE = (
    "rlite's phases: wall time from its own `time/*` metrics, CPU time measured between its hooks"
    " (shared out by wall time over the log-probs and training rows, which no hook divides); step"
    " metrics + logging timed between the `after_weight_sync` and `on_metrics` hooks."
)


def make_hook_clock(clock: StepClock, memory_phases: bool):
    """A plugin that times the stretches between rlite's lifecycle hooks into ``clock``."""
    import rlite

    class HookClock:
        def __init__(self) -> None:
            self.stretch: str | None = None
            self.since = (0.0, 0.0)
            self.last_step = 0
            self.train_start = 0.0
            self.peak_rss_mib = 0.0

        def enter(self, stretch: str | None) -> None:
            """Close the running stretch (charge its wall and CPU time to this step) and open ``stretch``."""
            now = (time.perf_counter(), time.process_time())
            if self.stretch is not None:
                clock.add(self.stretch, now[0] - self.since[0], now[1] - self.since[1])
            self.stretch, self.since = stretch, now
            clock.active = [stretch] if stretch is not None else []

        @rlite.hookimpl
        def on_run_start(self, config, run_dir):
            self.last_step = config.training.steps
            self.train_start = time.perf_counter()
            clock.start()
            if memory_phases:
                clock.sample_memory()
            self.enter(GENERATION)

        @rlite.hookimpl
        def after_rollout(self, step, batch):
            self.enter(REWARD)

        @rlite.hookimpl
        def after_rewards(self, step, batch):
            self.enter(TRAINING)

        @rlite.hookimpl
        def before_optimizer_step(self, step):
            self.enter(OPTIMIZER)

        @rlite.hookimpl
        def after_optimizer_step(self, step):
            self.enter(WEIGHT_SYNC)

        @rlite.hookimpl
        def after_weight_sync(self, step):
            self.enter(METRICS)

        @rlite.hookimpl
        def on_metrics(self, step, metrics):
            if step < 1:  # the baseline evaluation of a fresh run
                return
            self.enter(None)
            clock.end_step()
            if step < self.last_step:
                self.enter(GENERATION)
                return
            # the training run ends here: what follows is rlite's export and summary
            clock.stop()
            self.peak_rss_mib = max_rss_mib()

    return HookClock()


def phases_of_step(stretches: dict[str, list[float]], row: dict[str, float]) -> dict[str, list[float]]:
    """``{phase: [wall s, CPU s]}`` of one step: wall from rlite's ``time/*`` metrics, CPU from the
    hook stretches (split in proportion to wall time inside the log-probs + training stretch)."""

    def wall(key: str) -> float:
        return float(row.get(f"time/{key}", 0.0))

    def cpu(stretch: str) -> float:
        return stretches.get(stretch, [0.0, 0.0])[1]

    train_parts = ("train/forward", "train/backward", "train/optimizer")
    training = {
        "old log-probs + advantages (time/logprobs)": wall("logprobs"),
        "train: forward + loss (time/train/forward)": wall("train/forward"),
        "train: backward (time/train/backward)": wall("train/backward"),
        "train: clip + optimizer step (time/train/optimizer)": wall("train/optimizer"),
        "train: metric sums (rest of time/train)": wall("train") - sum(wall(k) for k in train_parts),
    }
    training_cpu = cpu(TRAINING) + cpu(OPTIMIZER)
    training_wall = sum(training.values()) or 1.0
    return {
        "generation (time/generation)": [wall("generation"), cpu(GENERATION)],
        "reward (time/reward)": [wall("reward"), cpu(REWARD)],
        **{name: [w, training_cpu * w / training_wall] for name, w in training.items()},
        "weight sync to the engine (time/weight_sync)": [wall("weight_sync"), cpu(WEIGHT_SYNC)],
        "step metrics + logging (hooks)": list(stretches.get(METRICS, [0.0, 0.0])),
    }


def shared_overrides(spec: dict, run_dir: Path) -> list[str]:
    """What both jobs set alike, matched to TRL's run: the batch shape, plain sampling at temperature 1, no KL,
    a constant learning rate without warm-up or weight decay, clipping at 1.0, no evaluation or checkpoints in
    the timed run, and quiet logs."""
    return [
        f"rollout.prompts_per_step={spec['prompts']}",
        f"rollout.samples_per_prompt={spec['samples']}",
        f"rollout.max_new_tokens={spec['max_new_tokens']}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.top_k=0",
        "algorithm.kl.coef=0.0",
        f"training.steps={spec['steps']}",
        f"training.seed={spec['seed']}",
        f"training.lr={spec['lr']}",
        "training.lr_schedule=constant",
        "training.warmup_steps=0",
        "training.weight_decay=0.0",
        "training.grad_clip=1.0",
        "training.eval_every=0",
        "checkpoint.every=0",
        "checkpoint.save_final=false",
        "checkpoint.resume=never",
        f"logging.run_dir={run_dir}",
        "logging.loggers=[jsonl]",
        "logging.progress_bar=false",
        "logging.plot=false",
        "plugins.autoload=false",
    ]


def rlite_overrides(spec: dict, run_dir: Path) -> list[str]:
    """The job as rlite settings (``--rlite-set`` last)."""
    advantage_args = "{name: grpo, args: {epsilon: 0.0001}}"
    reward = (
        "[exact_match]" if spec["reward"] == "exact_match" else "[{name: numeric, args: {position: last}}]"
    )
    overrides = [
        *shared_overrides(spec, run_dir),
        f"model.path={spec['model_dir']}",
        "model.dtype=float32",
        "model.attn_implementation=sdpa",
        f"data.train_files={spec['train_file']}",
        "data.shuffle=false",
        "data.chat_template=true",
        f"rewards={reward}",
        f"algorithm.advantage={advantage_args}",
        "algorithm.policy_loss=ppo_clip",
        "algorithm.loss_agg_mode=token-mean",
        "algorithm.entropy_coef=0.0",
        f"training.micro_batch_size={spec.get('rlite_micro_batch') or spec['prompts'] * spec['samples']}",
        f"training.logprob_chunk_size={spec['logprob_chunk_size']}",
        "checkpoint.export_hf=true",  # <run_dir>/hf_model, for the held-out evaluation
    ]
    if spec["system_prompt"] is not None:
        overrides.append(f"data.system_prompt={json.dumps(spec['system_prompt'])}")
    return overrides + (spec.get("rlite_set") or [])


def train_rlite(spec: dict) -> dict:
    start = time.perf_counter()
    setup_threads()
    import torch

    import rlite
    from rlite.config import load_config
    from rlite.plugin_manager import build_plugin_manager
    from rlite.run.loop import run_training

    run_dir = Path(spec["run_dir"]) / "rlite"
    clock = StepClock()
    hook_clock = make_hook_clock(clock, bool(spec.get("memory_phases")))
    pm = build_plugin_manager(autoload=False)
    pm.register(hook_clock, name="bench-hook-clock")
    cfg = load_config(None, rlite_overrides(spec, run_dir), pm=pm)
    summary = run_training(cfg, pm)
    done = time.perf_counter()

    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] >= 1]
    n = spec["prompts"] * spec["samples"]
    return dict(
        framework="rlite",
        version=rlite.__version__,
        torch=torch.__version__,
        step_times=clock.step_wall,
        step_cpu=clock.step_cpu,
        tokens=[float(r["response/length"]) * n for r in rows],
        rewards=[float(r["reward/mean"]) for r in rows],
        phases=[phases_of_step(stretches, row) for stretches, row in zip(clock.steps, rows)],
        phase_note=PHASE_NOTE,
        rlite_step_phases=[{k: v for k, v in r.items() if k.startswith("time/")} for r in rows],
        peak_rss_mib=hook_clock.peak_rss_mib,
        peak_rss_by_phase=clock.peak_rss,
        peak_live_by_phase=clock.peak_live,
        setup_s=hook_clock.train_start - start,
        total_s=done - start,
        final_model=str(run_dir / "hf_model"),
        time_breakdown_total=summary.get("time_breakdown", {}),
    )


# --------------------------------------------------------------------------------------------------
# the GPU job (vs_trl.py gpu / gpu-tiny)
# --------------------------------------------------------------------------------------------------

PRECISIONS = {
    # bf16 parameters, gradients and AdamW state
    "bf16": ["model.dtype=bfloat16", "parallelism.param_dtype=bfloat16", "parallelism.reduce_dtype=bfloat16"],
    # float32 master weights (and AdamW state), bf16 compute, float32 gradient reduction
    "fp32-master": ["model.dtype=float32", "parallelism.param_dtype=bfloat16", "parallelism.reduce_dtype=float32"],
}


def ignore_eos_supported() -> bool:
    from dataclasses import fields

    from rlite.config.schema import RolloutConfig

    return "ignore_eos" in {f.name for f in fields(RolloutConfig)}


def gpu_overrides(spec: dict, run_dir: Path) -> list[str]:
    """The GPU job as rlite settings: only what defines the job (model, data, reward, batch shape, sampling,
    optimizer, precision) and what keeps the run's files small; every performance setting is rlite's default."""
    overrides = [
        *shared_overrides(spec, run_dir),
        f"model.path={spec['model_dir']}",
        *PRECISIONS[spec["precision"]],
        f"data.train_files={spec['train_file']}",
        "data.shuffle=false",
        "data.chat_template=true",
        "rewards=[digit_fraction]",
        f"training.micro_batch_size={spec['micro_batch']}",
        "checkpoint.export_hf=false",
        "logging.samples_every=0",
    ]
    if spec.get("peak_tflops"):
        overrides.append(f"logging.peak_tflops={spec['peak_tflops']}")
    if spec.get("ignore_eos") and ignore_eos_supported():
        overrides.append("rollout.ignore_eos=true")
    return overrides + (spec.get("rlite_set") or [])


def synchronized_phases() -> None:
    """On CUDA, make every ``rlite.metrics.StepTimer`` phase wait for the GPU at its start and end."""
    from contextlib import contextmanager

    import torch

    from rlite.metrics import StepTimer

    if not torch.cuda.is_available():
        return
    timed = StepTimer.phase

    @contextmanager
    def phase(self, name: str):
        synchronize()  # what was queued before is not this phase's
        with timed(self, name):
            yield
            synchronize()  # this phase's kernels are

    StepTimer.phase = phase


class BudgetSpent(Exception):
    """Raised from ``on_metrics`` when the child's ``--budget-s`` share is spent: the run stops after that step."""


def make_gpu_probe(deadline: Deadline, clock: StepClock):
    """A plugin: the ``digit_fraction`` reward, each step's sequence lengths (for the FLOP count), and the
    budget guard (after the hook clock has closed the step: ``trylast``)."""
    import rlite
    from rlite.perf import sequence_sums

    class GpuProbe:
        def __init__(self) -> None:
            self.sums: list[list[float]] = []

        @rlite.hookimpl
        def register_reward_functions(self, register):
            register("digit_fraction", lambda completion, sample, cfg: digit_fraction(completion))

        @rlite.hookimpl
        def after_rollout(self, step, batch):
            self.sums.append(list(sequence_sums(batch.prompt_mask.sum(-1) + batch.response_present.sum(-1))))

        @rlite.hookimpl(trylast=True)
        def on_metrics(self, step, metrics):
            if step >= 1 and deadline.passed():
                clock.stop()
                raise BudgetSpent(f"stopped after step {step}: the budget of {deadline.seconds:.0f} s is spent")

    return GpuProbe()


def train_rlite_gpu(spec: dict) -> dict:
    """The GPU job with rlite (``gpu_overrides``): per-step wall times and phases, the sequences each step
    trained on, rlite's own ``perf/*`` metrics and the peak GPU memory."""
    start = time.perf_counter()
    deadline = Deadline(spec.get("budget_s"))
    setup_threads(spec.get("threads"))
    import torch

    import rlite
    from rlite.config import load_config
    from rlite.plugin_manager import build_plugin_manager
    from rlite.run.loop import run_training

    synchronized_phases()
    run_dir = Path(spec["run_dir"]) / f"rlite-{spec['precision']}"
    clock = StepClock()
    hook_clock = make_hook_clock(clock, False)
    probe = make_gpu_probe(deadline, clock)
    pm = build_plugin_manager(autoload=False)
    pm.register(hook_clock, name="bench-hook-clock")
    pm.register(probe, name="bench-gpu-probe")
    cfg = load_config(None, gpu_overrides(spec, run_dir), pm=pm)
    stopped = None
    try:
        run_training(cfg, pm)
    except BudgetSpent as exc:
        stopped = str(exc)
    clock.stop()
    done = time.perf_counter()
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] >= 1]
    steps = len(clock.steps)
    n = spec["prompts"] * spec["samples"]
    return dict(
        framework="rlite",
        version=rlite.__version__,
        torch=torch.__version__,
        device=device_name(),
        step_times=clock.step_wall,
        step_cpu=clock.step_cpu,
        tokens=[float(r["response/length"]) * n for r in rows][:steps],
        rewards=[float(r["reward/mean"]) for r in rows][:steps],
        sequence_sums=probe.sums[:steps],
        phases=[phases_of_step(stretches, row) for stretches, row in zip(clock.steps, rows)],
        phase_note=PHASE_NOTE,
        own_perf=[{k: v for k, v in r.items() if k.startswith("perf/")} for r in rows][:steps],
        peak_rss_mib=max_rss_mib(),
        device_memory=device_memory_gib(),
        setup_s=hook_clock.train_start - start,
        total_s=done - start,
        stopped=stopped,
        ignore_eos=("rollout.ignore_eos=true" if ignore_eos_supported() else
                    "not in this rlite (no rollout.ignore_eos key): completions may end at EOS"),
    )


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    child_main({"rlite": train_rlite, "rlite-gpu": train_rlite_gpu}, sys.argv[1:])
