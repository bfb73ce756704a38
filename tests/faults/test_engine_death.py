"""A dead engine process: the spawned transformers engine is SIGKILLed mid-run. It is restarted with
the trainer's current weights (checksums verified by the sync) and the run ends bitwise where an
undisturbed run ends; past ``rollout.engine_restarts`` the run stops with a checkpoint that resumes."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from rlite import hookimpl
from rlite.plugin_manager import build_plugin_manager
from rlite.run.checkpoint import list_checkpoints
from rlite.run.faults import EXIT_STOPPED, RunStopped
from rlite.run.loop import run_training
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir

PROCESS_ENGINE = ("rollout.engine.name=transformers", "rollout.engine.args.process=true", "training.steps=3",
                  "training.lr=1e-2", "checkpoint.export_hf=true", "rollout.timeout_s=120")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def undisturbed(model_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("undisturbed")
    run_training(tiny_config(model_dir, run_dir, *PROCESS_ENGINE))
    return load_file(run_dir / "hf_model" / "model.safetensors")


class EngineKiller:
    """SIGKILLs the engine process after the weight sync of some steps and after the rollout of others
    (a death found by the next generate, and one found by release_memory / the sync)."""

    def __init__(self, after_sync=(), after_rollout=()):
        self.sync_steps, self.rollout_steps = set(after_sync), set(after_rollout)
        self.engine = None
        self.killed: list[int] = []

    def _kill(self):
        self.killed.append(self.engine.pid)
        os.kill(self.engine.pid, signal.SIGKILL)

    @hookimpl
    def after_weight_sync(self, step, engine):
        self.engine = engine
        if step in self.sync_steps:
            self._kill()

    @hookimpl
    def after_rollout(self, step):
        if step in self.rollout_steps:
            self._kill()


def _run(model_dir, run_dir, killer, *overrides):
    pm = build_plugin_manager(autoload=False)
    if killer is not None:
        pm.register(killer, name="killer")
    return run_training(tiny_config(model_dir, run_dir, *PROCESS_ENGINE, *overrides, pm=pm), pm)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_killed_engine_is_restarted_with_the_current_weights_and_the_run_ends_bitwise_the_same(
    tmp_path, model_dir, undisturbed, caplog
):
    killer = EngineKiller(after_sync=[1], after_rollout=[2])
    with caplog.at_level(logging.WARNING, logger="rlite"):
        _run(model_dir, tmp_path / "run", killer)
    restarts = [r.getMessage() for r in caplog.records if "restarting it" in r.getMessage()]
    assert len(restarts) == 2 and "(1 of 2) with the trainer's weights v1" in restarts[0]
    assert "(2 of 2) with the trainer's weights v1" in restarts[1]  # killed before step 2's update
    assert all("died" in m and "killed by signal 9" in m for m in restarts)
    assert sum("synced and verified" in r.getMessage() for r in caplog.records) == 2
    assert len(set(killer.killed)) == 2 and killer.engine.pid not in killer.killed
    assert _same(undisturbed, load_file(tmp_path / "run" / "hf_model" / "model.safetensors"))
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2, 3]


def test_past_its_restarts_the_run_stops_with_a_checkpoint_that_resumes_bitwise(tmp_path, model_dir, undisturbed):
    run_dir = tmp_path / "run"
    killer = EngineKiller(after_sync=[1], after_rollout=[2])
    with pytest.raises(RunStopped) as stopped:
        _run(model_dir, run_dir, killer, "rollout.engine_restarts=1")
    message = str(stopped.value)
    assert stopped.value.exit_code == EXIT_STOPPED
    assert message.startswith("the rollout engine died again after 1 restart(s) (rollout.engine_restarts=1): "
                              "release_memory: engine process ")  # fmt: skip
    assert f"saved the checkpoint of step 1 ({run_dir / 'checkpoints' / 'step_00000001'})" in message
    assert "checkpoint.resume=auto" in message  # this run had resume=never
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000001"]
    _run(model_dir, run_dir, None, "checkpoint.resume=auto")
    assert _same(undisturbed, load_file(run_dir / "hf_model" / "model.safetensors"))
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]


class KilledDuringTheUpdate:
    """SIGKILLs the engine once the policy update of ``step`` is done: its death shows at that step's weight
    sync, after the policy moved, so the stop saves that step's checkpoint."""

    def __init__(self, step: int) -> None:
        self.step, self.engine = step, None

    @hookimpl
    def after_weight_sync(self, step, engine):
        self.engine = engine

    @hookimpl
    def after_optimizer_step(self, step, model, metrics):
        if step == self.step:
            os.kill(self.engine.pid, signal.SIGKILL)


def test_a_death_past_the_restarts_after_the_update_logs_the_steps_row_before_its_checkpoint(
    tmp_path, model_dir, undisturbed
):
    """Before, step 2's checkpoint was saved without step 2's metrics row, and the resume started at 3: the
    metrics file never had a row for step 2."""
    run_dir = tmp_path / "run"
    with pytest.raises(RunStopped) as stopped:
        _run(model_dir, run_dir, KilledDuringTheUpdate(2), "rollout.engine_restarts=0")
    assert f"saved the checkpoint of step 2 ({run_dir / 'checkpoints' / 'step_00000002'})" in str(stopped.value)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "reward/mean" in rows[-1] and "actor/pg_loss" in rows[-1]  # the step's rollout and update
    _run(model_dir, run_dir, None, "checkpoint.resume=auto")
    assert _same(undisturbed, load_file(run_dir / "hf_model" / "model.safetensors"))
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3]
