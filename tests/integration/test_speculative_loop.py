"""Speculative drafts in the real training loop on CPU: a trained draft learns every step without
touching the policy, its weights reach the engine (in-process, spawned, and SGLang through its
fake) in the policy's sync, it checkpoints and resumes bitwise, and the spec/* metrics are logged."""

from __future__ import annotations

import sys

import pytest
import torch

from rlite import hookimpl
from rlite.plugin_manager import build_plugin_manager
from rlite.run.loop import run_training
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir

SPEC_METRICS = ("spec/acceptance_rate", "spec/mean_accepted_length", "spec/tokens_per_target_forward",
                "spec/rollout_s", "spec/no_draft_estimate_s", "spec/estimated_speedup")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return build_tiny_model_dir(root / "policy", hidden=32, layers=2), build_tiny_model_dir(
        root / "draft", hidden=16, layers=1, seed=1)


def full(param) -> torch.Tensor:
    """A copy of a parameter, gathered whole if FSDP2 sharded it (a world of one: the local shard is it)."""
    tensor = param.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).clone()


@pytest.mark.parametrize("process", [False, True], ids=["in-process", "spawned"])
def test_a_trained_draft_learns_reaches_the_engine_and_leaves_the_policy_alone(tmp_path, dirs, process):
    policy_dir, draft_dir = dirs
    seen: dict = {}

    class Hooks:
        @hookimpl
        def after_optimizer_step(self, step, model):
            seen["policy"] = {n: full(p) for n, p in model.named_parameters()}

        @hookimpl
        def after_weight_sync(self, step, weight_version, engine):
            # the engine's copy of everything it was sent, draft included (spawned: a copy from the child)
            weights = dict(engine.named_weights()) if process else dict(engine.synced_parameters())
            seen["engine_draft"] = {n[len("draft."):]: t.detach().clone() for n, t in weights.items()
                                    if n.startswith("draft.")}
            seen["engine_policy"] = {n: t.detach().clone() for n, t in weights.items() if not n.startswith("draft.")}

    pm = build_plugin_manager(autoload=False)
    pm.register(Hooks(), name="watch")
    cfg = tiny_config(policy_dir, tmp_path / "run", "training.steps=3", "rollout.max_new_tokens=8",
                      f"rollout.engine.args.process={str(process).lower()}", "checkpoint.export_hf=true",
                      "rollout.draft=draft_model", f"rollout.draft.args.path={draft_dir}", "rollout.draft.args.lr=1e-2",
                      pm=pm)
    run_training(cfg, pm)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert all(key in row for key in SPEC_METRICS) and 0 <= row["spec/acceptance_rate"] <= 1
        assert row["spec/tokens_per_target_forward"] == pytest.approx(1 + row["spec/mean_accepted_length"], abs=0.5)
        assert row["draft/loss"] > 0 and row["time/draft"] > 0
    from transformers import AutoModelForCausalLM

    # the engine samples the next batch from exactly the policy and the draft of the last step
    exported_draft = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf_draft")
    initial_draft = AutoModelForCausalLM.from_pretrained(draft_dir)
    exported_policy = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf_model").named_parameters())
    for name, param in exported_draft.named_parameters():
        assert torch.equal(seen["engine_draft"][name], param.detach()), name
        assert not torch.equal(param, initial_draft.get_parameter(name)), f"the draft did not learn {name}"
    for name, tensor in seen["engine_policy"].items():
        assert torch.equal(tensor, exported_policy[name].detach()), name
        (after_step,) = [t for n, t in seen["policy"].items() if n == name or n.endswith("." + name)]  # a wrapper's names
        assert torch.equal(tensor, after_step), name  # the policy after its optimizer step, untouched


def test_a_run_with_a_trained_draft_resumes_bitwise(tmp_path, dirs):
    policy_dir, draft_dir = dirs
    common = ["rollout.max_new_tokens=6", "checkpoint.export_hf=true", "rollout.draft=draft_model",
              f"rollout.draft.args.path={draft_dir}", "rollout.draft.args.lr=1e-2"]
    run_training(tiny_config(policy_dir, tmp_path / "straight", "training.steps=3", *common))
    run_training(tiny_config(policy_dir, tmp_path / "resumed", "training.steps=2", "checkpoint.every=1", *common))
    run_training(tiny_config(policy_dir, tmp_path / "resumed", "training.steps=3", "checkpoint.resume=auto", *common))
    straight = read_jsonl(tmp_path / "straight" / "metrics.jsonl")
    resumed = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    for key in ("reward/mean", "draft/loss", "spec/acceptance_rate", "spec/tokens_per_target_forward"):
        assert [r.get(key) for r in straight] == [r.get(key) for r in resumed], key
    from safetensors.torch import load_file

    a = load_file(tmp_path / "straight" / "hf_draft" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "hf_draft" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sglang_gets_the_draft_in_a_session_of_its_own(tmp_path, dirs, monkeypatch):
    from fake_sglang import FakeSGLangEngine, fake_sglang_modules

    for name, module in fake_sglang_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    policy_dir, draft_dir = dirs
    cfg = tiny_config(policy_dir, tmp_path / "run", "rollout.engine=sglang", "checkpoint.export_hf=true",
                      "rollout.draft=draft_model", f"rollout.draft.args.path={draft_dir}",
                      "rollout.draft.args.loss=distill", "rollout.draft.args.distill_top_k=3",
                      "rollout.draft.args.num_speculative_tokens=3")
    run_training(cfg)
    (engine,) = FakeSGLangEngine.instances
    args = engine.server_args
    assert args["speculative_algorithm"] == "STANDALONE" and args["speculative_draft_model_path"] == str(draft_dir)
    assert (args["speculative_num_steps"], args["speculative_eagle_topk"], args["speculative_num_draft_tokens"]) == (3, 1, 4)
    assert "speculative_draft_load_format" not in args  # trained: its weights come with every sync
    sessions = [c for c in engine.calls if c[0] == "begin_weight_update"]
    assert sessions == [("begin_weight_update", "target"), ("begin_weight_update", "draft")] * 3  # build + 2 steps
    versions = [i for i, c in enumerate(engine.calls) if c[0] == "update_weight_version"]
    drafts = [i for i, c in enumerate(engine.calls) if c == ("begin_weight_update", "draft")]
    assert all(v > d for v, d in zip(versions, drafts))  # the version moves once both are in
    generates = [c for c in engine.calls if c[0] == "generate"]
    assert generates  # and the fake let every one through: the draft's weights were there
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "run" / "hf_draft" / "model.safetensors")
    assert set(engine.draft_weights) == set(exported)  # the draft's own names, "draft." removed
    engine_dtype = getattr(torch, engine.server_args["dtype"])  # the draft travels in the engine's dtype
    assert {tensor.dtype for tensor in engine.draft_weights.values()} == {engine_dtype}
    assert all(torch.equal(engine.draft_weights[name], tensor.to(engine_dtype)) for name, tensor in exported.items())
    policy = load_file(tmp_path / "run" / "hf_model" / "model.safetensors")  # and the policy went to the target
    assert all(torch.equal(engine.weights[name], tensor.to(engine_dtype)) for name, tensor in policy.items())
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    for row in rows:  # the fake's account: every other verification accepts one of 3 proposals
        assert row["spec/tokens_per_target_forward"] == pytest.approx(4 / 2)
        assert row["spec/acceptance_rate"] == pytest.approx((4 - 2) / (2 * 3))
        assert row["draft/loss"] > 0


def test_sglang_refuses_a_draft_in_true_on_policy_mode_when_the_config_loads(tmp_path):
    from rlite.config import ConfigError
    from rlite.plugin_manager import build_plugin_manager
    from rlite.testing import tiny_config

    pm = build_plugin_manager(autoload=False)
    with pytest.raises(ConfigError, match=r"^rollout.engine=sglang \(plugin 'rlite.plugins.sglang'\): rollout.draft: "
                                          "SGLang's true on-policy mode"):
        tiny_config("m", tmp_path, "rollout.engine=sglang", "rollout.true_on_policy=true", "rollout.draft=ngram", pm=pm)
    tiny_config("m", tmp_path, "rollout.engine=sglang", "rollout.draft=ngram", pm=pm)  # either alone loads
