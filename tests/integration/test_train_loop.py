"""End-to-end runs of the real loop on a tiny model: learning, resume, crash safety, export, LoRA."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from rlite import hookimpl
from rlite.distributed import shutdown_distributed
from rlite.plugin_manager import build_plugin_manager, get_plugin_manager, set_plugin_manager
from rlite.run.build import build_run
from rlite.run.checkpoint import find_resume_checkpoint, list_checkpoints
from rlite.run.loop import run_training, train
from rlite.testing import read_jsonl, run_in_subprocess_env, tiny_config
from rlite.tokenizer import build_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@dataclass
class DigitRewardConfig:
    digit: str = "1"
    """The digit the reward counts."""


class DigitReward:
    """A test plugin: reward = fraction of completion characters equal to one digit. A random tiny
    model learns it within a few steps, so learning is visible on a held-out split."""

    @hookimpl
    def register_reward_functions(self, register):
        def fraction_of_digit(completion, sample, cfg):
            return sum(ch == cfg.digit for ch in completion) / max(len(completion), 1)

        register("digit_fraction", fraction_of_digit, DigitRewardConfig)

        def even_code_points(completion, sample, cfg):
            # dense: almost every completion scores differently, so every group has a non-zero advantage
            return sum(ord(ch) % 2 == 0 for ch in completion) / max(len(completion), 1)

        register("even_chars", even_code_points)


@pytest.fixture
def pm_with_digit_reward():
    pm = build_plugin_manager(autoload=False)
    pm.register(DigitReward(), name="digit-reward")
    set_plugin_manager(pm)
    yield pm
    set_plugin_manager(None)


def test_reward_rises_on_held_out_prompts_and_parameters_change(tmp_path, model_dir, pm_with_digit_reward):
    cfg = tiny_config(
        model_dir,
        tmp_path / "run",
        "rewards=[digit_fraction]",
        "training.steps=12",
        "training.lr=3e-3",
        "training.eval_every=12",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=8",
        "rollout.max_new_tokens=6",
        "training.micro_batch_size=32",
        "data.num_eval=32",  # 192 sampled eval tokens: a '1' at a few per cent is seen
        pm=pm_with_digit_reward,
    )
    run = build_run(cfg, get_plugin_manager())
    before = {n: p.detach().full_tensor().clone() for n, p in run.policy.backend.model.named_parameters()}
    try:
        train(run)
        after = {n: p.detach().full_tensor() for n, p in run.policy.backend.model.named_parameters()}
    finally:  # full_tensor() needs the process group (torch < 2.11 resolves it even at world size 1)
        run.engine.shutdown()
        shutdown_distributed(run.ctx)
    assert all(not torch.equal(before[n], after[n]) for n in before), "every parameter should move"
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in rows if "eval/sampled_reward" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 12
    assert evals[-1]["eval/greedy_reward"] >= evals[0]["eval/greedy_reward"] + 0.5
    assert evals[-1]["eval/sampled_reward"] > evals[0]["eval/sampled_reward"]
    train_rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert sum(train_rewards[-3:]) > sum(train_rewards[:3])
    # the step-time breakdown: the parts of the training phase are reported but not counted twice
    for row in (r for r in rows if "time/train" in r):
        parts = [row[f"time/train/{part}"] for part in ("forward", "backward", "optimizer")]
        assert all(t > 0 for t in parts) and sum(parts) <= row["time/train"]
        top = [v for k, v in row.items() if k.startswith("time/") and k.count("/") == 1 and k != "time/step"]
        assert row["time/step"] == pytest.approx(sum(top))


def _metrics_without_timing(path):
    return [
        {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))} for row in read_jsonl(path)
    ]


class SimulatedCrash(Exception):
    pass


class CrashAfterCheckpoint:
    def __init__(self, at_step):
        self.at_step = at_step

    @hookimpl
    def on_checkpoint_save(self, step):
        if step == self.at_step:
            raise SimulatedCrash(f"crash after the step-{step} checkpoint")


def crash_after_checkpoint(model_dir, run_dir, common, step: int) -> None:
    """Run ``common`` in ``run_dir`` until it crashes right after its step-``step`` checkpoint."""
    pm = build_plugin_manager(autoload=False)
    pm.register(CrashAfterCheckpoint(step), name="crash")
    set_plugin_manager(pm)
    try:
        with pytest.raises(SimulatedCrash):
            run_training(tiny_config(model_dir, run_dir, *common, pm=pm))
    finally:
        set_plugin_manager(None)


PPO_WITH_CRITIC = (
    "algorithm.advantage=gae", "algorithm.critic.enabled=true", "algorithm.minibatches_per_step=2",
    "algorithm.kl.coef=0.05", "algorithm.kl.in_reward=true", "algorithm.kl.estimator=k1",
    "algorithm.kl.adaptive_target=0.5", "training.lr_schedule=cosine", "training.warmup_steps=2",
)


@pytest.mark.parametrize("variant", [(), PPO_WITH_CRITIC], ids=["grpo", "ppo-critic-adaptive-kl"])
def test_resume_equals_uninterrupted_run_bitwise(tmp_path, model_dir, variant):
    common = ("checkpoint.every=3", "training.eval_every=3", "checkpoint.export_hf=true", *variant, "training.steps=6")
    straight = tiny_config(model_dir, tmp_path / "straight", *common)
    run_training(straight)

    # the same run crashes right after its step-3 checkpoint, then is started again
    crash_after_checkpoint(model_dir, tmp_path / "resumed", common, step=3)
    assert [p.name for p in list_checkpoints(tmp_path / "resumed" / "checkpoints")] == ["step_00000003"]
    second = tiny_config(model_dir, tmp_path / "resumed", *common, "checkpoint.resume=auto")
    run_training(second)

    a = load_file(tmp_path / "straight" / "hf_model" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "hf_model" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert _metrics_without_timing(tmp_path / "straight" / "metrics.jsonl") == _metrics_without_timing(
        tmp_path / "resumed" / "metrics.jsonl"
    )


def _assert_same_trained_models(model_dir, run_a, run_b):
    a = load_file(run_a / "hf_model" / "model.safetensors")
    b = load_file(run_b / "hf_model" / "model.safetensors")
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert sum(not torch.equal(a[n], initial[n]) for n in a) > len(a) // 2, "the runs must have trained"
    rows_a, rows_b = _metrics_without_timing(run_a / "metrics.jsonl"), _metrics_without_timing(run_b / "metrics.jsonl")
    assert rows_a == rows_b
    assert all(r["actor/grad_norm"] > 0 for r in rows_a if "actor/grad_norm" in r), "real gradients, not only decay"


DENSE = ("rewards=[even_chars]", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=6")


@pytest.mark.parametrize("before_crash", ["disk", "none"])
def test_disk_offloaded_optimizer_trains_and_resumes_bitwise_like_in_memory_adamw(
    tmp_path, model_dir, pm_with_digit_reward, before_crash
):
    """optimizer_offload=disk (moments in files) gives the in-memory AdamW run's weights and metrics
    exactly, through FSDP2 parameters, a crash after a checkpoint and a resume (also from a checkpoint
    of in-memory AdamW); the files are removed."""
    pm = pm_with_digit_reward
    common = (*DENSE, "checkpoint.every=2", "training.eval_every=2", "checkpoint.export_hf=true",
              "training.steps=4", "training.weight_decay=0.01")
    run_training(tiny_config(model_dir, tmp_path / "memory", *common, pm=pm))

    offload = (*common, "training.optimizer_offload=disk", f"training.optimizer_offload_dir={tmp_path / 'moments'}")
    pm.register(CrashAfterCheckpoint(2), name="crash")
    try:
        with pytest.raises(SimulatedCrash):
            first = offload if before_crash == "disk" else common
            run_training(tiny_config(model_dir, tmp_path / "disk", *first, pm=pm))
    finally:
        pm.unregister(name="crash")
    assert not (tmp_path / "moments" / "rank0").exists(), "a crashed run still deletes its scratch files"
    run_training(tiny_config(model_dir, tmp_path / "disk", *offload, "checkpoint.resume=auto", pm=pm))
    assert not (tmp_path / "moments" / "rank0").exists()
    _assert_same_trained_models(model_dir, tmp_path / "memory", tmp_path / "disk")


def test_unsharded_single_process_equals_fully_shard_bitwise(tmp_path, model_dir, pm_with_digit_reward):
    """shard_single_process=false skips FSDP2 at world size 1: the same weights and metrics, with
    gradient accumulation, a checkpoint, and a resume into the sharded model."""
    pm = pm_with_digit_reward
    common = (*DENSE, "training.steps=4", "training.micro_batch_size=4", "checkpoint.export_hf=true",
              "checkpoint.every=2", "training.eval_every=2")
    run_training(tiny_config(model_dir, tmp_path / "sharded", *common, pm=pm))
    # autograd's accumulation, as FSDP2 does it (in-place accumulation sums in another order)
    plain = tiny_config(model_dir, tmp_path / "plain", *common, "parallelism.shard_single_process=false",
                        "parallelism.fused_grad_accumulation=false", "training.steps=2", pm=pm)
    run = build_run(plain, get_plugin_manager())
    try:
        assert not any(hasattr(p, "full_tensor") for p in run.policy.backend.model.parameters()), "a plain module"
        train(run)
    finally:
        run.engine.shutdown()
        shutdown_distributed(run.ctx)
    # the sharded model resumes from the plain model's checkpoint (DCP reshards) and finishes the run
    run_training(tiny_config(model_dir, tmp_path / "plain", *common, "checkpoint.resume=auto", pm=pm))
    _assert_same_trained_models(model_dir, tmp_path / "sharded", tmp_path / "plain")


def test_a_plain_model_resumes_a_sharded_checkpoint_bitwise(tmp_path, model_dir, pm_with_digit_reward):
    """A checkpoint written under FSDP2 (every CPU run, and GPU runs before shard_single_process=auto) resumes
    into the plain model that auto picks on one GPU: DCP reshards, and the run ends where an uninterrupted
    sharded run ends."""
    pm = pm_with_digit_reward
    common = (*DENSE, "training.steps=4", "training.micro_batch_size=4", "checkpoint.export_hf=true",
              "checkpoint.every=2", "training.eval_every=2")
    run_training(tiny_config(model_dir, tmp_path / "sharded", *common, pm=pm))
    run_training(tiny_config(model_dir, tmp_path / "switched", *common, "training.steps=2", pm=pm))
    plain = ("parallelism.shard_single_process=false", "parallelism.fused_grad_accumulation=false")
    run_training(tiny_config(model_dir, tmp_path / "switched", *common, *plain, "checkpoint.resume=auto", pm=pm))
    _assert_same_trained_models(model_dir, tmp_path / "sharded", tmp_path / "switched")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_exported_model_loads_in_plain_transformers(tmp_path, model_dir, tied):
    if tied:
        model_dir = str(build_tiny_model_dir(tmp_path / "tied", tie_word_embeddings=True))
    run_training(tiny_config(model_dir, tmp_path / "run", "checkpoint.export_hf=true"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run" / "hf_model"
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("12+35=", return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] > ids["input_ids"].shape[1]
    assert model.config.tie_word_embeddings == tied
    if tied:
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_sigkill_during_checkpoint_save_leaves_previous_checkpoint_usable(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    args = [
        f"model.path={model_dir}", "data.task=addition", "data.num_train=64", "data.num_eval=8",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
        f"logging.run_dir={run_dir}", "logging.progress_bar=false", "logging.plot=false",
        "logging.loggers=[jsonl]", "training.eval_every=0", "checkpoint.every=2",
        "checkpoint.save_final=false", "checkpoint.export_hf=false", "checkpoint.resume=auto",
    ]
    config_file = tmp_path / "run.yaml"
    config_file.write_text("training:\n  seed: 0\n")
    cmd = [sys.executable, "-m", "rlite", "train", str(config_file)]
    subprocess.run([*cmd, *args, "training.steps=2"], env=run_in_subprocess_env(), check=True, timeout=300,
                   capture_output=True)
    assert find_resume_checkpoint(run_dir, "auto").name == "step_00000002"

    # the save of step 4 pauses after writing its shards and before publishing: kill it there
    proc = subprocess.Popen([*cmd, *args, "training.steps=4"], env=run_in_subprocess_env(RLITE_DEBUG_CHECKPOINT_PAUSE="60"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    ckpt_root = run_dir / "checkpoints"
    while not any(p.name.startswith("step_00000004") for p in ckpt_root.iterdir()):
        assert proc.poll() is None, "the run ended before its step-4 save"
        assert time.monotonic() < deadline, "the step-4 save never started"
        time.sleep(0.2)
    time.sleep(1.0)  # the shards are being written or done; the marker is not
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert any(p.name.endswith(".tmp") for p in ckpt_root.iterdir())
    resume_from = find_resume_checkpoint(run_dir, "auto")
    assert resume_from.name == "step_00000002", "the half-written step-4 checkpoint must be ignored"

    done = subprocess.run([*cmd, *args, "training.steps=4"], env=run_in_subprocess_env(), timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed from" in done.stderr and "step 2" in done.stderr
    assert find_resume_checkpoint(run_dir, "auto").name == "step_00000004"
    assert not any(p.name.endswith(".tmp") for p in ckpt_root.iterdir())


def test_lora_trains_only_adapters_and_engine_samples_merged_weights(tmp_path, model_dir, pm_with_digit_reward):
    cfg = tiny_config(model_dir, tmp_path / "run", "model.lora.enabled=true", "model.lora.rank=4",
                      "training.lr=5e-2", "training.steps=3", "rewards=[even_chars]",
                      "rollout.samples_per_prompt=8", "rollout.max_new_tokens=6", pm=pm_with_digit_reward)
    run = build_run(cfg, get_plugin_manager())
    named = lambda: {n: p.detach().full_tensor().clone() for n, p in run.policy.backend.model.named_parameters()}  # noqa: E731
    before = named()
    try:
        train(run)
        after = named()
        engine_weights = {n: p.detach().clone() for n, p in run.engine.named_weights()}
    finally:
        run.engine.shutdown()
        shutdown_distributed(run.ctx)
    lora_names = [n for n in before if "lora_" in n]
    assert lora_names
    for name in before:
        changed = not torch.equal(before[name], after[name])
        if "lora_B" in name or "lora_A" in name:
            continue
        assert not changed, f"frozen base weight {name} changed"
    assert any(not torch.equal(before[n], after[n]) for n in lora_names if "lora_B" in n)
    # engine holds W + (alpha / r) * B @ A for every adapted layer
    scale = cfg.model.lora.alpha / cfg.model.lora.rank
    checked = 0
    for name, base in after.items():
        if not name.endswith("base_layer.weight"):
            continue
        prefix = name[: -len("base_layer.weight")]
        merged = base + scale * after[prefix + "lora_B.default.weight"] @ after[prefix + "lora_A.default.weight"]
        hf_name = name.replace("lm.base_model.model.", "").replace(".base_layer", "")
        torch.testing.assert_close(engine_weights[hf_name], merged, rtol=0, atol=1e-6)
        checked += 1
    assert checked >= 4


class SyncAuditor:
    """Checks after every sync that the engine holds exactly the trainer's weights."""

    def __init__(self, expect_shared: bool | None = None):
        self.model = None
        self.previous = None
        self.checked_versions = []
        self.expect_shared = expect_shared

    @hookimpl
    def after_optimizer_step(self, step, model):
        self.model = model

    @hookimpl
    def after_weight_sync(self, step, weight_version, engine):
        from rlite.plugins.fsdp2.weights import iter_full_tensors

        trainer = {n: t.clone() for n, t in iter_full_tensors(self.model.lm, lora_merge=False)}
        if self.previous is not None:  # the step changed the weights, so a stale engine would be caught
            assert any(not torch.equal(trainer[n], self.previous[n]) for n in trainer)
        self.previous = trainer
        engine_weights = dict(engine.named_weights())
        assert engine_weights.keys() <= trainer.keys()
        for name, tensor in engine_weights.items():
            assert torch.equal(tensor, trainer[name]), f"step {step}: engine weight {name} differs"
        if self.expect_shared is not None and hasattr(engine, "shared_bytes"):  # in-process engine
            own = dict(iter_full_tensors(self.model.lm, lora_merge=False, views=True))
            same = {n for n, t in engine_weights.items() if t.data_ptr() == own[n].data_ptr()}
            total = sum(t.numel() * t.element_size() for t in engine_weights.values())
            if self.expect_shared:  # the engine's weights are the trainer's storage: no second copy
                assert same == set(engine_weights) and engine.shared_bytes == total
            else:
                assert not same and engine.shared_bytes == 0
        self.checked_versions.append((step, weight_version, engine.weight_version))


@pytest.mark.parametrize(
    ("process", "share"), [(False, True), (False, False), (True, False)],
    ids=["in-process-shared", "in-process-copy", "spawned-process"],
)
def test_engine_weights_equal_trainer_weights_after_every_sync(tmp_path, model_dir, process, share):
    pm = build_plugin_manager(autoload=False)
    auditor = SyncAuditor(expect_shared=share)
    pm.register(auditor, name="sync-auditor")
    pm.register(DigitReward(), name="digit-reward")
    set_plugin_manager(pm)
    try:
        cfg = tiny_config(model_dir, tmp_path / "run", "training.steps=3", "rewards=[even_chars]",
                          "rollout.samples_per_prompt=8", "rollout.max_new_tokens=6",
                          f"rollout.engine={{name: transformers, args: {{process: {str(process).lower()}, "
                          f"share_weights: {str(share).lower()}}}}}", pm=pm)
        run_training(cfg)
    finally:
        set_plugin_manager(None)
    assert auditor.checked_versions == [(1, 1, 1), (2, 2, 2), (3, 3, 3)]


def test_profile_switch_writes_a_trace_of_two_steps(tmp_path, model_dir):
    run_training(tiny_config(model_dir, tmp_path / "run", "training.steps=4", "logging.profile=true"))
    profile = tmp_path / "run" / "profile"
    assert (profile / "trace_rank0.json").stat().st_size > 0
    table = (profile / "ops_rank0.txt").read_text()
    assert "aten::" in table


@pytest.mark.parametrize(
    "options",
    [
        ("parallelism.param_dtype=bfloat16",),
        ("parallelism.cpu_offload=true",),
        ("parallelism.activation_checkpointing=true",),
        ("parallelism.reshard_after_forward=false", "training.lr_schedule=cosine", "training.warmup_steps=1"),
    ],
    ids=["bf16-mixed-precision", "cpu-offload", "activation-checkpointing", "no-reshard-cosine"],
)
def test_fsdp_options_train(tmp_path, model_dir, pm_with_digit_reward, options):
    cfg = tiny_config(model_dir, tmp_path / "run", "rewards=[even_chars]", "training.steps=3",
                      "rollout.samples_per_prompt=8", "rollout.max_new_tokens=6", *options, pm=pm_with_digit_reward)
    run = build_run(cfg, get_plugin_manager())
    before = {n: p.detach().full_tensor().clone() for n, p in run.policy.backend.model.named_parameters()}
    try:
        train(run)
        after = {n: p.detach().full_tensor() for n, p in run.policy.backend.model.named_parameters()}
        # master weights stay float32 whatever the compute dtype
        assert all(p.dtype == torch.float32 for p in after.values())
    finally:
        run.engine.shutdown()
        shutdown_distributed(run.ctx)
    assert sum(not torch.equal(before[n], after[n]) for n in before) > len(before) // 2
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "actor/grad_norm" in r]
    assert all(math.isfinite(r["actor/grad_norm"]) for r in rows)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.path={missing}", "model.path"),
        ("data.train_files={missing}.jsonl", "data.train_files"),
        ("checkpoint.resume={missing}", "checkpoint.resume"),
    ],
)
def test_bad_inputs_fail_with_one_clear_line(tmp_path, model_dir, override, expected):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{path: {model_dir}}}\ndata: {{task: addition}}\nlogging: {{run_dir: {tmp_path / 'run'}}}\n")
    done = subprocess.run(
        [sys.executable, "-m", "rlite", "train", str(config), override.format(missing=tmp_path / "nope")],
        env=run_in_subprocess_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


def test_damaged_checkpoint_is_reported_not_crashed(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    run_training(tiny_config(model_dir, run_dir, "checkpoint.save_final=true"))
    ckpt = find_resume_checkpoint(run_dir, "auto")
    for shard in ckpt.glob("*.distcp"):
        shard.write_bytes(b"garbage")
    from rlite.config import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.resume=auto: every checkpoint .* is damaged"):
        run_training(tiny_config(model_dir, run_dir, "checkpoint.resume=auto", "training.steps=3"))
    (ckpt / "MANIFEST.json").unlink()  # without its manifest it is refused unless checkpoint.verify=false
    with pytest.raises(ConfigError, match="has no MANIFEST.json.*checkpoint.verify=false"):
        run_training(tiny_config(model_dir, run_dir, "checkpoint.resume=auto", "training.steps=3"))
    # trusted without checks, the damage shows when the shards are read
    with pytest.raises(ConfigError, match="damaged|cannot load"):
        run_training(tiny_config(model_dir, run_dir, "checkpoint.resume=auto", "checkpoint.verify=false",
                                 "training.steps=3"))


def test_metrics_file_holds_exactly_this_run(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    run_training(tiny_config(model_dir, run_dir, "training.steps=2"))
    run_training(tiny_config(model_dir, run_dir, "training.steps=3"))  # fresh (resume=never): starts over
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]


@pytest.mark.parametrize("variant", [PPO_WITH_CRITIC, ("model.lora.enabled=true", "model.lora.rank=4"),
                                     ("training.pack_sequences=true", *PPO_WITH_CRITIC)],
                         ids=["ppo-critic", "lora", "packed-ppo-critic"])
def test_token_budget_micro_batches_train_the_critic_and_lora_and_resume_bitwise(tmp_path, model_dir, variant):
    """``training.max_tokens_per_micro_batch`` through the whole loop (pi_old, the critic's values and
    update, LoRA): micro-batches stay within the budget, pad no more than fixed-size ones, and a resumed
    run equals a straight one."""
    common = ("training.max_tokens_per_micro_batch=48", "training.micro_batch_size=16", "checkpoint.every=2",
              "training.eval_every=0", "checkpoint.export_hf=true", *variant, "training.steps=3")
    run_training(tiny_config(model_dir, tmp_path / "straight", *common))
    crash_after_checkpoint(model_dir, tmp_path / "resumed", common, step=2)
    run_training(tiny_config(model_dir, tmp_path / "resumed", *common, "checkpoint.resume=auto"))
    rows = [r for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl") if "batching/micro_batches" in r]
    assert len(rows) == 3
    for row in rows:
        assert row["batching/micro_batches"] > 1
        assert row["batching/padding_fraction"] <= row["batching/padding_fraction_fixed_size"]
        assert row["batching/tokens_per_micro_batch"] <= 48
    if "algorithm.critic.enabled=true" in variant:
        assert all(math.isfinite(r["critic/vf_loss"]) and r["critic/skipped_nonfinite"] == 0 for r in rows)
    if "training.pack_sequences=true" in variant:
        assert all(r["batching/padding_fraction"] == 0.0 for r in rows)
    assert _metrics_without_timing(tmp_path / "straight" / "metrics.jsonl") == _metrics_without_timing(
        tmp_path / "resumed" / "metrics.jsonl"
    )
    a = load_file(tmp_path / "straight" / "hf_model" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "hf_model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
