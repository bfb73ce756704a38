"""The example third-party package (examples/rlite-example-plugin), installed by pip like a user would.

It is installed with ``pip install --target`` into a temporary folder instead of the shared venv,
so other tests (and other test sessions running at the same time) never see it; subprocesses get
that folder on ``PYTHONPATH``, which is how ``importlib.metadata`` finds the entry point.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rlite.algorithms import AdvantageInput
from rlite.config import ConfigError, load_config
from rlite.plugin_manager import build_plugin_manager

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlite-example-plugin"
MEDIAN_CONFIG = """\
model: {path: tiny-model}
data: {task: addition}
algorithm:
  advantage:
    name: median_baseline
    args: {scale: 0.5}
rewards:
  - exact_match
  - {name: contains_answer, args: {ignore_case: true}}
"""


@pytest.fixture(scope="module")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example package pip-installed (offline, no build isolation) into its own folder."""
    source = tmp_path_factory.mktemp("example-src") / "rlite-example-plugin"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp_path_factory.mktemp("example-site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert (site / "rlite_example_plugin-0.1.0.dist-info" / "entry_points.txt").is_file()
    return site


@pytest.fixture
def with_example(example_site: Path, monkeypatch: pytest.MonkeyPatch, clean_plugin_env, stand_ins):
    """The installed example visible in this process for one test."""
    monkeypatch.syspath_prepend(str(example_site))
    yield
    sys.modules.pop("rlite_example_plugin", None)


@pytest.fixture
def median_config(tmp_path: Path) -> Path:
    path = tmp_path / "median.yaml"
    path.write_text(MEDIAN_CONFIG)
    return path


def test_rlite_plugins_lists_the_installed_example(example_site, run_rlite) -> None:
    result = run_rlite("plugins", "--json", pythonpath=[example_site])
    assert result.returncode == 0, result.stderr
    plugins = {plugin["name"]: plugin for plugin in json.loads(result.stdout)["plugins"]}
    assert plugins["example"] == {
        "name": "example",
        "distribution": "rlite-example-plugin",
        "version": "0.1.0",
        "registers": {"advantage_estimator": ["median_baseline"], "reward_function": ["contains_answer"]},
        "lifecycle_hooks": ["on_metrics"],
        "error": None,
    }


def test_rlite_config_validates_the_example_choices(
    example_site, stand_ins_distribution, run_rlite, median_config
) -> None:
    result = run_rlite("config", str(median_config), pythonpath=[example_site, stand_ins_distribution])
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["algorithm"]["advantage"] == {"name": "median_baseline", "args": {"scale": 0.5}}
    assert resolved["rewards"][1] == {"name": "contains_answer", "args": {"weight": 1.0, "ignore_case": True}}

    result = run_rlite(
        "config",
        str(median_config),
        "algorithm.advantage.args.scael=2",
        pythonpath=[example_site, stand_ins_distribution],
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "rlite config: error: algorithm.advantage.args.scael: unknown key 'scael'. Valid keys here: scale. "
        "Did you mean 'scale'?"
    ]


def test_median_baseline_is_selected_by_name_from_yaml(with_example, median_config) -> None:
    pm = build_plugin_manager()
    cfg = load_config(median_config, [], pm)
    choice = cfg.algorithm.advantage
    estimator = pm.registry("advantage_estimator").get(choice.name)
    assert estimator.plugin == "example"

    batch = AdvantageInput(
        scores=torch.tensor([1.0, 0.0, 0.0, 5.0, 3.0, 2.0, 2.0]),
        group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1]),
        response_mask=torch.tensor([[1, 1]] * 6 + [[1, 0]]),
    )
    advantages, returns = estimator.implementation(batch, estimator.config_cls(**choice.args))
    # group 0 scores {1, 0, 0, 5}: median 0.5; group 1 scores {3, 2, 2}: median 2; scale 0.5
    expected = torch.tensor([0.25, -0.25, -0.25, 2.25, 0.5, 0.0, 0.0])
    assert torch.allclose(advantages[:, 0], expected)
    assert torch.allclose(advantages[:6, 1], expected[:6]) and advantages[6, 1] == 0
    assert torch.equal(returns, advantages)

    with pytest.raises(
        ConfigError,
        match="algorithm.advantage: unknown advantage_estimator 'median_baselin'.*median_baseline",
    ):
        load_config(median_config, ["algorithm.advantage=median_baselin"], pm)


def test_the_installed_estimator_passes_the_conformance_kit_and_gets_an_audit_row(with_example, median_config) -> None:
    """A third-party author's check: the kit finds the estimator by name among the installed plugins and
    compares it with the float64 reference it registered; the audit checks it by the same path (a pass,
    not n/a)."""
    from rlite.plugin_manager import plugin_manager_in_use
    from rlite.testing.conformance import check_estimator
    from rlite.tools.audit import PASS, check_formulas

    pm = build_plugin_manager()
    with plugin_manager_in_use(pm):
        report = check_estimator("median_baseline")
    assert report.plugin == "'median_baseline' (plugin example)" and "equals its float64 reference" in report.invariants()
    (row, _) = check_formulas(load_config(median_config, [], pm), pm)
    assert row.name == "advantage formula (median_baseline)" and row.result == PASS, row


def test_example_reward_and_lifecycle_hook(with_example) -> None:
    import rlite_example_plugin

    pm = build_plugin_manager()
    reward = pm.registry("reward_function").get("contains_answer")
    cfg = reward.config_cls(ignore_case=True)
    assert reward.implementation("The answer is 42.", {"prompt": "6*7=", "answer": 42}, cfg) == 1.0
    assert reward.implementation("The answer is 41.", {"prompt": "6*7=", "answer": 42}, cfg) == 0.0

    before = rlite_example_plugin.calls["on_metrics"]
    pm.hook.on_metrics(step=1, metrics={"reward/mean": 0.5})
    pm.hook.on_metrics(step=2, metrics={"reward/mean": 0.75})
    assert rlite_example_plugin.calls["on_metrics"] == before + 2
