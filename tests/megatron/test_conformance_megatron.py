"""The megatron backend passes rlite's conformance kit (rlite.testing.conformance.check_backend), registered as its
entry point registers it: log-probs equal the transformers model's, first ratio exactly 1, non-finite steps
skipped and counted, full_weights named as Hugging Face's, bitwise resume."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'rlite[megatron]'")

import rlite.plugins.megatron as megatron_plugin  # noqa: E402
from rlite.plugin_manager import build_plugin_manager, plugin_manager_in_use  # noqa: E402
from rlite.testing.conformance import check_backend  # noqa: E402


def test_megatron_passes_the_conformance_kit(tmp_path):
    pm = build_plugin_manager(autoload=False)
    pm.register(megatron_plugin, name="rlite.plugins.megatron")  # as its entry point would
    with plugin_manager_in_use(pm):
        report = check_backend("megatron", workdir=tmp_path)
    assert len(report.passed) == 9, report
    assert "first PPO ratio exactly 1 (training forward == pi_old)" in report.invariants()
