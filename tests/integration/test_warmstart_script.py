"""The warm-started models are rebuilt bit for bit by the command their docs give.

``examples/warmstart/HASHES.json`` records, for each warm start, the SHA-256 of the tensors of its full
run (the shipped files, where shipped) and of a 3-step run of the same command. The fast tests check
that the shipped files are the recorded full runs and that the script, run for 3 steps, still writes
the recorded 3-step weights (so a change to the script, the task data, the tokenizer, transformers or
torch that alters the training path fails here). The ``slow`` tests (left out of the default run:
``pytest -m slow tests/integration/test_warmstart_script.py``, minutes of CPU each) run each documented
command in full and compare its output with the recorded hash and the shipped files byte for byte.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlite.testing import run_in_subprocess_env

WARMSTART_DIR = Path(__file__).resolve().parents[2] / "examples" / "warmstart"
SCRIPT = WARMSTART_DIR / "make_warmstart.py"
HASHES = json.loads((WARMSTART_DIR / "HASHES.json").read_text())
SHIPPED = [name for name in HASHES if HASHES[name]["shipped"]]


def load_script():
    spec = importlib.util.spec_from_file_location("make_warmstart", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(flags: list[str], out: Path, **env: str) -> str:
    """Runs make_warmstart.py with ``flags`` into ``out`` (``env`` added to its environment); its printed output."""
    result = subprocess.run([sys.executable, str(SCRIPT), *flags, "--out", str(out)], env=run_in_subprocess_env(**env),
                            check=True, capture_output=True, text=True, timeout=1800)  # fmt: skip
    return result.stdout


def test_importing_the_script_leaves_the_environment_alone():
    """The script pins CPU kernels through the environment when run; imported (as these tests do) it must not:
    every later subprocess of the test session would load torch with other kernels (it did: a two-rank bf16
    test then differed from its in-process one-rank reference at bf16 rounding)."""
    before = dict(os.environ)
    load_script()
    assert dict(os.environ) == before


def test_every_warm_start_has_a_recorded_hash():
    script = load_script()
    assert set(HASHES) == set(script.DEFAULT_STEPS)
    for name, record in HASHES.items():
        flags = record["command"].split()[2:]
        assert record["command"].split()[:2] == ["python", "examples/warmstart/make_warmstart.py"], name
        assert script.warm_start_name("--moe" in flags, "--multiturn" in flags, "--strings" in flags) == name


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_weights_are_the_recorded_full_run(name):
    assert load_script().tensors_sha256(WARMSTART_DIR / name) == HASHES[name]["sha256"]


@pytest.mark.parametrize("name", list(HASHES))
def test_short_run_of_the_documented_command_writes_the_recorded_weights(tmp_path, name):
    """The documented command with ``--steps`` shortened: same script, data, model and optimiser."""
    record = HASHES[name]
    output = run_script([*record["command"].split()[2:], "--steps", str(record["short_steps"])], tmp_path / name)
    written = load_script().tensors_sha256(tmp_path / name)
    assert f"tensors sha256: {written}" in output
    assert written == record["short_sha256"], (
        f"{name}: {record['short_steps']} steps wrote tensors {written}, HASHES.json records "
        f"{record['short_sha256']} (made with {record['made_with']})"
    )
    shipped_dir = WARMSTART_DIR / name
    if record["shipped"]:  # the tokenizer the script writes is the shipped one
        for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            assert (tmp_path / name / file).read_bytes() == (shipped_dir / file).read_bytes(), file


def test_the_callers_cpu_settings_do_not_change_the_weights(tmp_path):
    """The weights depend on which kernels MKL and ATen pick for the CPU (vendor, AVX2 or AVX-512) and on
    the thread count; the script pins all three before torch loads. A caller asking for other kernels
    (ATen's unvectorised ones, MKL's automatic choice, two threads), as another machine would get
    unasked, still gets the recorded weights."""
    record = HASHES["addition-qwen2-1m"]
    out = tmp_path / "other-cpu"
    run_script(["--steps", str(record["short_steps"])], out, ATEN_CPU_CAPABILITY="default", MKL_CBWR="AUTO",
               OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")  # fmt: skip
    assert load_script().tensors_sha256(out) == record["short_sha256"]


def test_every_warm_start_is_rebuilt_by_its_command():
    """No warm start is kept that its documented command does not write (the slow test below checks it)."""
    assert [name for name in HASHES if not HASHES[name]["rebuilt_by_command"]] == []


REBUILT = [name for name in HASHES if HASHES[name]["rebuilt_by_command"]]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", REBUILT)
def test_documented_command_rebuilds_the_warm_start_bit_for_bit(tmp_path, name):
    """The exact documented command (full step count). Shipped warm starts: every file byte for byte
    (the config files up to the transformers version they name); the MoE one: its recorded hash."""
    record = HASHES[name]
    run_script(record["command"].split()[2:], tmp_path / name)
    assert load_script().tensors_sha256(tmp_path / name) == record["sha256"]
    if record["shipped"]:
        for shipped in sorted((WARMSTART_DIR / name).iterdir()):
            rebuilt = tmp_path / name / shipped.name
            if shipped.suffix == ".json":
                a, b = json.loads(rebuilt.read_text()), json.loads(shipped.read_text())
                a.pop("transformers_version", None), b.pop("transformers_version", None)
                assert a == b, shipped.name
            else:
                assert rebuilt.read_bytes() == shipped.read_bytes(), shipped.name
