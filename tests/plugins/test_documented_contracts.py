"""The backend and engine examples of docs/plugins.md satisfy the contracts: each trains two steps
of a real (tiny, CPU) run, checkpoints, resumes and exports, registered like a third-party plugin."""

from __future__ import annotations

import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from rlite.api import RolloutEngine, TrainingBackend, hookimpl
from rlite.plugin_manager import build_plugin_manager
from rlite.run.loop import run_training
from rlite.testing import read_jsonl, tiny_config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def example_defining(marker: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    (source,) = [b for b in blocks if marker in b]
    module = types.ModuleType(f"docs_{marker.split()[-1].rstrip(':')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(source, "docs/plugins.md", "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlite.tokenizer import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2)


class DigitsReward:
    """A reward that varies between samples of a random model (the share of digits), so advantages
    and gradients are not zero."""

    @hookimpl
    def register_reward_functions(self, register):
        register("digits_fraction", lambda completion, sample, cfg: sum(c.isdigit() for c in completion) / max(len(completion), 1))


def test_documented_backend_trains_resumes_and_exports(tmp_path, model_dir, monkeypatch) -> None:
    docs = example_defining("class SingleDeviceBackend(BackendBase):", monkeypatch)
    pm = build_plugin_manager(autoload=False)
    pm.register(docs, name="docs-backend")
    pm.register(DigitsReward(), name="digits-reward")
    backend = docs.SingleDeviceBackend(tiny_config(model_dir, tmp_path / "probe", pm=pm), torch.device("cpu"), 1)
    assert isinstance(backend, TrainingBackend)
    overrides = ["parallelism.backend=single_device", "algorithm.kl.coef=0.01", "checkpoint.every=1",
                 "rewards=[digits_fraction]", "rollout.max_new_tokens=8", "rollout.samples_per_prompt=8",
                 "checkpoint.export_hf=true"]
    summary = run_training(tiny_config(model_dir, tmp_path / "run", *overrides, pm=pm), pm)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    # its metrics channel: 2 prompts x 8 samples in micro-batches of 8 -> 2 backward passes a step
    assert [r["single_device/n_backward"] for r in rows] == [2, 2]
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    # resume from the step-2 checkpoint and train a third step
    resumed = tiny_config(model_dir, tmp_path / "run", *overrides, "training.steps=3", "checkpoint.resume=auto", pm=pm)
    run_training(resumed, pm)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf_model")
    initial = AutoModelForCausalLM.from_pretrained(model_dir)
    changed = [n for n, p in exported.named_parameters() if not torch.equal(p, initial.state_dict()[n])]
    assert changed, "the exported model holds the trained weights"
    assert summary["steps"] == 2


def test_documented_engine_runs_on_the_fsdp2_backend(tmp_path, model_dir, monkeypatch) -> None:
    docs = example_defining("class PlainSamplingEngine:", monkeypatch)
    pm = build_plugin_manager(autoload=False)
    pm.register(docs, name="docs-engine")
    config = tiny_config(model_dir, tmp_path / "run", "rollout.engine=plain_sampling", pm=pm)
    assert isinstance(docs.PlainSamplingEngine(config.model, []), RolloutEngine)
    run_training(config, pm)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    # it samples from the synced weights: the trainer's log-probs of its tokens are the engine's
    assert all(r["mismatch/k3_kl"] < 1e-9 for r in rows), [r["mismatch/k3_kl"] for r in rows]


def test_documented_drafts_run_in_a_real_loop(tmp_path, model_dir, monkeypatch):
    docs = example_defining("class LongLookupConfig:", monkeypatch)
    pm = build_plugin_manager(autoload=False)
    pm.register(docs, name="docs-drafts")
    run_training(tiny_config(model_dir, tmp_path / "run", "rollout.draft=long_lookup", pm=pm), pm)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2] and all("spec/acceptance_rate" in r for r in rows)
    with pytest.raises(Exception, match="rollout.draft.args.path: missing value"):
        tiny_config(model_dir, tmp_path / "other", "rollout.draft=distilled_draft", pm=pm)


def test_documented_backend_skips_a_nonfinite_update_and_trains_on(tmp_path, model_dir, monkeypatch) -> None:
    """The documented backend inherits BackendBase's step: an update whose loss is NaN (the loop passes
    ``skip=True``) or whose gradient norm is NaN leaves the weights as they were; a finite one moves them."""
    docs = example_defining("class SingleDeviceBackend(BackendBase):", monkeypatch)
    pm = build_plugin_manager(autoload=False)
    backend = docs.SingleDeviceBackend(tiny_config(model_dir, tmp_path / "probe", pm=pm), torch.device("cpu"), 1)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    calls = []
    first = next(backend.model.parameters())

    backend.backward((first * float("nan")).sum())
    assert math.isnan(backend.step(lambda: calls.append(1), skip=True))  # the loop's call: no TypeError
    backend.backward((first * float("nan")).sum())
    assert math.isnan(backend.step(lambda: calls.append(1)))  # a NaN norm alone skips too
    assert calls == [] and backend.skipped_steps == 2
    assert all(torch.equal(p, before[n]) for n, p in backend.model.named_parameters())
    assert all(p.grad is None for p in backend.model.parameters())

    backend.backward(first.square().sum())
    norm = backend.step(lambda: calls.append(1))
    assert norm > 0 and calls == [1] and backend.skipped_steps == 2
    assert not torch.equal(first, before[next(iter(before))])


def test_documented_wrapper_engine_composes_the_registered_transformers_engine(tmp_path, model_dir, monkeypatch) -> None:
    """The wrapper of docs/plugins.md gets the built-in engine through rlite.api.registered, from the run's
    own plugin manager (a plugin registered only there is found), and trains with it."""
    from rlite.api import registered

    docs = example_defining("class CountingEngine(EngineWrapper):", monkeypatch)
    pm = build_plugin_manager(autoload=False)
    pm.register(docs, name="docs-wrapper")
    made = []
    original = docs.CountingEngine.__init__
    monkeypatch.setattr(docs.CountingEngine, "__init__", lambda self, inner, metrics: (
        made.append((self, inner.model.config._attn_implementation)), original(self, inner, metrics))[1])
    run_training(tiny_config(model_dir, tmp_path / "run", "rollout.engine=counting", "training.eval_every=2",
                             "rollout.engine.args.inner_args.attn_implementation=eager", pm=pm), pm)  # fmt: skip
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    ((engine, attention),) = made
    assert type(engine.inner).__name__ == "TransformersEngine"
    assert attention == "eager"  # the wrapper's nested options reached the inner engine as its config
    # the metrics channel: each step's rollout, 2 prompts; the evaluations' calls (8 prompts, greedy and
    # sampled) under eval/
    assert [r["counting/n_prompts"] for r in steps] == [2, 2]
    assert [r["eval/counting/n_prompts"] for r in rows if "eval/greedy_accuracy" in r] == [16, 16]
    with pytest.raises(Exception, match="counting"):  # the run's manager was in use only while building
        registered("rollout_engine", "counting")


def test_documented_wrapper_backend_composes_the_registered_fsdp2_backend(tmp_path, model_dir, monkeypatch) -> None:
    """The backend wrapper of docs/plugins.md (a ``BackendWrapper`` overriding ``step`` alone) gets fsdp2
    through rlite.api.registered, trains a PPO run with its critic through it (every optimizer step's norm
    is the one the run logs), and passes the conformance kit like the backend it wraps."""
    from rlite.plugin_manager import plugin_manager_in_use
    from rlite.testing.conformance import check_backend

    docs = example_defining("class NormRecordingBackend(BackendWrapper):", monkeypatch)
    pm = build_plugin_manager(autoload=False)
    pm.register(docs, name="docs-backend-wrapper")
    pm.register(DigitsReward(), name="digits-reward")
    made = []
    original = docs.NormRecordingBackend.__init__
    monkeypatch.setattr(docs.NormRecordingBackend, "__init__",
                        lambda self, inner: (made.append(self), original(self, inner))[1])
    overrides = ["parallelism.backend=norm_recording", "rewards=[digits_fraction]", "rollout.samples_per_prompt=8",
                 "algorithm.advantage=gae", "algorithm.critic.enabled=true"]
    run_training(tiny_config(model_dir, tmp_path / "run", *overrides, pm=pm), pm)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    (backend,) = made
    assert isinstance(backend, TrainingBackend) and backend.capabilities.critic
    assert backend.grad_norms == [r["actor/grad_norm"] for r in rows] and all(n > 0 for n in backend.grad_norms)
    assert all(r["critic/skipped_nonfinite"] == 0 and r["critic/grad_norm"] > 0 for r in rows)
    with plugin_manager_in_use(pm):
        report = check_backend("norm_recording", workdir=tmp_path / "kit")
    assert len(report.passed) == 9 and report.plugin == "'norm_recording' (plugin docs-backend-wrapper)", report


def test_documented_backend_and_engine_pass_the_conformance_kit(tmp_path, monkeypatch) -> None:
    """The kit a third-party author runs: the docs' backend passes every backend invariant, the non-finite
    step (skipped, counted, weights unchanged) and bitwise resume included; the docs' engine every engine
    invariant, sampling with each synced version's weights."""
    from rlite.plugin_manager import plugin_manager_in_use
    from rlite.testing.conformance import check_backend, check_engine

    backend_docs = example_defining("class SingleDeviceBackend(BackendBase):", monkeypatch)
    engine_docs = example_defining("class PlainSamplingEngine:", monkeypatch)
    pm = build_plugin_manager(autoload=False)
    pm.register(backend_docs, name="docs-backend")
    pm.register(engine_docs, name="docs-engine")
    with plugin_manager_in_use(pm):  # as in the author's tests: the names resolve through rlite.api.registered
        backend = check_backend("single_device", workdir=tmp_path / "backend")
        engine = check_engine("plain_sampling", workdir=tmp_path / "engine")
    assert "a non-finite loss or gradient skips the step, counted, weights and LR unchanged" in backend.invariants()
    assert "resume: the step after a checkpoint load is bitwise equal" in backend.invariants()
    assert len(backend.passed) == 9 and backend.plugin == "'single_device' (plugin docs-backend)"
    assert "samples with the new weights, not the old" in engine.invariants() and len(engine.passed) == 12


def test_documented_estimator_and_loss_pass_the_conformance_kit(monkeypatch) -> None:
    """The docs' estimator and loss examples register float64 references, and match them on the kit's edge
    cases (a singleton group, a constant group, an empty row, log-ratios of +-30)."""
    from rlite.testing.conformance import check_estimator, check_policy_loss

    estimator = example_defining("class MeanBaselineConfig:", monkeypatch)
    loss = example_defining("class SymmetricClipConfig:", monkeypatch)
    pm = build_plugin_manager(autoload=False)
    pm.register(estimator, name="docs-estimator")
    pm.register(loss, name="docs-loss")
    assert "equals its float64 reference" in check_estimator(pm.registry("advantage_estimator").get("mean_baseline")).invariants()
    assert "equals its float64 reference" in check_policy_loss(pm.registry("policy_loss").get("symmetric_clip")).invariants()
