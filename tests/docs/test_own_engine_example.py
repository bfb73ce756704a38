"""The out-of-process engine of ``examples/own_engine/own_engine.py``, fed by the public weight-sync kit
(``rlite.sync``) from the real FSDP2 backend, as ``docs/weight_sync.md`` ("Feeding your own engine")
shows it: after every sync the engine process holds the trainer's weights bitwise, reports the sync's
version and the trainer's checksum, and generates what the trainer's weights generate."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from rlite.testing import fixed_batch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "own_engine"
DOC = ROOT / "docs" / "weight_sync.md"


@pytest.fixture
def own_engine(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))  # spawn hands sys.path on: the engine process finds it too
    import own_engine

    return own_engine


@pytest.fixture
def world_of_one():
    from rlite.distributed import init_distributed, shutdown_distributed

    ctx = init_distributed()
    yield ctx
    shutdown_distributed(ctx)


def _train_one_step(backend) -> None:
    from rlite.algorithms import AdvantageInput
    from rlite.plugin_manager import build_plugin_manager
    from rlite.rollout import TrainTargets
    from rlite.stages.update import LossSpec, update_policy
    from rlite.training.backend import ForwardSpec

    pm = build_plugin_manager(autoload=False)
    grpo, ppo_clip = pm.registry("advantage_estimator").get("grpo"), pm.registry("policy_loss").get("ppo_clip")
    batch = fixed_batch(num_prompts=2, samples=4, prompt_len=6, max_len=7, vocab=96)
    advantages, returns = grpo.implementation(AdvantageInput(batch.scores, batch.group_ids, batch.response_mask),
                                              grpo.config_cls())  # fmt: skip
    update_policy(
        backend, batch, TrainTargets(advantages, returns, batch.response_mask.clone()), ForwardSpec(micro_batch_size=8, temperature=1.0, chunk_size=16, exact_layout=False),
        LossSpec(ppo_clip.implementation, ppo_clip.config_cls(), "token-mean", 7.0, None, 0.0, 0.0),
        minibatches=1, epochs=1, dp_size=1, dp_group=None,
    )  # fmt: skip


def test_an_engine_process_of_your_own_receives_the_fsdp2_backends_weights_bitwise(tmp_path, own_engine,
                                                                                     world_of_one):  # fmt: skip
    from transformers import AutoModelForCausalLM

    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.plugins.fsdp2.backend import FSDP2Backend
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = str(build_tiny_model_dir(tmp_path / "tiny", hidden=32, layers=2))
    torch.manual_seed(0)
    backend = FSDP2Backend.build(ModelConfig(path=model_dir), ParallelismConfig(), TrainingConfig(lr=1e-2),
                                 torch.device("cpu"), total_optimizer_steps=2)  # fmt: skip
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # the trainer's weights, to generate from
    engine = own_engine.OwnEngine(model_dir, bucket_bytes=64 << 10)  # several buckets for this model
    try:
        assert engine.generate([1, 2, 3], 2).startswith("refusing to generate")  # no weights yet
        checksums = []
        for version in (1, 2, 3):
            if version > 1:
                _train_one_step(backend)
            stats = engine.update_weights(backend.full_weights(), version)
            assert stats.first_sync == (version == 1) and stats.buckets > 1

            trainer = {name: t.detach().clone() for name, t in backend.full_weights()}
            received = engine.call("weights")
            assert received.keys() == trainer.keys()
            assert all(torch.equal(received[name], trainer[name]) for name in trainer)
            assert engine.report() == (version, own_engine.weights_checksum(trainer.items()))
            checksums.append(engine.report()[1])

            reference.load_state_dict(trainer, strict=True)
            prompt = [5, 17, 42, 8]
            assert engine.generate(prompt, 5) == own_engine.greedy(reference, prompt, 5)
        assert len(set(checksums)) == 3  # the steps changed the weights, and every sync carried the change
    finally:
        engine.shutdown()
        backend.close()
    assert not engine.process.is_alive()


def test_a_corrupted_bucket_is_refused_and_the_next_sync_is_clean(tmp_path, own_engine) -> None:
    from transformers import AutoModelForCausalLM

    from rlite.api import EngineError
    from rlite.tokenizer import build_tiny_model_dir

    model_dir = str(build_tiny_model_dir(tmp_path / "tiny", hidden=32, layers=2))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    engine = own_engine.OwnEngine(model_dir)
    try:
        engine.update_weights(named, 1)
        engine.sender._debug_corrupt = True
        with pytest.raises(EngineError, match="checksum mismatch in bucket 0 v2"):
            engine.update_weights(named, 2)
        assert engine.generate([1, 2], 1).startswith("refusing to generate: weight sync v2 failed")
        engine.update_weights(named, 3)
        assert engine.report() == (3, own_engine.weights_checksum(named))
    finally:
        engine.shutdown()


def test_the_docs_show_the_examples_own_code() -> None:
    """Every line of the code blocks under "Feeding your own engine" is a line of the example."""
    section = DOC.read_text().split("## Feeding your own engine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks
    example = {line.strip() for line in (EXAMPLE / "own_engine.py").read_text().splitlines()}
    shown = [line.strip() for block in blocks for line in block.splitlines()]
    assert [line for line in shown if line and line != "..." and line not in example] == []


def test_the_example_runs_as_a_script(tmp_path) -> None:
    import subprocess

    from rlite.tokenizer import build_tiny_model_dir

    model_dir = build_tiny_model_dir(tmp_path / "tiny", hidden=32, layers=2)
    done = subprocess.run([sys.executable, str(EXAMPLE / "own_engine.py"), str(model_dir)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert re.findall(r"^v(\d): .* \(equal to the trainer's\)", done.stdout, re.M) == ["1", "2"]
