"""The wandb logger, offline (W&B's own files, read back): metrics at the right steps, rollouts as
tables, and one W&B run per rlite run, continued when the rlite run resumes."""

from __future__ import annotations

import json
import struct

import pytest

from rlite.run.loop import run_training
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir

pytest.importorskip("wandb")


def wandb_records(run_file):
    """The protobuf records of a ``run-<id>.wandb`` file (a LevelDB-style log of 32 KiB blocks after a
    7-byte ``:W&B`` header; wandb >= 0.19 no longer ships a Python reader)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += room
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start a record
        if kind in (1, 4):  # FULL/LAST end it
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_run(run_dir):
    """(run id, {step: {key: value}}) of the latest offline W&B run under ``run_dir``.

    The latest is the folder W&B's own ``wandb/latest-run`` link names. Not the last folder name in
    sorted order: the names carry whole-second timestamps, so two runs started within one second sort
    by their random ids (a fresh run could sort before the one it followed), and a run resumed within
    the same second gets its id's folder name with a ``-1`` suffix, which sorts before the original."""
    import wandb

    # the run's finish() returns before W&B's service process has necessarily written all of the
    # transaction log (1 read in 17 found no run record yet); shutting the service down flushes it
    wandb.teardown()
    latest = (run_dir / "wandb" / "latest-run").resolve()
    (run_file,) = latest.glob("run-*.wandb")
    run_id, history = None, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(items["_step"], {}).update(items)
    return run_id, history, run_file.parent


def test_wandb_gets_every_step_and_the_sample_tables_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    model_dir = build_tiny_model_dir(tmp_path / "model")
    run_dir = tmp_path / "run"
    common = ["logging.loggers=[jsonl,wandb]", "checkpoint.every=2", "logging.samples_every=1",
              "logging.samples_per_step=2"]
    run_training(tiny_config(model_dir, run_dir, *common, "training.steps=2"))
    run_id, history, folder = wandb_run(run_dir)
    metrics = {row["step"]: row for row in read_jsonl(run_dir / "metrics.jsonl")}
    for step in (1, 2):
        assert history[step]["reward/mean"] == pytest.approx(metrics[step]["reward/mean"], rel=1e-6)
        assert history[step]["actor/pg_loss"] == pytest.approx(metrics[step]["actor/pg_loss"], rel=1e-6)
    # the rollouts of step 2 as a table: the rows samples.jsonl holds
    table = json.loads((folder / "files" / history[2]["samples/train/path"]).read_text())
    written = [row for row in read_jsonl(run_dir / "samples.jsonl") if row["step"] == 2 and row["kind"] == "train"]
    column = table["columns"].index("completion")
    assert [row[column] for row in table["data"]] == [row["completion"] for row in written]
    assert len(written) == 2

    # resumed: the same W&B run id, the new steps only
    run_training(tiny_config(model_dir, run_dir, *common, "training.steps=3", "checkpoint.resume=auto"))
    resumed_id, resumed_history, _ = wandb_run(run_dir)
    assert resumed_id == run_id
    assert 3 in resumed_history and 1 not in resumed_history
    # a fresh start in the same folder is a new W&B run
    run_training(tiny_config(model_dir, run_dir, *common, "training.steps=1", "checkpoint.resume=never"))
    assert wandb_run(run_dir)[0] != run_id
