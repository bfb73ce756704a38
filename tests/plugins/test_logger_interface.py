"""``rlite.api.Logger`` is what ``register_loggers`` factories return: rlite's own loggers implement it, every
member is documented, a logger with only the required methods is enough, and a factory that returns something
else is refused when the run builds its loggers, naming the logger and its plugin."""

from __future__ import annotations

import inspect

import pytest

from rlite.api import ConfigError, Logger, hookimpl
from rlite.plugin_manager import build_plugin_manager
from rlite.plugins import loggers as builtin
from rlite.run.recorder import build_loggers
from rlite.testing import tiny_config


def test_the_interface_documents_every_member() -> None:
    members = ["log", "close", "log_samples", "resume"]
    for name in members:
        doc = inspect.getdoc(getattr(Logger, name)) or ""
        assert len(doc.split()) >= 8, f"Logger.{name} needs a docstring saying when it is called"
    assert list(inspect.signature(Logger.log).parameters) == ["self", "step", "metrics"]
    assert list(inspect.signature(Logger.log_samples).parameters) == ["self", "step", "kind", "rows"]


@pytest.mark.parametrize("cls", [builtin.JsonlLogger, builtin.TensorBoardLogger, builtin.WandbLogger])
def test_the_builtin_loggers_implement_it(cls) -> None:
    assert issubclass(cls, Logger)
    for name in ("log", "close"):
        assert getattr(cls, name) is not getattr(Logger, name), f"{cls.__name__} must implement {name}"


def test_the_jsonl_logger_is_a_logger_and_takes_the_optional_calls(tmp_path) -> None:
    logger = builtin.JsonlLogger(tmp_path / "metrics.jsonl")
    assert isinstance(logger, Logger)
    logger.resume(3)  # the interface's defaults: nothing to forget, no samples to show
    logger.log_samples(4, "train", [{"prompt": "1+1=", "completion": "2"}])
    logger.log(4, {"reward/mean": 0.5, "bad": float("nan")})
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 4, "reward/mean": 0.5, "bad": null}\n'


class MinimalLogger:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log(self, step, metrics):
        self.rows.append((step, metrics))

    def close(self):
        pass


class NotALogger:
    def log(self, step, metrics):
        pass


class Loggers:
    @hookimpl
    def register_loggers(self, register):
        register("minimal", lambda run_dir, config, cfg: MinimalLogger())
        register("broken", lambda run_dir, config, cfg: NotALogger())
        register("absent", lambda run_dir, config, cfg: None)


@pytest.fixture
def pm():
    pm = build_plugin_manager(autoload=False)
    pm.register(Loggers(), name="my_loggers")
    return pm


def test_only_the_required_methods_are_needed_and_none_is_skipped(pm, tmp_path) -> None:
    cfg = tiny_config(tmp_path / "model", tmp_path / "run", "logging.loggers=[minimal, absent]", pm=pm)
    (logger,) = build_loggers(cfg, tmp_path / "run", pm)
    assert isinstance(logger, MinimalLogger)


def test_a_factory_that_builds_no_logger_is_refused_naming_it(pm, tmp_path) -> None:
    cfg = tiny_config(tmp_path / "model", tmp_path / "run", "logging.loggers=[broken]", pm=pm)
    with pytest.raises(ConfigError, match=r"the 'broken' logger of plugin 'my_loggers' built a NotALogger without "
                                          r"close\(\): a logger implements rlite.api.Logger"):
        build_loggers(cfg, tmp_path / "run", pm)
