"""Every lifecycle hook is called by a real (tiny, CPU) training run with its documented arguments.

Two runs share a folder: 2 steps with a checkpoint every step, then the same config with 3 steps,
which resumes from the step-2 checkpoint (``on_checkpoint_load``) and trains step 3.
"""

from __future__ import annotations

import importlib
import numbers
from pathlib import Path

import pytest
import torch

from rlite import hookimpl
from rlite.config import RunConfig, load_config
from rlite.plugin_manager import build_plugin_manager, set_plugin_manager


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


pytestmark = [
    pytest.mark.skipif(not importable("rlite.run.loop"), reason="rlite.run.loop is not written yet"),
    pytest.mark.skipif(not importable("rlite.tokenizer"), reason="rlite.tokenizer is not written yet"),
]

STEP_ORDER = [
    "after_rollout",
    "after_rewards",
    "before_optimizer_step",
    "after_optimizer_step",
    "after_weight_sync",
    "on_metrics",
    "on_checkpoint_save",
]


class CheckpointProbe:
    """Whether the checkpoint folder exists at the moment the hook is called."""

    def __init__(self) -> None:
        self.saved_folder_existed: list[bool] = []
        self.loaded_folder_existed: list[bool] = []

    @hookimpl
    def on_checkpoint_save(self, path):
        self.saved_folder_existed.append(Path(path).is_dir())

    @hookimpl
    def on_checkpoint_load(self, path):
        self.loaded_folder_existed.append(Path(path).is_dir())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlite.tokenizer import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"), hidden=64, layers=2)


def run_with_recorder(recorder, probe: CheckpointProbe, overrides: list[str]) -> RunConfig:
    from rlite.run.loop import run_training

    pm = build_plugin_manager(autoload=False)
    pm.register(recorder, name="recorder")
    pm.register(probe, name="checkpoint-probe")
    cfg = load_config(None, overrides, pm)
    set_plugin_manager(pm)
    try:
        run_training(cfg)
    finally:
        set_plugin_manager(None)
    return cfg


@pytest.fixture(scope="module")
def runs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, lifecycle_recorder_class) -> dict:
    run_dir = tmp_path_factory.mktemp("run")
    overrides = [
        f"model.path={model_dir}",
        "data.task=addition",
        "training.steps=2",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=4",
        f"logging.run_dir={run_dir}",
        "checkpoint.every=1",
        "training.eval_every=1",
        "logging.progress_bar=false",
        "logging.loggers=[jsonl]",
    ]
    first, first_probe = lifecycle_recorder_class(), CheckpointProbe()
    first_cfg = run_with_recorder(first, first_probe, overrides)
    resumed, resumed_probe = lifecycle_recorder_class(), CheckpointProbe()
    run_with_recorder(resumed, resumed_probe, [*overrides, "training.steps=3", "checkpoint.resume=auto"])
    return {
        "first": first,
        "first_probe": first_probe,
        "first_cfg": first_cfg,
        "run_dir": run_dir,
        "resumed": resumed,
        "resumed_probe": resumed_probe,
    }


def steps_of(recorder, hook: str) -> list[int]:
    return [call["step"] for call in recorder.called(hook)]


def assert_metrics(metrics) -> None:
    assert isinstance(metrics, dict) and metrics
    for name, value in metrics.items():
        assert isinstance(name, str)
        assert isinstance(value, numbers.Real) and not isinstance(value, bool), f"{name}={value!r}"


def test_every_lifecycle_hook_is_called_by_a_run(runs) -> None:
    called = {name for name, _ in runs["first"].calls} | {name for name, _ in runs["resumed"].calls}
    expected = {
        name for name in dir(type(runs["first"])) if hasattr(getattr(type(runs["first"]), name), "rlite_impl")
    }
    assert called == expected


def test_run_start_and_end(runs) -> None:
    recorder = runs["first"]
    ((start,),) = [recorder.called("on_run_start")]
    assert isinstance(start["config"], RunConfig) and start["config"] == runs["first_cfg"]
    assert isinstance(start["run_dir"], Path) and start["run_dir"].resolve() == runs["run_dir"].resolve()
    ((end,),) = [recorder.called("on_run_end")]
    assert isinstance(end["config"], RunConfig) and isinstance(end["summary"], dict)
    assert recorder.calls[0][0] == "on_run_start" and recorder.calls[-1][0] == "on_run_end"


def test_step_hooks_are_called_each_step_in_the_documented_order(runs) -> None:
    recorder = runs["first"]
    # on_metrics also reports the baseline evaluation before training as step 0 (hookspecs)
    assert steps_of(recorder, "on_metrics")[0] in (0, 1)
    assert [s for s in steps_of(recorder, "on_metrics") if s] == [1, 2]
    for hook in ("after_rollout", "after_rewards", "after_optimizer_step", "after_weight_sync"):
        assert steps_of(recorder, hook) == [1, 2], (
            f"{hook}: once per training step, with the 1-based step (hookspecs)"
        )
    assert sorted(set(steps_of(recorder, "before_optimizer_step"))) == [1, 2]
    assert sorted(set(steps_of(recorder, "on_checkpoint_save"))) == [1, 2]
    step_one = [name for name, kwargs in recorder.calls if kwargs.get("step") == 1]
    deduplicated = [name for index, name in enumerate(step_one) if index == 0 or step_one[index - 1] != name]
    assert deduplicated == STEP_ORDER


def test_rollout_and_reward_hooks_receive_the_batch(runs) -> None:
    from rlite.rollout import RolloutBatch

    for call in runs["first"].called("after_rollout") + runs["first"].called("after_rewards"):
        assert isinstance(call["step"], int)
        assert isinstance(call["batch"], RolloutBatch)
        assert call["batch"].response_ids.shape[0] == 4  # 2 prompts x 2 samples on one rank
    for call in runs["first"].called("after_rewards"):
        assert isinstance(call["batch"].scores, torch.Tensor) and call["batch"].scores.shape == (4,)


def test_optimizer_hooks_receive_model_optimizer_and_metrics(runs) -> None:
    for call in runs["first"].called("before_optimizer_step"):
        assert isinstance(call["step"], int)
        assert isinstance(call["model"], torch.nn.Module)
        assert isinstance(call["optimizer"], torch.optim.Optimizer)
    for call in runs["first"].called("after_optimizer_step"):
        assert isinstance(call["model"], torch.nn.Module)
        assert_metrics(call["metrics"])


def test_weight_sync_hook_receives_the_engine_and_its_version(runs) -> None:
    from rlite.engines.base import RolloutEngine

    for call in runs["first"].called("after_weight_sync"):
        assert isinstance(call["weight_version"], int)
        assert isinstance(call["engine"], RolloutEngine)


def test_metrics_hook_receives_flat_metrics(runs) -> None:
    for call in runs["first"].called("on_metrics"):
        assert isinstance(call["step"], int)
        assert_metrics(call["metrics"])


def test_checkpoint_hooks_receive_existing_folders(runs) -> None:
    for call in runs["first"].called("on_checkpoint_save"):
        assert isinstance(call["step"], int) and isinstance(call["path"], Path)
    assert runs["first_probe"].saved_folder_existed and all(runs["first_probe"].saved_folder_existed)

    ((load,),) = [runs["resumed"].called("on_checkpoint_load")]
    assert load["step"] == 2 and isinstance(load["path"], Path)
    assert runs["resumed_probe"].loaded_folder_existed == [True]
    assert steps_of(runs["resumed"], "after_rollout") == [3]
