"""An engine that dies while starting is restarted like one that dies later: the spawned engine process
is SIGKILLed before it is ready (the first engine, and a replacement during a mid-run restart), each
death counted against ``rollout.engine_restarts``; past them the run stops with exit status 4."""

from __future__ import annotations

import functools
import logging
import signal

import pytest

from rlite import hookimpl
from rlite.engines.base import EngineDied
from rlite.engines.supervisor import EngineGaveUp, SupervisedEngine
from rlite.plugin_manager import build_plugin_manager
from rlite.run.faults import EXIT_STOPPED, RunStopped
from rlite.run.loop import run_training
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def process_killed_while_starting(model_dir: str):
    """A real engine process that is SIGKILLed before it reports ready (as the kernel's OOM killer would)."""
    from rlite.plugins.transformers.process import ProcessEngine

    return ProcessEngine(model_dir, pad_token_id=0, eos_token_ids=[0], timeout_s=120,
                         engine_factory=functools.partial(signal.raise_signal, signal.SIGKILL), factory_kwargs={})


class DiesWhileStarting:
    """The ``transformers`` engine (in a process), except that its first ``deaths`` starts die."""

    def __init__(self, deaths: int):
        self.deaths = deaths
        self.starts = 0

    @hookimpl
    def register_rollout_engines(self, register):
        from rlite.plugins.transformers import TransformersEngineConfig, make_transformers_engine

        def make(model_config, tokenizer, rollout_config, cfg, context):
            self.starts += 1
            if self.starts <= self.deaths:
                return process_killed_while_starting(model_config.path)
            return make_transformers_engine(model_config, tokenizer, rollout_config, cfg, context)

        register("dies_while_starting", make, TransformersEngineConfig)


def _run(model_dir, run_dir, plugin, *overrides):
    pm = build_plugin_manager(autoload=False)
    pm.register(plugin, name="dies_while_starting")
    cfg = tiny_config(model_dir, run_dir, "rollout.engine.name=dies_while_starting", "rollout.engine.args.process=true",
                      "training.steps=2", "rollout.timeout_s=120", *overrides, pm=pm)
    return run_training(cfg, pm)


def test_an_engine_that_dies_while_starting_is_started_again_and_the_run_finishes(tmp_path, model_dir, caplog):
    plugin = DiesWhileStarting(deaths=2)
    with caplog.at_level(logging.WARNING, logger="rlite"):
        _run(model_dir, tmp_path / "run", plugin, "rollout.engine_restarts=2")
    assert plugin.starts == 3
    again = [r.getMessage() for r in caplog.records if "died while starting" in r.getMessage()]
    assert len(again) == 2 and "(1 of 2)" in again[0] and "(2 of 2)" in again[1]
    assert all("killed by signal 9" in m for m in again)
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2]


def test_past_its_restarts_an_engine_dying_while_starting_stops_the_run_with_exit_4(tmp_path, model_dir):
    plugin = DiesWhileStarting(deaths=2)
    with pytest.raises(RunStopped) as stopped:
        _run(model_dir, tmp_path / "run", plugin, "rollout.engine_restarts=1")
    message = str(stopped.value)
    assert stopped.value.exit_code == EXIT_STOPPED
    assert message.startswith("the rollout engine died again while starting after 1 restart(s) "
                              "(rollout.engine_restarts=1): engine process died while starting: ")
    assert "killed by signal 9" in message and "No step ran in this run" in message
    assert plugin.starts == 2


class StubEngine:
    def __init__(self, name: str, dies: bool = False):
        self.name, self.dies, self.weight_version = name, dies, 0

    def generate(self, prompts, params):
        if self.dies:
            raise EngineDied(f"{self.name} died")
        return self.name

    def shutdown(self):
        pass


def test_a_replacement_that_dies_while_starting_counts_as_a_restart_and_the_next_one_takes_over():
    starts = iter([EngineDied("replacement 1 killed while starting"), StubEngine("replacement 2")])

    def start():
        outcome = next(starts)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    synced = []
    supervised = SupervisedEngine(StubEngine("first", dies=True), start, max_restarts=2,
                                  resync=lambda engine, version: synced.append(version))
    assert supervised.generate([], None) == "replacement 2"
    assert supervised.restarts == 2 and synced == [0]

    supervised = SupervisedEngine(StubEngine("first", dies=True), start=lambda: (_ for _ in ()).throw(
        EngineDied("killed while starting")), max_restarts=1, resync=lambda engine, version: synced.append(version))
    with pytest.raises(EngineGaveUp, match=r"died again while starting after 1 restart\(s\).*killed while starting"):
        supervised.generate([], None)
