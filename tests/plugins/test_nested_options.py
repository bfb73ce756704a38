"""A plugin's nested options -- a field holding another dataclass, and a wrapper's inner choice (its name and
options) -- are validated when the config loads, exactly as a top-level choice's args are (an error names the
full key, with no spurious ``args.`` segment), and arrive at the implementation as config objects: the nested
dataclass built, the inner choice's options as the inner implementation's own config instance."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from rlite.api import hookimpl
from rlite.config import ConfigError, config_to_yaml, load_config
from rlite.plugin_manager import build_plugin_manager, resolve_choice

BASE = ["model.path=x", "data.task=addition", "rollout.engine.name=wrapper"]


@dataclass
class Tuning:
    depth: int = 2
    """How deep."""
    width: float = 0.5
    """How wide."""

    def __post_init__(self) -> None:
        if self.depth < 0:
            raise ValueError(f"depth must be >= 0, got {self.depth}")


@dataclass
class WrapperConfig:
    inner: str = field(default="transformers", metadata={"choice_of": "rollout_engine"})
    """The wrapped engine."""
    inner_args: Any = None
    """The wrapped engine's options; arrive as its config instance."""
    tuning: Tuning = field(default_factory=Tuning)
    """A nested section of options."""


@dataclass
class BareConfig:
    pass


class Wrapper:
    @hookimpl
    def register_rollout_engines(self, register):
        register("wrapper", lambda *args: None, WrapperConfig)
        register("bare", lambda *args: None)  # takes no options


@pytest.fixture
def pm():
    pm = build_plugin_manager(autoload=False)
    pm.register(Wrapper(), name="wrapper")
    return pm


def load(pm, *overrides: str):
    return load_config(None, [*BASE, *overrides], pm=pm)


def test_unknown_nested_option_fails_at_load_naming_the_key_without_a_spurious_args(pm) -> None:
    with pytest.raises(ConfigError) as raised:
        load(pm, "rollout.engine.args.inner_args.bogus=3")
    message = str(raised.value)
    assert message.startswith("rollout.engine.args.inner_args.bogus: unknown key 'bogus'."), message
    assert "args.args" not in message and "inner_args.args" not in message


def test_unknown_key_of_a_nested_dataclass_names_its_full_key(pm) -> None:
    with pytest.raises(ConfigError, match=r"^rollout\.engine\.args\.tuning\.dept: unknown key 'dept'.*Did you mean 'depth'"):
        load(pm, "rollout.engine.args.tuning.dept=3")


def test_a_nested_dataclass_check_names_the_nested_key(pm) -> None:
    with pytest.raises(ConfigError) as raised:
        load(pm, "rollout.engine.args.tuning.depth=-1")
    assert str(raised.value) == "rollout.engine.args.tuning: depth must be >= 0, got -1"


def test_an_inner_choice_of_an_inner_choice_names_the_whole_path(pm) -> None:
    """A wrapper wrapping a wrapper: the innermost engine's bad option is named through both levels."""
    with pytest.raises(ConfigError) as raised:
        load(pm, "rollout.engine.args.inner=wrapper", "rollout.engine.args.inner_args.inner_args.bogus=1")
    assert str(raised.value).startswith("rollout.engine.args.inner_args.inner_args.bogus: unknown key 'bogus'")


def test_unknown_inner_engine_fails_at_load(pm) -> None:
    with pytest.raises(ConfigError, match=r"^rollout\.engine\.args\.inner: unknown rollout_engine 'nonesuch'"):
        load(pm, "rollout.engine.args.inner=nonesuch")


def test_options_for_an_inner_choice_that_takes_none_are_refused(pm) -> None:
    with pytest.raises(ConfigError, match=r"^rollout\.engine\.args\.inner_args: rollout_engine 'bare' takes no options"):
        load(pm, "rollout.engine.args.inner=bare", "rollout.engine.args.inner_args.x=1")


def test_valid_nested_options_load_with_the_inner_defaults_filled_in_as_plain_data(pm, tmp_path) -> None:
    cfg = load(pm, "rollout.engine.args.tuning.width=2")
    args = cfg.rollout.engine.args
    transformers = pm.registry("rollout_engine").get("transformers").config_cls()
    assert args["inner"] == "transformers"
    assert args["inner_args"] == vars(transformers)  # the inner engine's defaults, as a mapping
    assert args["tuning"] == {"depth": 2, "width": 2.0}
    assert yaml.safe_load(config_to_yaml(cfg))["rollout"]["engine"]["args"] == args
    written = tmp_path / "config.yaml"  # what a run folder's config.yaml holds loads again, unchanged
    written.write_text(config_to_yaml(cfg))
    assert load_config(written, [], pm=pm).rollout.engine.args == args


def test_the_implementation_receives_config_objects(pm) -> None:
    cfg = load(pm, "rollout.engine.args.tuning.depth=5", "rollout.engine.args.inner_args.dtype=float32")
    _, options = resolve_choice(pm.registry("rollout_engine"), cfg.rollout.engine)
    transformers = pm.registry("rollout_engine").get("transformers").config_cls
    assert isinstance(options, WrapperConfig)
    assert options.tuning == Tuning(depth=5)
    assert isinstance(options.inner_args, transformers) and options.inner_args.dtype == "float32"
    bare = load(pm, "rollout.engine.args.inner=bare")
    _, options = resolve_choice(pm.registry("rollout_engine"), bare.rollout.engine)
    assert options.inner_args is None  # an inner implementation without options gets None
    assert bare.rollout.engine.args["inner_args"] == {}


def test_a_wrapper_of_a_wrapper_gets_both_levels_built(pm) -> None:
    cfg = load(pm, "rollout.engine.args.inner=wrapper", "rollout.engine.args.inner_args.tuning.depth=7")
    _, options = resolve_choice(pm.registry("rollout_engine"), cfg.rollout.engine)
    middle = options.inner_args
    assert isinstance(middle, WrapperConfig) and middle.tuning.depth == 7
    assert type(middle.inner_args).__name__ == "TransformersEngineConfig"
