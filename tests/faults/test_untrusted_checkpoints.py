"""A checkpoint folder someone handed you is data, not code: a trainer state or a DCP ``.metadata`` whose
pickle would call something (here ``exec``, creating a marker file) is refused by ``rlite train``,
``rlite eval`` and ``rlite info`` with the file named, even under a manifest rewritten to match it, and
nothing runs. A checkpoint without a manifest is refused unless ``checkpoint.verify=false``; a model
whose keys or shapes differ from the checkpoint's is refused whatever ``checkpoint.resume_mismatch``
says."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rlite.config import ConfigError
from rlite.run.checkpoint import MANIFEST, list_checkpoints
from rlite.run.loop import run_training
from rlite.testing import tiny_config
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def cli_args(model_dir, run_dir) -> list[str]:
    return [
        f"model.path={model_dir}", "data.task=addition", "data.num_train=64", "data.num_eval=8",
        "training.steps=3", "training.micro_batch_size=8", "training.eval_every=0", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=4", f"logging.run_dir={run_dir}",
        "logging.progress_bar=false", "logging.plot=false", "logging.loggers=[jsonl]", "checkpoint.export_hf=false",
        "checkpoint.every=1", "checkpoint.resume=auto",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trained(model_dir, tmp_path_factory):
    """A run folder with the checkpoints of steps 1 and 2 (a resume trains step 3)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run_training(tiny_config(model_dir, run_dir, "training.steps=2", "checkpoint.every=1", "checkpoint.keep_last=2"))
    return run_dir


class Payload:
    """Unpickling it runs ``exec``: it creates the marker file."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def rewrite_manifest(checkpoint) -> None:
    """What whoever tampers with a folder does: a manifest that matches the files as they now are."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for name in manifest["files"]:
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def plant_in_trainer_state(checkpoint, marker) -> str:
    file = checkpoint / "trainer_state_rank0.pt"
    state = torch.load(file, weights_only=False)  # the test's own file
    state["sampler"] = {"payload": Payload(marker), **state["sampler"]}
    torch.save(state, file)
    return file.name


def plant_in_dcp_metadata(checkpoint, marker) -> str:
    file = checkpoint / ".metadata"
    metadata = pickle.loads(file.read_bytes())  # the test's own file
    metadata.planner_data = Payload(marker)
    file.write_bytes(pickle.dumps(metadata))
    return file.name


@pytest.mark.parametrize("plant", [plant_in_trainer_state, plant_in_dcp_metadata], ids=["trainer state", "DCP metadata"])
@pytest.mark.parametrize("command", ["train", "eval", "info"])
def test_a_checkpoint_whose_pickle_would_run_code_is_refused_naming_the_file_and_nothing_runs(
    tmp_path, model_dir, trained, plant, command, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    latest = list_checkpoints(run_dir / "checkpoints")[-1]
    marker = tmp_path / "code-ran"
    # building the file must not run the payload either; then the manifest vouches for it
    planted = plant(latest, marker)
    rewrite_manifest(latest)
    assert not marker.exists()
    config = tmp_path / "run.yaml"
    config.write_text("training:\n  seed: 0\n")
    argv = ["info", str(run_dir)] if command == "info" else [command, str(config), *cli_args(model_dir, run_dir)]
    assert main(argv) == 2
    assert not marker.exists(), "the checkpoint's pickle ran code"
    err = capsys.readouterr().err
    assert f"{latest / planted}" in err and "exec" in err and "rlite refuses it (nothing was executed)" in err
    # refused, never skipped for the intact step-1 checkpoint: the run did not go on
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000001", "step_00000002"]


COMMON = ("training.steps=4", "checkpoint.every=1", "checkpoint.keep_last=2", "checkpoint.export_hf=true",
          "training.lr=1e-2")


def test_a_checkpoint_without_a_manifest_is_refused_unless_verify_is_off_and_a_damaged_one_then_falls_back(
    tmp_path, model_dir, caplog
):
    run_training(tiny_config(model_dir, tmp_path / "straight", *COMMON))
    run_dir = tmp_path / "run"
    run_training(tiny_config(model_dir, run_dir, *COMMON[1:], "training.steps=3"))
    checkpoints = list_checkpoints(run_dir / "checkpoints")
    for checkpoint in checkpoints:
        (checkpoint / MANIFEST).unlink()
    with pytest.raises(ConfigError, match=f"step_00000003 has no {MANIFEST}.*checkpoint.verify=false"):
        run_training(tiny_config(model_dir, run_dir, *COMMON, "checkpoint.resume=auto"))
    shard = next(checkpoints[-1].glob("*.distcp"))  # a torn write of the newest: its shard cut short
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with caplog.at_level(logging.INFO, logger="rlite"):
        run_training(tiny_config(model_dir, run_dir, *COMMON, "checkpoint.resume=auto", "checkpoint.verify=false"))
    skipped = [r.getMessage() for r in caplog.records if "damaged and skipped" in r.getMessage()]
    assert len(skipped) == 1 and "step_00000003" in skipped[0] and f"{shard.name} has" in skipped[0]
    assert any("resumed from" in r.getMessage() and "step_00000002" in r.getMessage() for r in caplog.records)
    a = load_file(tmp_path / "straight" / "hf_model" / "model.safetensors")
    b = load_file(run_dir / "hf_model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("other_model", "named"),
    [({"layers": 2}, "keys only in the checkpoint: model.lm.model.layers.2."),
     ({"hidden": 48}, "shapes differ: model.lm.")],
    ids=["fewer layers", "wider"],
)  # fmt: skip
def test_a_checkpoint_of_another_model_is_refused_even_with_resume_mismatch_allow(tmp_path, other_model, named):
    four_layers = build_tiny_model_dir(tmp_path / "four", layers=4)
    other = build_tiny_model_dir(tmp_path / "other", **{"layers": 4, **other_model})
    run_dir = tmp_path / "run"
    run_training(tiny_config(four_layers, run_dir, "training.steps=1", "checkpoint.save_final=true"))
    with pytest.raises(ConfigError) as refused:
        run_training(tiny_config(other, run_dir, "training.steps=2", "checkpoint.resume=auto",
                                 "checkpoint.resume_mismatch=allow"))  # fmt: skip
    message = str(refused.value)
    assert "holds the state of another model than this run's" in message and named in message, message


def test_the_trainer_state_of_older_checkpoints_loads_and_its_numpy_rng_state_is_put_back(tmp_path):
    import numpy as np

    from rlite.run.checkpoint import rng_state, set_rng_state
    from rlite.run.safe_pickle import load_trainer_state

    np.random.seed(3)
    older = dict(rng_state(), numpy=np.random.get_state())  # before: numpy's own tuple, with its array
    torch.save({"step": 1, "rng": older}, tmp_path / "older.pt")
    expected = np.random.rand(3)
    np.random.seed(4)
    set_rng_state(load_trainer_state(tmp_path / "older.pt")["rng"])
    assert np.array_equal(np.random.rand(3), expected)
    torch.save({"step": 1, "rng": rng_state()}, tmp_path / "now.pt")  # now: plain ints, nothing from numpy
    assert not torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "now.pt")


def test_dcp_metadata_that_points_outside_the_checkpoint_is_refused(tmp_path, trained):
    from rlite.run.checkpoint import verify_checkpoint
    from rlite.run.safe_pickle import UnsafeCheckpointError

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    latest = list_checkpoints(run_dir / "checkpoints")[-1]
    metadata = pickle.loads((latest / ".metadata").read_bytes())  # the test's own file
    entry = next(iter(metadata.storage_data.values()))
    entry.relative_path = "../../../secret.distcp"
    (latest / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(latest)
    with pytest.raises(UnsafeCheckpointError, match=r"points at \.\./\.\./\.\./secret.distcp, outside the checkpoint"):
        verify_checkpoint(latest)
