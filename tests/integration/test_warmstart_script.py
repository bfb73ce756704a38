"""The warm-started models (the quickstart's, and ``--multiturn``'s for the multi-turn recipes) are made by a
deterministic script: two runs write identical weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlite.testing import run_in_subprocess_env

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "warmstart" / "make_warmstart.py"


@pytest.mark.parametrize("flags", [[], ["--multiturn"]], ids=["quickstart", "multiturn"])
def test_make_warmstart_is_deterministic(tmp_path, flags):
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--steps", "3", "--batch", "8", *flags],
                       env=run_in_subprocess_env(), check=True, capture_output=True, timeout=300)
        outs.append(load_file(out / "model.safetensors"))
    assert outs[0].keys() == outs[1].keys()
    assert all(outs[0][k].equal(outs[1][k]) for k in outs[0])
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
