"""rlite.testing.conformance: the built-in backend, both transformers engines (in-process and spawned), every
built-in estimator and policy loss pass the kit; a deliberately broken backend, engine, estimator and
loss each fail it with a ConformanceError that names the invariant and the plugin. (The docs' examples
pass it in tests/plugins/test_documented_contracts.py; the megatron backend in tests/megatron.)"""

from __future__ import annotations

import pytest
import torch

from rlite import hookimpl
from rlite.api import registered
from rlite.plugin_manager import build_plugin_manager, plugin_manager_in_use
from rlite.plugins import advantages as A
from rlite.plugins import policy_losses as L
from rlite.testing.conformance import (
    ConformanceError,
    check_backend,
    check_engine,
    check_estimator,
    check_policy_loss,
)

BACKEND_INVARIANTS = [
    "full_weights(): the Hugging Face model's names and shapes",
    "full_weights() before any step: the checkpoint's values",
    "log-probs equal a plain transformers forward",
    "scoring the same weights twice is bitwise equal",
    "first PPO ratio exactly 1 (training forward == pi_old)",
    "counts skipped steps (skipped_steps)",
    "a non-finite loss or gradient skips the step, counted, weights and LR unchanged",
    "a finite step changes the weights",
    "resume: the step after a checkpoint load is bitwise equal",
]
ENGINE_INVARIANTS = [
    "update_weights drains the stream and sets weight_version",
    "generate: n completions per prompt, grouped in order",
    "generate obeys max_new_tokens",
    "completions carry the synced weight version",
    "log-probs equal a teacher-forced forward of the synced weights",
    "generate: n completions per prompt, grouped in order",
    "generate obeys stop tokens (half the vocabulary)",
    "log-probs equal a teacher-forced forward of the synced weights (temperature 0.7)",
    "a second sync: drained, weight_version set",
    "completions after the second sync carry its version",
    "log-probs equal a teacher-forced forward of the synced weights after a sync of new weights",
    "samples with the new weights, not the old",
]

BUILTINS = build_plugin_manager(autoload=False)


@pytest.mark.parametrize("name", BUILTINS.registry("advantage_estimator").names())
def test_every_builtin_estimator_passes(name):
    report = check_estimator(BUILTINS.registry("advantage_estimator").get(name))
    assert "equals its float64 reference" in report.invariants()


@pytest.mark.parametrize("name", BUILTINS.registry("policy_loss").names())
def test_every_builtin_policy_loss_passes(name):
    report = check_policy_loss(BUILTINS.registry("policy_loss").get(name))
    assert "equals its float64 reference" in report.invariants()


def test_options_change_the_formula_checked():
    """Options reach both the implementation and the reference (a drifted option would show)."""
    report = check_estimator("grpo", A.GRPOConfig(singleton="raw", std_scope="batch"))
    assert report.plugin.startswith("'grpo'") and len(report.passed) == 4
    check_policy_loss("ppo_clip", L.PPOClipConfig(dual_clip_c=3.0, log_ratio_clamp=None))


def test_fsdp2_passes_by_its_registered_name(tmp_path):
    report = check_backend("fsdp2", workdir=tmp_path)
    assert report.invariants() == BACKEND_INVARIANTS
    assert "training_backend 'fsdp2'" in str(report)


@pytest.mark.parametrize("process", [False, True], ids=["in-process", "spawned-process"])
def test_the_transformers_engines_pass(tmp_path, process):
    entry = registered("rollout_engine", "transformers")
    report = check_engine(entry, entry.config_cls(process=process), workdir=tmp_path)
    assert report.invariants() == ENGINE_INVARIANTS


# -- broken plugins fail, naming the invariant ---------------------------------------------------------


class Wrapped:
    """A built-in backend or engine with one method replaced (composed through rlite.api.registered)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


class LogprobsOffByABit(Wrapped):
    def logprobs(self, batch, spec, *, with_entropy=False):
        logprobs, entropy = self.inner.logprobs(batch, spec, with_entropy=with_entropy)
        return logprobs + 1e-3 * batch.response_mask, entropy


class StepsWhateverTheNorm(Wrapped):
    """Steps the optimizer even when the loss or gradient is not finite."""

    def step(self, before_step=None, *, skip=False):
        norm = self.inner.clip_gradients()
        self.inner.optimizer_step()
        self.inner.zero_grad()
        return norm


class KeepsItsFirstWeights(Wrapped):
    """Drains every later sync and reports its version, but keeps sampling with the first weights."""

    def update_weights(self, named_tensors, version):
        if self.inner.weight_version == 0:
            return self.inner.update_weights(named_tensors, version)
        for _ in named_tensors:
            pass
        self.inner.weight_version = version


class ReadsAllButTheLast(Wrapped):
    def update_weights(self, named_tensors, version):
        iterator = iter(named_tensors)
        taken = []
        nxt = next(iterator, None)
        while nxt is not None:
            following = next(iterator, None)
            if following is None:
                break
            taken.append(nxt)
            nxt = following
        self.inner.update_weights(taken, version)


def broken_backend(wrapper):
    def factory(config, cfg, device, steps):
        return wrapper(registered("training_backend", "fsdp2").implementation(config, cfg, device, steps))

    return factory


@pytest.mark.parametrize("wrapper, invariant", [
    (LogprobsOffByABit, "log-probs equal a plain transformers forward"),
    (StepsWhateverTheNorm, "a non-finite loss or gradient skips the step, counted, weights and LR unchanged"),
])
def test_a_broken_backend_fails_naming_the_invariant(tmp_path, wrapper, invariant):
    with pytest.raises(ConformanceError) as failure:
        check_backend(broken_backend(wrapper), workdir=tmp_path)
    assert failure.value.invariant == invariant
    assert str(failure.value).startswith(f"'broken_backend.<locals>.factory' (unregistered): {invariant}: ")
    if wrapper is LogprobsOffByABit:
        assert "max |backend - transformers| = 1.00e-03" in failure.value.measured


@pytest.mark.parametrize("wrapper, invariant", [
    (KeepsItsFirstWeights, "log-probs equal a teacher-forced forward of the synced weights after a sync of new weights"),
    (ReadsAllButTheLast, "update_weights drains the stream and sets weight_version"),
])
def test_a_broken_engine_fails_naming_the_invariant(tmp_path, wrapper, invariant):
    def factory(model_config, tokenizer, rollout_config, cfg, context):
        inner = registered("rollout_engine", "transformers")
        return wrapper(inner.implementation(model_config, tokenizer, rollout_config, inner.config_cls(), context))

    with pytest.raises(ConformanceError) as failure:
        check_engine(factory, workdir=tmp_path)
    assert failure.value.invariant == invariant, failure.value
    if wrapper is ReadsAllButTheLast:  # the engine's own error is the measurement
        assert "raised EngineError: weight sync v1 left 1 engine parameters stale" in failure.value.measured


class BrokenAlgorithms:
    @hookimpl
    def register_advantage_estimators(self, register):
        def grpo_off_by_a_bit(batch, cfg):
            advantages, returns = A.grpo_advantages(batch, cfg)
            return advantages * 1.01, returns

        register("grpo_drifted", grpo_off_by_a_bit, A.GRPOConfig, reference=A.grpo_reference)
        register("grpo_unchecked", A.grpo_advantages, A.GRPOConfig)

    @hookimpl
    def register_policy_losses(self, register):
        def ppo_without_clamp(logprobs, old_logprobs, advantages, response_mask, cfg):
            ratio = (logprobs - old_logprobs).exp()  # the log-ratio of 30 overflows nothing, but is not clamped
            clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
            loss = torch.maximum(-advantages * ratio, -advantages * clipped) * response_mask
            return loss, {}

        register("ppo_unclamped", ppo_without_clamp, L.PPOClipConfig, reference=L.ppo_clip_reference)


def test_a_broken_estimator_and_loss_fail_naming_the_invariant():
    pm = build_plugin_manager(autoload=False)
    pm.register(BrokenAlgorithms(), name="broken")
    with plugin_manager_in_use(pm):  # names resolve through rlite.api.registered, as in a run
        with pytest.raises(ConformanceError, match=r"'grpo_drifted' \(plugin broken\): equals its float64 reference: "
                                                   r"max \|plugin - reference\| = "):
            check_estimator("grpo_drifted")
        with pytest.raises(ConformanceError, match="a float64 reference is registered: no reference registered"):
            check_estimator("grpo_unchecked")
        check_estimator("grpo_unchecked", reference=A.grpo_reference)  # or pass the reference yourself
        with pytest.raises(ConformanceError) as failure:
            check_policy_loss("ppo_unclamped")
    assert failure.value.invariant == "equals its float64 reference" and failure.value.plugin == "'ppo_unclamped' (plugin broken)"
