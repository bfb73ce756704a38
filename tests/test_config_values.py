"""Values that cannot work are refused when the config loads: exit 2 and one line naming the key and the valid range."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from rlite.plugin_manager import set_plugin_manager
from rlite.tools.cli import main


@pytest.fixture
def config_file(tmp_path: Path) -> str:
    path = tmp_path / "run.yaml"
    path.write_text("model: {path: tiny-model}\ndata: {task: addition}\ntraining: {steps: 3}\n")
    return str(path)


@pytest.fixture
def loop_calls(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """``rlite.run.loop`` replaced by a recorder: a refused config must never reach the loop."""
    calls: list[object] = []
    loop = types.ModuleType("rlite.run.loop")
    loop.run_training = lambda cfg, pm, preemption=None: calls.append(cfg)
    monkeypatch.setitem(sys.modules, "rlite.run.loop", loop)
    yield calls
    set_plugin_manager(None)


BAD_VALUES = [
    # (override, what the one line must hold)
    ("training.betas=[1.5,0.999]", ["training.betas[0]", "1.5", "[0, 1)"]),
    ("training.betas=[0.9,-0.1]", ["training.betas[1]", "-0.1", "[0, 1)"]),
    ("training.eps=-1", ["training.eps", "-1", "> 0"]),
    ("training.weight_decay=-1", ["training.weight_decay", "-1", ">= 0"]),
    ("training.grad_clip=-1", ["training.grad_clip", "-1", ">= 0", "0 = no clipping"]),
    ("training.warmup_steps=-3", ["training.warmup_steps", "-3", ">= 0"]),
    ("rollout.top_k=-1", ["rollout.top_k", "-1", ">= 0", "0 = off"]),
    ("training.eval_every=-1", ["training.eval_every", "-1", ">= 0"]),
    ("rollout.timeout_s=-1", ["rollout.timeout_s", "-1", "> 0"]),
    ("rollout.timeout_s=0", ["rollout.timeout_s", "0", "> 0"]),
    ("algorithm.critic.grad_clip=-2", ["algorithm.critic.grad_clip", ">= 0"]),
    ("training.min_lr_ratio=1.5", ["training.min_lr_ratio", "[0, 1]"]),
    ("training.eval_max_prompts=-1", ["training.eval_max_prompts", ">= 0"]),
    ("training.num_threads=0", ["training.num_threads", ">= 1"]),
    ("algorithm.kl.coef=-0.1", ["algorithm.kl.coef", ">= 0"]),
    ("algorithm.kl.adaptive_horizon=0", ["algorithm.kl.adaptive_horizon", "> 0"]),
    ("model.lora.dropout=1.0", ["model.lora.dropout", "[0, 1)"]),
    ("model.dtype=float16", ["model.dtype=float16", "without loss scaling", "bfloat16"]),
    ("parallelism.param_dtype=float16", ["parallelism.param_dtype=float16", "without loss scaling"]),
    ("parallelism.reduce_dtype=float16", ["parallelism.reduce_dtype=float16", "without loss scaling"]),
    ("model.attn_implementation=flash", ["model.attn_implementation", "'flash'", "sdpa, eager, flash_attention_2"]),
    ("rewards=[{name: python", ["override 'rewards=[{name: python'", "does not parse", "did not find expected"]),
]


@pytest.mark.parametrize("command", ["config", "train"])
@pytest.mark.parametrize(("override", "expected"), BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_a_value_that_cannot_work_exits_2_naming_key_and_range(
    stand_ins, loop_calls, config_file, capsys, command: str, override: str, expected: list[str]
) -> None:
    assert main([command, config_file, override]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"rlite {command}: error: ")
    for part in expected:
        assert part in line, (part, line)
    assert loop_calls == []


@pytest.mark.parametrize("run_dir", ["afile", "afile/sub"])
def test_a_run_dir_on_a_file_exits_2(stand_ins, loop_calls, config_file, tmp_path, capsys, run_dir: str) -> None:
    (tmp_path / "afile").write_text("not a folder")
    assert main(["train", config_file, f"logging.run_dir={tmp_path / run_dir}"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "logging.run_dir" in line and str(tmp_path / "afile") in line and "is not a folder" in line
    assert loop_calls == []


def test_the_edges_of_each_range_are_accepted(stand_ins, loop_calls, config_file) -> None:
    edges = ["training.betas=[0.0,0.0]", "training.eps=1e-12", "training.weight_decay=0", "training.grad_clip=0",
             "training.warmup_steps=0", "rollout.top_k=0", "training.eval_every=0", "rollout.timeout_s=0.5",
             "model.attn_implementation=eager"]
    assert main(["train", config_file, *edges]) == 0
    assert len(loop_calls) == 1
