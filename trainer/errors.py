"""The errors of rollout engines and of the weight sync that feeds them.

They live below both (:mod:`rlite.engines` raises them, and so does :mod:`rlite.sync`, which an
engine uses to receive weights) so that neither package has to import the other for them. Import them
from :mod:`rlite.api` (or :mod:`rlite.engines.base`, which re-exports them).
"""

from __future__ import annotations


class EngineError(RuntimeError):
    """The engine failed, timed out, or reported a wrong weight version/checksum."""


class EngineDied(EngineError):
    """The engine's process is gone: it died, or it was killed after a call timed out. A fresh engine
    can take over (:class:`rlite.engines.supervisor.SupervisedEngine` restarts it)."""
