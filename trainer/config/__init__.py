"""Typed run configuration: the schema (:mod:`rlite.config.schema`) and its loader
(:mod:`rlite.config.loader`)."""

from rlite.config.loader import config_to_dict, config_to_yaml, load_config, validate_choices
from rlite.config.schema import *  # noqa: F403 (the schema's dataclasses are the public config API)
from rlite.config.schema import ConfigError, optional_dependencies_deferred, require_optional_package

__all__ = [
    "ConfigError",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "optional_dependencies_deferred",
    "require_optional_package",
    "validate_choices",
]
