"""A checkpoint whose trainer state unpickles as data but is not a state rlite wrote (a tensor view past its
storage, a list nested 200,000 deep, an int as the whole state), under a manifest that vouches for it, is
damage: ``rlite train`` resumes from the older intact checkpoint, ``rlite chat`` and ``rlite eval`` refuse
it (exit status 2) naming the file, and ``rlite info`` reports it. Files moved between checkpoints under a
rewritten manifest are caught too: each manifest checksum, and the trainer state, is bound to its step."""

from __future__ import annotations

import io
import json
import logging
import shutil
from pathlib import Path

import pytest

from rlite.run.checkpoint import list_checkpoints
from rlite.testing import (
    MALFORMED_TRAINER_STATES,
    read_jsonl,
    rewrite_manifest,
    write_malformed_trainer_state,
)
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import main

TRAIN_ARGS = [
    "training.eval_every=0", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4",
    "training.micro_batch_size=8", "training.lr=1e-2", "logging.loggers=[jsonl]", "logging.plot=false",
    "logging.progress_bar=false", "checkpoint.every=1", "checkpoint.keep_last=2", "checkpoint.export_hf=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """A 2-step run with the checkpoints of steps 1 and 2, and its config."""
    tmp = tmp_path_factory.mktemp("finished")
    model_dir = build_tiny_model_dir(tmp / "tiny")
    config = tmp / "run.yaml"
    config.write_text(f"model: {{path: {model_dir}}}\ndata: {{task: addition, num_train: 32, num_eval: 4}}\n")
    assert main(["train", str(config), *TRAIN_ARGS, "training.steps=2", f"logging.run_dir={tmp / 'run'}",
                 "checkpoint.resume=never"]) == 0  # fmt: skip
    return tmp / "run", config


@pytest.fixture
def run_copy(finished, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished[0], run_dir)
    return run_dir


def damage_latest(run_dir: Path, kind: str) -> Path:
    latest = list_checkpoints(run_dir / "checkpoints")[-1]
    write_malformed_trainer_state(latest / "trainer_state_rank0.pt", kind)
    rewrite_manifest(latest)  # the manifest vouches for it: only its structure gives it away
    return latest / "trainer_state_rank0.pt"


def cli(finished, run_dir: Path, *extra: str) -> list[str]:
    return [str(finished[1]), *TRAIN_ARGS, f"logging.run_dir={run_dir}", "checkpoint.resume=auto", *extra]


@pytest.mark.parametrize("kind", MALFORMED_TRAINER_STATES)
def test_train_resumes_from_the_older_checkpoint_past_a_malformed_trainer_state(run_copy, finished, kind, caplog,
                                                                                capsys):  # fmt: skip
    damaged = damage_latest(run_copy, kind)
    with caplog.at_level(logging.WARNING, logger="rlite"):
        assert main(["train", *cli(finished, run_copy, "training.steps=3")]) == 0, capsys.readouterr().err[-2000:]
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert f"checkpoint step_00000002 is damaged and skipped: {damaged.name}" in warnings
    assert [row["step"] for row in read_jsonl(run_copy / "metrics.jsonl")] == [0, 1, 2, 3]  # redone from step 1


@pytest.mark.parametrize("kind", MALFORMED_TRAINER_STATES)
def test_chat_eval_and_info_name_a_malformed_latest_trainer_state(run_copy, finished, tmp_path, monkeypatch, capsys,
                                                                  kind):  # fmt: skip
    damaged = damage_latest(run_copy, kind)
    monkeypatch.setattr("sys.stdin", io.StringIO("12+3=\n"))
    assert main(["chat", str(run_copy), "--max-new-tokens", "2"]) == 2  # no export: the latest checkpoint
    err = capsys.readouterr().err
    assert f"the latest checkpoint {damaged.parent} is damaged: {damaged.name}" in err and "Traceback" not in err
    assert main(["eval", *cli(finished, run_copy)]) == 2
    assert f"the latest checkpoint {damaged.parent} is damaged: {damaged.name}" in capsys.readouterr().err
    assert main(["info", str(run_copy)]) == 0
    assert f"DAMAGED: {damaged.name}" in capsys.readouterr().out
    assert main(["info", str(run_copy), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["damaged"]
    assert list(report) == ["step_00000002"] and report["step_00000002"].startswith(damaged.name)


def swap(name: str, first: Path, second: Path) -> None:
    shutil.move(first / name, first / "swapping")
    shutil.move(second / name, first / name)
    shutil.move(first / "swapping", second / name)


def checksum_tool_manifest(checkpoint: Path) -> None:
    """A manifest recomputed by a checksum tool (``sha256sum`` of each file's bytes), which knows nothing of
    what rlite binds the checksums to; the rest of the manifest kept."""
    import hashlib

    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["__0_0.distcp", "trainer_state_rank0.pt", ".metadata"])
def test_files_swapped_between_checkpoints_under_recomputed_checksums_are_not_resumed(run_copy, finished, capsys, name):
    """Before, the resume loaded step 2's weights with step 1's optimizer or state, silently. Both checkpoints
    are mixed now, so the resume refuses rather than resume either."""
    first, second = list_checkpoints(run_copy / "checkpoints")
    swap(name, first, second)
    checksum_tool_manifest(first)
    checksum_tool_manifest(second)
    assert main(["train", *cli(finished, run_copy, "training.steps=3")]) == 2
    err = capsys.readouterr().err
    # (every file mismatches: the tool's checksums are of the bytes alone; the first one listed is named)
    assert "every checkpoint in" in err and "step_00000002: .metadata does not match the checksum written with it" in err


@pytest.mark.parametrize(("name", "tells"), [("trainer_state_rank0.pt", "holds the state of step 1, not of step 2"),
                                             (".metadata", "was written for step_00000001")])  # fmt: skip
def test_a_trainer_state_or_metadata_of_another_step_is_caught_under_a_manifest_in_rlites_own_scheme(
    run_copy, finished, capsys, name, tells
):
    """Whoever knows the manifest's scheme can make it vouch for a swapped shard (the manifest guards against
    torn writes, bit rot and careless copies, not against whoever writes the folder); the trainer state and the
    DCP metadata carry their step themselves."""
    first, second = list_checkpoints(run_copy / "checkpoints")
    swap(name, first, second)
    rewrite_manifest(first)
    rewrite_manifest(second)
    assert main(["train", *cli(finished, run_copy, "training.steps=3")]) == 2
    err = capsys.readouterr().err
    assert f"step_00000002: {name} {tells}" in err
