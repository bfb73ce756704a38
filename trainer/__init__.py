"""rlite: a lightweight trainer for reinforcement-learning post-training of LLMs."""

__version__ = "0.1.0"

from rlite.hookspecs import hookimpl  # noqa: E402

__all__ = ["__version__", "hookimpl"]
