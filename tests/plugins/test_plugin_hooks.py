"""Every hook has a ``test_hook_<name>`` here that registers a temporary plugin and sees the hook
called with its documented arguments.

Registration hooks are called by the manager when it collects its registries; lifecycle hooks are
called directly here with realistic arguments (``test_hooks_in_run.py`` sees them from a real run).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlite import hookimpl, hookspecs
from rlite.config import RunConfig, load_config

HOOKS = {
    name: function
    for name, function in vars(hookspecs).items()
    if callable(function) and hasattr(function, f"{hookspecs.PROJECT_NAME}_spec")
}
LIFECYCLE_HOOKS = sorted(name for name in HOOKS if not name.startswith("register_"))


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_plugin_hooks_have_tests(name: str) -> None:
    assert callable(globals().get(f"test_hook_{name}")), f"add test_hook_{name} to {__file__}"


def test_recorder_implements_every_lifecycle_hook_with_its_signature(lifecycle_recorder) -> None:
    for name in LIFECYCLE_HOOKS:
        implemented = list(inspect.signature(getattr(lifecycle_recorder, name)).parameters)
        assert implemented == list(inspect.signature(HOOKS[name]).parameters), name


# --------------------------------------------------------------------------------------------------
# registration hooks
# --------------------------------------------------------------------------------------------------


@dataclass
class ScaleConfig:
    scale: float = 1.0
    """A test option."""


def registration_plugin(hook_name: str, name: str, implementation: object, config_cls: type | None) -> object:
    """A plugin whose ``hook_name`` implementation registers one thing, recording the call."""
    calls: list[object] = []

    def hook(register):
        calls.append(register)
        if config_cls is None:
            register(name, implementation)
        else:
            register(name, implementation, config_cls)

    hook.__name__ = hook_name
    return SimpleNamespace(**{hook_name: hookimpl(hook)}, calls=calls)


def check_registration(
    pm, temp_plugin, hook_name: str, kind: str, config_cls: type | None = ScaleConfig
) -> None:
    def implementation(*args, **kwargs):
        return None

    plugin = temp_plugin(
        registration_plugin(hook_name, "test_choice", implementation, config_cls), name="test-plugin"
    )
    entry = pm.registry(kind).get("test_choice")
    assert len(plugin.calls) == 1 and callable(plugin.calls[0])
    assert entry.implementation is implementation
    assert entry.config_cls is config_cls
    assert entry.plugin == "test-plugin"
    assert "test_choice" in pm.registry(kind).names()

    pm.unregister(name="test-plugin")
    assert "test_choice" not in pm.registry(kind).names()


def test_hook_register_advantage_estimators(pm, temp_plugin) -> None:
    check_registration(pm, temp_plugin, "register_advantage_estimators", "advantage_estimator")


def test_hook_register_policy_losses(pm, temp_plugin) -> None:
    check_registration(pm, temp_plugin, "register_policy_losses", "policy_loss")


def test_hook_register_kl_estimators(pm, temp_plugin) -> None:
    check_registration(pm, temp_plugin, "register_kl_estimators", "kl_estimator", config_cls=None)


def test_hook_register_mismatch_corrections(pm, temp_plugin) -> None:
    check_registration(pm, temp_plugin, "register_mismatch_corrections", "mismatch_correction")


def test_hook_register_rollout_quantizers(pm, temp_plugin) -> None:
    check_registration(pm, temp_plugin, "register_rollout_quantizers", "rollout_quantizer")


def test_hook_register_speculative_drafts(pm, temp_plugin) -> None:
    check_registration(pm, temp_plugin, "register_speculative_drafts", "speculative_draft")


def test_hook_register_training_backends(pm, temp_plugin) -> None:
    check_registration(pm, temp_plugin, "register_training_backends", "training_backend")


def test_hook_register_rollout_engines(pm, temp_plugin) -> None:
    check_registration(pm, temp_plugin, "register_rollout_engines", "rollout_engine")


def test_hook_register_reward_functions(pm, temp_plugin) -> None:
    check_registration(pm, temp_plugin, "register_reward_functions", "reward_function")


def test_hook_register_rollout_workflows(pm, temp_plugin) -> None:
    check_registration(pm, temp_plugin, "register_rollout_workflows", "rollout_workflow")


def test_hook_register_loggers(pm, temp_plugin) -> None:
    check_registration(pm, temp_plugin, "register_loggers", "logger", config_cls=None)


def test_registered_choice_is_selectable_with_validated_args(temp_plugin, stand_ins) -> None:
    from rlite.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(autoload=False)  # rebuilt: stand_ins adds a built-in
    temp_plugin(
        registration_plugin("register_advantage_estimators", "test_scaled", print, ScaleConfig), manager=pm
    )
    cfg = load_config(
        None,
        [
            "model.path=m",
            "data.task=addition",
            "algorithm.advantage=test_scaled",
            "algorithm.advantage.args.scale=3",
        ],
        pm,
    )
    assert cfg.algorithm.advantage.name == "test_scaled"
    assert cfg.algorithm.advantage.args == {"scale": 3.0}


# --------------------------------------------------------------------------------------------------
# lifecycle hooks, called as the training loop calls them
# --------------------------------------------------------------------------------------------------


def make_run_config() -> RunConfig:
    return load_config(None, ["model.path=tiny-model", "data.task=addition"], pm=False)


def make_batch(scores: bool = False):
    """A 2-prompt x 2-sample batch, as the rollout step hands it over."""
    fields = dict(
        prompt_ids=torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]]),
        prompt_mask=torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]]),
        response_ids=torch.tensor([[3, 4, 2], [3, 2, 0], [4, 4, 4], [2, 0, 0]]),
        response_mask=torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]),
        rollout_logprobs=torch.full((4, 3), -1.0),
        group_ids=torch.tensor([0, 0, 1, 1]),
        finish_reasons=["stop", "stop", "length", "stop"],
        samples=[{"prompt": "1+1=", "answer": "2"}] * 2 + [{"prompt": "2+3=", "answer": "5"}] * 2,
        completion_texts=["2", "3", "555", "5"],
        scores=torch.tensor([1.0, 0.0, 0.0, 1.0]) if scores else None,
    )
    try:
        from rlite.rollout import RolloutBatch

        return RolloutBatch(**fields)
    except (ImportError, TypeError):  # rollout module not written yet, or its fields changed
        return SimpleNamespace(**fields)


class FakeEngine:
    def __init__(self) -> None:
        self.weight_version = 0

    def update_weights(self, named_tensors, version: int) -> None:
        self.weight_version = version


def test_hook_on_run_start(pm, temp_plugin, lifecycle_recorder, tmp_path: Path) -> None:
    temp_plugin(lifecycle_recorder)
    config = make_run_config()
    pm.hook.on_run_start(config=config, run_dir=tmp_path)
    assert lifecycle_recorder.calls == [("on_run_start", {"config": config, "run_dir": tmp_path})]


def test_hook_after_rollout(pm, temp_plugin, lifecycle_recorder) -> None:
    class DropTruncated:
        @hookimpl
        def after_rollout(self, step, batch):
            batch.response_mask[[i for i, r in enumerate(batch.finish_reasons) if r == "length"]] = 0

    temp_plugin(DropTruncated())
    temp_plugin(lifecycle_recorder)
    batch = make_batch()
    pm.hook.after_rollout(step=1, batch=batch)
    assert lifecycle_recorder.calls == [("after_rollout", {"step": 1, "batch": batch})]
    assert batch.response_mask[2].sum() == 0 and batch.response_mask[0].sum() == 3  # edited in place


def test_hook_after_rewards(pm, temp_plugin, lifecycle_recorder) -> None:
    class CenterScores:
        @hookimpl
        def after_rewards(self, step, batch):
            batch.scores -= 0.5

    temp_plugin(CenterScores())
    temp_plugin(lifecycle_recorder)
    batch = make_batch(scores=True)
    pm.hook.after_rewards(step=2, batch=batch)
    assert lifecycle_recorder.calls == [("after_rewards", {"step": 2, "batch": batch})]
    assert batch.scores.tolist() == [0.5, -0.5, -0.5, 0.5]


def test_hook_before_optimizer_step(pm, temp_plugin, lifecycle_recorder) -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()

    class ZeroBiasGrad:
        @hookimpl
        def before_optimizer_step(self, model):
            model.bias.grad.zero_()

    temp_plugin(ZeroBiasGrad())
    temp_plugin(lifecycle_recorder)
    bias_before = model.bias.detach().clone()
    pm.hook.before_optimizer_step(step=3, model=model, optimizer=optimizer)
    optimizer.step()
    assert lifecycle_recorder.calls == [
        ("before_optimizer_step", {"step": 3, "model": model, "optimizer": optimizer})
    ]
    assert torch.equal(model.bias, bias_before)


def test_hook_after_optimizer_step(pm, temp_plugin, lifecycle_recorder) -> None:
    class WeightNorm:
        @hookimpl
        def after_optimizer_step(self, model, metrics):
            metrics["plugin/weight_norm"] = float(model.weight.detach().norm())

    temp_plugin(WeightNorm())
    temp_plugin(lifecycle_recorder)
    model = torch.nn.Linear(4, 2)
    metrics = {"actor/pg_loss": 0.25, "actor/grad_norm": 1.5}
    pm.hook.after_optimizer_step(step=4, model=model, metrics=metrics)
    assert lifecycle_recorder.calls == [
        ("after_optimizer_step", {"step": 4, "model": model, "metrics": metrics})
    ]
    assert metrics["plugin/weight_norm"] == pytest.approx(float(model.weight.detach().norm()))


def test_hook_after_weight_sync(pm, temp_plugin, lifecycle_recorder) -> None:
    temp_plugin(lifecycle_recorder)
    engine = FakeEngine()
    engine.update_weights([("lm_head.weight", torch.zeros(2, 2))], version=5)
    pm.hook.after_weight_sync(step=5, weight_version=5, engine=engine)
    assert lifecycle_recorder.calls == [
        ("after_weight_sync", {"step": 5, "weight_version": 5, "engine": engine})
    ]


def test_hook_on_checkpoint_save(pm, temp_plugin, lifecycle_recorder, tmp_path: Path) -> None:
    class SaveState:
        @hookimpl
        def on_checkpoint_save(self, step, path):
            (path / "plugin_state.txt").write_text(str(step))

    temp_plugin(SaveState())
    temp_plugin(lifecycle_recorder)
    checkpoint = tmp_path / "step_000006"
    checkpoint.mkdir()
    pm.hook.on_checkpoint_save(step=6, path=checkpoint)
    assert lifecycle_recorder.calls == [("on_checkpoint_save", {"step": 6, "path": checkpoint})]
    assert (checkpoint / "plugin_state.txt").read_text() == "6"


def test_hook_on_checkpoint_load(pm, temp_plugin, lifecycle_recorder, tmp_path: Path) -> None:
    temp_plugin(lifecycle_recorder)
    pm.hook.on_checkpoint_load(step=6, path=tmp_path)
    assert lifecycle_recorder.calls == [("on_checkpoint_load", {"step": 6, "path": tmp_path})]


def test_hook_on_metrics(pm, temp_plugin, lifecycle_recorder) -> None:
    temp_plugin(lifecycle_recorder)
    metrics = {"actor/pg_loss": 0.1, "reward/mean": 0.5}
    pm.hook.on_metrics(step=7, metrics=metrics)
    assert lifecycle_recorder.calls == [("on_metrics", {"step": 7, "metrics": metrics})]


def test_hook_on_run_end(pm, temp_plugin, lifecycle_recorder) -> None:
    temp_plugin(lifecycle_recorder)
    config = make_run_config()
    summary = {"steps": 8, "reward/mean": 0.75}
    pm.hook.on_run_end(config=config, summary=summary)
    assert lifecycle_recorder.calls == [("on_run_end", {"config": config, "summary": summary})]


def test_implementation_may_take_fewer_arguments_than_the_spec(pm, temp_plugin) -> None:
    seen = []

    class StepsOnly:
        @hookimpl
        def on_metrics(self, step):
            seen.append(step)

    temp_plugin(StepsOnly())
    pm.hook.on_metrics(step=9, metrics={"reward/mean": 1.0})
    assert seen == [9]


def test_all_implementations_of_a_hook_are_called(pm, temp_plugin) -> None:
    order = []

    class First:
        @hookimpl
        def on_metrics(self, step):
            order.append("first")

    class Second:
        @hookimpl
        def on_metrics(self, step):
            order.append("second")

    temp_plugin(First())
    temp_plugin(Second())
    pm.hook.on_metrics(step=1, metrics={})
    assert order == ["second", "first"]  # most recently registered first, as documented
