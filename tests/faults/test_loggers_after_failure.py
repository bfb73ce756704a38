"""A run that stops early closes its loggers, as a finished one does: what they buffer reaches their files
and a W&B run ends, also for a rank that leaves through ``os._exit`` (no interpreter exit closes them)."""

from __future__ import annotations

import pytest

from rlite import hookimpl
from rlite.plugin_manager import build_plugin_manager
from rlite.run.loop import run_training
from rlite.testing import tiny_config
from rlite.tokenizer import build_tiny_model_dir

EVENTS: list[tuple] = []


class RecordingLogger:
    def log(self, step, metrics):
        EVENTS.append(("log", step))

    def close(self):
        EVENTS.append(("close",))


class RecordingLoggerPlugin:
    @hookimpl
    def register_loggers(self, register):
        register("recording", lambda run_dir, config, cfg: RecordingLogger(), None)


class FailAtStep:
    def __init__(self, step: int) -> None:
        self.step = step

    @hookimpl
    def after_rewards(self, step, batch):
        if step == self.step:
            raise RuntimeError(f"a plugin failed at step {step}")


@pytest.mark.parametrize("fail_at", [None, 2])  # None: also a run whose only logger is not jsonl ends with a summary
def test_loggers_are_closed_once_whether_the_run_finishes_or_fails(tmp_path, fail_at):
    model_dir = build_tiny_model_dir(tmp_path / "tiny")
    EVENTS.clear()
    pm = build_plugin_manager(autoload=False)
    pm.register(RecordingLoggerPlugin(), name="recording-logger")
    if fail_at is not None:
        pm.register(FailAtStep(fail_at), name="fail")
    cfg = tiny_config(model_dir, tmp_path / "run", "training.steps=3", "logging.loggers=[recording]", pm=pm)
    if fail_at is None:
        run_training(cfg, pm)
    else:
        with pytest.raises(RuntimeError, match="a plugin failed at step 2"):
            run_training(cfg, pm)
    logged = [e[1] for e in EVENTS if e[0] == "log"]
    assert logged == ([0, 1, 2, 3] if fail_at is None else [0, 1])  # step 0: the evaluation before training
    assert EVENTS.count(("close",)) == 1 and EVENTS[-1] == ("close",)
