"""The config-check phase: a chosen implementation's registered ``check_config(config, cfg)`` runs when the
config loads (after validation), and what it refuses stops the load naming the choice's key, the
implementation and its plugin; the capabilities a plugin declares become load-time refusals; a registration
whose metadata breaks the capabilities table is refused naming the plugin."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from rlite.api import ConfigError, Unsupported, hookimpl
from rlite.config import load_config
from rlite.config.capabilities import BACKEND_FEATURES, CAPABILITIES
from rlite.plugin_manager import PluginError, build_plugin_manager, load_entry_point_plugins
from rlite.tools.cli import main

REQUIRED = ["model.path=tiny-model", "data.task=addition"]
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class StrictConfig:
    max_tokens: int = 8
    """The longest response this estimator handles."""


SEEN: list[tuple[object, object]] = []


def check_strict(config, cfg: StrictConfig) -> None:
    SEEN.append((config, cfg))
    if config.rollout.max_new_tokens > cfg.max_tokens:
        raise ConfigError(f"rollout.max_new_tokens={config.rollout.max_new_tokens} exceeds "
                          f"algorithm.advantage.args.max_tokens={cfg.max_tokens}; lower it")


class Strict:
    @hookimpl
    def register_advantage_estimators(self, register):
        register("strict", lambda batch, cfg: None, StrictConfig, check_config=check_strict)


@pytest.fixture
def pm():
    SEEN.clear()
    pm = build_plugin_manager(autoload=False)
    pm.register(Strict(), name="strict-plugin")
    return pm


def test_a_plugins_check_refuses_a_config_at_load_naming_the_key_and_the_plugin(pm) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*REQUIRED, "algorithm.advantage=strict", "rollout.max_new_tokens=16"], pm=pm)
    assert str(refused.value) == ("algorithm.advantage=strict (plugin 'strict-plugin'): rollout.max_new_tokens=16 "
                                  "exceeds algorithm.advantage.args.max_tokens=8; lower it")


def test_the_check_gets_the_run_config_and_its_own_typed_options(pm) -> None:
    cfg = load_config(None, [*REQUIRED, "algorithm.advantage=strict", "algorithm.advantage.args.max_tokens=32",
                             "rollout.max_new_tokens=16"], pm=pm)
    ((config, options),) = SEEN
    assert config is cfg and options == StrictConfig(max_tokens=32)


def test_a_check_runs_only_for_the_chosen_implementation(pm) -> None:
    load_config(None, [*REQUIRED, "rollout.max_new_tokens=16"], pm=pm)  # grpo chosen: strict's check not called
    assert SEEN == []


def test_the_refusal_reaches_the_command_line_with_exit_2_before_the_run_folder(tmp_path, capsys, monkeypatch) -> None:
    import rlite.plugin_manager as plugin_manager

    built = plugin_manager.build_plugin_manager

    def with_strict(*args, **kwargs):
        manager = built(*args, **kwargs)
        manager.register(Strict(), name="strict-plugin")
        return manager

    monkeypatch.setattr(plugin_manager, "build_plugin_manager", with_strict)
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{path: m}}\ndata: {{task: addition}}\nlogging: {{run_dir: {run_dir}}}\n")
    code = main(["train", str(config), "plugins.autoload=false", "algorithm.advantage=strict", "rollout.max_new_tokens=16"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "algorithm.advantage=strict (plugin 'strict-plugin'): rollout.max_new_tokens=16" in err
    assert not run_dir.exists()


@dataclass
class WrapperConfig:
    inner: str = field(default="transformers", metadata={"choice_of": "rollout_engine"})
    """The wrapped engine."""
    inner_args: dict = field(default_factory=dict)
    """The wrapped engine's options."""


def test_a_wrapped_choice_is_checked_too() -> None:
    """A wrapper's inner engine (a ``choice_of`` option) is chosen as much as the wrapper: its check runs."""

    class Wrapper:
        @hookimpl
        def register_rollout_engines(self, register):
            register("wrapper", lambda *args: None, WrapperConfig)

    pm = build_plugin_manager(autoload=False)
    pm.register(Wrapper(), name="wrapper")
    lora = ["model.lora.enabled=true", "rollout.lora_sync=adapter"]
    with pytest.raises(ConfigError, match=r"^rollout.engine.args.inner=transformers \(plugin 'rlite.plugins.transformers'\): "
                                          "rollout.lora_sync=adapter: the 'transformers' engine cannot serve adapters"):
        load_config(None, [*REQUIRED, "rollout.engine=wrapper", *lora], pm=pm)
    load_config(None, [*REQUIRED, "rollout.engine=wrapper", "rollout.engine.args.inner=sglang", *lora], pm=pm)


def test_a_backends_unsupported_features_are_refused_at_load_with_its_reasons() -> None:
    class Lean:
        @hookimpl
        def register_training_backends(self, register):
            register("lean", lambda *args: None, unsupported={
                "compile": Unsupported("the lean backend runs eager only", "set training.compile=false")})

    pm = build_plugin_manager(autoload=False)
    pm.register(Lean(), name="lean-plugin")
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*REQUIRED, "parallelism.backend=lean", "training.compile=true",
                           "training.share_prompt_prefix=false"], pm=pm)
    assert str(refused.value) == ("parallelism.backend=lean with training.compile=true: the lean backend runs eager "
                                  "only; set training.compile=false, or use parallelism.backend=fsdp2, which "
                                  "implements it")
    load_config(None, [*REQUIRED, "parallelism.backend=lean"], pm=pm)
    load_config(None, [*REQUIRED, "training.compile=true", "training.share_prompt_prefix=false"], pm=pm)


@pytest.mark.parametrize(("metadata", "problem"), [
    ({"check_config": "not a function"}, "check_config='not a function' is not `fn(config, cfg)`"),
    ({"unsupported": {"teleport": Unsupported("", "")}}, "unsupported="),
    ({"unsupported": {"compile": "no"}}, "unsupported="),
    ({"model_parallel": "tensor_parallel"}, "model_parallel='tensor_parallel' is not tuple of option names"),
])
def test_a_registration_that_breaks_the_capabilities_table_names_its_plugin(metadata, problem) -> None:
    class Broken:
        @hookimpl
        def register_training_backends(self, register):
            register("broken", lambda *args: None, **metadata)

    pm = build_plugin_manager(autoload=False)
    pm.register(Broken(), name="broken-plugin")
    with pytest.raises(PluginError, match=r"^plugin 'broken-plugin': training_backend 'broken': ") as refused:
        pm.registry("training_backend")
    assert problem in str(refused.value)


@pytest.fixture(scope="module")
def with_megatron():
    if importlib.util.find_spec("megatron.core") is None:
        pytest.skip("needs megatron-core: pip install 'rlite[megatron]'")
    pm = build_plugin_manager(autoload=False)
    load_entry_point_plugins(pm, only=["megatron"])
    return pm


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallelism.backend={name: megatron, args: {tensor_parallel: 2}}", "rollout.mode=one_step_off"],
     "parallelism.backend=megatron (plugin 'megatron'): rollout.mode=one_step_off: asynchronous rollouts need every "
     "rank to sample its own batch, and parallelism.backend.args.tensor_parallel=2 lays out replicas"),
    (["parallelism.backend=megatron", "parallelism.activation_checkpointing=true", "algorithm.routing_replay=rollout"],
     "parallelism.backend=megatron (plugin 'megatron'): parallelism.activation_checkpointing=true with "
     "algorithm.routing_replay: megatron recomputes each layer"),
])
def test_megatrons_own_refusals_fire_when_the_config_loads(with_megatron, overrides, message) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(None, [*REQUIRED, *overrides], pm=with_megatron)
    assert str(refused.value).startswith(message), refused.value
    load_config(None, [*REQUIRED, "parallelism.backend={name: megatron, args: {tensor_parallel: 2}}"], pm=with_megatron)


def test_the_capabilities_table_in_the_docs_is_the_codes() -> None:
    """docs/plugins.md shows :data:`rlite.config.capabilities.CAPABILITIES` row for row (its generator's output)."""
    from rlite.config.capabilities import capabilities_markdown

    docs = (ROOT / "docs" / "plugins.md").read_text()
    assert capabilities_markdown() in docs, "paste rlite.config.capabilities.capabilities_markdown() into docs/plugins.md"
    for row in CAPABILITIES:
        assert f"`{row.key}`" in capabilities_markdown()
    assert all(f"`{feature}`" in docs for feature in BACKEND_FEATURES)


def test_the_docs_example_check_refuses_what_it_says(monkeypatch) -> None:
    import re
    import sys
    import types

    (source,) = [block for block in re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "plugins.md").read_text(), flags=re.S)
                 if "check_config=check_length_budget" in block]  # fmt: skip
    module = types.ModuleType("docs_length_budget")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(source, "docs/plugins.md", "exec"), module.__dict__)
    pm = build_plugin_manager(autoload=False)
    pm.register(module, name="docs-length-budget")
    with pytest.raises(ConfigError, match=r"^rewards\[1\]=length_budget \(plugin 'docs-length-budget'\): "
                                          r"args.budget=32 is not below rollout.max_new_tokens=32"):
        load_config(None, [*REQUIRED, "rewards=[exact_match, length_budget]", "rollout.max_new_tokens=32"], pm=pm)
    load_config(None, [*REQUIRED, "rewards=[exact_match, length_budget]", "rollout.max_new_tokens=64"], pm=pm)
