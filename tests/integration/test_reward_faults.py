"""Reward functions that fail, return garbage or hang, met the way a user meets them: ``rlite train``.

A run stops with the reward function's own traceback (exit status 3) when its failures pass the
configured bound, tolerates and counts rare ones, and a hanging function costs each batch one
deadline, its worker processes killed and replaced, never the run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest

from rlite.testing import read_jsonl, run_in_subprocess_env
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import EXIT_REWARDS_FAILED, main

USER_REWARDS = '''
import os
import time

calls = 0


def always_fails(completion, sample):
    raise KeyError("no column 'solution' in this row")


def hangs(completion, sample, markers):
    with open(os.path.join(markers, f"{os.getpid()}-{time.monotonic_ns()}"), "w"):
        pass
    time.sleep(600)
    return 1.0


def fails_every_fifth_call(completion, sample):
    global calls
    calls += 1
    if calls % 5 == 0:
        return float("nan")
    return 1.0
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def user_rewards(tmp_path):
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "my_rewards.py").write_text(textwrap.dedent(USER_REWARDS))
    return folder


def write_config(tmp_path, model_dir, rewards: list[str], extra: str = "") -> str:
    config = tmp_path / "run.yaml"
    lines = [
        f"model: {{path: {model_dir}}}",
        "data: {task: addition, num_train: 64, num_eval: 8}",
        "training: {steps: 2, micro_batch_size: 8, eval_every: 0}",
        "rollout: {prompts_per_step: 2, samples_per_prompt: 4, max_new_tokens: 4}",
        f"logging: {{run_dir: {tmp_path / 'run'}, progress_bar: false, plot: false, loggers: [jsonl]}}",
        "checkpoint: {resume: never, save_final: false, export_hf: false}",
        "rewards:",
        *[f"  - {reward}" for reward in rewards],
    ]
    config.write_text("\n".join(lines) + "\n" + extra)
    return str(config)


def test_a_reward_failing_on_every_call_stops_the_run_with_its_traceback(tmp_path, model_dir, user_rewards):
    # the function by a file path relative to the working folder, as a user writes it
    config = write_config(tmp_path, model_dir, ['{name: python, args: {function: "user/my_rewards.py:always_fails"}}'])
    done = subprocess.run(
        [sys.executable, "-m", "rlite", "train", config], capture_output=True, text=True, timeout=600,
        env=run_in_subprocess_env(), cwd=tmp_path,
    )
    assert done.returncode == EXIT_REWARDS_FAILED
    stderr = done.stderr
    assert "rlite train: stopped: reward function 'python' failed on 8 of 8 calls in this batch" in stderr
    assert "reward_max_failure_fraction" in stderr
    # the user's own frame and message, not only rlite's
    assert f'File "{user_rewards / "my_rewards.py"}", line 9, in always_fails' in stderr
    assert "KeyError: \"no column 'solution' in this row\"" in stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or all(
        "reward/mean" not in row for row in read_jsonl(tmp_path / "run" / "metrics.jsonl"))


def test_hanging_and_rarely_failing_rewards_are_bounded_counted_and_tolerated(
        tmp_path, model_dir, user_rewards, capsys):
    """A reward that hangs on every call (timeouts tolerated) next to one that returns NaN on every
    fifth call (failures tolerated up to half): the run finishes; each batch's hanging calls end at
    its one deadline (only ``reward_workers`` of them ever start), the killed workers are replaced
    and gone at the end; metrics and summary count failures and timeouts apart."""
    markers = tmp_path / "markers"
    markers.mkdir()
    functions = user_rewards / "my_rewards.py"
    rewards = [f'{{name: python, args: {{function: "{functions}:hangs", kwargs: {{markers: "{markers}"}}}}}}',
               f'{{name: python, args: {{function: "{functions}:fails_every_fifth_call"}}}}']
    extra = ("reward_timeout_s: 4\nreward_workers: 2\nreward_max_timeout_fraction: 1.0\n"
             "reward_max_failure_fraction: 0.5\n")
    config = write_config(tmp_path, model_dir, rewards, extra)
    threads_before = threading.active_count()
    assert main(["train", config, "data.num_eval=16"]) == 0
    assert threading.active_count() == threads_before

    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["reward/timeouts"] for r in steps] == [8.0, 8.0]  # every call of the hanging function
    assert all(r["reward/failures"] < 8 for r in steps)  # each worker fails one call in five
    assert all(r["reward/python"] == 0.0 for r in steps)
    evals = [r for r in rows if "eval/reward_timeouts" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(r["eval/reward_timeouts"] == 2 * 16 for r in evals)  # greedy and sampled passes
    # 6 batches (2 steps, 2 evaluations of 2 passes), each ended at its deadline with 2 calls started
    started = os.listdir(markers)
    assert len(started) == 6 * 2
    pids = {int(name.split("-")[0]) for name in started}
    assert len(pids) == 6 * 2  # every hung worker was replaced by a fresh one
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    failures = int(sum(r.get("reward/failures", 0) + r.get("eval/reward_failures", 0) for r in rows))
    assert failures > 0
    summary = capsys.readouterr().out
    assert re.search(rf"reward_failures\s*│\s*{failures}\s*│", summary)
    assert re.search(rf"reward_timeouts\s*│\s*{2 * 8 + 4 * 16}\s*│", summary)


def test_a_wrong_signature_is_refused_before_any_model_loads(tmp_path, model_dir, user_rewards):
    config = write_config(tmp_path, model_dir, ['{name: python, args: {function: "user/my_rewards.py:hangs"}}'])
    done = subprocess.run(
        [sys.executable, "-m", "rlite", "train", config], capture_output=True, text=True, timeout=600,
        env=run_in_subprocess_env(), cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "Loading weights" not in done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("rlite train: error: rewards[0]: args.function: 'user/my_rewards.py:hangs' (hangs in ")
    assert f"{user_rewards / 'my_rewards.py'}, line 12) cannot be called as hangs(completion: str, sample: dict) -> float" in line
    assert "missing a required argument: 'markers'" in line
