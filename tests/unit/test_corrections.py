"""Every built-in mismatch correction against weights and masks written out with float64 loops."""

from __future__ import annotations

import math

import pytest
import torch

from rlite.algorithms.mismatch import compose_corrections
from rlite.config import ConfigError
from rlite.plugin_manager import RlitePluginManager
from rlite.plugins import corrections as C

torch.set_num_threads(1)

MASK = torch.tensor(
    [
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
    ]
)
# log(π_old / π_roll) per valid token, chosen so that every band below is crossed on both sides
D = [
    [0.05, -0.1, 0.9, -0.8, 0.2, 0.0],
    [0.3, 0.4, -0.05, 0.1],
    [-2.5, 0.01],
    [],
    [1e-4, -2e-4, 3e-4],
]


def _tensors(dtype=torch.float64):
    roll = torch.full(MASK.shape, float("nan"), dtype=dtype)  # padding must never be read
    old = torch.full(MASK.shape, -math.inf, dtype=dtype)
    base = -torch.linspace(0.5, 3.0, MASK.numel(), dtype=dtype).reshape(MASK.shape)
    for i, row in enumerate(D):
        for t, d in enumerate(row):
            roll[i, t] = base[i, t]
            old[i, t] = base[i, t] + d
    return old, roll, MASK.clone()


def _level_values(level: str) -> list[list[float]]:
    """Per-token log-ratio at a level: token d_t, sequence Σ d, geometric Σ d / n."""
    out = []
    for row in D:
        if level == "token":
            out.append(list(row))
        elif level == "sequence":
            out.append([sum(row)] * len(row))
        else:
            out.append([sum(row) / len(row)] * len(row) if row else [])
    return out


def _to_tensor(rows: list[list[float]]) -> torch.Tensor:
    out = torch.zeros(MASK.shape, dtype=torch.float64)
    for i, row in enumerate(rows):
        for t, v in enumerate(row):
            out[i, t] = v
    return out


def _mask_from(rows: list[list[bool]]) -> torch.Tensor:
    return _to_tensor([[1.0 if keep else 0.0 for keep in row] for row in rows]).to(MASK.dtype)


# --------------------------------------------------------------------------------------------------
# registration and configs
# --------------------------------------------------------------------------------------------------


def test_registered_names_and_config_classes():
    pm = RlitePluginManager()
    pm.register(C)
    registry = pm.registry("mismatch_correction")
    assert registry.names() == ["batch_norm", "icepop", "mis", "opsm", "rejection", "tis"]
    assert registry.get("icepop").implementation is registry.get("mis").implementation
    assert registry.get("icepop").config_cls is C.IcePopConfig


@pytest.mark.parametrize(
    "make",
    [
        lambda: C.TisConfig(level="seq"),
        lambda: C.TisConfig(upper=0.0),
        lambda: C.TisConfig(lower=3.0, upper=2.0),
        lambda: C.MisConfig(lower=-1.0),
        lambda: C.RejectionConfig(statistic="k4"),
        lambda: C.RejectionConfig(level="seq_max"),  # k1 has no seq_max
        lambda: C.RejectionConfig(statistic="k2", lower=0.5),
        lambda: C.RejectionConfig(upper=None, lower=0.5),
        lambda: C.RejectionConfig(veto=0.0),
        lambda: C.OpsmConfig(behaviour="current"),
        lambda: C.BatchNormConfig(level="geometric"),
    ],
)
def test_invalid_configs_fail(make):
    with pytest.raises(ConfigError):
        make()


# --------------------------------------------------------------------------------------------------
# tis
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "level, lower, upper",
    [
        ("token", None, 2.0),
        ("token", 0.8, 1.5),
        ("sequence", None, 2.0),
        ("sequence", 0.5, 1.2),
        ("geometric", 0.9, 1.1),
    ],
)
def test_tis_weights(level, lower, upper):
    old, roll, mask = _tensors()
    cfg = C.TisConfig(level=level, lower=lower, upper=upper)
    weights, out_mask, metrics = C.truncated_is(old, roll, mask, cfg)
    expected = [[min(max(math.exp(v), lower or 0.0), upper) for v in row] for row in _level_values(level)]
    assert torch.allclose(weights, _to_tensor(expected), rtol=1e-12, atol=0)
    assert torch.equal(out_mask, mask)
    assert not weights.requires_grad
    units = [w for row in expected for w in row] if level == "token" else [row[0] for row in expected if row]
    raw = (
        [v for row in _level_values(level) for v in row]
        if level == "token"
        else [row[0] for row in _level_values(level) if row]
    )
    assert metrics["rollout_is_mean"] == pytest.approx(sum(units) / len(units), rel=1e-12)
    assert metrics["rollout_is_max"] == pytest.approx(max(units)) and metrics[
        "rollout_is_min"
    ] == pytest.approx(min(units))
    mean = sum(units) / len(units)
    ess = mean**2 / (sum(u * u for u in units) / len(units))
    assert metrics["rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-12)
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(
        sum(math.exp(v) > upper for v in raw) / len(raw)
    )
    assert metrics["rollout_is_ratio_fraction_low"] == pytest.approx(
        sum(math.exp(v) < (lower or 0.0) for v in raw) / len(raw)
    )
    assert metrics["rollout_is_ratio_fraction_high"] + metrics["rollout_is_ratio_fraction_low"] > 0


def test_tis_float32_inputs_and_huge_ratios():
    old, roll, mask = _tensors(torch.float32)
    old = old + 200.0  # exp overflows float32: the cap must still hold, no NaN/inf
    weights, _, metrics = C.truncated_is(old, roll, mask, C.TisConfig(level="sequence"))
    assert weights.dtype == torch.float32
    assert torch.equal(weights, 2.0 * mask.float())
    assert all(math.isfinite(v) for v in metrics.values())


# --------------------------------------------------------------------------------------------------
# mis / icepop
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        C.MisConfig(),
        C.MisConfig(level="token", lower=0.7, upper=3.0),
        C.MisConfig(level="geometric", lower=0.9, upper=1.05),
        C.IcePopConfig(),
        C.IcePopConfig(drop_from_mask=True),
        C.MisConfig(level="sequence", lower=0.8, upper=1.5, drop_from_mask=True),
    ],
)
def test_mis_weights_and_mask(cfg):
    old, roll, mask = _tensors()
    weights, out_mask, metrics = C.masked_is(old, roll, mask, cfg)
    levels = _level_values(cfg.level)
    inside = [[cfg.lower <= math.exp(v) <= cfg.upper for v in row] for row in levels]
    expected = [[math.exp(v) if ok else 0.0 for v, ok in zip(row, oks)] for row, oks in zip(levels, inside)]
    assert torch.allclose(weights, _to_tensor(expected), rtol=1e-12, atol=0)
    assert torch.equal(out_mask, _mask_from(inside) if cfg.drop_from_mask else mask)
    n_out = sum(not ok for row in inside for ok in row)
    assert 0 < n_out < int(mask.sum())
    assert metrics["masked_fraction"] == pytest.approx(n_out / int(mask.sum()))
    seqs_hit = sum(any(not ok for ok in row) for row in inside if row)
    assert metrics["seq_masked_fraction"] == pytest.approx(seqs_hit / 4)


def test_icepop_defaults_and_values():
    assert (C.IcePopConfig().level, C.IcePopConfig().lower, C.IcePopConfig().upper) == ("token", 0.5, 5.0)
    assert (C.MisConfig().level, C.MisConfig().lower, C.MisConfig().upper) == ("sequence", 0.5, 2.0)
    old, roll, mask = _tensors()
    weights, _, _ = C.masked_is(old, roll, mask, C.IcePopConfig())
    assert weights[2, 0] == 0.0  # ρ = e^-2.5 ≈ 0.08 < 0.5
    assert weights[0, 2] == pytest.approx(math.exp(0.9))  # 2.46 inside [0.5, 5]


# --------------------------------------------------------------------------------------------------
# rejection
# --------------------------------------------------------------------------------------------------


def _k(stat: str, d: float) -> float:
    return {"k1": d, "k2": 0.5 * d * d, "k3": math.exp(d) - 1 - d}[stat]


def _rejection_reference(cfg: C.RejectionConfig) -> list[list[bool]]:
    keep = []
    for row in D:
        stats = [_k(cfg.statistic, d) for d in row]
        if cfg.level == "token":
            units = stats
        else:
            agg = {"seq_sum": sum, "seq_mean": lambda s: sum(s) / len(s), "seq_max": max}[cfg.level]
            units = [agg(stats)] * len(stats) if stats else []
        if cfg.upper is None:
            row_keep = [True] * len(units)
        elif cfg.statistic == "k1":
            lower = cfg.lower if cfg.lower is not None else 1 / cfg.upper
            row_keep = [lower <= math.exp(u) <= cfg.upper for u in units]
        else:
            row_keep = [u <= cfg.upper for u in units]
        if cfg.veto is not None and any(math.exp(d) < cfg.veto for d in row):
            row_keep = [False] * len(row)
        keep.append(row_keep)
    return keep


@pytest.mark.parametrize(
    "cfg",
    [
        C.RejectionConfig(),  # geometric k1 in [1/1.001, 1.001]
        C.RejectionConfig(level="token", lower=0.8, upper=1.5),  # asymmetric
        C.RejectionConfig(level="token", upper=1.3),  # lower = 1/1.3
        C.RejectionConfig(level="seq_sum", lower=0.5, upper=2.0),
        C.RejectionConfig(level="seq_mean", lower=0.95, upper=1.2),
        C.RejectionConfig(statistic="k2", level="token", upper=0.03),
        C.RejectionConfig(statistic="k2", level="seq_sum", upper=0.5),
        C.RejectionConfig(statistic="k3", level="seq_max", upper=0.1),
        C.RejectionConfig(statistic="k3", level="seq_mean", upper=0.05),
        C.RejectionConfig(level="token", upper=None, veto=0.1),  # veto alone
        C.RejectionConfig(statistic="k2", level="token", upper=0.3, veto=0.5),
    ],
)
def test_rejection_masks(cfg):
    old, roll, mask = _tensors()
    weights, out_mask, metrics = C.rejection_sampling(old, roll, mask, cfg)
    keep = _rejection_reference(cfg)
    assert weights is None
    assert torch.equal(out_mask, _mask_from(keep)) and out_mask.dtype == mask.dtype
    n_removed = sum(not k for row in keep for k in row)
    assert 0 < n_removed < int(mask.sum())  # every case keeps some tokens and rejects others
    assert metrics["masked_fraction"] == pytest.approx(n_removed / int(mask.sum()))
    assert metrics["seq_masked_fraction"] == pytest.approx(sum(not all(row) for row in keep if row) / 4)


def test_rejection_k1_bounds_refer_to_old_over_rollout():
    """ρ = π_old/π_roll = 1.4 is kept by [0.8, 1.5]; its inverse 1/1.4 ≈ 0.71 is rejected.

    verl's k1 compares log(π_roll/π_train), so verl would do the opposite with threshold "0.8_1.5".
    """
    roll = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    old = roll + torch.log(torch.tensor([[1.4, 1 / 1.4]], dtype=torch.float64))
    mask = torch.ones(1, 2)
    _, out_mask, _ = C.rejection_sampling(
        old, roll, mask, C.RejectionConfig(level="token", lower=0.8, upper=1.5)
    )
    assert out_mask.tolist() == [[1.0, 0.0]]


def test_veto_rejects_the_whole_sequence():
    old, roll, mask = _tensors()
    _, out_mask, metrics = C.rejection_sampling(old, roll, mask, C.RejectionConfig(upper=None, veto=0.1))
    expected = mask.clone()
    expected[2] = 0  # e^-2.5 < 0.1 on its first token
    assert torch.equal(out_mask, expected)
    assert metrics["veto_fraction"] == pytest.approx(1 / 4)


def test_everything_rejected_is_finite_through_a_chain():
    old, roll, mask = _tensors()
    chain = [
        ("rejection", C.rejection_sampling, C.RejectionConfig(level="token", lower=1.5, upper=1.6)),
        ("tis", C.truncated_is, C.TisConfig()),
        ("mis", C.masked_is, C.MisConfig()),
        ("batch_norm", C.batch_normalize, C.BatchNormConfig(level="sequence")),
    ]
    weights, out_mask, metrics = compose_corrections(chain, old, roll, mask)
    assert out_mask.sum() == 0
    assert torch.isfinite(weights).all() and weights.abs().sum() == 0
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["correction/rejection/masked_fraction"] == 1.0
    assert metrics["correction/rejection/seq_masked_fraction"] == 1.0
    assert metrics["correction/tis/rollout_is_eff_sample_size"] == 1.0


# --------------------------------------------------------------------------------------------------
# opsm
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("behaviour", ["old", "rollout"])
@pytest.mark.parametrize("per_token", [False, True])
def test_opsm_drops_negative_advantage_far_sequences(behaviour, per_token):
    old, roll, mask = _tensors()
    current = roll.clone()
    shift = [0.0, 0.5, 0.05, 0.0, -0.2]  # current = roll - shift on valid tokens
    for i, s in enumerate(shift):
        current[i] = roll[i] - s
    adv_seq = torch.tensor([-1.0, -1.0, -0.5, -1.0, 1.0], dtype=torch.float64)
    advantages = adv_seq[:, None].expand(MASK.shape).clone() if per_token else adv_seq
    if per_token:
        advantages[1, 1] = 0.3  # per-token advantages: only negative tokens are dropped
    cfg = C.OpsmConfig(delta=0.1, behaviour=behaviour)
    weights, out_mask, metrics = C.off_policy_sequence_masking(
        old, roll, mask, cfg, advantages=advantages, logprobs=current
    )
    expected = []
    for i, row in enumerate(D):
        b = [(roll[i, t] + (d if behaviour == "old" else 0.0)).item() for t, d in enumerate(row)]
        kl = sum(bt - current[i, t].item() for t, bt in enumerate(b)) / len(row) if row else 0.0
        expected.append(
            [
                not (advantages[i, t] < 0 if per_token else adv_seq[i] < 0) or kl <= 0.1
                for t in range(len(row))
            ]
        )
    assert torch.equal(weights, _mask_from(expected).double())
    assert torch.equal(out_mask, mask)
    dropped = sum(not k for row in expected for k in row)
    assert dropped > 0 and metrics["masked_fraction"] == pytest.approx(dropped / int(mask.sum()))
    _, dropped_mask, _ = C.off_policy_sequence_masking(
        old,
        roll,
        mask,
        C.OpsmConfig(delta=0.1, behaviour=behaviour, drop_from_mask=True),
        advantages=advantages,
        logprobs=current,
    )
    assert torch.equal(dropped_mask, _mask_from(expected))


def test_opsm_needs_advantages_and_logprobs():
    old, roll, mask = _tensors()
    with pytest.raises(ValueError, match="advantages"):
        compose_corrections([("opsm", C.off_policy_sequence_masking, C.OpsmConfig())], old, roll, mask)
    weights, _, _ = compose_corrections(
        [("opsm", C.off_policy_sequence_masking, C.OpsmConfig())],
        old,
        roll,
        mask,
        advantages=-torch.ones(5),
        logprobs=old - 1.0,
    )
    assert torch.equal(weights, torch.zeros_like(weights))  # every sequence: A < 0 and KL = 1 > 1e-4


# --------------------------------------------------------------------------------------------------
# batch_norm and composition order
# --------------------------------------------------------------------------------------------------


def test_batch_norm_without_weights_is_a_no_op():
    old, roll, mask = _tensors()
    weights, out_mask, metrics = C.batch_normalize(old, roll, mask, C.BatchNormConfig())
    assert weights is None and torch.equal(out_mask, mask) and metrics["rollout_is_batch_norm_factor"] == 1.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_then_batch_norm_averages_one(level):
    old, roll, mask = _tensors()
    chain = [
        ("tis", C.truncated_is, C.TisConfig(level="token")),
        ("bn", C.batch_normalize, C.BatchNormConfig(level=level)),
    ]
    weights, _, metrics = compose_corrections(chain, old, roll, mask)
    tis = [[min(math.exp(d), 2.0) for d in row] for row in D]
    if level == "token":
        mean = sum(w for row in tis for w in row) / sum(len(row) for row in tis)
    else:
        per_seq = [sum(row) / len(row) for row in tis if row]
        mean = sum(per_seq) / len(per_seq)
    assert metrics["correction/bn/rollout_is_batch_norm_factor"] == pytest.approx(mean, rel=1e-12)
    assert torch.allclose(weights, _to_tensor(tis) / mean, rtol=1e-12, atol=0)
    if level == "token":
        assert (weights.sum() / mask.sum()).item() == pytest.approx(1.0, rel=1e-12)


def test_composition_order_matters():
    old, roll, mask = _tensors()
    tis = ("tis", C.truncated_is, C.TisConfig())
    bn = ("batch_norm", C.batch_normalize, C.BatchNormConfig())
    w_tis_bn, _, _ = compose_corrections([tis, bn], old, roll, mask)
    w_bn_tis, _, _ = compose_corrections([bn, tis], old, roll, mask)
    w_tis, _, _ = compose_corrections([tis], old, roll, mask)
    assert torch.equal(w_bn_tis, w_tis)  # nothing to normalise yet
    assert not torch.allclose(w_tis_bn, w_bn_tis)
    assert (w_tis_bn.sum() / mask.sum()).item() == pytest.approx(1.0, rel=1e-12)


def test_batch_norm_sees_only_tokens_kept_by_earlier_rejection():
    old, roll, mask = _tensors()
    rejection = ("rejection", C.rejection_sampling, C.RejectionConfig(level="token", lower=0.5, upper=2.0))
    chain = [
        rejection,
        ("tis", C.truncated_is, C.TisConfig(upper=1.2)),
        ("bn", C.batch_normalize, C.BatchNormConfig()),
    ]
    weights, out_mask, _ = compose_corrections(chain, old, roll, mask)
    kept = [[0.5 <= math.exp(d) <= 2.0 for d in row] for row in D]
    tis = [[min(math.exp(d), 1.2) if k else 0.0 for d, k in zip(row, ks)] for row, ks in zip(D, kept)]
    mean = sum(w for row in tis for w in row) / sum(k for row in kept for k in row)
    assert torch.equal(out_mask, _mask_from(kept))
    assert torch.allclose(weights, _to_tensor(tis) / mean, rtol=1e-12, atol=0)
