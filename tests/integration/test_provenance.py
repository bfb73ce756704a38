"""Every checkpoint and the first row of metrics.jsonl say what produced the run; resume keeps the record
and chains its own; ``rlite info RUN_DIR`` prints it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import rlite
from rlite.plugin_manager import build_plugin_manager
from rlite.run.loop import run_training
from rlite.run.provenance import PACKAGES, config_hash, metrics_records, read_checkpoint_record
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def test_provenance_in_metrics_and_checkpoints_survives_resume(tmp_path, model_dir, capsys):
    pm = build_plugin_manager(autoload=False)
    run_dir = tmp_path / "run"
    common = ["checkpoint.every=1", "checkpoint.resume=auto", "training.seed=7", "data.seed=3"]
    cfg = tiny_config(model_dir, run_dir, *common, pm=pm)
    run_training(cfg, pm)

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = lines[0]
    assert set(first) == {"step", "provenance"} and first["step"] == 0
    record = first["provenance"]
    assert record["rlite_version"] == rlite.__version__
    assert record["packages"]["torch"] == torch.__version__ and set(record["packages"]) == set(PACKAGES)
    assert record["packages"]["sglang"] is None or isinstance(record["packages"]["sglang"], str)
    plugins = {p["name"]: p for p in record["plugins"]}
    assert {"rlite.plugins.advantages", "rlite.plugins.policy_losses"} <= set(plugins)
    assert plugins["rlite.plugins.advantages"]["distribution"] and "version" in plugins["rlite.plugins.advantages"]
    assert record["config_sha256"] == config_hash(cfg)
    assert record["seeds"] == {"training": 7, "data": 3}
    assert record["world_size"] == 1 and record["device"] == "cpu" and record["weight_version"] == 0
    head = subprocess.run(["git", "-C", str(Path(rlite.__file__).parent), "rev-parse", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert record["git"]["commit"] == head  # the tests run from the checkout
    # the metric readers skip it
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2]

    checkpoints = run_dir / "checkpoints"
    for step in (1, 2):
        saved = read_checkpoint_record(checkpoints / f"step_{step:08d}")
        assert saved == dict(record, weight_version=step)

    # resume for one more step: the first row stays, the resumed run adds its record chained to the checkpoint's
    resumed_cfg = tiny_config(model_dir, run_dir, *common, "training.steps=3", pm=pm)
    run_training(resumed_cfg, pm)
    rows = metrics_records(run_dir / "metrics.jsonl")
    assert rows[0] == first
    assert rows[1]["step"] == 2 and rows[1]["provenance"]["weight_version"] == 2
    assert rows[1]["provenance"]["resumed_from"] == {"step": 2, "provenance": dict(record, weight_version=2)}
    assert rows[1]["provenance"]["config_sha256"] == config_hash(resumed_cfg) != record["config_sha256"]
    third = read_checkpoint_record(checkpoints / "step_00000003")
    assert third["weight_version"] == 3 and third["resumed_from"]["step"] == 2

    assert main(["info", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"git {head[:12]}" in out and "weight version 3" in out and "resumed from the checkpoint of step 2" in out
    assert f"torch {torch.__version__}" in out and "rlite.plugins.advantages" in out
    assert main(["info", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"]["step_00000003"] == third
    assert main(["info", str(tmp_path / "nothing")]) == 2
