"""Built-in plugin: quantizers (placeholder, filled in by its owner)."""

from rlite import hookimpl  # noqa: F401
