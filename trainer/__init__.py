"""rlite: a lightweight trainer for reinforcement-learning post-training of LLMs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlite.version import __version__

if TYPE_CHECKING:
    from rlite.hookspecs import hookimpl

__all__ = ["__version__", "hookimpl"]


def __getattr__(name: str) -> Any:
    # ``hookimpl`` loads on first use: importing the package stays instant, so that the ``rlite`` command's
    # entry point (rlite.__main__) installs its SIGTERM handler before anything heavy is imported
    if name == "hookimpl":
        from rlite.hookspecs import hookimpl

        return hookimpl
    raise AttributeError(f"module 'rlite' has no attribute {name!r}")
