"""Built-in plugin: policy_losses (placeholder, filled in by its owner)."""

from rlite import hookimpl  # noqa: F401
