"""True on-policy mode: the engine samples with the trainer's own fixed-shape forward, so the
rollout log-probs equal the trainer's bit for bit and every mismatch metric reads exactly 0. With
the ordinary KV-cache engine the mismatch is small, non-zero, and reported."""

from __future__ import annotations

import pytest

from rlite.run.loop import run_training
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _train_rows(tmp_path, model_dir, *overrides):
    cfg = tiny_config(model_dir, tmp_path / "run", "training.steps=3", "rollout.samples_per_prompt=4",
                      "rollout.max_new_tokens=6", "training.micro_batch_size=3", *overrides)
    run_training(cfg)
    return [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_true_on_policy_logprobs_are_bitwise_equal(tmp_path, model_dir, temperature):
    # the trainer divides its logits by the sampling temperature exactly as the engine does
    rows = _train_rows(tmp_path, model_dir, "rollout.true_on_policy=true", f"rollout.temperature={temperature}")
    assert len(rows) == 3
    for row in rows:
        assert row["mismatch/bitwise_equal_fraction"] == 1.0
        assert row["mismatch/max_abs_diff"] == 0.0
        assert row["mismatch/kl"] == 0.0
        assert row["mismatch/k3_kl"] == 0.0
        assert row["mismatch/chi2_token"] == 0.0
        assert row["mismatch/ess"] == 1.0


@pytest.mark.parametrize("draft", ["ngram", "draft_model"])
def test_true_on_policy_stays_bitwise_with_a_speculative_draft(tmp_path, model_dir, draft):
    """Verification runs the trainer's fixed-shape forward with the proposals in the buffer: causal
    attention keeps each position's logits those of the final sequence, bit for bit."""
    overrides = ["rollout.true_on_policy=true", "rollout.temperature=0.7", f"rollout.draft={draft}"]
    if draft == "draft_model":
        draft_dir = build_tiny_model_dir(tmp_path / "draft", hidden=16, layers=1, seed=1)
        overrides += [f"rollout.draft.args.path={draft_dir}"]
    rows = _train_rows(tmp_path, model_dir, *overrides, "rollout.max_new_tokens=10")
    for row in rows:
        assert row["spec/proposed_per_target_forward"] > 0  # proposals sat in the verified buffer
        if draft == "draft_model":  # and (a draft LM on this random policy) were accepted
            assert row["spec/mean_accepted_length"] > 0
        assert row["mismatch/bitwise_equal_fraction"] == 1.0
        assert row["mismatch/max_abs_diff"] == 0.0


def test_kv_cache_engine_mismatch_is_small_nonzero_and_reported(tmp_path, model_dir):
    rows = _train_rows(tmp_path, model_dir)
    assert all("mismatch/max_abs_diff" in row for row in rows)
    worst = max(row["mismatch/max_abs_diff"] for row in rows)
    assert 0.0 < worst < 1e-3
    assert min(row["mismatch/bitwise_equal_fraction"] for row in rows) < 1.0


class _EngineSpy:
    """Captures the engine and the trainer model so the test can compare their weights."""

    def __init__(self):
        self.model = None
        self.trainer_weights = None
        self.engine_weights = None

    from rlite import hookimpl as _hookimpl

    @_hookimpl
    def after_optimizer_step(self, model):
        self.model = model

    @_hookimpl
    def after_weight_sync(self, engine):
        from rlite.plugins.fsdp2.weights import iter_full_tensors

        self.trainer_weights = {n: t.clone() for n, t in iter_full_tensors(self.model.lm, lora_merge=False)}
        self.engine_weights = {n: t.clone() for n, t in engine.named_weights()}


@pytest.mark.parametrize("quantizer", ["fp8_blockwise", "int8_channel"])
def test_quantized_rollout_weights_differ_and_mismatch_rises(tmp_path, model_dir, quantizer):
    import torch

    from rlite.plugin_manager import build_plugin_manager, set_plugin_manager

    full = _train_rows(tmp_path / "full", model_dir)
    pm = build_plugin_manager(autoload=False)
    spy = _EngineSpy()
    pm.register(spy, name="engine-spy")
    set_plugin_manager(pm)
    try:
        quant = _train_rows(tmp_path / "quant", model_dir, f"rollout.quantization={quantizer}")
    finally:
        set_plugin_manager(None)
    trainer, engine = spy.trainer_weights, spy.engine_weights
    for name, weight in engine.items():
        if name.endswith("_proj.weight"):  # quantized: close to the trainer's, but not equal
            assert not torch.equal(weight, trainer[name]), name
            rel = (weight - trainer[name]).norm() / trainer[name].norm()
            assert rel < (0.07 if quantizer == "fp8_blockwise" else 0.01), (name, float(rel))
        else:  # embeddings, norms, output layer are left in full precision
            assert torch.equal(weight, trainer[name]), name
    full_diff = max(r["mismatch/max_abs_diff"] for r in full)
    quant_diff = max(r["mismatch/max_abs_diff"] for r in quant)
    assert quant_diff > 10 * full_diff
    assert max(abs(r["mismatch/k3_kl"]) for r in quant) > max(abs(r["mismatch/k3_kl"]) for r in full)


@pytest.mark.parametrize(
    "corrections",
    [
        "[tis]",
        "[{name: mis, args: {level: token, lower: 0.5, upper: 2.0}}, batch_norm]",
        "[rejection, opsm]",
    ],
)
def test_corrections_run_in_training_and_report_metrics(tmp_path, model_dir, corrections):
    rows = _train_rows(tmp_path, model_dir, f"algorithm.corrections={corrections}",
                       "rollout.quantization=int8_channel")
    names = [c.strip("[]{ ").split(",")[0].replace("name: ", "") for c in corrections.split(", ") if c.strip("[]{ ")]
    for row in rows:
        for name in names:
            if name in ("tis", "mis", "batch_norm", "rejection", "opsm"):
                assert any(key.startswith(f"correction/{name}") for key in row), (name, sorted(row))
