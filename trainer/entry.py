"""The ``rlite`` command's first code (:mod:`rlite.__main__` installs it): a SIGTERM handler, set before anything
heavy is imported.

Importing the command (pluggy, omegaconf, rich, then torch) takes a second or two on a loaded node, and a
scheduler's SIGTERM in that window used to kill the process (status 143) before ``rlite train`` had
installed its preemption handlers. This module imports nothing of rlite's, and its handler only records the
signal. ``rlite train`` then stops with status 75 before it starts anything (there is nothing to save yet);
every other command restores the default handler and, if the signal came, ends by it as it would have.
Only the interpreter's own start-up comes before this.
"""

from __future__ import annotations

import signal
import threading

_received: list[int] = []


def _record(signum: int, frame: object) -> None:
    _received.append(signum)


def install() -> None:
    """Record a SIGTERM from now on (the main thread only: signal handlers can be set nowhere else)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _record)


def received() -> bool:
    """Whether a SIGTERM came while this module's handler was installed."""
    return bool(_received)


def release() -> None:
    """Give SIGTERM back to its default action, and deliver a signal that came meanwhile: for the commands
    that have no preemption of their own (everything but ``rlite train``)."""
    if signal.getsignal(signal.SIGTERM) is _record:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if _received:
            signal.raise_signal(signal.SIGTERM)
