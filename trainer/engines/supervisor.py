"""A rollout engine that comes back: when its process dies, a fresh one is started and given the
trainer's current weights, and the call that failed is made again.

:class:`SupervisedEngine` wraps any engine; only :class:`~rlite.engines.base.EngineDied` (the process
is gone) leads to a restart, any other :class:`~rlite.engines.base.EngineError` is passed on. The new
engine receives the weights through the ordinary sync (``resync(version)``), so it samples with the
version the trainer last synced, checksums verified by the sync protocol. After ``max_restarts``
restarts the next death raises :class:`EngineGaveUp`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rlite.engines.base import EngineDied, EngineError, RolloutEngine

log = logging.getLogger("rlite")


class EngineGaveUp(EngineError):
    """The engine died once more after all the restarts it was allowed."""


class SupervisedEngine:
    """Forwards every call to the engine it holds (same interface and capabilities); restarts it when
    its process dies."""

    def __init__(self, engine: RolloutEngine, start: Callable[[], RolloutEngine], max_restarts: int) -> None:
        self.engine = engine
        self.start = start
        """Builds a fresh engine like the first (the engine factory with the run's arguments)."""
        self.max_restarts = max_restarts
        self.restarts = 0
        self.resync: Callable[[int], None] | None = None
        """Syncs the trainer's weights into the engine as a version (the run's ``sync_weights``)."""
        self.version = 0
        """The weight version last asked for: what the trainer's weights are."""

    @property
    def capabilities(self):
        return self.engine.capabilities

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def __getattr__(self, name: str) -> Any:  # what the wrapped engine has beyond the contract
        engine = self.__dict__.get("engine")
        if engine is None:
            raise AttributeError(name)
        return getattr(engine, name)

    # -- the contract ---------------------------------------------------------------------------
    def generate(self, prompts, params):
        return self._call("generate", prompts, params)

    def update_weights(self, named_tensors, version: int) -> None:
        self.version = int(version)
        try:
            return self.engine.update_weights(named_tensors, version)
        except EngineDied as died:  # the stream is half spent: the new engine gets a fresh one
            self._restart(died)

    def update_lora_adapter(self, named_tensors, config: dict, version: int) -> None:
        self.version = int(version)
        try:
            return self.engine.update_lora_adapter(named_tensors, config, version)
        except EngineDied as died:
            self._restart(died)

    def release_memory(self) -> None:
        self._call("release_memory")

    def resume_memory(self) -> None:
        self._call("resume_memory")

    def speculation_stats(self):
        return self._call("speculation_stats")

    def shutdown(self) -> None:
        self.engine.shutdown()

    # -- restarts ---------------------------------------------------------------------------------
    def _call(self, method: str, *args):
        while True:
            try:
                return getattr(self.engine, method)(*args)
            except EngineDied as died:
                self._restart(died)  # then the same call again, on the new engine

    def _restart(self, died: EngineDied) -> None:
        cause = str(died).splitlines()[0]
        if self.restarts >= self.max_restarts or self.resync is None:
            raise EngineGaveUp(
                f"the rollout engine died again after {self.restarts} restart(s) "
                f"(rollout.engine_restarts={self.max_restarts}): {cause}"
            ) from died
        self.restarts += 1
        log.warning("rollout engine died (%s); restarting it (%d of %d) with the trainer's weights v%d",
                    cause, self.restarts, self.max_restarts, self.version)  # fmt: skip
        try:
            self.engine.shutdown()
        except Exception:  # noqa: BLE001 (the old engine is gone either way)
            pass
        self.engine = self.start()
        self.resync(self.version)  # the sync protocol's checksums verify every byte the new engine got
        log.warning("rollout engine restarted (pid %s), weights v%d synced and verified",
                    getattr(self.engine, "pid", "in-process"), self.engine.weight_version)  # fmt: skip
