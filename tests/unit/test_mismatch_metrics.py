"""rlite.algorithms.mismatch: the mismatch metrics against float64 loops, composition rules, old-logprob modes."""

from __future__ import annotations

import math

import pytest
import torch

from rlite.algorithms.mismatch import (
    build_corrections,
    compose_corrections,
    mismatch_metrics,
    needs_current_logprobs,
    resolve_old_logprobs,
)

torch.set_num_threads(1)

NAMES = (
    "kl",
    "k3_kl",
    "training_ppl",
    "rollout_ppl",
    "log_ppl_diff",
    "chi2_token",
    "chi2_seq",
    "ess",
    "max_abs_diff",
    "mean_abs_diff",
    "bitwise_equal_fraction",
)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[4, 5] log-probs with ragged rows and one fully masked row; padding holds -inf."""
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    train = roll + 0.3 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    train[1, 2] = roll[1, 2]  # one bitwise-equal token
    train = train.masked_fill(mask == 0, -math.inf)
    roll = roll.masked_fill(mask == 0, float("nan"))
    return train, roll, mask


def _reference(train: torch.Tensor, roll: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    tokens, seqs = [], []
    for i in range(mask.shape[0]):
        row = [(float(train[i, t]), float(roll[i, t])) for t in range(mask.shape[1]) if mask[i, t]]
        tokens += row
        if row:
            seqs.append(row)
    n = len(tokens)
    rhos = [math.exp(a - b) for a, b in tokens]
    mean_rho = sum(rhos) / n
    seq_log_ratio = [min(max(sum(a - b for a, b in row), -20.0), 20.0) for row in seqs]
    return {
        "kl": sum(b - a for a, b in tokens) / n,
        "k3_kl": sum(math.exp(a - b) - 1 - (a - b) for a, b in tokens) / n,
        "training_ppl": sum(math.exp(-sum(a for a, _ in row) / len(row)) for row in seqs) / len(seqs),
        "rollout_ppl": sum(math.exp(-sum(b for _, b in row) / len(row)) for row in seqs) / len(seqs),
        "log_ppl_diff": sum(sum(b - a for a, b in row) / len(row) for row in seqs) / len(seqs),
        "chi2_token": sum(r * r for r in rhos) / n - 1,
        "chi2_seq": sum(math.exp(2 * s) for s in seq_log_ratio) / len(seqs) - 1,
        "ess": 1 / (sum((r / mean_rho) ** 2 for r in rhos) / n),
        "max_abs_diff": max(abs(a - b) for a, b in tokens),
        "mean_abs_diff": sum(abs(a - b) for a, b in tokens) / n,
        "bitwise_equal_fraction": sum(a == b for a, b in tokens) / n,
    }


def test_metrics_match_float64_loops():
    train, roll, mask = _batch()
    got = mismatch_metrics(train, roll, mask)
    assert sorted(got) == sorted(f"mismatch/{k}" for k in NAMES)
    for key, value in _reference(train, roll, mask).items():
        assert got[f"mismatch/{key}"] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert got["mismatch/bitwise_equal_fraction"] == pytest.approx(1 / 9)


def test_equal_tensors_give_exact_zeros_and_unit_ess():
    train, _, mask = _batch()
    got = mismatch_metrics(train, train.clone(), mask)
    for key in ("kl", "k3_kl", "log_ppl_diff", "chi2_token", "chi2_seq", "max_abs_diff", "mean_abs_diff"):
        assert got[f"mismatch/{key}"] == 0.0, key
    assert got["mismatch/ess"] == 1.0
    assert got["mismatch/bitwise_equal_fraction"] == 1.0
    assert got["mismatch/training_ppl"] == got["mismatch/rollout_ppl"] > 1.0


def test_float32_and_bf16_inputs():
    train, roll, mask = _batch(1)
    got32 = mismatch_metrics(train.float(), roll.float(), mask.bool())
    ref = _reference(train.float().double(), roll.float().double(), mask)
    assert got32["mismatch/kl"] == pytest.approx(ref["kl"], rel=1e-9)
    got_bf16 = mismatch_metrics(train.to(torch.bfloat16), train.to(torch.bfloat16), mask)
    assert got_bf16["mismatch/kl"] == 0.0 and got_bf16["mismatch/ess"] == 1.0


def test_fully_masked_batch_is_finite():
    train, roll, mask = _batch()
    got = mismatch_metrics(train, roll, torch.zeros_like(mask))
    assert all(math.isfinite(v) for v in got.values())
    assert got["mismatch/kl"] == 0.0 and got["mismatch/ess"] == 1.0
    assert got["mismatch/training_ppl"] == 1.0 and got["mismatch/bitwise_equal_fraction"] == 1.0


def test_large_mismatch_stays_finite():
    train, roll, mask = _batch()
    got = mismatch_metrics(train + 30.0, roll, mask)  # sequence log-ratios beyond the ±20 clamp
    assert all(math.isfinite(v) for v in got.values())
    assert got["mismatch/chi2_seq"] == pytest.approx(math.exp(40) - 1, rel=1e-12)


# --------------------------------------------------------------------------------------------------
# compose_corrections
# --------------------------------------------------------------------------------------------------


def _recorder(name, weight_value, drop_column, seen):
    """A fake correction: weight ``weight_value`` everywhere, drops ``drop_column``, records its inputs."""

    def fn(old_logprobs, rollout_logprobs, response_mask, cfg):
        seen.append((name, response_mask.clone(), cfg))
        mask = response_mask.clone()
        if drop_column is not None:
            mask[:, drop_column] = 0
        weights = None if weight_value is None else torch.full(mask.shape, weight_value, dtype=torch.float64)
        return weights, mask, {"value": float(weight_value or 0)}

    return fn


def test_compose_multiplies_weights_intersects_masks_in_order():
    train, roll, mask = _batch()
    seen = []
    corrections = [
        ("a", _recorder("a", 2.0, 0, seen), "cfg-a"),
        ("b", _recorder("b", None, 1, seen), "cfg-b"),
        ("c", _recorder("c", 0.25, None, seen), "cfg-c"),
    ]
    weights, out_mask, metrics = compose_corrections(corrections, train, roll, mask)
    expected_mask = mask.clone()
    expected_mask[:, :2] = 0
    assert torch.equal(out_mask, expected_mask) and out_mask.dtype == mask.dtype
    assert torch.equal(weights, 0.5 * expected_mask.double())  # 2 × 0.25, zero outside the mask
    assert [s[0] for s in seen] == ["a", "b", "c"] and [s[2] for s in seen] == ["cfg-a", "cfg-b", "cfg-c"]
    assert torch.equal(seen[0][1], mask)
    assert seen[1][1][:, 0].sum() == 0 and seen[1][1][:, 1].sum() > 0  # b sees a's mask
    assert seen[2][1][:, :2].sum() == 0  # c sees a's and b's
    assert metrics == {"correction/a/value": 2.0, "correction/b/value": 0.0, "correction/c/value": 0.25}


def test_compose_with_no_corrections_and_duplicate_names():
    train, roll, mask = _batch()
    weights, out_mask, metrics = compose_corrections([], train, roll, mask)
    assert weights is None and torch.equal(out_mask, mask) and metrics == {}
    seen = []
    twice = [("x", _recorder("x", 2.0, None, seen), None), ("x", _recorder("x", 3.0, None, seen), None)]
    weights, _, metrics = compose_corrections(twice, train, roll, mask)
    assert set(metrics) == {"correction/x.0/value", "correction/x.1/value"}
    assert torch.equal(weights, 6.0 * mask.double())


def test_compose_passes_only_declared_keyword_arguments():
    train, roll, mask = _batch()
    received = {}

    def plain(old_logprobs, rollout_logprobs, response_mask, cfg):
        return torch.full(mask.shape, 3.0, dtype=torch.float64), response_mask, {}

    def wants_all(
        old_logprobs, rollout_logprobs, response_mask, cfg, *, weights=None, advantages=None, logprobs=None
    ):
        received.update(weights=weights, advantages=advantages, logprobs=logprobs)
        return None, response_mask, {}

    def wants_kwargs(old_logprobs, rollout_logprobs, response_mask, cfg, **kwargs):
        received["kwargs"] = sorted(kwargs)
        return None, response_mask, {}

    advantages = torch.randn(4)
    logprobs = train.clone().requires_grad_(True)
    chain = [("plain", plain, None), ("all", wants_all, None), ("kw", wants_kwargs, None)]
    compose_corrections(chain, train, roll, mask, advantages=advantages, logprobs=logprobs)
    assert torch.equal(received["weights"], torch.full(mask.shape, 3.0, dtype=torch.float64))
    assert received["advantages"] is not None and torch.equal(received["advantages"], advantages)
    assert not received["logprobs"].requires_grad
    assert received["kwargs"] == ["advantages", "logprobs", "weights"]
    assert needs_current_logprobs(chain) and not needs_current_logprobs([("plain", plain, None)])


def test_build_corrections_from_registry():
    from rlite.config import Choice
    from rlite.plugin_manager import RlitePluginManager
    from rlite.plugins import corrections

    pm = RlitePluginManager()
    pm.register(corrections)
    registry = pm.registry("mismatch_correction")
    built = build_corrections([Choice("tis", {"upper": 3.0}), Choice("batch_norm", {})], registry)
    assert [name for name, _, _ in built] == ["tis", "batch_norm"]
    assert built[0][2] == corrections.TisConfig(upper=3.0)
    assert built[0][1] is corrections.truncated_is


# --------------------------------------------------------------------------------------------------
# decoupled vs bypass
# --------------------------------------------------------------------------------------------------


def test_resolve_old_logprobs_modes():
    old, roll = torch.randn(2, 3), torch.randn(2, 3)
    assert resolve_old_logprobs("decoupled", old, roll) is old
    assert resolve_old_logprobs("bypass", old, roll) is roll
    assert resolve_old_logprobs("bypass", None, roll) is roll
    with pytest.raises(ValueError, match="bypass"):
        resolve_old_logprobs("decoupled", None, roll)
    with pytest.raises(ValueError, match="Valid choices: decoupled, bypass"):
        resolve_old_logprobs("bypas", old, roll)


def test_bypass_makes_weight_corrections_no_ops():
    from rlite.plugins.corrections import TisConfig, truncated_is

    _, roll, mask = _batch()
    old = resolve_old_logprobs("bypass", None, roll)
    weights, _, _ = compose_corrections([("tis", truncated_is, TisConfig())], old, roll, mask)
    assert torch.equal(weights, mask.double())
