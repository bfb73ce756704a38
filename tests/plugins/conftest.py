"""Fixtures for the plugin contract tests."""

from __future__ import annotations

from typing import Any

import pytest

from rlite import hookimpl


class LifecycleRecorder:
    """Implements every lifecycle hook with its full documented signature and records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def _record(self, hook: str, **kwargs: Any) -> None:
        self.calls.append((hook, kwargs))

    def called(self, hook: str) -> list[dict[str, Any]]:
        return [kwargs for name, kwargs in self.calls if name == hook]

    @hookimpl
    def on_run_start(self, config, run_dir):
        self._record("on_run_start", config=config, run_dir=run_dir)

    @hookimpl
    def after_rollout(self, step, batch):
        self._record("after_rollout", step=step, batch=batch)

    @hookimpl
    def after_rewards(self, step, batch):
        self._record("after_rewards", step=step, batch=batch)

    @hookimpl
    def before_optimizer_step(self, step, model, optimizer):
        self._record("before_optimizer_step", step=step, model=model, optimizer=optimizer)

    @hookimpl
    def after_optimizer_step(self, step, model, metrics):
        self._record("after_optimizer_step", step=step, model=model, metrics=metrics)

    @hookimpl
    def after_weight_sync(self, step, weight_version, engine):
        self._record("after_weight_sync", step=step, weight_version=weight_version, engine=engine)

    @hookimpl
    def on_checkpoint_save(self, step, path):
        self._record("on_checkpoint_save", step=step, path=path)

    @hookimpl
    def on_checkpoint_load(self, step, path):
        self._record("on_checkpoint_load", step=step, path=path)

    @hookimpl
    def on_metrics(self, step, metrics):
        self._record("on_metrics", step=step, metrics=metrics)

    @hookimpl
    def on_run_end(self, config, summary):
        self._record("on_run_end", config=config, summary=summary)


@pytest.fixture
def lifecycle_recorder() -> LifecycleRecorder:
    return LifecycleRecorder()


@pytest.fixture(scope="session")
def lifecycle_recorder_class() -> type[LifecycleRecorder]:
    """For module-scoped fixtures that need their own recorders."""
    return LifecycleRecorder
