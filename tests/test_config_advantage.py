"""``algorithm.advantage`` is looked up in one place (:func:`rlite.config.advantage.advantage_choice`), and its
``needs_group`` declaration has one reading there: evaluated on the options for the one-sample-per-prompt
refusal, declared-at-all for the learning-signal watch. The loader, the run builder and the loop read it
through that function, so they agree."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from rlite.api import hookimpl
from rlite.config import ConfigError, load_config
from rlite.config.advantage import advantage_choice
from rlite.plugin_manager import build_plugin_manager
from rlite.run.recorder import group_relative

BASE = ["model.path=x", "data.task=addition"]


@dataclass
class PairConfig:
    scale: float = 1.0
    """Multiplier."""


class ThirdParty:
    @hookimpl
    def register_advantage_estimators(self, register):
        register("pair_baseline", lambda batch, cfg: None, PairConfig, needs_group=True)


@pytest.fixture(scope="module")
def pm():
    pm = build_plugin_manager(autoload=False)
    pm.register(ThirdParty(), name="third_party")
    return pm


@pytest.mark.parametrize(
    ("overrides", "needs_group", "group_baseline", "optional", "critic", "greedy"),
    [
        (["algorithm.advantage=grpo"], True, True, True, False, False),
        (["algorithm.advantage=grpo", "algorithm.advantage.args.singleton=raw"], False, True, True, False, False),
        (["algorithm.advantage=rloo"], True, True, True, False, False),
        (["algorithm.advantage=gae", "algorithm.critic.enabled=true"], False, False, False, True, False),
        (["algorithm.advantage=remax"], False, False, False, False, True),
        (["algorithm.advantage=reinforce_pp"], False, False, False, False, False),
        (["algorithm.advantage=pair_baseline"], True, True, False, False, False),
    ],
)  # fmt: skip
def test_the_declarations_read_in_one_place(pm, overrides, needs_group, group_baseline, optional, critic, greedy):
    cfg = load_config(None, [*BASE, *overrides], pm=pm)
    advantage = advantage_choice(cfg.algorithm, pm.registries)
    entry = pm.registry("advantage_estimator").get(cfg.algorithm.advantage.name)
    assert advantage.name == entry.name and advantage.implementation is entry.implementation
    assert isinstance(advantage.options, entry.config_cls)
    assert (advantage.needs_group, advantage.group_baseline, advantage.group_need_is_optional,
            advantage.needs_critic, advantage.needs_greedy_baseline) == (needs_group, group_baseline, optional, critic,
                                                                         greedy)  # fmt: skip
    # the loop watches exactly the estimators whose baseline is the group's
    assert group_relative(cfg, pm) is group_baseline


def test_one_sample_per_prompt_is_refused_only_where_the_options_need_a_group(pm):
    with pytest.raises(ConfigError, match=r"algorithm.advantage=grpo compares each sample.*singleton=raw"):
        load_config(None, [*BASE, "rollout.samples_per_prompt=1"], pm=pm)
    with pytest.raises(ConfigError) as raised:  # declared True, not by options: no hint about options
        load_config(None, [*BASE, "rollout.samples_per_prompt=1", "algorithm.advantage=pair_baseline"], pm=pm)
    assert "singleton=raw" not in str(raised.value)
    able = str(raised.value).split("works with one sample: ")[1].split(", ")
    assert "gae" in able and "remax" in able and "grpo" not in able and "pair_baseline" not in able
    cfg = load_config(None, [*BASE, "rollout.samples_per_prompt=1", "algorithm.advantage.args.singleton=raw"], pm=pm)
    assert not advantage_choice(cfg.algorithm, pm.registries).needs_group


def test_a_critic_estimator_without_a_critic_is_refused(pm):
    with pytest.raises(ConfigError, match=r"algorithm.advantage=gae needs a critic: set algorithm.critic.enabled=true"):
        load_config(None, [*BASE, "algorithm.advantage=gae"], pm=pm)
