"""The transformers engine in a spawned process: zero-copy weight sync, failures surface as EngineError."""

from __future__ import annotations

import os
import signal
import types

import pytest
import torch

from rlite.engines.base import EngineError, SamplingParams
from rlite.plugins.fsdp2.weights import iter_full_tensors
from rlite.plugins.transformers.process import ProcessEngine

torch.set_num_threads(1)

START_TIMEOUT_S = 180.0  # importing transformers in a fresh process is slow on a loaded machine
PAD, EOS = 0, 1


def _tiny_model(seed: int = 0):
    from rlite.testing import tiny_qwen2

    return tiny_qwen2(64, tie=True, seed=seed)


def _bare_engine_kwargs() -> dict:
    """A child without transformers, for the tests that only need a live process.

    (The factory must be importable in the child: test modules are not, under --import-mode=importlib.)
    """
    return dict(
        engine_factory=types.SimpleNamespace,
        factory_kwargs={"model": torch.nn.Linear(4, 4), "weight_version": 0},
    )


def _perturb(model: torch.nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen2")
    _tiny_model().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = ProcessEngine(
        model_dir, pad_token_id=PAD, eos_token_ids=[EOS], timeout_s=60.0, start_timeout_s=START_TIMEOUT_S
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def trainer_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def _assert_engine_equals(engine: ProcessEngine, model: torch.nn.Module) -> None:
    got = dict(engine.named_weights())
    expected = dict(model.named_parameters())
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_weights_are_bitwise_equal_after_every_sync_and_shared(engine, trainer_model):
    for version in (1, 2, 3):
        _perturb(trainer_model, version)
        stats = engine.update_weights(iter_full_tensors(trainer_model, lora_merge=False), version)
        assert stats.first_sync is (version == 1)
        assert engine.weight_version == version
        _assert_engine_equals(engine, trainer_model)
    # zero-copy: every engine parameter now lives in a shared-memory bucket
    shared = engine._call("shared_weights")
    assert set(shared) == {n for n, _ in trainer_model.named_parameters()}
    completions = engine.generate([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert [c.weight_version for c in completions] == [3, 3]


def test_generation_matches_the_in_process_engine(engine, trainer_model):
    from rlite.plugins.transformers.engine import TransformersEngine

    _perturb(trainer_model, 10)
    engine.update_weights(iter_full_tensors(trainer_model, lora_merge=False), 10)
    local = TransformersEngine(trainer_model, pad_token_id=PAD, eos_token_ids=[EOS])
    prompts = [[5, 6, 7, 8], [9, 10], [11]]
    for params in (
        SamplingParams(n=3, max_new_tokens=8, seed=1234),
        SamplingParams(n=2, max_new_tokens=6, temperature=0.7, top_k=10, seed=7),
        SamplingParams(n=1, max_new_tokens=5, greedy=True),
    ):
        remote = engine.generate(prompts, params)
        here = local.generate(prompts, params)
        assert [c.token_ids for c in remote] == [c.token_ids for c in here]
        assert [c.finish_reason for c in remote] == [c.finish_reason for c in here]
        for a, b in zip(remote, here):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)


def test_version_mismatch_raises_then_a_clean_sync_recovers(engine, trainer_model):
    engine._sender._debug_version_offset = 1
    try:
        with pytest.raises(EngineError, match="version mismatch"):
            engine.update_weights(iter_full_tensors(trainer_model, lora_merge=False), 20)
    finally:
        engine._sender._debug_version_offset = 0
    with pytest.raises(EngineError, match="incomplete weights"):
        engine.generate([[5]], SamplingParams(max_new_tokens=2, seed=0))
    _perturb(trainer_model, 21)
    engine.update_weights(iter_full_tensors(trainer_model, lora_merge=False), 21)
    _assert_engine_equals(engine, trainer_model)


def test_checksum_mismatch_raises(engine, trainer_model):
    engine._sender._debug_corrupt = True
    with pytest.raises(EngineError, match="checksum mismatch in bucket 0"):
        engine.update_weights(iter_full_tensors(trainer_model, lora_merge=False), 30)
    engine.update_weights(iter_full_tensors(trainer_model, lora_merge=False), 31)
    _assert_engine_equals(engine, trainer_model)


def test_a_missing_parameter_is_refused(engine, trainer_model):
    """Against the layout of the first sync: one is done here, so the test does not depend on the module's
    other tests having run first (alone, the engine's stale-parameter check would refuse instead)."""
    named = list(iter_full_tensors(trainer_model, lora_merge=False))
    engine.update_weights(named, 39)
    with pytest.raises(EngineError, match="tensors, the first sync had"):
        engine.update_weights(named[:-1], 40)
    engine.update_weights(named, 41)


def _bare_engine(timeout_s: float) -> ProcessEngine:
    """An engine process with no model, for the fault tests."""
    return ProcessEngine(
        ".", pad_token_id=PAD, eos_token_ids=[EOS], timeout_s=timeout_s, start_timeout_s=START_TIMEOUT_S,
        **_bare_engine_kwargs(),
    )


def test_a_hung_engine_is_detected_within_the_timeout_and_killed():
    eng = _bare_engine(timeout_s=2.0)
    try:
        with pytest.raises(EngineError, match="did not answer within the timeout of 2 s"):
            eng._call("_debug_hang", 3600)
        assert not eng._process.is_alive()
        with pytest.raises(EngineError, match="engine process is gone"):
            eng.release_memory()
    finally:
        eng.shutdown()


def test_a_killed_engine_is_detected():
    eng = _bare_engine(timeout_s=60.0)
    try:
        os.kill(eng.pid, signal.SIGKILL)
        with pytest.raises(EngineError, match="died \\(exit code -9, killed by signal 9\\)"):
            eng.generate([[1, 2]], SamplingParams())
    finally:
        eng.shutdown()
    assert not eng._process.is_alive()


def test_an_engine_that_fails_to_start_says_why():
    with pytest.raises(EngineError, match="failed to start(.|\n)*FileNotFoundError(.|\n)*no-model-here"):
        ProcessEngine(
            ".",
            pad_token_id=PAD,
            eos_token_ids=[EOS],
            timeout_s=60.0,
            start_timeout_s=START_TIMEOUT_S,
            engine_factory=open,
            factory_kwargs={"file": "/nonexistent/no-model-here"},
        )
