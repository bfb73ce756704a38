"""Preemption: a real SIGTERM to a running ``rlite train`` saves a checkpoint at the next step boundary
and exits with status 75; running the same command again ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from rlite.config import load_config
from rlite.plugin_manager import get_plugin_manager
from rlite.run.checkpoint import list_checkpoints
from rlite.run.faults import EXIT_PREEMPTED
from rlite.run.loop import run_training
from rlite.testing import read_jsonl, run_in_subprocess_env
from rlite.tokenizer import build_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _args(model_dir, run_dir, steps):
    return [
        f"model.path={model_dir}", "data.task=addition", "data.num_train=64", "data.num_eval=8",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4",
        f"logging.run_dir={run_dir}", "logging.progress_bar=false", "logging.plot=false",
        "logging.loggers=[jsonl]", "training.eval_every=0", "training.lr=1e-2", f"training.steps={steps}",
        "checkpoint.every=0", "checkpoint.export_hf=true", "checkpoint.resume=auto",
    ]  # fmt: skip


def _complete_rows(path):
    """The rows of a jsonl file another process is appending to: only lines already ended by their
    newline (the last one may be half-written at the moment it is read)."""
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def _wait_for_step(metrics, step, proc, timeout_s=240):
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, "the run ended before the signal"
        assert time.monotonic() < deadline, f"step {step} never logged"
        if metrics.is_file() and any(row.get("step", -1) >= step for row in _complete_rows(metrics)):
            return
        time.sleep(0.05)


def test_sigterm_saves_at_a_step_boundary_exits_75_and_resume_is_bitwise(tmp_path, model_dir):
    steps = 6
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("training:\n  seed: 0\n")
    cmd = [sys.executable, "-m", "rlite", "train", str(config), *_args(model_dir, run_dir, steps)]
    proc = subprocess.Popen(cmd, env=run_in_subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    _wait_for_step(run_dir / "metrics.jsonl", 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert "Traceback" not in stderr
    line = next(x for x in stderr.splitlines() if x.startswith("rlite train: stopped: SIGTERM received: saved the"))
    (ckpt,) = list_checkpoints(run_dir / "checkpoints")  # checkpoint.every=0: only the preemption's
    saved = int(ckpt.name.split("_")[1])
    assert 2 <= saved < steps and f"checkpoint of step {saved} ({ckpt})" in line
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")][-1] == saved  # no half-logged step

    done = subprocess.run(cmd, env=run_in_subprocess_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"(step {saved})" in done.stderr  # "resumed from ... (step N)"
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(steps + 1))

    straight = tmp_path / "straight"
    run_training(load_config(str(config), _args(model_dir, straight, steps), pm=get_plugin_manager()))
    a = load_file(straight / "hf_model" / "model.safetensors")
    b = load_file(run_dir / "hf_model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_second_ctrl_c_stops_at_once_without_a_new_checkpoint(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("training:\n  seed: 0\n")
    cmd = [sys.executable, "-m", "rlite", "train", str(config), *_args(model_dir, run_dir, 50)]
    proc = subprocess.Popen(cmd, env=run_in_subprocess_env(RLITE_DEBUG_CHECKPOINT_PAUSE="60"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    _wait_for_step(run_dir / "metrics.jsonl", 1, proc)
    proc.send_signal(signal.SIGINT)  # the first: a checkpoint at the next boundary (its save pauses 60 s) ...
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints").is_dir() or not any((run_dir / "checkpoints").iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)  # ... the second stops now
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-3000:]
    assert "press Ctrl-C again to stop now" in stderr and "rlite: interrupted" in stderr
    assert list_checkpoints(run_dir / "checkpoints") == []  # the interrupted save never became a checkpoint


def test_sigterm_while_the_run_starts_stops_cleanly_before_the_first_step(tmp_path, model_dir):
    """`rlite train` installs its handlers before it reads the config: a SIGTERM during start-up (here
    while a reward file is imported, which the config check does) is not a kill (-15) but a clean stop
    with status 75 and nothing to save; the same command then runs the whole job."""
    marker, go, steps = tmp_path / "importing", tmp_path / "go", 2
    # the import holds until the test has sent its signal (not a fixed sleep: on a loaded machine the
    # signal could land after the import and so after the start-up it is meant to interrupt)
    (tmp_path / "slow_reward.py").write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(marker)!r}).touch()\n"
        "deadline = time.monotonic() + 120\n"
        f"while not pathlib.Path({str(go)!r}).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.02)\n"
        "def digits(completion, sample):\n"
        "    return float(sum(c.isdigit() for c in completion))\n"
    )
    config = tmp_path / "run.yaml"
    config.write_text("training:\n  seed: 0\nrewards:\n  - {name: python, args: {function: slow_reward.py:digits}}\n")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlite", "train", str(config), *_args(model_dir, run_dir, steps)]
    proc = subprocess.Popen(cmd, env=run_in_subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)  # fmt: skip
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the reward file was never imported"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    go.touch()
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "SIGTERM received before the first step: nothing new to save; a re-run starts from the beginning" in stderr
    assert not (run_dir / "checkpoints").exists() or list_checkpoints(run_dir / "checkpoints") == []
    marker.unlink()

    done = subprocess.run(cmd, env=run_in_subprocess_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(steps + 1))


PAUSE_IMPORT = """
import os, sys, time


class PauseImport:
    '''Holds the first import of rlite.tools.cli until the test says go: the moment a loaded node spends importing.'''

    def find_spec(self, name, path=None, target=None):
        if name == "rlite.tools.cli" and not os.path.exists(os.environ["RLITE_TEST_READY"]):
            open(os.environ["RLITE_TEST_READY"], "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(os.environ["RLITE_TEST_GO"]) and time.monotonic() < deadline:
                time.sleep(0.02)
        return None


sys.meta_path.insert(0, PauseImport())
"""


def test_sigterm_while_the_command_is_still_importing_exits_75(tmp_path, model_dir):
    """``import rlite.tools.cli`` took 1.9 s under load, and a SIGTERM 1.8 s after start exited 143: the handler
    was installed by ``rlite train`` itself. ``rlite.entry`` records it first thing."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(PAUSE_IMPORT)
    ready, go = tmp_path / "ready", tmp_path / "go"
    config = tmp_path / "run.yaml"
    config.write_text("training:\n  seed: 0\n")
    env = run_in_subprocess_env(PYTHONPATH=str(hook), RLITE_TEST_READY=str(ready), RLITE_TEST_GO=str(go))
    cmd = [sys.executable, "-m", "rlite", "train", str(config), *_args(model_dir, tmp_path / "run", 2)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the command never got to importing rlite.tools.cli"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    go.touch()
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert "rlite train: stopped: SIGTERM received while rlite was starting" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "run").exists()  # nothing started

