"""The transformers engine reads no weights: its model is built from the config (parameters on the
meta device) and the trainer's first sync gives every parameter, so a run reads the checkpoint once."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlite.engines.base import EngineError, SamplingParams
from rlite.hf_models import skeleton_causal_lm
from rlite.plugins.transformers.engine import TransformersEngine
from rlite.tokenizer import build_tiny_model_dir

PARAMS = SamplingParams(n=2, max_new_tokens=5, seed=11)
PROMPTS = [[40, 41, 42], [43, 44]]


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True))


@pytest.fixture
def count_from_pretrained(monkeypatch):
    """Every ``from_pretrained`` of a transformers model in this process (what reads a checkpoint)."""
    from transformers import PreTrainedModel

    calls: list[str] = []
    original = PreTrainedModel.from_pretrained.__func__

    def counting(cls, path, *args, **kwargs):
        calls.append(str(path))
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(counting))
    return calls


def reference_engine(model_dir: str) -> TransformersEngine:
    from transformers import AutoModelForCausalLM

    return TransformersEngine(AutoModelForCausalLM.from_pretrained(model_dir), pad_token_id=0, eos_token_ids=[1])


def test_skeleton_has_no_weights_keeps_ties_and_computes_buffers(tied_model_dir, count_from_pretrained):
    model = skeleton_causal_lm(tied_model_dir)
    assert count_from_pretrained == []
    assert all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tied weights stay one parameter"
    reference = reference_engine(tied_model_dir).model
    buffers = dict(reference.named_buffers())
    assert {n for n, _ in model.named_buffers()} == set(buffers) != set()
    for name, buffer in model.named_buffers():  # the rotary embedding's, which no sync carries
        assert not buffer.is_meta and torch.equal(buffer, buffers[name]), name


def test_generate_before_the_first_sync_is_refused(tied_model_dir):
    engine = TransformersEngine(skeleton_causal_lm(tied_model_dir), pad_token_id=0, eos_token_ids=[1])
    with pytest.raises(EngineError, match="a complete weight sync must come before the first generate"):
        engine.generate(PROMPTS, PARAMS)


@pytest.mark.parametrize("share_weights", [True, False], ids=["shared", "copied"])
def test_a_run_reads_the_checkpoint_once_and_the_engine_samples_the_synced_weights(
    tmp_path, tied_model_dir, count_from_pretrained, share_weights
):
    from rlite.distributed import shutdown_distributed
    from rlite.plugin_manager import get_plugin_manager
    from rlite.run.build import build_run
    from rlite.testing import tiny_config

    cfg = tiny_config(tied_model_dir, tmp_path / "run", f"rollout.engine.args.share_weights={share_weights}")
    run = build_run(cfg, get_plugin_manager())  # builds the trainer and the engine, then syncs version 0
    try:
        assert count_from_pretrained == [tied_model_dir], "the trainer reads the checkpoint; the engine does not"
        engine = run.engine
        assert engine.weight_version == 0
        trainer = dict(run.policy.backend.full_weights())
        checkpoint = load_file(f"{tied_model_dir}/model.safetensors")
        params = dict(engine.model.named_parameters())
        assert set(params) <= set(trainer)
        for name, param in params.items():
            assert not param.is_meta and torch.equal(param, trainer[name]) and torch.equal(param, checkpoint[name]), name
        assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
        assert (engine.shared_bytes > 0) is share_weights
        # the first generate samples exactly what an engine loaded from the checkpoint samples
        expected = reference_engine(tied_model_dir).generate(PROMPTS, PARAMS)
        got = engine.generate(PROMPTS, PARAMS)
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        for a, b in zip(got, expected):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    finally:
        run.engine.shutdown()
        run.policy.backend.close()
        shutdown_distributed(run.ctx)


def test_the_spawned_engine_builds_without_weights_and_samples_the_synced_ones(tied_model_dir):
    from transformers import AutoModelForCausalLM

    from rlite.plugins.fsdp2.weights import iter_full_tensors
    from rlite.plugins.transformers.process import ProcessEngine

    trainer_model = AutoModelForCausalLM.from_pretrained(tied_model_dir).eval()
    with torch.no_grad():
        for p in trainer_model.parameters():  # weights the checkpoint does not hold
            p.add_(0.01)
    engine = ProcessEngine(tied_model_dir, pad_token_id=0, eos_token_ids=[1], timeout_s=60.0,
                           start_timeout_s=180.0, weights_from_sync=True)  # fmt: skip
    try:
        with pytest.raises(EngineError, match="before the first generate"):
            engine.generate(PROMPTS, PARAMS)
        engine.update_weights(iter_full_tensors(trainer_model, lora_merge=False), 1)
        got = dict(engine.named_weights())
        for name, param in trainer_model.named_parameters():
            assert torch.equal(got[name], param), name
        local = TransformersEngine(trainer_model, pad_token_id=0, eos_token_ids=[1])
        local.weight_version = 1
        assert [c.token_ids for c in engine.generate(PROMPTS, PARAMS)] == [c.token_ids for c in local.generate(PROMPTS, PARAMS)]
    finally:
        engine.shutdown()
