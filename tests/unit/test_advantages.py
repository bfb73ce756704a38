"""Advantage estimators and the discounted scan against values written out with plain float64 loops."""

from __future__ import annotations

import math

import pytest
import torch

from rlite.algorithms import AdvantageInput, masked_var, masked_whiten
from rlite.config import ConfigError
from rlite.plugins import advantages as A

torch.set_num_threads(1)

# Groups are not contiguous; group 7 is a singleton, group 5 has constant rewards, row 6 is fully
# masked, rows 1 and 3 have interior masked (tool) tokens.
SCORES = [1.0, 0.0, 0.5, 2.0, 1.0, 0.3, 0.3, 0.3, -1.0]
GROUPS = [0, 3, 0, 3, 0, 5, 5, 5, 7]
MASK = [
    [1, 1, 1, 0, 0],
    [1, 0, 0, 1, 1],
    [1, 1, 1, 1, 1],
    [1, 1, 0, 1, 0],
    [1, 0, 0, 0, 0],
    [1, 1, 0, 0, 0],
    [0, 0, 0, 0, 0],
    [1, 1, 1, 1, 0],
    [1, 1, 1, 0, 0],
]
B, T = len(SCORES), len(MASK[0])


def make_batch(token_rewards=None, values=None) -> AdvantageInput:
    return AdvantageInput(
        scores=torch.tensor(SCORES, dtype=torch.float64),
        group_ids=torch.tensor(GROUPS),
        response_mask=torch.tensor(MASK),
        token_rewards=None if token_rewards is None else torch.tensor(token_rewards, dtype=torch.float64),
        values=None if values is None else torch.tensor(values, dtype=torch.float64),
    )


def members(i: int) -> list[int]:
    return [j for j in range(B) if GROUPS[j] == GROUPS[i]]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def bessel_std(xs: list[float]) -> float:
    mu = mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def broadcast(per_response: list[float]) -> torch.Tensor:
    return torch.tensor(
        [[per_response[i] if MASK[i][t] else 0.0 for t in range(T)] for i in range(B)], dtype=torch.float64
    )


def whiten(rows: list[list[float]]) -> list[list[float]]:
    kept = [rows[i][t] for i in range(B) for t in range(T) if MASK[i][t]]
    mu = mean(kept)
    var = sum((x - mu) ** 2 for x in kept) / (len(kept) - 1)
    return [
        [(rows[i][t] - mu) / math.sqrt(var + 1e-8) if MASK[i][t] else 0.0 for t in range(T)] for i in range(B)
    ]


def assert_close(actual: torch.Tensor, expected, **kw) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(
        actual.double(), expected, rtol=kw.get("rtol", 1e-12), atol=kw.get("atol", 1e-12)
    )


# --------------------------------------------------------------------------------------------------
# group estimators
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("singleton", ["zero", "raw"])
@pytest.mark.parametrize("eps", [1e-6, 1e-4])
def test_grpo_group_scope(singleton: str, eps: float) -> None:
    expected = []
    for i in range(B):
        rewards = [SCORES[j] for j in members(i)]
        if len(rewards) == 1:
            expected.append(0.0 if singleton == "zero" else SCORES[i] / (1.0 + eps))
        else:
            expected.append((SCORES[i] - mean(rewards)) / (bessel_std(rewards) + eps))
    adv, ret = A.grpo_advantages(make_batch(), A.GRPOConfig(epsilon=eps, singleton=singleton))
    assert_close(adv, broadcast(expected))
    assert_close(ret, broadcast(expected))


def test_grpo_edge_cases_are_exact() -> None:
    adv, _ = A.grpo_advantages(make_batch(), A.GRPOConfig())
    assert (adv[5:8] == 0).all()  # constant group of 0.3s: exactly 0, not ~1e-11
    assert (adv[8] == 0).all()  # singleton
    assert (adv[6] == 0).all()  # fully masked row
    assert (adv[torch.tensor(MASK) == 0] == 0).all()
    zero_eps, _ = A.grpo_advantages(make_batch(), A.GRPOConfig(epsilon=0.0))
    assert torch.isfinite(zero_eps).all() and (zero_eps[5:8] == 0).all()


def test_grpo_batch_scope_and_mean_only() -> None:
    sigma = bessel_std(SCORES)
    expected = []
    for i in range(B):
        rewards = [SCORES[j] for j in members(i)]
        expected.append(0.0 if len(rewards) == 1 else (SCORES[i] - mean(rewards)) / (sigma + 1e-6))
    adv, _ = A.grpo_advantages(make_batch(), A.GRPOConfig(std_scope="batch"))
    assert_close(adv, broadcast(expected))

    mean_only = [SCORES[i] - mean([SCORES[j] for j in members(i)]) for i in range(B)]
    adv, _ = A.grpo_advantages(make_batch(), A.GRPOConfig(norm_by_std=False))
    assert_close(adv, broadcast(mean_only))
    adv, _ = A.dr_grpo_advantages(make_batch(), A.DrGRPOConfig())
    assert_close(adv, broadcast(mean_only))
    raw = mean_only[:-1] + [SCORES[-1]]
    adv, _ = A.dr_grpo_advantages(make_batch(), A.DrGRPOConfig(singleton="raw"))
    assert_close(adv, broadcast(raw))


@pytest.mark.parametrize("singleton", ["zero", "raw"])
def test_rloo(singleton: str) -> None:
    expected = []
    for i in range(B):
        others = [SCORES[j] for j in members(i) if j != i]
        if not others:
            expected.append(0.0 if singleton == "zero" else SCORES[i])
        else:
            expected.append(SCORES[i] - sum(others) / len(others))
    adv, ret = A.rloo_advantages(make_batch(), A.RLOOConfig(singleton=singleton))
    assert_close(adv, broadcast(expected))
    assert_close(ret, adv)
    assert (adv[5:8] == 0).all()


def test_integer_scores_give_float_advantages() -> None:
    batch = AdvantageInput(
        scores=torch.tensor([1, 0, 1, 1]),
        group_ids=torch.tensor([0, 0, 1, 1]),
        response_mask=torch.ones(4, 2),
    )
    adv, _ = A.grpo_advantages(batch, A.GRPOConfig())
    assert adv.dtype == torch.float32
    assert adv[2:].abs().sum() == 0 and adv[0, 0] > 0 > adv[1, 0]


# --------------------------------------------------------------------------------------------------
# return-based estimators
# --------------------------------------------------------------------------------------------------

TOKEN_REWARDS = [[0.1 * (i + 1) - 0.05 * t for t in range(T)] for i in range(B)]
VALUES = [[0.2 * math.sin(i + 3 * t) for t in range(T)] for i in range(B)]


def hand_rewards(outcome: list[float], token_rewards) -> list[list[float]]:
    rows = []
    for i in range(B):
        kept = [t for t in range(T) if MASK[i][t]]
        row = [(token_rewards[i][t] if token_rewards and MASK[i][t] else 0.0) for t in range(T)]
        if kept:
            row[kept[-1]] += outcome[i]
        rows.append(row)
    return rows


def hand_returns(rewards: list[list[float]], gamma: float) -> list[list[float]]:
    """G over the mask-1 positions only: tool tokens neither add reward nor discount."""
    out = [[0.0] * T for _ in range(B)]
    for i in range(B):
        running = 0.0
        for t in reversed([t for t in range(T) if MASK[i][t]]):
            running = rewards[i][t] + gamma * running
            out[i][t] = running
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("with_token_rewards", [False, True])
def test_reinforce_pp(gamma: float, with_token_rewards: bool) -> None:
    token_rewards = TOKEN_REWARDS if with_token_rewards else None
    returns = hand_returns(hand_rewards(SCORES, token_rewards), gamma)
    adv, ret = A.reinforce_pp_advantages(make_batch(token_rewards), A.ReinforcePPConfig(gamma=gamma))
    assert_close(ret, returns)
    assert_close(adv, whiten(returns))
    adv, _ = A.reinforce_pp_advantages(
        make_batch(token_rewards), A.ReinforcePPConfig(gamma=gamma, whiten=False)
    )
    assert_close(adv, returns)


@pytest.mark.parametrize("singleton", ["zero", "raw"])
def test_reinforce_pp_baseline(singleton: str) -> None:
    outcome = []
    for i in range(B):
        group = [SCORES[j] for j in members(i)]
        if len(group) == 1:
            outcome.append(0.0 if singleton == "zero" else SCORES[i])
        else:
            outcome.append(SCORES[i] - mean(group))
    returns = hand_returns(hand_rewards(outcome, TOKEN_REWARDS), 1.0)
    cfg = A.ReinforcePPBaselineConfig(singleton=singleton)
    adv, ret = A.reinforce_pp_baseline_advantages(make_batch(TOKEN_REWARDS), cfg)
    assert_close(ret, returns)
    assert_close(adv, whiten(returns))


def hand_gae(rewards, values, gamma: float, lam: float) -> tuple[list[list[float]], list[list[float]]]:
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for i in range(B):
        kept = [t for t in range(T) if MASK[i][t]]
        running = 0.0
        for j in reversed(range(len(kept))):
            t = kept[j]
            next_value = values[i][kept[j + 1]] if j + 1 < len(kept) else 0.0
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            running = delta + gamma * lam * running
            adv[i][t] = running
            ret[i][t] = running + values[i][t]
    return adv, ret


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae(gamma: float, lam: float) -> None:
    rewards = hand_rewards(SCORES, TOKEN_REWARDS)
    adv, ret = hand_gae(rewards, VALUES, gamma, lam)
    batch = make_batch(TOKEN_REWARDS, VALUES)
    got_adv, got_ret = A.gae_advantages(batch, A.GAEConfig(gamma=gamma, lam=lam, whiten=False))
    assert_close(got_adv, adv)
    assert_close(got_ret, ret)
    got_adv, got_ret = A.gae_advantages(batch, A.GAEConfig(gamma=gamma, lam=lam))
    assert_close(got_adv, whiten(adv))
    assert_close(got_ret, ret)  # returns are taken before whitening


def test_gae_without_values_names_the_config_key() -> None:
    with pytest.raises(ValueError, match="algorithm.advantage"):
        A.gae_advantages(make_batch(), A.GAEConfig())


@pytest.mark.parametrize(
    ("name", "cfg"),
    [
        ("grpo", A.GRPOConfig()),
        ("dr_grpo", A.DrGRPOConfig()),
        ("rloo", A.RLOOConfig()),
        ("reinforce_pp", A.ReinforcePPConfig()),
        ("reinforce_pp_baseline", A.ReinforcePPBaselineConfig()),
        ("gae", A.GAEConfig()),
    ],
)
def test_outputs_are_zero_outside_the_mask_and_detached(name: str, cfg: object) -> None:
    registered = {}
    A.register_advantage_estimators(register=lambda n, fn, c=None, **meta: registered.__setitem__(n, (fn, c)))
    fn, config_cls = registered[name]
    assert isinstance(cfg, config_cls)
    values = torch.tensor(VALUES, dtype=torch.float64, requires_grad=True)
    batch = make_batch(TOKEN_REWARDS)
    batch.values = values
    adv, ret = fn(batch, cfg)
    outside = torch.tensor(MASK) == 0
    assert adv.shape == ret.shape == (B, T)
    assert (adv[outside] == 0).all() and (ret[outside] == 0).all()
    assert not adv.requires_grad and not ret.requires_grad


def test_registration() -> None:
    registered, metadata = {}, {}

    def register(name, fn, config_cls=None, **meta):
        registered[name] = config_cls
        metadata[name] = meta

    A.register_advantage_estimators(register=register)
    assert {name for name, meta in metadata.items() if meta.get("needs_critic")} == {"gae"}
    assert {name for name, meta in metadata.items() if meta.get("needs_group")} == {
        "grpo", "dr_grpo", "rloo", "opo", "gpg", "gdpo", "reinforce_pp_baseline"}  # fmt: skip
    assert {name for name, meta in metadata.items() if meta.get("needs_greedy_baseline")} == {"remax"}
    assert registered == {
        "grpo": A.GRPOConfig,
        "dr_grpo": A.DrGRPOConfig,
        "rloo": A.RLOOConfig,
        "opo": A.OPOConfig,
        "gpg": A.GPGConfig,
        "gdpo": A.GDPOConfig,
        "remax": A.ReMaxConfig,
        "reinforce_pp": A.ReinforcePPConfig,
        "reinforce_pp_baseline": A.ReinforcePPBaselineConfig,
        "gae": A.GAEConfig,
    }


@pytest.mark.parametrize(
    "make",
    [
        lambda: A.GRPOConfig(std_scope="global"),
        lambda: A.GRPOConfig(singleton="nan"),
        lambda: A.GRPOConfig(epsilon=-1.0),
        lambda: A.RLOOConfig(singleton="baseline"),
        lambda: A.ReinforcePPConfig(gamma=1.5),
        lambda: A.GAEConfig(lam=-0.1),
    ],
)
def test_invalid_options_raise_config_errors(make) -> None:
    with pytest.raises(ConfigError):
        make()


# --------------------------------------------------------------------------------------------------
# masked statistics and the scan
# --------------------------------------------------------------------------------------------------


def test_masked_var_and_whiten() -> None:
    x = torch.tensor([[1.0, 2.0, 100.0], [4.0, -1.0, 7.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    kept = [1.0, 2.0, 4.0, 7.0]
    mu = mean(kept)
    var = sum((v - mu) ** 2 for v in kept) / 3
    assert masked_var(x, m).item() == pytest.approx(var, rel=1e-14)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(var * 3 / 4, rel=1e-14)
    expected = [
        [(v - mu) / math.sqrt(var + 1e-8) if m[i, j] else 0.0 for j, v in enumerate(row)]
        for i, row in enumerate(x.tolist())
    ]
    assert_close(masked_whiten(x, m), expected)
    one = torch.tensor([[3.0, 5.0]], dtype=torch.float64)
    assert masked_var(one, torch.tensor([[1, 0]])).item() == 0.0  # verl raises; rlite returns 0
    assert (masked_whiten(one, torch.tensor([[1, 0]])) == 0).all()
    assert (masked_whiten(one, torch.zeros(1, 2)) == 0).all()


def random_case(generator: torch.Generator, batch: int, length: int, dtype: torch.dtype):
    x = torch.randn(batch, length, generator=generator, dtype=dtype)
    kind = torch.randint(0, 3, (), generator=generator).item()
    if kind == 0:  # right padding only
        lengths = torch.randint(0, length + 1, (batch,), generator=generator)
        mask = torch.arange(length)[None, :] < lengths[:, None]
    elif kind == 1:  # random holes
        mask = torch.rand(batch, length, generator=generator) < 0.7
    else:  # tool spans inside right-padded responses
        lengths = torch.randint(0, length + 1, (batch,), generator=generator)
        mask = torch.arange(length)[None, :] < lengths[:, None]
        start = torch.randint(0, length, (batch,), generator=generator)
        span = (torch.arange(length)[None, :] >= start[:, None]) & (
            torch.arange(length)[None, :] < start[:, None] + 5
        )
        mask &= ~span
    return x, mask


def loop_reference(x: torch.Tensor, mask: torch.Tensor, discount: float) -> torch.Tensor:
    """Independent scalar loop in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for i in range(x.shape[0]):
        running = 0.0
        for t in reversed(range(x.shape[1])):
            if mask[i, t]:
                running = float(x[i, t]) + discount * running
                out[i, t] = running
    return out


def test_discounted_cumsum_matches_a_scalar_loop() -> None:
    generator = torch.Generator().manual_seed(0)
    for length in [1, 2, 7, 33, 70]:
        x, mask = random_case(generator, 3, length, torch.float64)
        for discount in [0.0, 0.5, 0.97, 1.0]:
            expected = loop_reference(x, mask, discount)
            for chunk in [2, 4, 16, 128]:
                assert_close(
                    A.discounted_cumsum(x, mask, discount, chunk=chunk), expected, rtol=1e-11, atol=1e-11
                )
            assert_close(A.discounted_cumsum_loop(x, mask, discount), expected, rtol=1e-11, atol=1e-11)


def test_chunked_scan_equals_loop_float32_random() -> None:
    """Chunked vs per-token loop to 1e-5 relative (to the row's scale) for random lengths and masks."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(12):
        length = int(torch.randint(1, 1500, (), generator=generator))
        discount = [1.0, 0.999, 0.95, 0.5][int(torch.randint(0, 4, (), generator=generator))]
        chunk = [8, 32, 128][int(torch.randint(0, 3, (), generator=generator))]
        x, mask = random_case(generator, 4, length, torch.float32)
        fast = A.discounted_cumsum(x, mask, discount, chunk=chunk)
        slow = A.discounted_cumsum_loop(x, mask, discount)
        scale = slow.abs().amax(-1, keepdim=True).clamp(min=1e-30)
        assert ((fast - slow).abs() / scale).max() <= 1e-5
        assert (fast[~mask] == 0).all()

        values = torch.randn(x.shape, generator=generator)
        for got, want in zip(
            A.gae(x, values, mask, 0.99, 0.95, chunk), A.gae_loop(x, values, mask, 0.99, 0.95)
        ):
            scale = want.abs().amax(-1, keepdim=True).clamp(min=1e-30)
            assert ((got - want).abs() / scale).max() <= 1e-5


def test_scan_rejects_chunk_below_two() -> None:
    with pytest.raises(ValueError, match="chunk"):
        A.discounted_cumsum(torch.ones(1, 4), None, 0.5, chunk=1)


def test_scan_without_mask_and_gradient() -> None:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 300, generator=generator, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 300, generator=generator) < 0.8
    torch.testing.assert_close(
        A.discounted_cumsum(x, None, 0.9, chunk=16), loop_reference(x.detach(), torch.ones(2, 300), 0.9)
    )
    weights = torch.randn(2, 300, generator=generator, dtype=torch.float64)
    (grad_fast,) = torch.autograd.grad((A.discounted_cumsum(x, mask, 0.9, chunk=16) * weights).sum(), x)
    (grad_loop,) = torch.autograd.grad((A.discounted_cumsum_loop(x, mask, 0.9) * weights).sum(), x)
    torch.testing.assert_close(grad_fast, grad_loop)
    assert (grad_fast[~mask] == 0).all()  # a masked token's x is ignored


@pytest.mark.parametrize("singleton", ["zero", "raw"])
def test_needs_group_says_which_estimators_learn_nothing_from_one_sample_per_prompt(singleton) -> None:
    """The ``needs_group`` declaration matches the maths: with every group a singleton (one sample per
    prompt) exactly the estimators that declare it, under these options, give all-zero advantages."""
    registered = {}
    A.register_advantage_estimators(register=lambda name, fn, config_cls=None, **meta: registered.update(
        {name: (fn, config_cls, meta)}))  # fmt: skip
    batch = AdvantageInput(
        scores=torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=torch.float64), group_ids=torch.arange(4),
        response_mask=torch.ones(4, 3, dtype=torch.long),
        values=torch.tensor([[0.1, 0.2, 0.3]] * 4, dtype=torch.float64),
        baseline_scores=torch.zeros(4, dtype=torch.float64),  # ReMax's greedy rollouts, scored 0
        reward_components=torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.5, 0.0], [2.0, 0.0]], dtype=torch.float64),
        reward_weights=torch.ones(2, dtype=torch.float64),
    )  # fmt: skip
    for name, (fn, config_cls, meta) in registered.items():
        fields = {f for f in config_cls.__dataclass_fields__}
        cfg = config_cls(**({"singleton": singleton} if "singleton" in fields else {}))
        declared = meta.get("needs_group", False)
        needs_group = declared(cfg) if callable(declared) else bool(declared)
        advantages, _ = fn(batch, cfg)
        assert bool((advantages == 0).all()) == needs_group, name


# --------------------------------------------------------------------------------------------------
# OPO, GPG, GDPO, ReMax
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("singleton", ["zero", "raw"])
def test_opo_length_weighted_baseline(singleton: str) -> None:
    lengths = [sum(row) for row in MASK]
    expected = []
    for i in range(B):
        group = members(i)
        if len(group) == 1:
            expected.append(0.0 if singleton == "zero" else SCORES[i])
            continue
        baseline = sum(lengths[j] * SCORES[j] for j in group) / sum(lengths[j] for j in group)
        expected.append(SCORES[i] - baseline)
    adv, ret = A.opo_advantages(make_batch(), A.OPOConfig(singleton=singleton))
    assert_close(adv, broadcast(expected))
    assert_close(ret, adv)
    assert (adv[5:8] == 0).all()  # constant group (one row fully masked): exactly 0
    # equal lengths give the plain group mean (Dr.GRPO)
    batch = AdvantageInput(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64), torch.tensor([0, 0, 0]),
                           torch.ones(3, 4))
    assert_close(A.opo_advantages(batch, A.OPOConfig())[0][:, 0], [2 / 3, -1 / 3, -1 / 3])


@pytest.mark.parametrize("singleton", ["zero", "raw"])
@pytest.mark.parametrize("f_norm", [1.0, 2.5])
def test_gpg(singleton: str, f_norm: float) -> None:
    alpha = B / sum(1 for s in SCORES if s != 0)  # 9 / 8
    expected = []
    for i in range(B):
        rewards = [SCORES[j] for j in members(i)]
        if len(rewards) == 1:
            centred = 0.0 if singleton == "zero" else SCORES[i]
        else:
            centred = SCORES[i] - mean(rewards)
        expected.append(alpha * centred / f_norm)
    adv, ret = A.gpg_advantages(make_batch(), A.GPGConfig(f_norm=f_norm, singleton=singleton))
    assert_close(adv, broadcast(expected))
    assert_close(ret, adv)
    # all rewards zero: alpha = B / max(0, 1), advantages 0
    batch = AdvantageInput(torch.zeros(4), torch.tensor([0, 0, 1, 1]), torch.ones(4, 2))
    assert (A.gpg_advantages(batch, A.GPGConfig())[0] == 0).all()


COMPONENTS = [[1.0, 0.0], [0.0, 1.0], [0.5, 1.0], [2.0, 1.0], [1.0, 0.0], [0.3, 1.0], [0.3, 0.0], [0.3, 1.0],
              [-1.0, 0.5]]


@pytest.mark.parametrize("singleton", ["zero", "raw"])
@pytest.mark.parametrize("whiten_sum", [True, False])
def test_gdpo_normalises_each_reward_then_sums(singleton: str, whiten_sum: bool) -> None:
    weights = [0.7, 2.0]
    total = []
    for i in range(B):
        value = 0.0
        for k in range(2):
            rewards = [COMPONENTS[j][k] for j in members(i)]
            if len(rewards) == 1:
                a = 0.0 if singleton == "zero" else COMPONENTS[i][k] / (1 + 1e-6)
            else:
                mu, sd = mean(rewards), bessel_std(rewards)
                a = 0.0 if sd == 0 else (COMPONENTS[i][k] - mu) / (sd + 1e-6)
            value += weights[k] * a
        total.append(value)
    rows = broadcast(total).tolist()
    expected = whiten(rows) if whiten_sum else rows
    batch = make_batch()
    batch.reward_components = torch.tensor(COMPONENTS, dtype=torch.float64)
    batch.reward_weights = torch.tensor(weights, dtype=torch.float64)
    adv, ret = A.gdpo_advantages(batch, A.GDPOConfig(singleton=singleton, whiten=whiten_sum))
    assert_close(adv, expected)
    assert_close(ret, adv)
    # it differs from GRPO on the summed reward (the point of GDPO)
    summed = make_batch()
    summed.scores = torch.tensor([0.7 * a + 2.0 * b for a, b in COMPONENTS], dtype=torch.float64)
    grpo, _ = A.grpo_advantages(summed, A.GRPOConfig(singleton=singleton))
    assert not torch.allclose(grpo, adv)


def test_gdpo_without_components_is_an_error() -> None:
    with pytest.raises(ValueError, match="reward_components"):
        A.gdpo_advantages(make_batch(), A.GDPOConfig())


@pytest.mark.parametrize("with_token_rewards", [False, True])
def test_remax_greedy_baseline(with_token_rewards: bool) -> None:
    token_rewards = TOKEN_REWARDS if with_token_rewards else None
    baseline = [0.25 * i - 0.5 for i in range(B)]
    returns = hand_returns(hand_rewards(SCORES, token_rewards), 1.0)
    expected = [[returns[i][t] - baseline[i] * MASK[i][t] for t in range(T)] for i in range(B)]
    batch = make_batch(token_rewards)
    batch.baseline_scores = torch.tensor(baseline, dtype=torch.float64)
    adv, ret = A.remax_advantages(batch, A.ReMaxConfig())
    assert_close(adv, expected)
    assert_close(ret, returns)
    if not with_token_rewards:  # outcome only: R_i - b_i on every response token
        assert_close(adv, broadcast([SCORES[i] - baseline[i] for i in range(B)]))
    # a greedy completion as good as the sample gives exactly 0
    batch.baseline_scores = batch.scores.clone()
    batch.token_rewards = None
    assert (A.remax_advantages(batch, A.ReMaxConfig())[0] == 0).all()
    batch.baseline_scores = None
    with pytest.raises(ValueError, match="baseline_scores"):
        A.remax_advantages(batch, A.ReMaxConfig())


def test_remax_registration_declares_the_greedy_rollout() -> None:
    from rlite.plugin_manager import build_plugin_manager

    registry = build_plugin_manager(autoload=False).registry("advantage_estimator")
    assert registry.get("remax").metadata.get("needs_greedy_baseline") is True
    assert not registry.get("grpo").metadata.get("needs_greedy_baseline")


def test_gae_skips_observation_spans_as_if_they_were_not_there() -> None:
    """A multi-turn response: GAE over a row with observation tokens (mask 0) inside equals GAE over
    the same row with those tokens removed, and is 0 on them."""
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0, 1]], dtype=torch.float32)
    values = torch.randn(1, 9, generator=g)
    rewards = A.per_token_rewards(torch.tensor([0.7]), mask, torch.randn(1, 9, generator=g) * 0.1)
    advantages, returns = A.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    keep = mask[0].bool()
    compact_a, compact_r = A.gae(rewards[:, keep], values[:, keep], None, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages[:, keep], compact_a)
    torch.testing.assert_close(returns[:, keep], compact_r)
    assert advantages[:, ~keep].abs().sum() == 0 and returns[:, ~keep].abs().sum() == 0
