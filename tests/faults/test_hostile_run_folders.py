"""A run folder someone hands you is data: ``rlite chat``, ``rlite generate``, ``rlite info`` and ``rlite eval``
run nothing it names (a reward file, remote modelling code), and no command follows a link out of it to
read or write a file that is not the run's (``docs/faults.md``, threat model).

The hostile folder here is a real run's folder whose ``config.yaml`` was rewritten to name a ``python``
reward file and a model folder with remote code (``trust_remote_code: true``), each creating a marker file
when imported: the marker must never appear."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from rlite.run.checkpoint import list_checkpoints
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import main

TRAIN_ARGS = [
    "training.steps=2", "training.eval_every=0", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=4", "training.micro_batch_size=8", "training.lr=1e-2", "logging.loggers=[jsonl]",
    "logging.plot=false", "logging.progress_bar=false", "checkpoint.every=1", "checkpoint.save_final=true",
    "checkpoint.export_hf=true", "logging.samples_every=1",
]  # fmt: skip

EVIL_REWARD = """
open({marker!r}, "w").close()


def score(completion, sample):
    return 0.0
"""

EVIL_MODELLING = """
open({marker!r}, "w").close()
from transformers import Qwen2Config, Qwen2ForCausalLM


class EvilConfig(Qwen2Config):
    pass


class EvilModel(Qwen2ForCausalLM):
    config_class = EvilConfig
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, model_dir) -> tuple[Path, Path]:
    """A finished 2-step run (checkpoints of steps 1 and 2, an export) and the config that trained it."""
    tmp = tmp_path_factory.mktemp("finished")
    config = tmp / "run.yaml"
    config.write_text(f"model: {{path: {model_dir}}}\ndata: {{task: addition, num_train: 32, num_eval: 4}}\n")
    assert main(["train", str(config), *TRAIN_ARGS, f"logging.run_dir={tmp / 'run'}", "checkpoint.resume=never"]) == 0
    return tmp / "run", config


@pytest.fixture
def run_copy(finished, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished[0], run_dir, symlinks=True)
    return run_dir


def make_hostile(run_dir: Path, model_dir: Path, marker: Path) -> None:
    """Rewrite the folder's config.yaml as an attacker would: a reward file and a remote-code model folder,
    both inside the folder, each creating ``marker`` when it is imported."""
    (run_dir / "evil.py").write_text(EVIL_REWARD.format(marker=str(marker)))
    model = run_dir / "model"
    shutil.copytree(model_dir, model)
    (model / "evil_model.py").write_text(EVIL_MODELLING.format(marker=str(marker)))
    hf_config = json.loads((model / "config.json").read_text())
    hf_config["auto_map"] = {"AutoConfig": "evil_model.EvilConfig", "AutoModelForCausalLM": "evil_model.EvilModel"}
    (model / "config.json").write_text(json.dumps(hf_config))
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["rewards"] = [{"name": "python", "args": {"function": f"{run_dir / 'evil.py'}:score"}}]
    config["model"].update(path=str(model), trust_remote_code=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))


@pytest.mark.parametrize("export", [True, False], ids=["its export", "its checkpoint"])
@pytest.mark.parametrize("command", ["chat", "generate"])
def test_chat_and_generate_run_nothing_a_run_folders_config_names(run_copy, model_dir, tmp_path, monkeypatch,
                                                                     capsys, command, export):  # fmt: skip
    marker = tmp_path / "code-ran"
    make_hostile(run_copy, model_dir, marker)
    if not export:  # the checkpoint is turned into a model by the training backend: the config's model section
        shutil.rmtree(run_copy / "hf_model")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("12+3=\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("12+3=\n"))
    argv = ["chat", str(run_copy)] if command == "chat" else [
        "generate", str(run_copy), "--prompts", str(prompts), "--out", str(tmp_path / "out.jsonl")]
    assert main([*argv, "--max-new-tokens", "2"]) == 0, capsys.readouterr().err
    assert not marker.exists(), "a file the run folder's config named was executed"


def test_info_and_eval_run_nothing_a_run_folders_config_names(run_copy, finished, model_dir, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    make_hostile(run_copy, model_dir, marker)
    assert main(["info", str(run_copy)]) == 0
    # eval's own config is the user's (trusted); the folder it resumes from is only read
    assert main(["eval", str(finished[1]), *TRAIN_ARGS, f"logging.run_dir={run_copy}", "checkpoint.resume=auto",
                 "checkpoint.resume_mismatch=allow"]) == 0, capsys.readouterr().err  # fmt: skip
    assert not marker.exists(), "a file the run folder's config named was executed"


# -- links and special files where a run keeps its own ----------------------------------------------

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKeyKeyKeyKeyKeyKeyKeyKeyKeyKeyKeyKeyKeyKeyKey user@host\n"


def resume(finished, run_dir: Path, capsys, steps: int = 3) -> tuple[int, str]:
    status = main(["train", str(finished[1]), *TRAIN_ARGS, f"training.steps={steps}", f"logging.run_dir={run_dir}",
                   "checkpoint.resume=auto"])  # fmt: skip
    return status, capsys.readouterr().err


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl", "config.yaml"])
def test_a_resume_refuses_a_linked_run_file_and_leaves_what_it_points_to_as_it_was(run_copy, finished, tmp_path,
                                                                                   capsys, name):  # fmt: skip
    """A resume rewrote metrics.jsonl through the link (the torn-line repair), then appended to it: a one-line
    public key became metrics rows, and the warning copied the key into the log."""
    target = tmp_path / "id_ed25519.pub"
    target.write_text(KEY)
    (run_copy / name).unlink()
    (run_copy / name).symlink_to(target)
    status, err = resume(finished, run_copy, capsys)
    assert status == 2, err[-2000:]
    assert f"{run_copy / name} is a symbolic link to {target}" in err
    assert target.read_text() == KEY and "AAAAC3Nza" not in err
    assert (run_copy / name).is_symlink()  # refused before anything was written


def test_a_one_line_log_that_is_not_rlites_is_refused_not_emptied(run_copy, finished, capsys):
    (run_copy / "metrics.jsonl").write_text(KEY)
    status, err = resume(finished, run_copy, capsys)
    assert status == 2
    assert f"{run_copy / 'metrics.jsonl'}: its first line is not a row rlite writes" in err and "AAAAC3Nza" not in err
    assert (run_copy / "metrics.jsonl").read_text() == KEY


def test_rlite_info_refuses_a_fifo_for_metrics_without_waiting_for_a_writer(run_copy, tmp_path):
    import subprocess
    import sys

    from rlite.testing import run_in_subprocess_env

    (run_copy / "metrics.jsonl").unlink()
    os.mkfifo(run_copy / "metrics.jsonl")
    done = subprocess.run([sys.executable, "-m", "rlite", "info", str(run_copy)], env=run_in_subprocess_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and f"{run_copy / 'metrics.jsonl'} is a FIFO" in done.stderr


def link_a_shard_out(run_dir: Path, outside: Path) -> Path:
    """The latest checkpoint's DCP shard moved out of the folder and linked back: its bytes (and so the
    manifest's checksum) unchanged."""
    latest = list_checkpoints(run_dir / "checkpoints")[-1]
    shard = latest / "__0_0.distcp"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    return shard


def link_the_checkpoint_folder_out(run_dir: Path, outside: Path) -> Path:
    latest = list_checkpoints(run_dir / "checkpoints")[-1]
    shutil.move(latest, outside)
    latest.symlink_to(outside, target_is_directory=True)
    return latest


@pytest.mark.parametrize("link", [link_a_shard_out, link_the_checkpoint_folder_out], ids=["a shard", "the folder"])
def test_a_checkpoint_holding_a_link_is_refused_naming_it(run_copy, finished, tmp_path, capsys, link):
    linked = link(run_copy, tmp_path / "elsewhere")
    status, err = resume(finished, run_copy, capsys)
    assert status == 2, err[-2000:]
    assert f"{linked} is a symbolic link to {tmp_path / 'elsewhere'}" in err
    assert [json.loads(line)["step"] for line in (run_copy / "metrics.jsonl").read_text().splitlines()][-1] == 2


@pytest.mark.parametrize("what", ["hf_model", "hf_model/model.safetensors"])
def test_chat_refuses_an_export_holding_a_link(run_copy, tmp_path, monkeypatch, capsys, what):
    linked = run_copy / what
    shutil.move(linked, tmp_path / "elsewhere")
    linked.symlink_to(tmp_path / "elsewhere")
    monkeypatch.setattr("sys.stdin", io.StringIO("12+3=\n"))
    assert main(["chat", str(run_copy), "--max-new-tokens", "2"]) == 2
    assert f"{linked} is a symbolic link to {tmp_path / 'elsewhere'}" in capsys.readouterr().err


def test_a_run_folder_that_cannot_be_made_is_refused_naming_the_key(finished, capsys):
    assert main(["train", str(finished[1]), *TRAIN_ARGS, "logging.run_dir=/proc/rlite-run"]) == 2
    err = capsys.readouterr().err
    assert "logging.run_dir: cannot create the run folder '/proc/rlite-run'" in err and "Traceback" not in err
