"""The ``rlite`` command: help, ``config``, ``train`` (with a stand-in training loop) and ``plugins``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rlite import __version__, hookimpl
from rlite.config import ConfigError, RunConfig, load_config
from rlite.plugin_manager import build_plugin_manager, set_plugin_manager
from rlite.tools.cli import main

FAKE_PLUGIN = """
from rlite import hookimpl


@hookimpl
def register_advantage_estimators(register):
    register("fake_adv", lambda batch, cfg: None)


@hookimpl
def on_metrics(step, metrics):
    pass
"""


@pytest.fixture
def config_file(tmp_path: Path) -> str:
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: tiny-model}\ndata: {task: addition}\ntraining: {steps: 3}\n")
    return str(path)


@pytest.fixture
def fake_plugin(fake_distribution, clean_plugin_env) -> None:
    fake_distribution(
        "rlite-fake", {"fake": "rlite_test_fake"}, {"rlite_test_fake": FAKE_PLUGIN}, version="1.2"
    )


@pytest.fixture
def fake_loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[RunConfig, object]]]:
    """Replace ``rlite.run.loop`` with a module recording what ``run_training`` received."""
    calls: list[tuple[RunConfig, object]] = []
    loop = types.ModuleType("rlite.run.loop")
    loop.run_training = lambda cfg, pm, preemption=None: calls.append((cfg, pm))
    monkeypatch.setitem(sys.modules, "rlite.run.loop", loop)
    yield calls
    set_plugin_manager(None)


# --------------------------------------------------------------------------------------------------
# help
# --------------------------------------------------------------------------------------------------


def test_help_lists_the_commands(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("train", "chat", "generate", "config", "plugins"):
        assert f"    {command} " in out


@pytest.mark.parametrize("command", ["train", "chat", "generate", "config", "plugins"])
def test_every_command_has_help(capsys, command: str) -> None:
    assert main([command, "--help"]) == 0
    assert f"usage: rlite {command}" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys) -> None:
    assert main([]) == 2
    assert main(["trian"]) == 2
    assert main(["train"]) == 2  # CONFIG is required
    assert "usage: rlite" in capsys.readouterr().err


def test_version(capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rlite {__version__}"


def test_python_m_rlite_runs_the_cli_without_heavy_imports() -> None:
    script = (
        "import sys, runpy\n"
        "sys.argv = ['rlite', '--help']\n"
        "try:\n"
        "    runpy.run_module('rlite', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "usage: rlite" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_plugins_and_config_import_nothing_heavier_than_the_plugins(
    stand_ins_distribution, config_file
) -> None:
    script = (
        "import sys\n"
        "from rlite.tools.cli import main\n"
        "from rlite.plugin_manager import build_plugin_manager\n"
        "build_plugin_manager()\n"
        "before = set(sys.modules)\n"
        "assert main(['plugins', '--json']) == 0\n"
        f"assert main(['config', {config_file!r}]) == 0\n"
        "heavy = ('transformers', 'datasets', 'peft', 'matplotlib', 'sglang')\n"
        "print('NEW HEAVY', sorted(m for m in set(sys.modules) - before if m.split('.')[0] in heavy))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLITE_")}
    env["PYTHONPATH"] = str(stand_ins_distribution)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "NEW HEAVY []"


# --------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------


def test_config_prints_the_resolved_config_with_defaults(stand_ins, config_file, capsys, tmp_path) -> None:
    assert main(["config", config_file, "rollout.max_new_tokens=8", "plugins.autoload=false"]) == 0
    printed = capsys.readouterr().out
    resolved = yaml.safe_load(printed)
    assert resolved["training"]["steps"] == 3  # from the YAML
    assert resolved["rollout"]["max_new_tokens"] == 8  # from the override
    assert resolved["rollout"]["temperature"] == 1.0  # a default
    assert resolved["algorithm"]["advantage"]["name"] == "grpo"

    # the printed config is itself a complete config that loads to the same thing
    (tmp_path / "resolved.yaml").write_text(printed)
    pm = build_plugin_manager(autoload=False)
    assert load_config(tmp_path / "resolved.yaml", pm=pm) == load_config(
        config_file, ["rollout.max_new_tokens=8", "plugins.autoload=false"], pm=pm
    )


@pytest.mark.parametrize("command", ["config", "train"])
def test_config_errors_print_one_line_and_exit_2(
    stand_ins, fake_loop, config_file, capsys, command: str
) -> None:
    assert main([command, config_file, "training.stepz=4"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        f"rlite {command}: error: training.stepz: unknown key 'stepz'. Valid keys here: steps,"
    )
    assert line.endswith("Did you mean 'steps'?")

    assert main([command, config_file + ".missing"]) == 2
    assert "not found" in capsys.readouterr().err
    assert fake_loop == []


# --------------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------------


def test_train_runs_the_loop_with_the_config_and_its_plugin_manager(
    stand_ins, fake_plugin, fake_loop, config_file
) -> None:
    assert main(["train", config_file, "training.steps=2", "algorithm.advantage=fake_adv"]) == 0
    ((cfg, pm),) = fake_loop
    assert isinstance(cfg, RunConfig)
    assert cfg.training.steps == 2 and cfg.algorithm.advantage.name == "fake_adv"
    assert pm.has_plugin("fake")


def test_train_honours_plugins_autoload(stand_ins, fake_plugin, fake_loop, config_file) -> None:
    assert main(["train", config_file, "plugins.autoload=false"]) == 0
    ((_, pm),) = fake_loop
    assert not pm.has_plugin("fake")


def test_train_honours_plugins_enable(stand_ins, fake_plugin, fake_loop, config_file) -> None:
    assert main(["train", config_file, "plugins.enable=[some_other_plugin]"]) == 0
    ((_, pm),) = fake_loop
    assert not pm.has_plugin("fake")


# --------------------------------------------------------------------------------------------------
# plugins
# --------------------------------------------------------------------------------------------------


def test_plugins_table_shows_distribution_registered_names_and_hooks(
    fake_plugin, capsys, monkeypatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "rlite.plugins.advantages" in out and "rlite (built-in)" in out
    (row,) = [line for line in out.splitlines() if " fake " in line]
    assert "rlite-fake 1.2" in row and "advantage_estimator: fake_adv" in row and "on_metrics" in row


def test_plugins_json(fake_plugin, capsys) -> None:
    assert main(["plugins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == []
    plugins = {plugin["name"]: plugin for plugin in report["plugins"]}
    assert plugins["fake"] == {
        "name": "fake",
        "distribution": "rlite-fake",
        "version": "1.2",
        "registers": {"advantage_estimator": ["fake_adv"]},
        "lifecycle_hooks": ["on_metrics"],
        "error": None,
    }
    assert plugins["rlite.plugins.advantages"]["distribution"] == "rlite (built-in)"


def test_train_warns_about_plugins_that_failed_to_load(tmp_path, monkeypatch, capsys):
    import rlite.plugin_manager
    import rlite.run.loop
    import rlite.tools.cli as cli
    from rlite.plugin_manager import PluginInfo, build_plugin_manager

    pm = build_plugin_manager(autoload=False)
    pm.failed.append(PluginInfo("broken", "rlite-broken", "1.0", [], error="failed to load 'x:y': ImportError: nope"))
    monkeypatch.setattr(rlite.plugin_manager, "build_manager", lambda **kwargs: pm)
    ran = []
    monkeypatch.setattr(rlite.run.loop, "run_training", lambda cfg, pm, preemption=None: ran.append(cfg))
    config = tmp_path / "run.yaml"
    config.write_text("model: {path: /nowhere}\ndata: {task: addition}\n")
    assert cli.main(["train", str(config)]) == 0
    assert ran
    err = capsys.readouterr().err
    assert "plugin 'broken' (rlite-broken) is skipped" in err and "ImportError: nope" in err


# --------------------------------------------------------------------------------------------------
# list-valued overrides (omegaconf's dotlist grammar)
# --------------------------------------------------------------------------------------------------


def resolved_config(capsys, *overrides: str) -> dict:
    assert main(["config", "configs/quickstart.yaml", *overrides]) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)


@pytest.fixture
def in_repo(monkeypatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[1])


def test_list_valued_overrides_set_lists_and_their_entries(in_repo, capsys) -> None:
    # a bare name for a list of choices is a one-entry list
    resolved = resolved_config(capsys, "rewards=numeric", "logging.loggers=jsonl")
    assert [r["name"] for r in resolved["rewards"]] == ["numeric"]
    assert [lg["name"] for lg in resolved["logging"]["loggers"]] == ["jsonl"]
    # an entry's option by index, and the entry stays the implementation it was
    resolved = resolved_config(capsys, "rewards.0.args.weight=2")
    assert resolved["rewards"][0]["name"] == "exact_match" and resolved["rewards"][0]["args"]["weight"] == 2.0
    # YAML lists, names mixed with mappings
    resolved = resolved_config(capsys, "rewards=[exact_match, {name: numeric, args: {weight: 0.5}}]")
    assert [(r["name"], r["args"]["weight"]) for r in resolved["rewards"]] == [("exact_match", 1.0), ("numeric", 0.5)]
    # replacing an entry by name forgets the old implementation's options
    resolved = resolved_config(capsys, "rewards.0.args.case_sensitive=false", "rewards.0=numeric")
    assert resolved["rewards"][0]["name"] == "numeric" and "case_sensitive" not in resolved["rewards"][0]["args"]
    resolved = resolved_config(capsys, "training.betas.1=0.95")
    assert resolved["training"]["betas"] == [0.9, 0.95]
    # a whole section, with the shorthand inside it
    resolved = resolved_config(capsys, "algorithm={advantage: rloo, entropy_coef: 0.01}")
    assert resolved["algorithm"]["advantage"]["name"] == "rloo" and resolved["algorithm"]["entropy_coef"] == 0.01


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("rewards.3.args.weight=2", "rewards is a list of 1 entry, so rewards.3 does not exist"),
        ("rewards.first.args.weight=2", "rewards is a list of 1 entry, so rewards.first does not exist"),
        ("training.steps.x=1", "training.steps is a value, not a section"),
        ("rewards=7", "rewards takes an implementation's name"),
        ("algorithm.advantage=[grpo]", "algorithm.advantage takes an implementation's name"),
        ("rewards.0.args.wieght=2", "rewards[0].args.wieght: unknown key 'wieght'"),
        ("training.steps", "must look like key.path=value"),
    ],
)
def test_an_override_that_cannot_apply_names_its_key(in_repo, capsys, override: str, expected: str) -> None:
    assert main(["config", "configs/quickstart.yaml", override]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert expected in line


def test_list_overrides_through_the_console_script(in_repo, run_rlite) -> None:
    result = run_rlite("config", "configs/quickstart.yaml", "rewards=exact_match", "logging.loggers=jsonl",
                       "rewards.0.args.weight=2")
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["rewards"] == [{"name": "exact_match", "args": {**resolved["rewards"][0]["args"], "weight": 2.0}}]
    assert [lg["name"] for lg in resolved["logging"]["loggers"]] == ["jsonl"]


# --------------------------------------------------------------------------------------------------
# one sample per prompt with a group-relative estimator
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_one_sample_per_prompt_with_a_group_estimator_is_refused(in_repo, capsys, estimator: str) -> None:
    assert main(["config", "configs/quickstart.yaml", "rollout.samples_per_prompt=1",
                 f"algorithm.advantage={estimator}"]) == 2  # fmt: skip
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"rlite config: error: rollout.samples_per_prompt=1: algorithm.advantage={estimator} ")
    assert "every advantage is 0" in line and "works with one sample: gae, gpg, reinforce_pp, remax" in line


def test_one_sample_per_prompt_works_where_no_group_is_needed(in_repo, capsys) -> None:
    resolved = resolved_config(capsys, "rollout.samples_per_prompt=1", "algorithm.advantage=reinforce_pp")
    assert resolved["rollout"]["samples_per_prompt"] == 1
    resolved = resolved_config(capsys, "rollout.samples_per_prompt=1", "algorithm.advantage.args.singleton=raw")
    assert resolved["algorithm"]["advantage"] == {"name": "grpo", "args": {**resolved["algorithm"]["advantage"]["args"],
                                                                           "singleton": "raw"}}


def test_a_third_party_estimator_declares_that_it_needs_a_group(tmp_path, temp_plugin, pm) -> None:
    class GroupEstimator:
        @hookimpl
        def register_advantage_estimators(self, register):
            register("leave_one_out_2", lambda batch, cfg: None, needs_group=True)
            register("plain_2", lambda batch, cfg: None)

    temp_plugin(GroupEstimator(), name="group-estimator")
    base = ["model.path=m", "data.task=addition", "rollout.samples_per_prompt=1"]
    with pytest.raises(ConfigError, match=r"algorithm\.advantage=leave_one_out_2 compares .* one sample: .*plain_2"):
        load_config(None, [*base, "algorithm.advantage=leave_one_out_2"], pm=pm)
    assert load_config(None, [*base, "algorithm.advantage=plain_2"], pm=pm).rollout.samples_per_prompt == 1
    assert load_config(None, [*base[:2], "algorithm.advantage=leave_one_out_2"], pm=pm).rollout.samples_per_prompt == 8
