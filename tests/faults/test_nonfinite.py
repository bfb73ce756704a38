"""Non-finite numbers: an update with a NaN/inf loss or gradient norm is skipped (the weights and the
optimizer stay as they were), counted, and too many in a row stop the run with a clear message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlite import hookimpl as hookimpl_
from rlite.run.faults import EXIT_STOPPED, NonFiniteGuard, RunStopped
from rlite.stages.sync import refuse_nonfinite
from rlite.testing import fixed_batch, run_in_subprocess_env

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def world_of_one():
    from rlite.distributed import init_distributed, shutdown_distributed

    ctx = init_distributed()
    yield ctx
    shutdown_distributed(ctx)


def _backend(model_dir):
    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.plugins.fsdp2.backend import FSDP2Backend

    torch.manual_seed(0)
    return FSDP2Backend.build(ModelConfig(path=model_dir), ParallelismConfig(), TrainingConfig(lr=1e-2, grad_clip=1.0),
                              torch.device("cpu"), total_optimizer_steps=4)  # fmt: skip


def _batch_and_specs(advantage_scale=1.0):
    from rlite.algorithms import AdvantageInput
    from rlite.plugin_manager import build_plugin_manager
    from rlite.rollout import TrainTargets
    from rlite.stages.update import LossSpec
    from rlite.training.backend import ForwardSpec

    pm = build_plugin_manager(autoload=False)
    grpo, ppo_clip = pm.registry("advantage_estimator").get("grpo"), pm.registry("policy_loss").get("ppo_clip")
    batch = fixed_batch(num_prompts=4, samples=4, prompt_len=6, max_len=7, vocab=96)
    advantages, returns = grpo.implementation(AdvantageInput(batch.scores, batch.group_ids, batch.response_mask),
                                              grpo.config_cls())  # fmt: skip
    targets = TrainTargets(advantages * advantage_scale, returns, batch.response_mask.clone())
    fwd = ForwardSpec(micro_batch_size=8, temperature=1.0, chunk_size=16, exact_layout=False)
    loss = LossSpec(ppo_clip.implementation, ppo_clip.config_cls(), "token-mean", 7.0, None, 0.0, 0.0)
    return batch, targets, fwd, loss


def _weights(backend):
    return {name: t.detach().clone() for name, t in backend.full_weights()}


def test_a_nan_gradient_is_skipped_and_the_other_update_is_exactly_the_one_alone(tmp_path, world_of_one):
    """Two mini-batches; a NaN lands in one gradient of the first. Its update is skipped (no optimizer
    or scheduler step), so the weights equal bitwise those of a fresh backend that trained on the
    second mini-batch alone."""
    from rlite.stages.update import update_policy
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = str(build_tiny_model_dir(tmp_path / "tiny", hidden=32, layers=2))
    batch, targets, fwd, loss = _batch_and_specs()
    backend = _backend(model_dir)
    before = _weights(backend)
    backward, calls = backend.backward, []

    def poisoned_backward(total):  # the first mini-batch's gradient gets one NaN entry
        backward(total)
        calls.append(1)
        if len(calls) == 1:
            grad = next(p for p in backend.trainable_parameters() if p.grad is not None).grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")

    backend.backward = poisoned_backward
    update = update_policy(backend, batch, targets, fwd, loss, minibatches=2, epochs=1, dp_size=1)
    metrics, outcomes = update.metrics, update.outcomes
    assert metrics["train/skipped_nonfinite"] == 1.0
    assert outcomes[1] is None and outcomes[0]["grad_norm"] != outcomes[0]["grad_norm"]  # NaN
    after = _weights(backend)
    assert all(torch.isfinite(t).all() for t in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert backend.scheduler.last_epoch == 1  # one scheduler step, the applied update's

    alone = _backend(model_dir)
    second = slice(len(batch) // 2, len(batch))
    alone_metrics = update_policy(alone, batch.select(second), targets.select(second), fwd, loss, minibatches=1,
                                  epochs=1, dp_size=1).metrics
    assert metrics["actor/grad_norm"] == alone_metrics["actor/grad_norm"] > 0  # averaged over applied updates only
    expected = _weights(alone)
    assert all(torch.equal(after[n], expected[n]) for n in expected)
    backend.close()
    alone.close()


def test_a_nan_loss_skips_the_update_and_leaves_weights_and_optimizer_untouched(tmp_path, world_of_one):
    from rlite.stages.update import update_policy
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = str(build_tiny_model_dir(tmp_path / "tiny", hidden=32, layers=2))
    batch, targets, fwd, loss = _batch_and_specs(advantage_scale=float("nan"))
    backend = _backend(model_dir)
    before = _weights(backend)
    update = update_policy(backend, batch, targets, fwd, loss, minibatches=1, epochs=1, dp_size=1)
    metrics, outcomes = update.metrics, update.outcomes
    # no average of the skipped step's numbers; what the micro-batching computed is reported regardless
    assert {k: v for k, v in metrics.items() if not k.startswith("batching/")} == {"train/skipped_nonfinite": 1.0}
    assert len(outcomes) == 1 and outcomes[0]["loss"] != outcomes[0]["loss"]
    after = _weights(backend)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not backend.optimizer.state and backend.scheduler.last_epoch == 0
    assert all(p.grad is None for p in backend.trainable_parameters())
    backend.close()


def _critic_and_batch(model_dir, returns_scale=1.0):
    """A fresh fsdp2 critic (its own AdamW, lr 1e-2), the GRPO batch and its value targets: V_old as the critic
    scores it, returns scaled by ``returns_scale``."""
    import dataclasses

    from rlite.config import CriticConfig
    from rlite.stages.minibatches import score_values

    batch, targets, fwd, _ = _batch_and_specs()
    critic = _backend(model_dir).build_critic(CriticConfig(enabled=True, lr=1e-2, grad_clip=1.0))
    head = critic.model.value_head.weight
    head = head.to_local() if hasattr(head, "to_local") else head  # (one rank: its shard is the whole head)
    with torch.no_grad():  # a value head that is not all zeros: every parameter gets a gradient
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(1)))
    old_values = score_values(critic, batch, fwd, minibatches=2)
    targets = dataclasses.replace(targets, returns=targets.returns * returns_scale, old_values=old_values)
    return critic, batch, targets, fwd


def _update_critic(critic, batch, targets, fwd, minibatches):
    from rlite.stages.update import update_critic

    return update_critic(critic, batch, targets, fwd, value_clip=0.2, agg_mode="token-mean", horizon=7.0,
                         minibatches=minibatches, dp_size=1)


def _critic_weights(critic):
    return {name: p.detach().clone() for name, p in critic.model.named_parameters()}


def test_a_nan_critic_gradient_is_skipped_and_counted_like_the_policys(tmp_path, world_of_one):
    """The critic's update is the policy's loop: a NaN in one gradient of its first mini-batch skips that
    update (no optimizer step), counts it in ``critic/skipped_nonfinite`` and reports it in the outcomes the
    run's guard reads, and the critic's weights equal bitwise those of a fresh critic that trained on the
    second mini-batch alone."""
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = str(build_tiny_model_dir(tmp_path / "tiny", hidden=32, layers=2))
    critic, batch, targets, fwd = _critic_and_batch(model_dir)
    before = _critic_weights(critic)
    backward, calls = critic.backward, []

    def poisoned_backward(total):  # the first mini-batch's gradient gets one NaN entry
        backward(total)
        calls.append(1)
        if len(calls) == 1:
            grad = next(p for p in critic.trainable_parameters() if p.grad is not None).grad
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")

    critic.backward = poisoned_backward
    update = _update_critic(critic, batch, targets, fwd, minibatches=2)
    metrics, outcomes = update.metrics, update.outcomes
    assert metrics["critic/skipped_nonfinite"] == 1.0 and critic.skipped_steps == 1
    assert outcomes[1] is None and outcomes[0]["grad_norm"] != outcomes[0]["grad_norm"]  # NaN
    after = _critic_weights(critic)
    assert all(torch.isfinite(t).all() for t in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before)

    alone, _, _, _ = _critic_and_batch(model_dir)
    second = slice(len(batch) // 2, len(batch))
    alone_metrics = _update_critic(alone, batch.select(second), targets.select(second), fwd, minibatches=1).metrics
    assert alone_metrics["critic/skipped_nonfinite"] == 0.0
    for name in ("critic/grad_norm", "critic/vf_loss", "critic/vf_clipfrac", "critic/values_mean"):
        assert metrics[name] == alone_metrics[name], name  # averaged over the applied update only
    expected = _critic_weights(alone)
    assert all(torch.equal(after[n], expected[n]) for n in expected)


def test_a_nan_critic_loss_skips_the_update_and_leaves_weights_and_optimizer_untouched(tmp_path, world_of_one):
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = str(build_tiny_model_dir(tmp_path / "tiny", hidden=32, layers=2))
    critic, batch, targets, fwd = _critic_and_batch(model_dir, returns_scale=float("nan"))
    before = _critic_weights(critic)
    update = _update_critic(critic, batch, targets, fwd, minibatches=1)
    metrics, outcomes = update.metrics, update.outcomes
    assert metrics == {"critic/skipped_nonfinite": 1.0}  # no average of the skipped update's numbers
    assert len(outcomes) == 1 and outcomes[0]["loss"] != outcomes[0]["loss"]
    assert all(torch.equal(before[n], t) for n, t in _critic_weights(critic).items())
    assert not critic.optimizer.state and all(p.grad is None for p in critic.trainable_parameters())


def test_the_guard_stops_after_the_limit_in_a_row_and_resets_on_an_applied_update(tmp_path):
    guard = NonFiniteGuard(limit=3, run_dir=tmp_path)
    bad = dict(loss=float("nan"), grad_norm=float("nan"), lr=1e6)
    guard.record(1, [bad, bad])
    guard.record(2, [None])  # an applied update: the count starts over
    guard.record(3, [bad, bad])
    with pytest.raises(RunStopped) as stopped:
        guard.record(4, [bad])
    message = str(stopped.value)
    assert message.startswith("step 4: 3 updates in a row") and "learning rate 1e+06" in message
    assert "training.lr" in message and "no checkpoint was saved yet" in message
    assert stopped.value.exit_code == EXIT_STOPPED

    critic = NonFiniteGuard.for_critic(limit=2, run_dir=tmp_path)  # counted apart from the policy's updates
    critic.record(5, [bad])
    with pytest.raises(RunStopped) as stopped:
        critic.record(6, [bad])
    message = str(stopped.value)
    assert message.startswith("step 6: 2 critic updates in a row") and "algorithm.critic.lr" in message
    assert "algorithm.critic.grad_clip" in message and "training.lr" not in message


def test_weights_that_overflowed_never_reach_the_engine():
    good = torch.ones(3)
    stream = refuse_nonfinite(iter([("a", good), ("b", torch.tensor([1.0, float("inf")])), ("c", good)]), 7)
    assert next(stream)[0] == "a"
    with pytest.raises(RunStopped, match="step 7: the updated weight b holds NaN or infinite"):
        next(stream)
    # huge but finite weights whose float32 sum overflows pass
    assert [n for n, _ in refuse_nonfinite(iter([("big", torch.full((4,), 3e38))]), 1)] == ["big"]


def test_a_huge_learning_rate_ends_with_a_clear_message_not_a_sampler_traceback(tmp_path):
    """What a user meets: ``rlite train ... training.lr=1e6`` on the warm-started quickstart model."""
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "rlite", "train", str(REPO / "configs" / "quickstart.yaml"),
         f"model.path={REPO / 'examples' / 'warmstart' / 'addition-qwen2-1m'}", f"logging.run_dir={run_dir}",
         "training.lr=1e6", "training.warmup_steps=0", "training.steps=8", "training.eval_every=0",
         "data.num_train=64", "data.num_eval=4", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=8",
         "logging.progress_bar=false", "logging.plot=false", "logging.loggers=[jsonl]", "checkpoint.every=1",
         "checkpoint.resume=never", "checkpoint.export_hf=false", "training.max_nonfinite_in_a_row=2"],
        env=run_in_subprocess_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    from rlite.tools.cli import EXIT_REWARDS_FAILED

    # a fault of the run (4) is told apart from a reward function's bug (3) by the status alone
    assert done.returncode == EXIT_STOPPED != EXIT_REWARDS_FAILED, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    line = next(x for x in done.stderr.splitlines() if x.startswith("rlite train: stopped: step "))
    assert "2 updates in a row had a non-finite" in line and "training.lr" in line
    assert "the last good checkpoint is" in line
    from rlite.testing import read_jsonl

    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert sum(r["train/skipped_nonfinite"] for r in rows) == 1  # the stopping step logs no row
    assert all(r.get("actor/grad_norm", 0.0) == r.get("actor/grad_norm", 0.0) for r in rows)  # no NaN logged


def test_a_huge_critic_learning_rate_stops_the_run_naming_the_critics_keys(tmp_path):
    """``algorithm.critic.lr=1e30``: the critic's first update makes its values overflow, so every later
    critic update has a non-finite loss and is skipped (its weights stay finite); the critic's own guard
    stops the run with the critic's keys. The estimator is GRPO (the critic trains but its values are not
    used), so the policy's updates stay finite and cannot be what stops it."""
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "rlite", "train", str(REPO / "configs" / "quickstart.yaml"),
         f"model.path={REPO / 'examples' / 'warmstart' / 'addition-qwen2-1m'}", f"logging.run_dir={run_dir}",
         "algorithm.critic.enabled=true", "algorithm.critic.lr=1e30", "training.warmup_steps=0", "training.steps=6",
         "training.eval_every=0", "data.num_train=64", "data.num_eval=4", "rollout.prompts_per_step=4",
         "rollout.samples_per_prompt=8", "logging.progress_bar=false", "logging.plot=false",
         "logging.loggers=[jsonl]", "checkpoint.every=1", "checkpoint.resume=never", "checkpoint.export_hf=false",
         "training.max_nonfinite_in_a_row=2"],
        env=run_in_subprocess_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == EXIT_STOPPED, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    line = next(x for x in done.stderr.splitlines() if x.startswith("rlite train: stopped: step "))
    assert "2 critic updates in a row had a non-finite" in line and "algorithm.critic.lr" in line
    from rlite.testing import read_jsonl

    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert sum(r["critic/skipped_nonfinite"] for r in rows) == 1  # the stopping step logs no row
    assert all(r["train/skipped_nonfinite"] == 0 for r in rows)


class _NanRewards:
    """The two roads of a NaN reward (docs/faults.md, "NaN rewards"): a reward function that returns NaN on one
    call of step 2 (``nan_once``), and a hook that writes NaN into the first score of step 2's batch."""

    def __init__(self, hook: bool) -> None:
        self.hook, self.step, self.returned_nan = hook, 0, False

    @hookimpl_
    def register_reward_functions(self, register):
        def nan_once(completion, sample, cfg):
            if self.step == 2 and not self.hook and not self.returned_nan:
                self.returned_nan = True
                return float("nan")
            return sum(c.isdigit() for c in completion) / max(len(completion), 1)

        register("nan_once", nan_once, isolation="inline")

    @hookimpl_
    def after_rollout(self, step):
        self.step = step  # the step's rewards are scored next (the evaluations' are not in a step)

    @hookimpl_
    def after_rewards(self, step, batch):
        if self.hook and step == 2:
            batch.scores[0] = float("nan")


@pytest.mark.parametrize("road", ["reward function", "hook"])
def test_a_nan_reward_costs_at_most_the_updates_it_reaches(tmp_path, road):
    """From a reward function: a counted failure scored 0, so the batch never holds it and nothing is skipped.
    Written into the batch: the mini-batch holding it (its group's advantages are NaN) is skipped, the other
    one of the step updates, ``reward/mean`` is logged as null, and the run goes on."""
    from rlite.plugin_manager import build_plugin_manager
    from rlite.run.loop import run_training
    from rlite.testing import read_jsonl, tiny_config
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = build_tiny_model_dir(tmp_path / "tiny")
    pm = build_plugin_manager(autoload=False)
    pm.register(_NanRewards(hook=road == "hook"), name="nan-rewards")
    cfg = tiny_config(model_dir, tmp_path / "run", "rewards=[nan_once]", "training.steps=3", "rollout.temperature=1.0",
                      "algorithm.minibatches_per_step=2", "reward_max_failure_fraction=1.0", pm=pm)  # fmt: skip
    run_training(cfg, pm)
    rows = {r["step"]: r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/failures" in r}
    assert sorted(rows) == [1, 2, 3]
    if road == "reward function":
        assert [rows[s]["reward/failures"] for s in (1, 2, 3)] == [0, 1, 0]
        assert all(rows[s]["reward/mean"] is not None and rows[s]["train/skipped_nonfinite"] == 0 for s in rows)
    else:
        assert [rows[s]["train/skipped_nonfinite"] for s in (1, 2, 3)] == [0, 1, 0]  # one of step 2's two updates
        assert rows[2]["reward/mean"] is None and rows[2]["actor/pg_loss"] is not None  # the other one applied
        assert all(rows[s]["reward/failures"] == 0 for s in rows)
