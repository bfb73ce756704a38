"""What a newcomer meets on day one, run the way they run it (``rlite train CONFIG k=v``): the exported
model's generation config, the run folder and resuming, and bad paths reported before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlite.cli import main
from rlite.tokenizer import build_tiny_model_dir

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
