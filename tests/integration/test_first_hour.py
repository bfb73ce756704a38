"""The commands that surprised a newcomer in their first hour (issue #44), each run the way they ran it:
a run folder where a run is meant, what ``rlite info`` says first, a finished run run again, ``| head``,
an offline ``--from-hub``, a relative data path, a misspelt or misbehaving reward function, a missing
model folder, and ``rlite config`` without an optional package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlite.testing import read_jsonl, run_in_subprocess_env
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "data.task=addition", "data.num_train=16", "data.num_eval=4", "training.steps=2", "training.eval_every=2",
    "training.micro_batch_size=8", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=3", "logging.progress_bar=false", "logging.plot=false", "logging.loggers=jsonl",
    "checkpoint.every=1",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def finished_run(model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A finished 2-step run (a checkpoint each step, the model exported): its config and its folder."""
    work = tmp_path_factory.mktemp("run")
    config = work / "tiny.yaml"
    config.write_text(f"model:\n  path: {model_dir}\n")
    run_dir = work / "runs" / "tiny"
    assert main(["train", str(config), *TINY, f"logging.run_dir={run_dir}"]) == 0
    return config, run_dir


def test_eval_takes_a_run_folder(finished_run, capsys):
    config, run_dir = finished_run
    capsys.readouterr()
    assert main(["eval", str(run_dir)]) == 0
    (row,) = read_jsonl(run_dir / "eval.jsonl")
    assert row["step"] == 2 and "step_00000002" in row["model"]  # the run's latest checkpoint, in its own folder
    final = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step") == 2 and "eval/greedy_accuracy" in r]
    assert row["eval/greedy_accuracy"] == final[0]["eval/greedy_accuracy"]  # the run's own evaluation, repeated


def test_a_folder_that_is_not_a_run_is_named(tmp_path, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{str(tmp_path)!r} is a folder without config.yaml, so not a run folder" in err


def test_info_says_where_the_run_stands(finished_run, capsys):
    _, run_dir = finished_run
    metrics = {row["step"]: row for row in read_jsonl(run_dir / "metrics.jsonl")}
    capsys.readouterr()
    assert main(["info", str(run_dir)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "steps done: 2 (finished)"
    assert out[1] == f"last reward (reward/mean of step 2): {metrics[2]['reward/mean']:.4f}"
    assert out[2].startswith(f"held-out accuracy at step 2: greedy {metrics[2]['eval/greedy_accuracy']:.4f}, sampled ")
    assert out[3].startswith("wall time: 0:00:") and out[3].endswith("(start-up to the last step logged, 1 run of rlite train)")
    assert out[4].startswith("time in training steps: 0:00:")
    assert out[5].startswith(f"model: {run_dir / 'hf_model'} (a Hugging Face folder")
    assert out[6] == f"latest checkpoint: {run_dir / 'checkpoints' / 'step_00000002'}"
    assert main(["info", str(run_dir), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)["status"]
    assert status["steps_done"] == status["steps_planned"] == 2
    assert status["time_in_steps_s"] == pytest.approx(metrics[1]["time/step"] + metrics[2]["time/step"])
    # the wall time counts from the command's start: its start-up and the step-0 evaluation too
    assert status["wall_s"] == metrics[2]["perf/wall_s"] > status["time_in_steps_s"] and status["runs"] == 1


def test_info_adds_up_the_wall_time_of_every_command_that_trained(tmp_path):
    """A run resumed once was trained by two commands: each one's rows start with a provenance row and count
    their perf/wall_s from that command's start, so the wall time is the sum of each command's last row."""
    from rlite.run.status import wall_time

    rows = [{"provenance": {}, "step": 0}, {"step": 0, "perf/wall_s": 2.0}, {"step": 1, "perf/wall_s": 5.0},
            {"provenance": {}, "step": 1}, {"step": 2, "perf/wall_s": 4.0},
            {"provenance": {}, "step": 2}]  # a third command that logged nothing (stopped at start-up)
    assert wall_time(rows) == {"wall_s": 9.0, "runs": 2}
    assert wall_time([{"provenance": {}, "step": 0}, {"step": 1, "time/step": 1.0}]) == {"wall_s": None, "runs": 0}


def test_running_a_finished_run_again_says_nothing_ran(finished_run, capsys):
    config, run_dir = finished_run
    before = (run_dir / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["train", str(config), *TINY, f"logging.run_dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert f"rlite: {run_dir} already finished its 2 steps (step_00000002); nothing ran." in out
    assert "steps done in" not in out
    assert (run_dir / "metrics.jsonl").read_bytes() == before  # no provenance row for a run that did not happen
    # more steps still resume, and another model is still refused rather than called finished
    assert main(["train", str(config), *TINY, f"logging.run_dir={run_dir}", "model.path=" + str(run_dir / "hf_model")]) == 2
    assert "model.path" in capsys.readouterr().err


def test_info_piped_into_head_ends_quietly(finished_run):
    _, run_dir = finished_run
    # a reader that closes the pipe after one line, before rlite has written the rest
    command = (f"{sys.executable} -m rlite info {run_dir} | {sys.executable} -c "
               "\"import sys; sys.stdout.write(sys.stdin.readline())\"")  # fmt: skip
    result = subprocess.run(["bash", "-c", f"set -o pipefail; {command}"], capture_output=True, text=True,
                            env=run_in_subprocess_env(), timeout=120, check=False)  # fmt: skip
    assert result.stdout.startswith("steps done: 2")
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode in (0, 141)  # 141: rlite stopped by the closed pipe, as `cat` would be


def test_info_piped_into_head_ends_quietly_when_the_pipe_closes_first(finished_run):
    _, run_dir = finished_run
    read, write = os.pipe()
    os.close(read)  # nobody reads: the first write fails
    result = subprocess.run([sys.executable, "-m", "rlite", "info", str(run_dir)], stdout=write, stderr=subprocess.PIPE,
                            text=True, env=run_in_subprocess_env(), timeout=120, check=False)  # fmt: skip
    os.close(write)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr, result.stderr
    assert result.returncode == 141


def test_prepare_gsm8k_from_hub_offline_is_one_clear_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gsm8k" / "prepare_gsm8k.py"), "--from-hub", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
        env=run_in_subprocess_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
    )  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("prepare_gsm8k: ")]
    assert "could not read openai/gsm8k from the Hugging Face Hub" in line and "needs network access" in line
    assert "--train TRAIN --test TEST" in line


def test_a_missing_data_file_says_where_relative_paths_are_read(tmp_path, model_dir, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "run.yaml").write_text(f"model:\n  path: {model_dir}\n")
    assert main(["train", "cfg/run.yaml", *TINY, "data.task=null", "data.train_files=nope.jsonl"]) == 2
    err = capsys.readouterr().err
    assert ("data.train_files: 'nope.jsonl' does not exist (relative paths are read from the working folder, "
            f"{tmp_path}, not from the config file's folder)") in err


def write_rewards(folder: Path) -> Path:
    (folder / "reward.py").write_text(
        "import math\n\n\n"
        "def zero(completion, sample):\n"
        "    return 0.0\n\n\n"
        "def stringly(completion, sample):\n"
        "    cleaned = completion.strip()\n"
        "    return cleaned  # a string, not a number\n\n\n"
        "def _helper():\n"
        "    pass\n"
    )
    return folder / "reward.py"


def test_a_misspelt_reward_function_gets_did_you_mean_and_the_list(tmp_path, model_dir, capsys):
    reward = write_rewards(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {model_dir}\n")
    assert main(["config", str(config), "data.task=addition",
                 f"rewards=[{{name: python, args: {{function: '{reward}:zer0'}}}}]"]) == 2
    err = capsys.readouterr().err
    assert "has no attribute 'zer0'. Did you mean 'zero'? Its functions: stringly, zero" in err  # not math's, not _helper


def test_a_reward_returning_a_string_shows_the_users_line(tmp_path, model_dir, capsys):
    reward = write_rewards(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {model_dir}\n")
    code = main(["train", str(config), *TINY, f"logging.run_dir={tmp_path / 'run'}",
                 f"rewards=[{{name: python, args: {{function: '{reward}:stringly'}}}}]"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 3, err
    assert f'File "{reward}", line 10, in stringly\n    return cleaned  # a string, not a number' in err
    assert "returned str" in err and "not a number" in err
    assert "reward_runner.py" not in err and "rewards.py" not in err  # rlite's own frames (trainer/reward_runner.py,
    # plugins/rewards.py) are not shown


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("./nope", "model.path: folder 'nope' does not exist (relative paths are read from the working folder, {cwd})"),
        ("{cwd}/models/a/b", "model.path: folder '{cwd}/models/a/b' does not exist; its nearest existing folder is "
                             "'{cwd}/models'"),
        ("someone/no-such-model", "model.path: 'someone/no-such-model' is not a local folder (relative paths are read "
                                  "from the working folder, {cwd}), and as a Hugging Face hub name it would be downloaded"),
    ],
)
def test_a_missing_model_folder_says_where_it_looked_and_that_a_hub_name_is_tried(tmp_path, capsys, monkeypatch,
                                                                                  given, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "run.yaml").write_text(f"model:\n  path: {given.format(cwd=tmp_path)}\n")
    assert main(["train", "run.yaml", *TINY]) == 2
    err = capsys.readouterr().err
    assert expected.format(cwd=tmp_path) in err, err
    assert "nearest existing folder is '" + str(tmp_path) + "'" not in err  # the working folder is no hint


@pytest.mark.parametrize(
    ("config", "package", "refusal"),
    [
        ("qwen2.5_gpu.yaml", "math_verify", "the math_verify reward needs the math-verify package: pip install 'rlite[math]'"),
    ],
)
def test_config_prints_without_the_optional_package_that_train_requires(capsys, monkeypatch, config, package, refusal):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name.split(".")[0] == package else real(name, *args))
    assert main(["config", str(ROOT / "configs" / config)]) == 0
    assert "run_dir:" in capsys.readouterr().out
    assert main(["train", str(ROOT / "configs" / config)]) == 2
    assert refusal in capsys.readouterr().err
