"""Damaged and unwritable checkpoints: every checkpoint carries a checksum manifest; ``resume: auto``
falls back to the newest intact one; a full disk during a save leaves the previous one intact."""

from __future__ import annotations

import errno
import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from rlite import hookimpl
from rlite.config import ConfigError
from rlite.plugin_manager import build_plugin_manager
from rlite.run.checkpoint import MANIFEST, list_checkpoints, verify_checkpoint
from rlite.run.faults import EXIT_STOPPED, RunStopped
from rlite.run.loop import run_training
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _flip_a_byte(path, at=None):
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_manifest_names_every_file_and_catches_a_flipped_byte_a_short_file_and_a_missing_one(tmp_path, model_dir):
    run_training(tiny_config(model_dir, tmp_path / "run", "checkpoint.save_final=true", "training.steps=1"))
    (ckpt,) = list_checkpoints(tmp_path / "run" / "checkpoints")
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    on_disk = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()} - {MANIFEST, "COMPLETE"}
    assert set(files) == on_disk and "trainer_state_rank0.pt" in on_disk
    assert verify_checkpoint(ckpt) == ""
    shard = next(ckpt.glob("*.distcp"))
    original = shard.read_bytes()
    _flip_a_byte(shard)
    assert verify_checkpoint(ckpt) == f"{shard.name} does not match the checksum written with it"
    shard.write_bytes(original[:-1])
    assert verify_checkpoint(ckpt) == f"{shard.name} has {len(original) - 1} bytes, {len(original)} were written"
    shard.unlink()
    assert verify_checkpoint(ckpt) == f"{shard.name} is missing"
    (ckpt / MANIFEST).unlink()
    assert verify_checkpoint(ckpt) == f"it has no {MANIFEST}"
    # without checksums (checkpoint.verify=false) a missing or short shard still shows
    assert verify_checkpoint(ckpt, checksums=False) == f"{shard.name} is missing"
    shard.write_bytes(original[:-1])
    assert verify_checkpoint(ckpt, checksums=False) == (
        f"{shard.name} has {len(original) - 1} bytes, its metadata needs {len(original)}")
    shard.write_bytes(original)
    assert verify_checkpoint(ckpt, checksums=False) == ""


COMMON = ("training.steps=4", "checkpoint.every=1", "checkpoint.keep_last=2", "checkpoint.export_hf=true",
          "training.lr=1e-2")


def test_resume_auto_skips_a_damaged_latest_checkpoint_and_still_ends_bitwise_like_an_uninterrupted_run(
    tmp_path, model_dir, caplog
):
    run_training(tiny_config(model_dir, tmp_path / "straight", *COMMON))
    run_dir = tmp_path / "run"
    run_training(tiny_config(model_dir, run_dir, *COMMON[1:], "training.steps=3"))
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000002", "step_00000003"]
    damaged = run_dir / "checkpoints" / "step_00000003"
    _flip_a_byte(next(damaged.glob("*.distcp")))
    with caplog.at_level(logging.INFO, logger="rlite"):
        run_training(tiny_config(model_dir, run_dir, *COMMON, "checkpoint.resume=auto"))
    skipped = [r.getMessage() for r in caplog.records if "damaged and skipped" in r.getMessage()]
    assert len(skipped) == 1 and "step_00000003" in skipped[0] and ".distcp does not match the checksum" in skipped[0]
    assert any("resumed from" in r.getMessage() and "step_00000002" in r.getMessage() for r in caplog.records)
    a = load_file(tmp_path / "straight" / "hf_model" / "model.safetensors")
    b = load_file(run_dir / "hf_model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2, 3, 4]


def test_when_every_checkpoint_is_damaged_resume_auto_refuses_naming_each(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    run_training(tiny_config(model_dir, run_dir, "training.steps=2", "checkpoint.every=1"))
    for ckpt in list_checkpoints(run_dir / "checkpoints"):
        _flip_a_byte(ckpt / "trainer_state_rank0.pt")
    with pytest.raises(ConfigError) as refused:
        run_training(tiny_config(model_dir, run_dir, "training.steps=3", "checkpoint.resume=auto"))
    message = str(refused.value)
    assert message.startswith("checkpoint.resume=auto: every checkpoint in")
    assert "step_00000001: trainer_state_rank0.pt does not match" in message and "step_00000002:" in message
    assert "checkpoint.resume=never" in message
    with pytest.raises(ConfigError, match="step_00000002 is damaged: trainer_state_rank0.pt"):
        run_training(tiny_config(model_dir, run_dir, f"checkpoint.resume={run_dir / 'checkpoints' / 'step_00000002'}"))


class ArmAfterFirstSave:
    def __init__(self):
        self.armed = False

    @hookimpl
    def on_checkpoint_save(self, step):
        self.armed = True


def _disk_full():
    return OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("writer", ["model shards (DCP)", "trainer state (torch.save)"])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_names_folder_and_free_space(
    tmp_path, model_dir, monkeypatch, writer
):
    import torch.distributed.checkpoint.filesystem as dcp_fs

    arm = ArmAfterFirstSave()
    if writer.startswith("model"):
        write_item = dcp_fs._write_item

        def failing_write_item(transforms, stream, *args, **kwargs):
            if arm.armed:
                stream.write(b"partial")
                raise _disk_full()
            return write_item(transforms, stream, *args, **kwargs)

        monkeypatch.setattr(dcp_fs, "_write_item", failing_write_item)
    else:
        save = torch.save

        def failing_save(obj, f, *args, **kwargs):
            if arm.armed and str(f).endswith("trainer_state_rank0.pt"):
                with open(f, "wb") as handle:
                    handle.write(b"partial")
                raise _disk_full()
            return save(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", failing_save)
    pm = build_plugin_manager(autoload=False)
    pm.register(arm, name="arm")
    run_dir = tmp_path / "run"
    with pytest.raises(RunStopped) as stopped:
        run_training(tiny_config(model_dir, run_dir, "training.steps=3", "checkpoint.every=1", pm=pm), pm)
    message, root = str(stopped.value), run_dir / "checkpoints"
    assert stopped.value.exit_code == EXIT_STOPPED
    assert message.startswith(f"the checkpoint of step 2 could not be written to {root} (")
    assert "GiB free of" in message and "No space left on device" in message and "Free disk space" in message
    assert f"the previous checkpoint {root / 'step_00000001'} is intact" in message
    assert [p.name for p in root.iterdir()] == ["step_00000001"]  # the partial folder is gone
    assert verify_checkpoint(root / "step_00000001") == ""
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2]
