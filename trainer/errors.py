"""Errors raised on several floors of the house, defined below all of them.

:class:`EngineError` and :class:`EngineDied`: rollout engines raise them, and so does :mod:`rlite.sync`,
which an engine uses to receive weights, so neither package imports the other for them (import them
from :mod:`rlite.api`, or :mod:`rlite.engines.base`, which re-exports them). :class:`RunStopped`: a
step's stage (:mod:`rlite.stages`) or the run around it (:mod:`rlite.run`) stops the run with it
(:mod:`rlite.run.faults` re-exports it with the other exit codes). :class:`ConfigError`: the config
loader raises it, and so do plugins and engines that check their own settings, some of them (the SGLang
launcher) in a process that has no omegaconf, so it lives here rather than in :mod:`rlite.config`, which
re-exports it.
"""

from __future__ import annotations

EXIT_STOPPED = 4
"""Exit status of a run that stopped on a fault it cannot get past (too many non-finite updates in a
row, an engine that keeps dying, a full disk). The message names the cause and the checkpoint to
resume from. (3 is a reward function failing past its bound, :data:`rlite.tools.cli.EXIT_REWARDS_FAILED`: a
bug in user code, where this is the run's own state or machine.)"""


class ConfigError(ValueError):
    """A configuration problem, always naming the full key path and what to do."""


class RunStopped(Exception):
    """The run stopped on purpose; ``str(self)`` says why and what to do, ``exit_code`` is the status
    the ``rlite`` command exits with."""

    def __init__(self, message: str, exit_code: int = EXIT_STOPPED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class EngineError(RuntimeError):
    """The engine failed, timed out, or reported a wrong weight version/checksum."""


class EngineDied(EngineError):
    """The engine's process is gone: it died, or it was killed after a call timed out. A fresh engine
    can take over (:class:`rlite.engines.supervisor.SupervisedEngine` restarts it)."""
