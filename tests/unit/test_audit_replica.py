"""What the audit's replica keeps of a config and what it replaces (and says so): the model's family,
data files that are not here, an engine that cannot start here, model-parallel sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlite.config import DataConfig, ModelConfig, load_config
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.audit import (
    build_replica_model,
    files_missing,
    model_family,
    replica_adjustments,
    synthetic_data,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("family, kwargs, moe, architecture", [
    ("qwen2", {}, False, "Qwen2ForCausalLM"),
    ("llama", {"family": "llama", "tie_word_embeddings": True}, False, "LlamaForCausalLM"),
    ("qwen3_moe", {"num_experts": 4}, True, "Qwen3MoeForCausalLM"),
])
def test_the_replica_has_the_models_family(tmp_path, family, kwargs, moe, architecture):
    model = build_tiny_model_dir(tmp_path / "real", **kwargs)
    found = model_family(ModelConfig(path=str(model)))
    assert (found.family, found.moe, found.tied, found.source) == (
        family, moe, kwargs.get("tie_word_embeddings", False), "config.json")
    replica, note = build_replica_model(found, tmp_path / "replica")
    config = json.loads((replica / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["tie_word_embeddings"] == found.tied
    assert note.startswith(f"{family} (config.json) -> tiny")


def test_a_model_that_is_not_here_is_unknown_and_replaced_by_a_qwen2_the_note_says_so(tmp_path):
    found = model_family(ModelConfig(path="Qwen/Qwen2.5-0.5B-Instruct"))  # a hub name, nothing cached
    assert (found.family, found.moe) == ("unknown", False)
    replica, note = build_replica_model(found, tmp_path / "replica")
    assert json.loads((replica / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert note == "model family unknown (not on this machine) -> tiny Qwen2 (no tiny replica of this family)"
    moe = model_family(ModelConfig(path="Qwen/Qwen1.5-MoE-A2.7B-Chat"))
    assert (moe.family, moe.moe, moe.source) == ("unknown", True, "MoE guessed from the name")


def test_files_missing(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    assert not files_missing(str(tmp_path / "a.jsonl")) and not files_missing(None)
    assert not files_missing([str(tmp_path / "*.jsonl")])
    assert files_missing([str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")])
    assert files_missing(str(tmp_path / "*.parquet"))


def test_synthetic_data_has_the_configured_keys_nested_where_dotted(tmp_path):
    train, held_out = synthetic_data(DataConfig(train_files="absent.parquet", prompt_key="extra.question",
                                                answer_key="reward_model.ground_truth"),
                                     tmp_path)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 32 and len(held_out.read_text().splitlines()) == 4
    for row in rows:
        a, b = row["extra"]["question"].removeprefix("What is ").removesuffix("?").split(" + ")
        assert row["reward_model"]["ground_truth"] == str(int(a) + int(b))


def test_the_gpu_recipes_are_adjusted_to_what_runs_here(tmp_path, monkeypatch):
    import torch

    from rlite.tools.matrix import matrix_plugins

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pm = matrix_plugins()  # the built-ins and megatron, whose registrations say what a replica must change
    cfg = load_config(CONFIGS / "moe_megatron_gpu.yaml", [], pm=False)
    overrides, notes = replica_adjustments(cfg, tmp_path, pm)
    assert overrides == [f"data.train_files={tmp_path / 'data' / 'train.jsonl'}",
                         f"data.eval_files={tmp_path / 'data' / 'eval.jsonl'}", "rollout.engine=transformers",
                         "parallelism.backend.args.expert_parallel=1"]
    assert notes[1] == "engine sglang cannot start here (needs its package and a GPU) -> transformers engine"
    assert notes[2] == "expert_parallel 8 -> 1"
    quickstart = load_config(CONFIGS / "quickstart.yaml", [], pm=False)
    assert replica_adjustments(quickstart, tmp_path, pm) == ([], [])  # files present, engine runs, nothing split


def test_an_unreadable_gguf_file_gives_an_unknown_family_with_the_reason(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")  # the magic bytes and nothing else
    found = model_family(ModelConfig(path=str(tmp_path), gguf_file="model.gguf"))
    assert found.family == "unknown" and found.source.startswith("model.gguf unreadable: ")
