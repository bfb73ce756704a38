"""The TRL child of ``vs_trl.py``: train the job with TRL's ``GRPOTrainer`` and time its phases.

TRL's own ``profiling_context`` reports only to wandb, mlflow or trackio, so the phases are timed by
wrapping ``GRPOTrainer``'s methods (``_generate_single_turn``, ``_calculate_rewards``,
``_generate_and_score_completions``, ``_compute_loss``, ``training_step``) and by its optimizer
callbacks. These are TRL's internals: a TRL release that renames them breaks this module only.

The ``gpu`` and ``gpu-tiny`` jobs set more of the spec: ``device`` (``cuda``: every timed call starts and ends
with a ``torch.cuda.synchronize()``, so that a phase holds its own kernels), ``precision`` (``bf16``: the model
loaded in bf16, AdamW on bf16 parameters; ``fp32-master``: loaded in float32, computed under bf16 autocast;
the CPU jobs' ``fp32``), ``micro_batch`` (``per_device_train_batch_size``, the rest accumulated),
``ignore_eos`` (``min_new_tokens`` = ``max_new_tokens``: every completion has exactly that many tokens),
``budget_s`` (stop after the step under way once spent) and ``save_model``. Each step's sequence lengths
(prompt + completion masks of every ``_compute_loss`` call) are recorded for the FLOP count.

Run by ``vs_trl.py`` as ``python benchmarks/vs_trl_child_trl.py trl SPEC_JSON RESULT_JSON``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from vs_trl_common import (  # benchmarks/ is on sys.path when a script here runs
    BenchError,
    Deadline,
    StepClock,
    child_main,
    device_memory_gib,
    max_rss_mib,
    messages_of,
    minus,
    read_jsonl,
    reward_fn,
    rlite_prompt_ids,
    setup_threads,
    synchronize,
)

PHASE_NOTE = "TRL's phases: timed by wrapping its `GRPOTrainer` methods and optimizer callbacks."


def time_calls(clock: StepClock, owner, attr: str, label: str, sync: bool = False) -> None:
    """Time every call of ``owner.attr`` (a function or method looked up at call time) as ``label``; with
    ``sync`` the GPU's queue is drained before and at the end of the call (:func:`synchronize`)."""
    original = getattr(owner, attr)

    def timed(*args, **kwargs):
        if sync:
            synchronize()
        with clock.phase(label):
            out = original(*args, **kwargs)
            if sync:
                synchronize()
            return out

    setattr(owner, attr, timed)


PRECISIONS = {
    # (the model's dtype when loaded, bf16 autocast)
    "fp32": ("float32", False),
    "bf16": ("bfloat16", True),
    "fp32-master": ("float32", True),
}


def train_trl(spec: dict) -> dict:
    start = time.perf_counter()
    deadline = Deadline(spec.get("budget_s"))
    setup_threads(spec.get("threads", 1))
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
    micro = spec.get("micro_batch") or n
    if n % micro:
        raise BenchError(f"micro_batch {micro} does not divide the {n} completions of a step")
    dtype, autocast = PRECISIONS[spec.get("precision", "fp32")]
    on_cuda = spec.get("device", "cpu") == "cuda"
    out_dir = Path(spec["run_dir"]) / ("trl" if "precision" not in spec else f"trl-{spec['precision']}")
    args = GRPOConfig(
        output_dir=str(out_dir),
        use_cpu=not on_cuda,
        bf16=autocast,
        fp16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": dtype, "attn_implementation": "sdpa"},
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=n // micro,
        steps_per_generation=n // micro,  # one generation of the whole batch per optimizer step
        num_generations=spec["samples"],
        num_iterations=1,
        max_completion_length=spec["max_new_tokens"],
        generation_kwargs={"min_new_tokens": spec["max_new_tokens"]} if spec.get("ignore_eos") else None,
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

    clock = StepClock()
    time_calls(clock, GRPOTrainer, "_generate_single_turn", "generation", on_cuda)
    time_calls(clock, GRPOTrainer, "_calculate_rewards", "reward", on_cuda)
    time_calls(clock, GRPOTrainer, "_generate_and_score_completions", "rollout_total", on_cuda)
    time_calls(clock, GRPOTrainer, "_compute_loss", "train_forward", on_cuda)
    time_calls(clock, GRPOTrainer, "training_step", "training_step", on_cuda)
    time_calls(clock, torch.Tensor, "backward", "backward")  # only a label for --memory-phases
    sums = record_sequence_sums(GRPOTrainer)

    marks: dict = {}
    step_logs: list[dict] = []  # TRL's logged metrics of each step

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
            sums.append([0.0, 0.0])
            if deadline.passed():  # the --budget-s share of this child is spent: this was the last step
                control.should_training_stop = True

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                step_logs.append(dict(logs, step=state.global_step))

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
    memory = device_memory_gib()
    if spec.get("save_model", True):
        trainer.save_model(str(out_dir / "final"))
    step_logs.sort(key=lambda r: r["step"])

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
        tokens=[float(r["completions/mean_length"]) * n for r in step_logs],
        rewards=[float(r["reward"]) for r in step_logs],
        phases=clock.phases(derive),
        phase_note=PHASE_NOTE,
        peak_rss_mib=peak,
        peak_rss_by_phase=clock.peak_rss,
        peak_live_by_phase=clock.peak_live,
        setup_s=marks["train_start"] - start,
        total_s=done - start,
        final_model=str(out_dir / "final"),
        optimizer=str(trainer.args.optim),
        device=torch.cuda.get_device_name() if on_cuda else "cpu",
        sequence_sums=sums[: len(clock.steps)],
        device_memory=memory,
        stopped=f"stopped after step {len(clock.steps)}: the budget of {deadline.seconds:.0f} s is spent"
        if deadline.hit else None,
        ignore_eos=f"min_new_tokens={spec['max_new_tokens']}" if spec.get("ignore_eos") else "no",
    )


def record_sequence_sums(trainer_cls) -> list[list[float]]:
    """Per step ``[sum s, sum s (s + 1) / 2]`` over the sequences TRL's loss ran on (prompt + completion
    masks of each ``_compute_loss`` call; a new entry opens at each step's end)."""
    from rlite.perf import sequence_sums

    sums = [[0.0, 0.0]]
    compute_loss = trainer_cls._compute_loss

    def counted(self, model, inputs):
        lengths = inputs["prompt_mask"].sum(-1) + inputs["completion_mask"].sum(-1)
        tokens, pairs = sequence_sums(lengths.cpu())
        sums[-1][0] += tokens
        sums[-1][1] += pairs
        return compute_loss(self, model, inputs)

    trainer_cls._compute_loss = counted
    return sums


if __name__ == "__main__":
    child_main({"trl": train_trl}, sys.argv[1:])
