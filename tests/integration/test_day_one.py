"""What a newcomer meets on day one, run the way they run it (``rlite train CONFIG k=v``): the exported
model's generation config, the run folder and resuming, and bad paths reported before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import main

TINY_RUN = [
    "data.task=addition", "data.num_train=16", "data.num_eval=0", "training.steps=1", "training.eval_every=0",
    "training.micro_batch_size=8", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=3", "logging.progress_bar=false", "logging.plot=false", "logging.loggers=jsonl",
    "checkpoint.export_hf=false",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def write_config(path: Path, model: Path | str, **sections: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({"model": {"path": str(model)}, **sections}))
    return path


def test_export_keeps_the_source_models_generation_config(tmp_path, model_dir):
    source = tmp_path / "source"
    source.mkdir()
    for file in model_dir.iterdir():
        (source / file.name).write_bytes(file.read_bytes())
    generation = json.loads((source / "generation_config.json").read_text())
    generation.update(do_sample=True, temperature=0.6, top_k=5, max_new_tokens=77)
    (source / "generation_config.json").write_text(json.dumps(generation))
    config = write_config(tmp_path / "gen.yaml", source, logging={"run_dir": str(tmp_path / "run")})

    assert main(["train", str(config), *TINY_RUN, "checkpoint.export_hf=true", "checkpoint.save_final=false"]) == 0
    exported = json.loads((tmp_path / "run" / "hf_model" / "generation_config.json").read_text())
    assert exported.get("use_cache", True) is True  # the KV cache is on for generate()
    for key in ("do_sample", "temperature", "top_k", "max_new_tokens", "eos_token_id"):
        assert exported[key] == generation[key], key
    assert json.loads((tmp_path / "run" / "hf_model" / "config.json").read_text())["use_cache"] is True


@pytest.mark.parametrize(
    ("missing", "expected"),
    [
        ("{tmp}/nope", "model.path: folder {missing!r} does not exist"),
        ("{tmp}/models/qwen-0.5b", "model.path: folder {missing!r} does not exist"),
        # a hub repo id: the tests run offline (conftest), so it cannot be downloaded
        ("someone/no-such-model", "model.path: {missing!r} is not a local folder (relative paths are read from the "
                                  "working folder"),
    ],
)
def test_a_missing_model_folder_is_named(tmp_path, capsys, missing, expected):
    (tmp_path / "models").mkdir()
    missing = missing.format(tmp=tmp_path)
    config = write_config(tmp_path / "run.yaml", missing, logging={"run_dir": str(tmp_path / "run")})
    assert main(["train", str(config), *TINY_RUN]) == 2
    err = capsys.readouterr().err
    assert "rlite train: error: " + expected.format(missing=missing) in err, err
    assert "Repo id" not in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing written for a run that cannot start


def test_missing_data_files_are_found_before_anything_loads(tmp_path, model_dir, capsys, monkeypatch):
    import rlite.run.build as build

    def load_tokenizer(cfg):
        raise AssertionError("the tokenizer loaded before the data files were checked")

    monkeypatch.setattr(build, "load_tokenizer", load_tokenizer)
    config = write_config(tmp_path / "run.yaml", model_dir, logging={"run_dir": str(tmp_path / "run")})
    present = tmp_path / "train.jsonl"
    present.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    for files, expected in [
        (str(tmp_path / "train-*.parquet"), f"data.train_files: '{tmp_path}/train-*.parquet' matches no file"),
        (f"[{present}, {tmp_path}/more.jsonl]", f"data.train_files: '{tmp_path}/more.jsonl' does not exist"),
    ]:
        assert main(["train", str(config), *TINY_RUN, f"data.train_files={files}"]) == 2
        assert expected in capsys.readouterr().err
    assert main(["train", str(config), *TINY_RUN, f"data.train_files={present}",
                 f"data.eval_files={tmp_path}/eval.jsonl"]) == 2  # fmt: skip
    assert f"data.eval_files: '{tmp_path}/eval.jsonl' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_each_config_file_gets_its_own_run_folder(tmp_path, capsys, monkeypatch):
    import yaml

    monkeypatch.chdir(tmp_path)
    for name in ("grpo_small", "rloo_big"):
        write_config(tmp_path / f"{name}.yaml", "some/model", data={"task": "addition"})
        assert main(["config", f"{name}.yaml"]) == 0
        assert yaml.safe_load(capsys.readouterr().out)["logging"]["run_dir"] == f"runs/{name}"
    assert main(["config", "grpo_small.yaml", "logging.run_dir=elsewhere"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["logging"]["run_dir"] == "elsewhere"


def test_resuming_a_run_with_another_algorithm_is_refused_unless_allowed(tmp_path, model_dir, capsys):
    from rlite.run.checkpoint import list_checkpoints
    from rlite.testing import read_jsonl

    run_dir = tmp_path / "shared"
    first = write_config(tmp_path / "first.yaml", model_dir, logging={"run_dir": str(run_dir)})
    assert main(["train", str(first), *TINY_RUN, "checkpoint.save_final=true"]) == 0
    saved_config = (run_dir / "config.yaml").read_text()
    assert "name: grpo" in saved_config and len(list_checkpoints(run_dir / "checkpoints")) == 1

    # another config pointed at the same folder: another estimator and another model dtype
    second = write_config(tmp_path / "second.yaml", model_dir, logging={"run_dir": str(run_dir)},
                          algorithm={"advantage": "rloo"})  # fmt: skip
    capsys.readouterr()
    assert main(["train", str(second), *TINY_RUN, "training.steps=2", "model.dtype=bfloat16"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("rlite train: error: checkpoint.resume: ") and "another model or algorithm" in line
    assert "model.dtype: 'float32' then, 'bfloat16' now" in line
    assert "algorithm.advantage.name: 'grpo' then, 'rloo' now" in line
    assert "checkpoint.resume_mismatch=allow" in line
    assert (run_dir / "config.yaml").read_text() == saved_config  # the other run's record is untouched

    # asked for explicitly, it resumes from the checkpoint (step 1) and trains step 2
    assert main(["train", str(second), *TINY_RUN, "training.steps=2", "checkpoint.resume_mismatch=allow"]) == 0
    assert [row["step"] for row in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    assert "name: rloo" in (run_dir / "config.yaml").read_text()


def test_accuracy_counts_right_answers_not_positive_rewards(tmp_path, model_dir, monkeypatch):
    """A shaped reward gives every completion 0.5 on top of exact match: every reward is > 0, but only
    right answers count, so accuracy = mean reward - 0.5 exactly (and not 1)."""
    from rlite.testing import read_jsonl

    (tmp_path / "shaping_for_test.py").write_text("def half(completion, sample):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(tmp_path / "shaped.yaml", model_dir, logging={"run_dir": str(tmp_path / "run")},
                          rewards=["exact_match", {"name": "python", "args": {"function": "shaping_for_test:half"}}])
    assert main(["train", str(config), *TINY_RUN, "data.num_eval=8", "training.eval_max_prompts=8"]) == 0
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in rows if "eval/greedy_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1]
    for row in evals:
        for mode in ("greedy", "sampled"):
            assert row[f"eval/{mode}_reward"] >= 0.5
            assert row[f"eval/{mode}_accuracy"] == pytest.approx(row[f"eval/{mode}_reward"] - 0.5, abs=1e-6)
            assert row[f"eval/{mode}_accuracy"] < 1.0  # "reward > 0" would say 1.0
    (step,) = [r for r in rows if "reward/accuracy" in r]
    assert step["reward/accuracy"] == pytest.approx(step["reward/mean"] - 0.5, abs=1e-6)
