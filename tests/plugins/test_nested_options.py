"""A wrapper plugin's nested options (its inner engine's name and options) are validated when the config
loads, exactly as a top-level choice's args are: an unknown inner option names its full key."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rlite.api import hookimpl
from rlite.config import ConfigError, load_config
from rlite.plugin_manager import build_plugin_manager


@dataclass
class WrapperConfig:
    inner: str = field(default="transformers", metadata={"choice_of": "rollout_engine"})
    """The wrapped engine."""
    inner_args: dict = field(default_factory=dict)
    """The wrapped engine's options."""


class Wrapper:
    @hookimpl
    def register_rollout_engines(self, register):
        register("wrapper", lambda *args: None, WrapperConfig)


@pytest.fixture
def pm():
    pm = build_plugin_manager(autoload=False)
    pm.register(Wrapper(), name="wrapper")
    return pm


def test_unknown_nested_option_fails_at_load_naming_the_key(pm) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.engine\.args\.inner_args.*bogus"):
        load_config(None, ["model.path=x", "data.task=addition", "rollout.engine.name=wrapper", "rollout.engine.args.inner_args.bogus=3"], pm=pm)


def test_unknown_inner_engine_fails_at_load(pm) -> None:
    with pytest.raises(ConfigError, match="nonesuch"):
        load_config(None, ["model.path=x", "data.task=addition", "rollout.engine.name=wrapper", "rollout.engine.args.inner=nonesuch"], pm=pm)


def test_valid_nested_options_load_with_the_inner_defaults_filled_in(pm) -> None:
    cfg = load_config(None, ["model.path=x", "data.task=addition", "rollout.engine.name=wrapper"], pm=pm)
    assert cfg.rollout.engine.args["inner"] == "transformers"
    assert cfg.rollout.engine.args["inner_args"]  # the transformers engine's defaults
