"""What the newer estimators read reaches them in a real run: ReMax's greedy baseline (asked for by the
estimator's registration, ``needs_greedy_baseline``) and GDPO's per-reward values and weights."""

from __future__ import annotations

import pytest
import torch

from rlite import hookimpl
from rlite.plugin_manager import build_plugin_manager, set_plugin_manager
from rlite.plugins import advantages as A
from rlite.run.loop import run_training
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir


def digits(completion, sample, cfg):
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def short(completion, sample, cfg):
    return 1.0 if len(completion) <= 3 else 0.0


class Probe:
    def __init__(self):
        self.batches, self.inputs = [], []

    @hookimpl
    def register_reward_functions(self, register):
        register("digits_fraction", digits)
        register("short", short)

    @hookimpl
    def register_advantage_estimators(self, register):
        def recording_gdpo(batch, cfg):
            self.inputs.append(batch)
            return A.gdpo_advantages(batch, cfg)

        register("recording_gdpo", recording_gdpo, A.GDPOConfig)

    @hookimpl
    def after_rewards(self, step, batch):
        self.batches.append(batch)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def probe():
    pm = build_plugin_manager(autoload=False)
    probe = Probe()
    pm.register(probe, name="probe")
    set_plugin_manager(pm)
    yield pm, probe
    set_plugin_manager(None)


def test_remax_gets_one_scored_greedy_completion_per_prompt(tmp_path, model_dir, probe):
    pm, recorder = probe
    cfg = tiny_config(model_dir, tmp_path / "run", "rewards=[digits_fraction]", "algorithm.advantage=remax",
                      "rollout.temperature=1.0", pm=pm)
    run_training(cfg)
    assert len(recorder.batches) == 2
    for batch in recorder.batches:
        ids = batch.group_ids.tolist()
        assert batch.baseline_scores is not None and len(batch.baseline_texts) == len(ids)
        for i, gid in enumerate(ids):
            first = ids.index(gid)
            # one greedy completion per prompt: the same text and reward for the whole group
            assert batch.baseline_texts[i] == batch.baseline_texts[first]
            assert batch.baseline_scores[i].item() == pytest.approx(digits(batch.baseline_texts[i], None, None), abs=1e-6)
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert all("reward/greedy_baseline" in r for r in rows)
    # a plain estimator asks for no greedy rollout
    recorder.batches.clear()
    cfg = tiny_config(model_dir, tmp_path / "run2", "rewards=[digits_fraction]", "training.steps=1", pm=pm)
    run_training(cfg)
    assert recorder.batches[0].baseline_scores is None and not recorder.batches[0].baseline_texts


def test_gdpo_reads_every_reward_function_and_its_weight(tmp_path, model_dir, probe):
    pm, recorder = probe
    cfg = tiny_config(model_dir, tmp_path / "run", "rewards=[digits_fraction,{name: short, args: {}}]",
                      "algorithm.advantage=recording_gdpo", "rollout.prompts_per_step=2", pm=pm)
    run_training(cfg)
    assert len(recorder.inputs) == 2
    for batch in recorder.inputs:
        assert batch.reward_components.shape == (len(batch.scores), 2)
        assert torch.equal(batch.reward_weights, torch.tensor([1.0, 1.0], dtype=torch.float64))
        torch.testing.assert_close(batch.scores.double(), batch.reward_components.double().sum(-1))
