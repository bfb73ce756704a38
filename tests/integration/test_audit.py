"""``rlite audit``: the shipped quickstart passes every invariant, and a loss that normalises per
micro-batch fails with the invariant named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlite import hookimpl
from rlite.audit import FAIL, PASS, run_audit
from rlite.cli import main
from rlite.plugin_manager import build_plugin_manager
from rlite.testing import per_micro_batch_mean_loss

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_repo_root():
    cwd = os.getcwd()
    os.chdir(ROOT)  # model.path in the shipped configs is relative to the repository root
    yield
    os.chdir(cwd)


def test_audit_passes_on_the_quickstart(tmp_path, in_repo_root, capsys):
    assert main(["audit", "configs/quickstart.yaml", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for invariant in ("on-policy ratio", "world size 2 == world size 1", "micro-batch x accumulation (token-mean)",
                      "weight sync: version and checksum", "mismatch (transformers, quantizer none)",
                      "advantage formula (grpo)", "loss formula (ppo_clip)", "resume == uninterrupted (3 steps)"):
        assert invariant in out
    assert "FAIL" not in out and "replica tiny Qwen2" in out


class BrokenLoss:
    @hookimpl
    def register_policy_losses(self, register):
        register("per_micro_batch_mean", per_micro_batch_mean_loss)


def test_audit_names_the_invariant_a_broken_loss_breaks(tmp_path, in_repo_root):
    pm = build_plugin_manager(autoload=False)
    pm.register(BrokenLoss(), name="broken-loss")
    checks, _ = run_audit("configs/quickstart.yaml", ["algorithm.policy_loss=per_micro_batch_mean"], pm, tmp_path)
    results = {check.name: check for check in checks}
    assert results["micro-batch x accumulation (token-mean)"].result == FAIL
    assert results["world size 2 == world size 1"].result == FAIL
    assert "pg_loss" in results["micro-batch x accumulation (token-mean)"].measured
    # what the broken loss does not touch still passes
    assert results["weight sync: version and checksum"].result == PASS
    assert results["resume == uninterrupted (3 steps)"].result == PASS
    assert results["loss formula (per_micro_batch_mean)"].result == "n/a"
