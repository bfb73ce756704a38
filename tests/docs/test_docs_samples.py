"""docs/plugins.md's samples of rlite's output (``rlite plugins``, the config errors) are made by
``python -m rlite.tools.docs_samples --write`` and must be current: the committed file equals what the command makes
now. A stale sample (an estimator added since, an error worded otherwise) fails here, and the command says so
and rewrites it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from rlite.plugin_manager import build_plugin_manager
from rlite.testing import run_in_subprocess_env
from rlite.tools.docs_samples import BLOCK, main, regenerate

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "plugins.md"


def sample(text: str, name: str) -> str:
    (body,) = [m.group("body") for m in BLOCK.finditer(text) if m.group("name") == name]
    return body


def test_the_committed_samples_are_what_the_command_makes() -> None:
    committed = DOC.read_text()
    assert regenerate(committed, REPO) == committed, "stale samples: run python -m rlite.tools.docs_samples --write"


def test_the_plugins_sample_lists_every_builtin_choice() -> None:
    """What the issue found stale (6 estimators and 3 losses listed of 10 and 8) cannot be stale here."""
    text = " ".join(sample(DOC.read_text(), "rlite-plugins").split())  # names wrap across the table's lines
    pm = build_plugin_manager(autoload=False)
    for kind in ("advantage_estimator", "policy_loss", "kl_estimator", "mismatch_correction", "rollout_engine"):
        for name in pm.registry(kind).names():
            assert f" {name}," in text or f" {name} " in text, (kind, name)
    assert "rlite-example-plugin 0.1.0" in text and "median_baseline" in text


def test_the_command_finds_and_rewrites_a_stale_sample(tmp_path) -> None:
    """On a copy of the repository's docs with one estimator dropped from the sample: the command exits 1 with
    a diff naming it, ``--write`` puts it back, and then the file is current."""
    (tmp_path / "docs").mkdir()
    for folder in ("configs", "examples"):
        (tmp_path / folder).symlink_to(REPO / folder)
    stale = DOC.read_text().replace("gdpo, ", "", 1)
    assert stale != DOC.read_text()
    (tmp_path / "docs" / "plugins.md").write_text(stale)
    assert main(["--repo", str(tmp_path)]) == 1
    assert main(["--repo", str(tmp_path), "--write"]) == 0
    assert (tmp_path / "docs" / "plugins.md").read_text() == DOC.read_text()
    assert main(["--repo", str(tmp_path)]) == 0


def test_the_module_runs_as_the_docs_say(tmp_path) -> None:
    """``python -m rlite.tools.docs_samples`` in the repository, as a contributor runs it (a copy of the docs)."""
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    for folder in ("configs", "examples"):
        (tmp_path / folder).symlink_to(REPO / folder)
    done = subprocess.run([sys.executable, "-m", "rlite.tools.docs_samples"], cwd=tmp_path, env=run_in_subprocess_env(),
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every sample is current" in done.stdout
