"""Partial rollouts in a run (rollout.partial_segment_tokens): a weight sync that arrives while the
producer is inside a generation gets in between two segments; the samples' tokens then span two
versions, never decreasing, within the staleness bound on every token, and rollout/partial_fraction
counts them."""

from __future__ import annotations

import json

import pytest

from rlite import hookimpl
from rlite.config import ConfigError
from rlite.plugin_manager import build_plugin_manager
from rlite.run.loop import run_training
from rlite.stages.async_rollout import AsyncRollouts
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


class SyncArrivesMidGeneration(AsyncRollouts):
    """Holds the producer at its first segment boundary after batch 1 until the trainer's weight sync
    is waiting, so that the sync lands inside step 2's generation on every run (not by timing)."""

    def _let_sync_in(self) -> None:
        if self.produced == 1 and not getattr(self, "held", False):
            self.held = True
            assert self.sync_pending.wait(timeout=120), "the trainer never asked for the engine"
        super()._let_sync_in()


class ThreeTurns:
    def reset(self, sample):
        return None

    def step(self, action):
        return "go on", 0.0, action.turn == 2


class Recorder:
    def __init__(self) -> None:
        self.batches = []

    @hookimpl
    def register_reward_functions(self, register):
        register("digits", lambda completion, sample, cfg: sum(c.isdigit() for c in completion) / max(len(completion), 1))

    @hookimpl
    def register_rollout_workflows(self, register):
        register("three_turns", lambda cfg, tokenizer: ThreeTurns())

    @hookimpl
    def after_rewards(self, step, batch):
        self.batches.append((step, batch.token_weight_versions.clone(), batch.response_mask.clone(),
                             list(batch.weight_versions)))  # fmt: skip


def run(model_dir, run_dir, monkeypatch, *overrides):
    monkeypatch.setattr("rlite.run.build.AsyncRollouts", SyncArrivesMidGeneration)
    pm = build_plugin_manager(autoload=False)
    recorder = Recorder()
    pm.register(recorder, name="recorder")
    cfg = tiny_config(model_dir, run_dir, "rewards=[digits]", "training.lr=3e-3", "rollout.temperature=1.0",
                      "training.steps=3", "rollout.mode=async", "rollout.max_staleness=1",
                      "rollout.engine.args.share_weights=false", "rollout.partial_segment_tokens=3",
                      "rollout.max_new_tokens=12", *overrides, pm=pm)  # fmt: skip
    run_training(cfg, pm)
    return recorder.batches, [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


@pytest.mark.parametrize("workflow", [
    [],
    ["rollout.workflow=three_turns", "rollout.max_turns=3", "rollout.max_response_tokens=64"],
], ids=["single_turn", "three_turns"])  # fmt: skip
def test_a_sync_inside_a_generation_continues_it_with_the_new_weights(tmp_path, model_dir, monkeypatch, workflow):
    batches, rows = run(model_dir, tmp_path, monkeypatch, *workflow)
    assert [s for s, *_ in batches] == [1, 2, 3]
    bound = 1
    for step, versions, loss_mask, sample_versions in batches:
        sampled = loss_mask.bool()
        assert (versions[~sampled] == -1).all()  # observations and padding have no version
        mixed = 0
        for row in range(versions.shape[0]):
            row_versions = versions[row][sampled[row]].tolist()
            assert row_versions == sorted(row_versions)  # a sync only moves a sequence forward
            assert sample_versions[row] == min(row_versions)
            assert step - 1 - bound <= min(row_versions) and max(row_versions) <= step - 1  # the bound, per token
            mixed += len(set(row_versions)) > 1
        assert rows[step - 1]["rollout/partial_fraction"] == mixed / versions.shape[0]
    # step 2's batch began with version 0, and the sync of version 1 came between two of its segments
    _, versions, loss_mask, _ = batches[1]
    assert set(versions[loss_mask.bool()].tolist()) == {0, 1}
    assert rows[1]["rollout/partial_fraction"] > 0
    # inside one engine call: a sample's first turn (all of it, single-turn) already spans both versions
    first_turns = [row[: int(mask.tolist().index(0.0)) if 0.0 in mask.tolist() else len(mask)]
                   for row, mask in zip(versions, loss_mask)]  # fmt: skip
    assert any(set(turn.tolist()) == {0, 1} for turn in first_turns)


def test_segments_need_async_with_staleness(tmp_path, model_dir):
    pm = build_plugin_manager(autoload=False)
    for overrides in (["rollout.partial_segment_tokens=4"],
                      ["rollout.partial_segment_tokens=4", "rollout.mode=one_step_off"],
                      ["rollout.partial_segment_tokens=4", "rollout.mode=async", "rollout.max_staleness=0"]):  # fmt: skip
        with pytest.raises(ConfigError, match="rollout.partial_segment_tokens"):
            tiny_config(model_dir, tmp_path, *overrides, pm=pm)
    with pytest.raises(ConfigError, match="rollout.partial_segment_tokens must be >= 0"):
        tiny_config(model_dir, tmp_path, "rollout.partial_segment_tokens=-1", pm=pm)


def test_the_cli_trains_with_segments_and_resumes(tmp_path, model_dir, capsys):
    """``rlite train CONFIG k=v`` as a user runs it: 2 steps with partial segments, then the same command
    with more steps resumes from the checkpoint; a segment size without async mode is one clear line."""
    from rlite.tools.cli import main

    config = tmp_path / "run.yaml"
    config.write_text("training:\n  seed: 0\n")
    args = [f"model.path={model_dir}", "data.task=addition", "data.num_train=64", "data.num_eval=8",
            "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6",
            f"logging.run_dir={tmp_path / 'run'}", "logging.progress_bar=false", "logging.plot=false",
            "logging.loggers=[jsonl]", "training.eval_every=0", "checkpoint.every=1", "checkpoint.export_hf=false",
            "rollout.mode=async", "rollout.max_staleness=1", "rollout.engine.args.share_weights=false",
            "rollout.partial_segment_tokens=2"]  # fmt: skip
    assert main(["train", str(config), *args, "training.steps=2"]) == 0
    assert main(["train", str(config), *args, "training.steps=4"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    resumed = [r["provenance"]["resumed_from"]["step"] for r in lines if "resumed_from" in r.get("provenance", {})]
    assert resumed == [2]  # the second command resumed from the step-2 checkpoint
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(0.0 <= r["rollout/partial_fraction"] <= 1.0 and r["rollout/staleness_max"] <= 1 for r in rows)
    capsys.readouterr()
    assert main(["train", str(config), *args[:-4], "rollout.partial_segment_tokens=2"]) == 2
    assert "rollout.partial_segment_tokens" in capsys.readouterr().err
