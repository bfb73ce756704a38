"""A full disk at each write path of a run (metrics, TensorBoard, samples, checkpoint, export) stops
``rlite train`` cleanly: exit status 4 and one message naming the folder, its free space and the
checkpoint to resume from. An export stopped half-way leaves no partial ``hf_model/``, and the next
run of the same command exports again."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from rlite import hookimpl as rlite_hookimpl
from rlite.run.faults import EXIT_STOPPED
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def write_config(tmp_path: Path, model_dir: str, **sections: dict) -> str:
    config = {
        "model": {"path": model_dir},
        "data": {"task": "addition", "num_train": 64, "num_eval": 8},
        "training": {"steps": 3, "micro_batch_size": 8, "lr": 1e-3, "eval_every": 0},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 4},
        "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False, "plot": False, "loggers": ["jsonl"],
                    "samples_every": 0},
        "checkpoint": {"every": 1, "save_final": True, "export_hf": False},
    }
    for section, values in sections.items():
        config[section].update(values)
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


def disk_full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def fail_at_step(step: int):
    """A writer ``(self, step, ...)`` that raises ENOSPC from ``step`` on."""

    def write(self, at_step, *args, **kwargs):
        if at_step >= step:
            raise disk_full()

    return write


def stopped_message(capsys) -> str:
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlite train:")]
    assert line.startswith("rlite train: stopped: "), line
    return line


def assert_names_space_and_resume(message: str, folder: Path, checkpoint: str) -> None:
    assert f"could not be written to {folder} (" in message
    assert "GiB free of" in message and "No space left on device" in message
    assert "Free disk space" in message and "run the same command again" in message
    assert checkpoint in message


WRITERS = {  # the writer's class, its method, the folder the message must name (under the run folder)
    "metrics.jsonl": ("rlite.plugins.loggers:JsonlLogger", "log", ""),
    "tensorboard": ("rlite.plugins.loggers:TensorBoardLogger", "log", ""),
    "samples.jsonl": ("rlite.samples:SampleWriter", "write", "samples.jsonl"),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_full_disk_while_logging_stops_with_exit_4_naming_folder_space_and_checkpoint(
    tmp_path, model_dir, monkeypatch, capsys, writer
) -> None:
    import importlib

    target, method, folder = WRITERS[writer]
    module, cls = target.split(":")
    monkeypatch.setattr(getattr(importlib.import_module(module), cls), method, fail_at_step(2))
    config = write_config(tmp_path, model_dir, logging={"loggers": ["jsonl", "tensorboard"], "samples_every": 1})
    assert main(["train", config]) == EXIT_STOPPED
    run_dir = tmp_path / "run"
    message = stopped_message(capsys)
    assert_names_space_and_resume(message, run_dir / folder if folder else run_dir,
                                  f"the last good checkpoint is {run_dir / 'checkpoints' / 'step_00000001'}")
    assert "step 2" in message


def test_a_full_disk_while_torch_save_writes_the_checkpoint_reads_free_disk_space(
    tmp_path, model_dir, monkeypatch, capsys
) -> None:
    """``torch.save`` reports ENOSPC as a RuntimeError of its zip writer, without the errno (as writing to
    /dev/full shows); it used to read "Fix the folder"."""
    save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if str(f).endswith("trainer_state_rank0.pt") and "step_00000002" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    assert main(["train", write_config(tmp_path, model_dir)]) == EXIT_STOPPED
    message = stopped_message(capsys)
    root = tmp_path / "run" / "checkpoints"
    assert f"the checkpoint of step 2 could not be written to {root} (" in message and "GiB free of" in message
    assert "Free disk space" in message and "Fix the folder" not in message
    assert f"the previous checkpoint {root / 'step_00000001'} is intact" in message


def test_an_export_stopped_by_a_full_disk_leaves_no_partial_folder_and_the_next_run_exports_again(
    tmp_path, model_dir, monkeypatch, capsys
) -> None:
    from transformers import PreTrainedModel

    save_pretrained = PreTrainedModel.save_pretrained

    def config_then_full(self, save_directory, *args, **kwargs):  # what a full disk did: config.json only
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(save_directory)
        raise disk_full()

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", config_then_full)
    config = write_config(tmp_path, model_dir, checkpoint={"export_hf": True})
    assert main(["train", config]) == EXIT_STOPPED
    run_dir = tmp_path / "run"
    message = stopped_message(capsys)
    assert message.startswith(f"rlite train: stopped: the exported model could not be written to {run_dir / 'hf_model'}")
    assert_names_space_and_resume(message, run_dir / "hf_model",
                                  f"the last good checkpoint is {run_dir / 'checkpoints' / 'step_00000003'}")
    assert not (run_dir / "hf_model").exists() and not (run_dir / "hf_model.tmp").exists()

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_pretrained)
    assert main(["train", config]) == 0  # resumes from the final checkpoint: no step, the export again
    exported = {p.name for p in (run_dir / "hf_model").iterdir()}
    assert {"config.json", "model.safetensors"} <= exported
    assert not (run_dir / "hf_model.tmp").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "provenance" not in row] == [0, 1, 2, 3]


def test_a_second_ctrl_c_that_interrupts_torch_save_stops_with_130_not_as_a_full_disk(
    tmp_path, model_dir, monkeypatch, capsys
) -> None:
    """torch.save's zip writer turns the KeyboardInterrupt of a second Ctrl-C into the same RuntimeError a
    full disk gives ("unexpected pos"); after a second Ctrl-C it must read as the interrupt (status 130).
    (tests/faults/test_preemption.py's real-signal test hit this when its second SIGINT landed mid-write.)"""
    import rlite.run.disk as disk

    save = torch.save

    def interrupted_save(obj, f, *args, **kwargs):
        if str(f).endswith("trainer_state_rank0.pt") and "step_00000002" in str(f):
            monkeypatch.setattr(disk, "_STOP_NOW", True)  # what the second SIGINT's handler records
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", interrupted_save)
    assert main(["train", write_config(tmp_path, model_dir)]) == 130
    assert "Free disk space" not in capsys.readouterr().err


@pytest.fixture
def small_disk(tmp_path):
    """A real 24 MiB file system (tmpfs), for writers whose errors on a full disk no injected OSError imitates."""
    import subprocess

    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"needs a small real file system, and mounting a tmpfs is not permitted here: "
                    f"{(mounted.stderr or mounted.stdout).strip()}")  # fmt: skip
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


class FillsTheDiskAfterTheLastCheckpoint:
    """Once the final checkpoint is written, fills its disk but for 64 KiB: the export comes next."""

    def __init__(self, last_step: int, filler: Path) -> None:
        self.last_step, self.filler = last_step, filler

    @rlite_hookimpl
    def on_checkpoint_save(self, step, path):
        import shutil

        if step == self.last_step:
            free = shutil.disk_usage(self.filler.parent).free
            with open(self.filler, "wb") as handle:
                handle.write(b"\0" * (free - 64 * 1024))


def test_a_real_full_disk_during_the_export_stops_with_exit_4_and_the_next_run_exports(tmp_path, model_dir, small_disk):
    """safetensors reports a full disk as ``SafetensorError: ... No space left on device (os error 28)``, no
    OSError: it ended in a traceback (exit 1) while the tests injected OSError(ENOSPC)."""
    from rlite.plugin_manager import build_plugin_manager
    from rlite.run.faults import RunStopped
    from rlite.run.loop import run_training
    from rlite.testing import tiny_config

    run_dir = small_disk / "run"
    args = ("training.steps=2", "checkpoint.every=1", "checkpoint.save_final=true", "checkpoint.export_hf=true",
            "checkpoint.resume=auto")  # fmt: skip
    pm = build_plugin_manager(autoload=False)
    pm.register(FillsTheDiskAfterTheLastCheckpoint(2, small_disk / "filler"), name="filler")
    with pytest.raises(RunStopped) as stopped:
        run_training(tiny_config(model_dir, run_dir, *args, pm=pm), pm)
    message = str(stopped.value)
    assert stopped.value.exit_code == EXIT_STOPPED
    assert message.startswith(f"the exported model could not be written to {run_dir / 'hf_model'} (0.00 GiB free")
    assert "No space left on device (os error 28)" in message  # safetensors' own words
    assert_names_space_and_resume(message, run_dir / "hf_model",
                                  f"the last good checkpoint is {run_dir / 'checkpoints' / 'step_00000002'}")
    assert not (run_dir / "hf_model").exists() and not (run_dir / "hf_model.tmp").exists()

    (small_disk / "filler").unlink()
    pm = build_plugin_manager(autoload=False)
    run_training(tiny_config(model_dir, run_dir, *args, pm=pm), pm)  # the final checkpoint: no step, the export
    assert (run_dir / "hf_model" / "model.safetensors").is_file()
