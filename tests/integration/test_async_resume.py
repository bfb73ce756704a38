"""Resume of asynchronous runs: a checkpoint keeps the trained data position and the batches the
producer had already sampled for the steps after it. ``one_step_off`` then resumes bitwise like an
uninterrupted run; ``async`` (timing-dependent) trains every step on the same prompts, none lost and
none repeated."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlite import hookimpl
from rlite.plugin_manager import build_plugin_manager
from rlite.run.checkpoint import list_checkpoints
from rlite.run.loop import run_training
from rlite.run.safe_pickle import load_trainer_state
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir

TIMING = ("time/", "perf/", "rollout/producer_")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


class SimulatedCrash(Exception):
    pass


class Plugin:
    """A learnable reward (the fraction of digits), and optionally a crash right after a checkpoint."""

    def __init__(self, crash_at: int | None = None) -> None:
        self.crash_at = crash_at

    @hookimpl
    def register_reward_functions(self, register):
        register("digits", lambda completion, sample, cfg: sum(c.isdigit() for c in completion) / max(len(completion), 1))

    @hookimpl
    def on_checkpoint_save(self, step):
        if step == self.crash_at:
            raise SimulatedCrash(f"crash after the step-{step} checkpoint")


def run(model_dir, run_dir, *overrides, crash_at=None, resume="never"):
    pm = build_plugin_manager(autoload=False)
    pm.register(Plugin(crash_at), name="plugin")
    cfg = tiny_config(model_dir, run_dir, "rewards=[digits]", "training.lr=3e-3", "rollout.temperature=1.0",
                      "rollout.engine.args.share_weights=false", "training.steps=6", "checkpoint.every=3",
                      "checkpoint.export_hf=true", "logging.samples_every=1", "logging.samples_per_step=100",
                      f"checkpoint.resume={resume}", *overrides, pm=pm)  # fmt: skip
    run_training(cfg, pm)


def crash_and_resume(model_dir, run_dir, *overrides):
    with pytest.raises(SimulatedCrash):
        run(model_dir, run_dir, *overrides, crash_at=3)
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000003"]
    saved = load_trainer_state(run_dir / "checkpoints" / "step_00000003" / "trainer_state_rank0.pt")  # as a resume reads it
    run(model_dir, run_dir, *overrides, resume="auto")
    return saved


def metrics(run_dir):
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)}
            for row in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in row]  # fmt: skip


def train_prompts(run_dir):
    by_step: dict[int, list] = {}
    for row in read_jsonl(run_dir / "samples.jsonl"):
        if row["kind"] == "train":
            by_step.setdefault(row["step"], []).append((row["group"], row["prompt"]))
    return by_step


def test_one_step_off_resumes_bitwise_like_an_uninterrupted_run(tmp_path, model_dir):
    mode = ("rollout.mode=one_step_off", "training.eval_every=3")
    run(model_dir, tmp_path / "straight", *mode)
    saved = crash_and_resume(model_dir, tmp_path / "resumed", *mode)
    # the checkpoint kept step 4's batch, drawn with version 2 (the weights it holds are version 3)
    ahead = saved["rollouts_ahead"]["batches"]
    assert 4 in ahead and ahead[4][0].weight_versions == [2] * len(ahead[4][0])
    a = load_file(tmp_path / "straight" / "hf_model" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "hf_model" / "model.safetensors")
    initial = load_file(f"{model_dir}/model.safetensors")
    assert sum(not torch.equal(a[n], initial[n]) for n in a) > len(a) // 2, "the runs must have trained"
    for name in a:
        assert torch.equal(a[name], b[name]), name
    straight, resumed = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert straight == resumed
    assert train_prompts(tmp_path / "straight") == train_prompts(tmp_path / "resumed")


def test_async_resume_loses_and_repeats_no_prompt(tmp_path, model_dir):
    mode = ("rollout.mode=async", "rollout.max_staleness=2")
    run(model_dir, tmp_path / "straight", *mode)
    crash_and_resume(model_dir, tmp_path / "resumed", *mode)
    straight, resumed = train_prompts(tmp_path / "straight"), train_prompts(tmp_path / "resumed")
    assert sorted(resumed) == list(range(1, 7))
    assert resumed == straight  # step by step the same prompts: the sampler's order, nothing skipped or redone
    rows = metrics(tmp_path / "resumed")
    assert [r["step"] for r in rows] == list(range(1, 7)) and max(r["rollout/staleness_max"] for r in rows) <= 2


def test_a_synchronous_run_resumes_an_async_checkpoint_at_its_trained_position(tmp_path, model_dir):
    """The batches sampled ahead are not the synchronous run's (they lag): it samples those steps again."""
    run(model_dir, tmp_path / "straight", "rollout.mode=one_step_off")
    with pytest.raises(SimulatedCrash):
        run(model_dir, tmp_path / "resumed", "rollout.mode=one_step_off", crash_at=3)
    run(model_dir, tmp_path / "resumed", "rollout.mode=sync", "checkpoint.resume_mismatch=allow", resume="auto")
    assert train_prompts(tmp_path / "resumed") == train_prompts(tmp_path / "straight")
    assert [r["step"] for r in metrics(tmp_path / "resumed")] == list(range(1, 7))


def test_one_step_off_resumes_a_checkpoint_without_a_batch_ahead(tmp_path, model_dir):
    """A synchronous run's checkpoint (or one written after the producer failed) keeps no batch for the
    next step, and its weights are the only ones left: that step samples with them (lag 0, like step 1)."""
    with pytest.raises(SimulatedCrash):
        run(model_dir, tmp_path / "run", "rollout.mode=sync", crash_at=3)
    run(model_dir, tmp_path / "run", "rollout.mode=one_step_off", resume="auto")
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [r["rollout/staleness_max"] for r in rows[3:]] == [0.0, 1.0, 1.0]
    straight = tmp_path / "straight"
    run(model_dir, straight, "rollout.mode=sync")
    assert train_prompts(tmp_path / "run") == train_prompts(straight)  # the same prompts, step by step


def test_a_stop_after_the_next_batch_was_handed_out_keeps_it_and_resumes_bitwise(tmp_path, model_dir, monkeypatch):
    """A SIGTERM seen right after step 4 took its batch (before its update) saves the checkpoint of step 3
    with that batch kept ahead; the resumed one_step_off run is the uninterrupted one bitwise."""
    from rlite.run.faults import Preemption, RunStopped
    from rlite.stages.async_rollout import AsyncRollouts

    signalled = []

    class SignalAfterCollect(AsyncRollouts):
        def collect(self, step):
            out = super().collect(step)
            if step == 4:
                signalled.append(step)
            return out

    class FlaggedPreemption(Preemption):
        def requested(self) -> bool:
            if signalled and self.signal_name is None:
                self.signal_name = "SIGTERM"
            return super().requested()

    mode = ("rollout.mode=one_step_off", "checkpoint.every=0")
    run(model_dir, tmp_path / "straight", *mode)
    monkeypatch.setattr("rlite.run.build.AsyncRollouts", SignalAfterCollect)
    monkeypatch.setattr("rlite.run.loop.Preemption", FlaggedPreemption)
    with pytest.raises(RunStopped, match="checkpoint of step 3"):
        run(model_dir, tmp_path / "resumed", *mode)
    monkeypatch.undo()
    saved = load_trainer_state(tmp_path / "resumed" / "checkpoints" / "step_00000003" / "trainer_state_rank0.pt")
    assert saved["rollouts_ahead"]["batches"][4][0].weight_versions == [2] * 8
    run(model_dir, tmp_path / "resumed", *mode, resume="auto")
    a = load_file(tmp_path / "straight" / "hf_model" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "hf_model" / "model.safetensors")
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert metrics(tmp_path / "straight") == metrics(tmp_path / "resumed")
    assert train_prompts(tmp_path / "straight") == train_prompts(tmp_path / "resumed")
