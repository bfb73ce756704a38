"""TensorBoard after a resume: every step appears once (the steps logged after the checkpoint by the
interrupted run are purged), and rollout samples show as text."""

from __future__ import annotations

import pytest

from rlite.run.loop import run_training
from rlite.testing import tiny_config
from rlite.tokenizer import build_tiny_model_dir

pytest.importorskip("tensorboard")


def read_events(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_resumed_run_logs_each_step_once_to_tensorboard(tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / "model")
    run_dir = tmp_path / "run"
    common = ["logging.loggers=[jsonl,tensorboard]", "checkpoint.every=2", "logging.samples_every=1",
              "logging.samples_per_step=2"]
    # steps 1-3 are logged, the checkpoint holds step 2: a run that stopped after logging step 3
    run_training(tiny_config(model_dir, run_dir, *common, "training.steps=3"))
    before = read_events(run_dir / "tensorboard")
    assert [e.step for e in before.Scalars("reward/mean")] == [1, 2, 3]
    run_training(tiny_config(model_dir, run_dir, *common, "training.steps=4", "checkpoint.resume=auto"))
    after = read_events(run_dir / "tensorboard")
    for tag in ("reward/mean", "actor/pg_loss", "time/step"):
        assert [e.step for e in after.Scalars(tag)] == [1, 2, 3, 4], tag
    # text: the legacy EventAccumulator never purges tensors; the accumulator TensorBoard serves with does
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    served = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    served.Reload()
    assert [e.step for e in served.Tensors("reward/mean")] == [1, 2, 3, 4]
    texts = served.Tensors("samples/train/text_summary")
    assert [e.step for e in texts] == [1, 2, 3, 4]
    header = texts[-1].tensor_proto.string_val[0].decode().splitlines()[0]
    assert header.startswith("| group | prompt | prompt_text | answer | completion | reward | advantage | rewards |")
