"""A rollout engine that comes back: when its process dies, a fresh one is started and given the
trainer's current weights, and the call that failed is made again.

:class:`SupervisedEngine` wraps any engine; only :class:`~rlite.engines.base.EngineDied` (the process
is gone) leads to a restart, any other :class:`~rlite.engines.base.EngineError` is passed on. The new
engine receives the weights through the ordinary sync (``resync(engine, version)``, given at construction:
the run's weight sync, into the supervisor itself, so that a death during it restarts again), so it samples
with the version the trainer last synced, checksums verified by the sync protocol. An engine that dies while
starting (the first one, :meth:`SupervisedEngine.launch`, or a replacement) is started again the same
way and counts as a restart. After ``max_restarts`` restarts the next death raises :class:`EngineGaveUp`.
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

    def __init__(self, engine: RolloutEngine, start: Callable[[], RolloutEngine], max_restarts: int,
                 resync: Callable[[RolloutEngine, int], None] | None = None, restarts: int = 0) -> None:
        self.engine = engine
        self.start = start
        """Builds a fresh engine like the first (the engine factory with the run's arguments)."""
        self.max_restarts = max_restarts
        self.restarts = restarts
        """Restarts so far (those while starting the first engine included)."""
        self.resync = resync
        """Syncs the trainer's weights into an engine as a version (the run's
        :meth:`~rlite.stages.sync.WeightSync.send`); ``None``: a death cannot be recovered from."""
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

    @classmethod
    def launch(cls, start: Callable[[], RolloutEngine], max_restarts: int,
               resync: Callable[[RolloutEngine, int], None] | None = None) -> SupervisedEngine:
        """Start the first engine with ``start``; one that dies while starting is started again, counted
        against ``max_restarts`` like a death later in the run. ``resync``: as the constructor takes it."""
        restarts = 0
        while True:
            try:
                engine = start()
                break
            except EngineDied as died:
                restarts = cls._count_restart(died, restarts, max_restarts, "while starting")
                log.warning("rollout engine died while starting (%s); starting it again (%d of %d)",
                            str(died).splitlines()[0], restarts, max_restarts)  # fmt: skip
        return cls(engine, start, max_restarts, resync, restarts)

    @staticmethod
    def _count_restart(died: EngineDied, restarts: int, max_restarts: int, when: str = "") -> int:
        """One more restart after ``died``, or :class:`EngineGaveUp` when none is left."""
        cause = str(died).splitlines()[0]
        if restarts >= max_restarts:
            raise EngineGaveUp(
                f"the rollout engine died{' again' if restarts else ''}{' ' + when if when else ''} after {restarts} restart(s) "
                f"(rollout.engine_restarts={max_restarts}): {cause}"
            ) from died
        return restarts + 1

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
        if self.resync is None:  # nothing could give a new engine the trainer's weights
            raise EngineGaveUp(f"the rollout engine died before the run could sync it: {died}") from died
        when = ""
        while True:
            self.restarts = self._count_restart(died, self.restarts, self.max_restarts, when)
            log.warning("rollout engine died%s (%s); restarting it (%d of %d) with the trainer's weights v%d",
                        " " + when if when else "", str(died).splitlines()[0], self.restarts, self.max_restarts,
                        self.version)  # fmt: skip
            try:
                self.engine.shutdown()
            except Exception:  # noqa: BLE001 (the old engine is gone either way)
                pass
            try:
                self.engine = self.start()
                break
            except EngineDied as again:  # the replacement died while starting: the same as any death
                died, when = again, "while starting"
        self.resync(self, self.version)  # the sync protocol's checksums verify every byte the new engine got
        log.warning("rollout engine restarted (pid %s), weights v%d synced and verified",
                    getattr(self.engine, "pid", "in-process"), self.engine.weight_version)  # fmt: skip
