"""Asynchronous rollouts (rollout.mode): the staleness bound holds on every sample, one_step_off is
exactly one version behind, max_staleness 0 is the synchronous run bitwise, and the engine's log-probs
are the behaviour policy's (the mismatch metrics see the lag)."""

from __future__ import annotations

import pytest
import torch

from rlite import hookimpl
from rlite.config import ConfigError
from rlite.loop import run_training
from rlite.plugin_manager import build_plugin_manager
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir


class Recorder:
    """A learnable reward (the fraction of digits) and a record of every batch and the final weights."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, list[int], torch.Tensor, torch.Tensor]] = []
        self.weights: dict[str, torch.Tensor] = {}

    @hookimpl
    def register_reward_functions(self, register):
        register("digits", lambda completion, sample, cfg: sum(c.isdigit() for c in completion) / max(len(completion), 1))

    @hookimpl
    def after_rewards(self, step, batch):
        self.batches.append((step, list(batch.weight_versions), batch.response_ids.clone(), batch.rollout_logprobs.clone()))

    @hookimpl
    def after_optimizer_step(self, step, model):
        self.weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                        for k, v in model.state_dict().items()}  # FSDP2 shards are DTensors


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def run(model_dir, run_dir, *overrides):
    pm = build_plugin_manager(autoload=False)
    recorder = Recorder()
    pm.register(recorder, name="recorder")
    cfg = tiny_config(model_dir, run_dir, "rewards=[digits]", "training.lr=3e-3", "rollout.temperature=1.0",
                      *overrides, pm=pm)  # fmt: skip
    run_training(cfg, pm)
    return recorder, [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


def test_max_staleness_zero_is_the_synchronous_run_bitwise(tmp_path, model_dir):
    sync, sync_rows = run(model_dir, tmp_path / "sync", "training.steps=3")
    zero, zero_rows = run(model_dir, tmp_path / "async", "training.steps=3", "rollout.mode=async",
                          "rollout.max_staleness=0")  # fmt: skip
    assert len(sync.batches) == len(zero.batches) == 3
    for (s, v, ids, lp), (s2, v2, ids2, lp2) in zip(sync.batches, zero.batches):
        assert s == s2 and v == v2 == [s - 1] * len(v)
        assert torch.equal(ids, ids2) and torch.equal(lp, lp2)
    for name, tensor in sync.weights.items():
        assert torch.equal(tensor, zero.weights[name]), name
    assert [r["reward/mean"] for r in sync_rows] == [r["reward/mean"] for r in zero_rows]
    assert all(r["rollout/staleness_max"] == 0 for r in zero_rows)


@pytest.mark.parametrize("mode, bound", [("one_step_off", 1), ("async", 2)])
def test_staleness_never_exceeds_the_bound(tmp_path, model_dir, mode, bound):
    recorder, rows = run(model_dir, tmp_path / mode, "training.steps=6", f"rollout.mode={mode}",
                         f"rollout.max_staleness={bound}", "rollout.engine.args.share_weights=false")  # fmt: skip
    assert [s for s, *_ in recorder.batches] == list(range(1, 7))
    for step, versions, *_ in recorder.batches:
        staleness = [step - 1 - v for v in versions]
        assert all(0 <= lag <= bound for lag in staleness), (step, versions)
        if mode == "one_step_off":  # deterministic: exactly one version behind from step 2 on
            assert staleness == [min(step - 1, 1)] * len(versions)
    assert max(r["rollout/staleness_max"] for r in rows) <= bound
    # the engine's log-probs are those of the older weights that sampled: the trainer's differ from them
    lagging = [abs(r["mismatch/kl"]) for r, (step, versions, *_) in zip(rows, recorder.batches)
               if any(step - 1 - v > 0 for v in versions)]  # fmt: skip
    assert lagging and max(lagging) > 1e-6


def test_async_needs_an_engine_with_its_own_weights(tmp_path, model_dir):
    pm = build_plugin_manager(autoload=False)
    cfg = tiny_config(model_dir, tmp_path, "rollout.mode=one_step_off", pm=pm)
    with pytest.raises(ConfigError, match="share_weights=false"):
        run_training(cfg, pm)
    with pytest.raises(ConfigError, match="rollout.mode"):
        tiny_config(model_dir, tmp_path, "rollout.mode=later", pm=pm)
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        tiny_config(model_dir, tmp_path, "rollout.max_staleness=-1", pm=pm)


class ThreeTurns:
    def reset(self, sample):
        return None

    def step(self, action):
        return "go on", 0.0, action.turn == 2


def test_multiturn_async_records_each_tokens_version_within_the_bound(tmp_path, model_dir):
    pm = build_plugin_manager(autoload=False)
    seen = []

    class Plugin(Recorder):
        @hookimpl
        def register_rollout_workflows(self, register):
            register("three_turns", lambda cfg, tokenizer: ThreeTurns())

        @hookimpl
        def after_rewards(self, step, batch):
            seen.append((step, batch.token_weight_versions.clone(), batch.response_mask.clone(),
                         batch.response_present.clone(), list(batch.weight_versions)))  # fmt: skip

    pm.register(Plugin(), name="recorder")
    cfg = tiny_config(model_dir, tmp_path, "rewards=[digits]", "training.lr=3e-3", "rollout.workflow=three_turns",
                      "rollout.max_turns=3", "rollout.max_response_tokens=64", "training.steps=6",
                      "rollout.mode=async", "rollout.max_staleness=2", "rollout.engine.args.share_weights=false",
                      pm=pm)  # fmt: skip
    run_training(cfg, pm)
    assert [s for s, *_ in seen] == list(range(1, 7))
    for step, versions, loss_mask, present, sample_versions in seen:
        sampled = loss_mask.bool()
        assert (versions[~sampled] == -1).all()  # observations and padding have no version
        for row in range(versions.shape[0]):
            row_versions = versions[row][sampled[row]].tolist()
            assert row_versions == sorted(row_versions)  # a sync between turns only moves forward
            assert sample_versions[row] == min(row_versions)
            assert step - 1 - 2 <= min(row_versions) and max(row_versions) <= step - 1
        assert (present.bool() & ~sampled).any()  # there are observations inside
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "reward/mean" in r]
    assert all(0.0 <= r["rollout/partial_fraction"] <= 1.0 and r["rollout/staleness_max"] <= 2 for r in rows)
