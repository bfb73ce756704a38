"""Issue #31's acceptance: a plugin package written only against ``rlite.api`` (``rlite_thirdparty_kit/``, its
own ``pyproject.toml``), installed with pip, passes the conformance kit, trains the quickstart for 3 steps
with its engines, backend and estimator selected through ``plugins.enable``, and gets a passing audit row.

The package is installed with ``pip install --target`` into a temporary folder (offline, no build isolation,
no dependencies) instead of the shared venv, as ``tests/plugins/test_example_plugin.py`` does: no other test
(nor another test session running at the same time) sees it. This process finds its entry point with the
folder on ``sys.path`` for one test; the ``rlite train`` subprocess with it on ``PYTHONPATH``.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlite.config import load_config
from rlite.plugin_manager import build_plugin_manager, plugin_manager_in_use
from rlite.testing import read_jsonl

KIT = Path(__file__).resolve().parent / "rlite_thirdparty_kit"
REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
QUICKSTART_MODEL = REPO / "examples" / "warmstart" / "addition-qwen2-1m"


@pytest.fixture(scope="module")
def kit_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package pip-installed (offline, no build isolation) into its own folder."""
    source = tmp_path_factory.mktemp("kit-src") / "rlite_thirdparty_kit"
    shutil.copytree(KIT, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp_path_factory.mktemp("kit-site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert (site / "rlite_thirdparty_kit-0.1.0.dist-info" / "entry_points.txt").is_file()
    return site


@pytest.fixture
def kit(kit_site: Path, monkeypatch: pytest.MonkeyPatch, clean_plugin_env):
    """The installed package visible in this process for one test: its plugin manager."""
    monkeypatch.syspath_prepend(str(kit_site))
    yield build_plugin_manager(only=["thirdparty"])
    for module in [m for m in sys.modules if m == "rlite_thirdparty_kit" or m.startswith("rlite_thirdparty_kit.")]:
        del sys.modules[module]


def test_the_package_imports_nothing_of_rlite_but_its_public_api() -> None:
    imported = set()
    for path in KIT.rglob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and words[1].split(".")[0] == "rlite":
                imported.add(words[1])
    assert imported == {"rlite.api"}


def test_the_engines_pass_the_conformance_kit(kit, tmp_path) -> None:
    """Both engines, by their registered names (resolved through rlite.api.registered in the kit's
    manager): the wrapper around the built-in transformers engine, and the engine in its own process. What
    each reported through the metrics channel during the check is what it did there."""
    from transformers import AutoModelForCausalLM

    from rlite.testing.conformance import check_engine

    with plugin_manager_in_use(kit):
        wrapper = check_engine("thirdparty_counting", workdir=tmp_path / "counting")
        remote = check_engine("thirdparty_remote", workdir=tmp_path / "remote")
    for report, name in ((wrapper, "thirdparty_counting"), (remote, "thirdparty_remote")):
        assert report.plugin == f"'{name}' (plugin thirdparty)", report
        assert len(report.passed) == 12, report
        assert "samples with the new weights, not the old" in report.invariants(), report
    # the check generates 3 times, 3 completions for each of 2 prompts; the wrapper wrapped transformers
    assert wrapper.metrics == {"thirdparty/n_completions": 18.0, "thirdparty/n_generate_calls": 3.0}
    # the engine process: every forward of its 18 completions (at most 6 tokens each), and the tensors of
    # the two syncs (over the generate replies and the protocol's ("metrics",) message)
    tensors = len(dict(AutoModelForCausalLM.from_pretrained(tmp_path / "remote" / "model").named_parameters()))
    assert remote.metrics["thirdparty/remote/n_tensors_loaded"] == 2 * tensors
    assert 18 <= remote.metrics["thirdparty/remote/n_forwards"] <= 18 * 6


def test_the_backend_and_estimator_pass_the_conformance_kit(kit, tmp_path) -> None:
    from rlite_thirdparty_kit.backend import CountingBackend

    from rlite.api import BackendWrapper
    from rlite.testing.conformance import check_backend, check_estimator

    # the public wrapper does the delegation: the kit writes its step alone, no __getattr__ and no guard
    assert issubclass(CountingBackend, BackendWrapper) and set(vars(CountingBackend)) & {"__getattr__", "__init__"} == set()
    with plugin_manager_in_use(kit):
        backend = check_backend("thirdparty_fsdp2", workdir=tmp_path / "backend")
        estimator = check_estimator("range_baseline")
    assert backend.plugin == "'thirdparty_fsdp2' (plugin thirdparty)" and len(backend.passed) == 9, backend
    assert "resume: the step after a checkpoint load is bitwise equal" in backend.invariants(), backend
    # the check's steps on the backend it keeps: the NaN loss and the NaN gradient skipped, then two finite ones
    assert backend.metrics == {"thirdparty/n_backend_skipped_steps": 2.0, "thirdparty/n_backend_steps": 4.0}
    assert estimator.plugin == "'range_baseline' (plugin thirdparty)", estimator
    assert "equals its float64 reference" in estimator.invariants(), estimator


def test_the_audit_checks_the_estimator_against_its_reference(kit) -> None:
    """The audit's formula row for the third-party estimator is a pass (not n/a), and it fails for an
    implementation that drifts from the registered reference by 1e-6."""
    from rlite.tools.audit import FAIL, PASS, check_formulas, formula_check

    pm = kit
    overrides = ["model.path=unused", "data.task=addition", "algorithm.advantage=range_baseline",
                 "algorithm.advantage.args.scale=0.5"]
    config = load_config(None, overrides, pm=pm)
    (row, _) = check_formulas(config, pm)
    assert row.name == "advantage formula (range_baseline)" and row.result == PASS, row

    entry = pm.registry("advantage_estimator").get("range_baseline")
    drifted = dataclasses.replace(entry, implementation=lambda batch, cfg: tuple(
        t * (1 + 1e-6) for t in entry.implementation(batch, cfg)))
    row = formula_check("advantage_estimator", drifted, entry.config_cls(scale=0.5))
    assert row.result == FAIL, row


def test_the_quickstart_trains_3_steps_with_the_third_party_plugins(kit_site, run_rlite, tmp_path) -> None:
    """``rlite train configs/quickstart.yaml`` (smaller: 4 prompts x 4 samples, 8 eval prompts) with
    ``plugins.enable=[thirdparty]``: the wrapper engine around the out-of-process engine, the wrapped fsdp2
    backend and the third-party estimator, 3 steps."""
    run_dir = tmp_path / "run"
    result = run_rlite(
        "train", str(QUICKSTART), f"model.path={QUICKSTART_MODEL}", "plugins.enable=[thirdparty]",
        "rollout.engine=thirdparty_counting", "rollout.engine.args.inner=thirdparty_remote",
        "parallelism.backend=thirdparty_fsdp2", "algorithm.advantage=range_baseline",
        "training.steps=3", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "rollout.temperature=1.0",
        "training.micro_batch_size=16", "training.warmup_steps=0", "data.num_train=64", "data.num_eval=8",
        f"logging.run_dir={run_dir}", "logging.progress_bar=false", "logging.plot=false", "logging.loggers=[jsonl]",
        "checkpoint.resume=never", "checkpoint.save_final=false", "checkpoint.export_hf=false",
        pythonpath=[kit_site], env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["rollout"]["engine"]["name"] == "thirdparty_counting"
    assert resolved["rollout"]["engine"]["args"]["inner"] == "thirdparty_remote"
    assert resolved["parallelism"]["backend"] == {"name": "thirdparty_fsdp2", "args": {"inner": "fsdp2", "inner_args": {}}}
    assert resolved["plugins"]["enable"] == ["thirdparty"]
    assert resolved["algorithm"]["advantage"]["name"] == "range_baseline"

    rows = [row for row in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in row]
    max_new_tokens = resolved["rollout"]["max_new_tokens"]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "mismatch/k3_kl"):
            assert math.isfinite(row[key]), (row["step"], key, row[key])
        # the step's own numbers, through the metrics channel: one optimizer step through the wrapper, one
        # rollout call of 16 completions, and the engine process's forwards for them
        assert row["thirdparty/n_backend_steps"] == 1 and row["thirdparty/n_backend_skipped_steps"] == 0
        assert row["thirdparty/n_generate_calls"] == 1 and row["thirdparty/n_completions"] == 16
        assert 16 <= row["thirdparty/remote/n_forwards"] <= 16 * max_new_tokens
        assert row["mismatch/k3_kl"] < 1e-6  # the engine process sampled with the synced weights
    # what the engine process loaded in the sync before each rollout (the first: the build's), every tensor
    tensors = {row["thirdparty/remote/n_tensors_loaded"] for row in rows}
    assert len(tensors) == 1 and tensors.pop() > 0
    # the evaluations' calls (steps 0 and 3: greedy and sampled over 8 prompts) land under eval/
    evals = [row for row in read_jsonl(run_dir / "metrics.jsonl") if "eval/greedy_accuracy" in row]
    assert [row["step"] for row in evals] == [0, 3]
    assert all(row["eval/thirdparty/n_generate_calls"] == 2 and row["eval/thirdparty/n_completions"] == 16
               for row in evals)  # fmt: skip
    assert any(row["actor/grad_norm"] > 0 for row in rows)
