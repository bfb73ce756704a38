"""The plugin manager: built-ins, entry-point discovery and its switches, and its failure modes."""

from __future__ import annotations

import json

import pluggy
import pytest

from rlite import hookimpl
from rlite.config import ConfigError
from rlite.plugin_manager import DEFAULT_PLUGINS, REGISTRY_KINDS, PluginError, build_plugin_manager
from rlite.tools.cli import load_run_config, main

# Names the default config selects; their built-in plugins must provide them.
DEFAULT_CHOICES = [
    ("advantage_estimator", "grpo"),
    ("policy_loss", "ppo_clip"),
    ("reward_function", "exact_match"),
    ("rollout_engine", "transformers"),
    ("training_backend", "fsdp2"),
    ("logger", "jsonl"),
]


def estimator_module(*names: str) -> str:
    registrations = "".join(f"    register({name!r}, lambda batch, cfg: None)\n" for name in names)
    return f"from rlite import hookimpl\n\n\n@hookimpl\ndef register_advantage_estimators(register):\n{registrations}"


BROKEN_MODULE = 'raise ImportError("rlite_test_broken needs the frobnicate package")\n'
TYPO_MODULE = "from rlite import hookimpl\n\n\n@hookimpl\ndef on_metric(step, metrics):\n    pass\n"


@pytest.fixture
def alpha_and_beta(fake_distribution, clean_plugin_env) -> None:
    """Two installed plugins, ``alpha`` and ``beta``, each registering one advantage estimator."""
    fake_distribution(
        "rlite-alpha", {"alpha": "rlite_test_alpha"}, {"rlite_test_alpha": estimator_module("alpha_adv")}
    )
    fake_distribution(
        "rlite-beta", {"beta": "rlite_test_beta"}, {"rlite_test_beta": estimator_module("beta_adv")}
    )


def loaded(pm) -> set[str]:
    return {name for name in ("alpha", "beta") if pm.has_plugin(name)}


def write_config(tmp_path, text: str = "") -> str:
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: tiny-model}\ndata: {task: addition}\n" + text)
    return str(path)


# --------------------------------------------------------------------------------------------------
# built-ins
# --------------------------------------------------------------------------------------------------


def test_builtin_plugins_are_registered_like_any_plugin() -> None:
    pm = build_plugin_manager(autoload=False)
    names = [name for name, _ in pm.list_name_plugin()]
    assert names == DEFAULT_PLUGINS
    for info in pm.plugin_infos():
        assert info.distribution == "rlite (built-in)" and info.error is None
    assert set(pm.registries) == set(REGISTRY_KINDS)


@pytest.mark.parametrize(("kind", "name"), DEFAULT_CHOICES)
def test_builtins_register_the_default_choices(kind: str, name: str) -> None:
    registry = build_plugin_manager(autoload=False).registry(kind)
    if not registry.entries:
        pytest.skip(f"the built-in plugin for {kind} registers nothing yet")
    assert registry.get(name).plugin in DEFAULT_PLUGINS


# --------------------------------------------------------------------------------------------------
# contract violations
# --------------------------------------------------------------------------------------------------


def test_duplicate_name_across_two_plugins_names_both(pm, temp_plugin) -> None:
    class One:
        @hookimpl
        def register_reward_functions(self, register):
            register("same_reward", lambda completion, sample, cfg: 1.0)

    class Two:
        @hookimpl
        def register_reward_functions(self, register):
            register("same_reward", lambda completion, sample, cfg: 0.0)

    temp_plugin(One(), name="plugin-one")
    temp_plugin(Two(), name="plugin-two")
    with pytest.raises(PluginError, match="same_reward") as excinfo:
        pm.registries  # noqa: B018
    assert "plugin-one" in str(excinfo.value) and "plugin-two" in str(excinfo.value)


def test_duplicate_name_from_entry_points_fails_the_commands(
    fake_distribution, clean_plugin_env, tmp_path, capsys
) -> None:
    fake_distribution(
        "rlite-gamma", {"gamma": "rlite_test_gamma"}, {"rlite_test_gamma": estimator_module("shared")}
    )
    fake_distribution(
        "rlite-delta", {"delta": "rlite_test_delta"}, {"rlite_test_delta": estimator_module("shared")}
    )

    assert main(["plugins"]) == 1
    err = capsys.readouterr().err
    assert "'shared'" in err and "gamma" in err and "delta" in err

    assert main(["config", write_config(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gamma" in err and "delta" in err and "Traceback" not in err


def test_check_pending_catches_a_misspelled_hook_name(pm, temp_plugin) -> None:
    class Typo:
        @hookimpl
        def on_metric(self, step, metrics):  # should be on_metrics
            pass

    temp_plugin(Typo(), name="typo-plugin")
    with pytest.raises(pluggy.PluginValidationError, match="on_metric") as excinfo:
        pm.check_pending()
    assert "typo-plugin" in str(excinfo.value)


def test_misspelled_hook_in_an_installed_plugin_stops_startup(
    fake_distribution, clean_plugin_env, capsys
) -> None:
    fake_distribution(
        "rlite-typo", {"typo": "rlite_test_typo"}, {"rlite_test_typo": TYPO_MODULE}, version="2.3"
    )
    with pytest.raises(pluggy.PluginValidationError, match="'typo' \\(rlite-typo 2.3\\).*on_metric"):
        build_plugin_manager()

    assert main(["plugins"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "on_metric" in err and "rlite-typo" in err


def test_broken_plugin_is_reported_and_rlite_plugins_exits_0(
    fake_distribution, clean_plugin_env, capsys
) -> None:
    fake_distribution(
        "rlite-broken", {"broken": "rlite_test_broken"}, {"rlite_test_broken": BROKEN_MODULE}, version="0.7"
    )

    pm = build_plugin_manager()
    assert not pm.has_plugin("broken")
    (failure,) = [info for info in pm.plugin_infos() if info.error is not None]
    assert (failure.name, failure.distribution, failure.version) == ("broken", "rlite-broken", "0.7")
    assert "ImportError" in failure.error and "frobnicate" in failure.error
    assert set(pm.registries) == set(REGISTRY_KINDS)  # everything else still works

    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "failed to load" in out and "broken" in out and "rlite-broken 0.7" in out and "frobnicate" in out

    assert main(["plugins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (entry,) = [plugin for plugin in report["plugins"] if plugin["name"] == "broken"]
    assert entry["distribution"] == "rlite-broken" and "frobnicate" in entry["error"]


# --------------------------------------------------------------------------------------------------
# discovery switches
# --------------------------------------------------------------------------------------------------


def test_entry_point_plugins_are_discovered(alpha_and_beta) -> None:
    pm = build_plugin_manager()
    assert loaded(pm) == {"alpha", "beta"}
    assert pm.registry("advantage_estimator").get("alpha_adv").plugin == "alpha"
    info = {i.name: i for i in pm.plugin_infos()}["alpha"]
    assert (info.distribution, info.version) == ("rlite-alpha", "1.0")


@pytest.mark.parametrize(("value", "expected"), [("1", set()), ("true", set()), ("0", {"alpha", "beta"})])
def test_disable_autoload_environment_variable(alpha_and_beta, monkeypatch, value, expected) -> None:
    monkeypatch.setenv("RLITE_DISABLE_PLUGIN_AUTOLOAD", value)
    assert loaded(build_plugin_manager()) == expected


def test_config_autoload_false_stops_discovery(alpha_and_beta, stand_ins, tmp_path) -> None:
    _, pm = load_run_config(write_config(tmp_path), [])
    assert loaded(pm) == {"alpha", "beta"}

    _, pm = load_run_config(write_config(tmp_path, "plugins: {autoload: false}\n"), [])
    assert loaded(pm) == set()
    with pytest.raises(ConfigError, match="algorithm.advantage: unknown advantage_estimator 'alpha_adv'"):
        load_run_config(write_config(tmp_path), ["plugins.autoload=false", "algorithm.advantage=alpha_adv"])


def test_rlite_plugins_environment_variable_restricts_discovery(alpha_and_beta, monkeypatch) -> None:
    monkeypatch.setenv("RLITE_PLUGINS", "alpha")
    assert loaded(build_plugin_manager()) == {"alpha"}
    monkeypatch.setenv("RLITE_PLUGINS", " beta , alpha ")
    assert loaded(build_plugin_manager()) == {"alpha", "beta"}
    monkeypatch.setenv("RLITE_PLUGINS", "")
    assert loaded(build_plugin_manager()) == set()


def test_config_enable_restricts_discovery(alpha_and_beta, stand_ins, tmp_path) -> None:
    cfg, pm = load_run_config(
        write_config(tmp_path, "plugins: {enable: [beta]}\n"), ["algorithm.advantage=beta_adv"]
    )
    assert loaded(pm) == {"beta"}
    assert cfg.algorithm.advantage.name == "beta_adv"
