"""``examples/drafts/make_draft.py`` makes, in one command, a draft for a shipped recipe that the
policy accepts far more often than a random-weight draft (which it accepts about 1% of the time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from rlite.testing import run_in_subprocess_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "drafts" / "make_draft.py"
POLICY = REPO / "examples" / "warmstart" / "addition-qwen2-1m"  # configs/quickstart.yaml's model


def test_make_draft_fits_a_one_layer_draft_the_quickstart_policy_accepts(tmp_path):
    out = tmp_path / "draft"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "configs/quickstart.yaml", "--out", str(out), "--prompts", "64",
         "--samples", "2", "--steps", "40", "--measure-prompts", "8"],
        cwd=REPO, env=run_in_subprocess_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    draft, policy = AutoConfig.from_pretrained(out), AutoConfig.from_pretrained(POLICY)
    assert draft.num_hidden_layers == 1 and draft.vocab_size == policy.vocab_size
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(POLICY).get_vocab()
    report = json.loads((out / "draft_fit.json").read_text())
    assert report["measured"]["fitted"]["acceptance"] >= 0.2
    assert f"rollout.draft.args.path={out}" in done.stdout  # the line that uses it
