"""Where the built-in transformers engine samples, in what dtype and with which decode (its config's
``device``, ``dtype`` and ``decode``, each ``auto`` by default), and its arguments checked as the config
loads. A GPU rank is described to the factory by :class:`rlite.api.EngineContext`; the placement rules
are functions of it, so they are checked here without a GPU (``tests/gpu`` runs them on one)."""

from __future__ import annotations

import pytest
import torch

from rlite.config import ConfigError, RolloutConfig
from rlite.engines.placement import EngineContext
from rlite.plugins.transformers import (
    TransformersEngineConfig,
    engine_decode,
    engine_device,
    engine_dtype,
    shares_weights,
)
from rlite.testing import tiny_config
from rlite.tokenizer import build_tiny_model_dir


def gpu_rank(index: int = 1, **kwargs) -> EngineContext:
    return EngineContext.single_process(gpu_index=index, gpu_uuid=f"GPU-{index}", **kwargs)


def test_auto_samples_on_the_ranks_own_gpu_and_cpu_keeps_it_on_the_host():
    auto = TransformersEngineConfig()
    assert engine_device(auto, gpu_rank(1)) == torch.device("cuda", 1)
    assert engine_device(auto, EngineContext.single_process()) == torch.device("cpu")
    assert engine_device(TransformersEngineConfig(device="cpu"), gpu_rank(1)) == torch.device("cpu")


def test_auto_dtype_is_the_trainers_compute_dtype():
    from rlite.config import ModelConfig

    model = ModelConfig(path="x")  # float32 master weights
    assert engine_dtype(TransformersEngineConfig(), model, gpu_rank(compute_dtype="bfloat16")) == "bfloat16"
    assert engine_dtype(TransformersEngineConfig(), model, EngineContext.single_process()) == "float32"
    assert engine_dtype(TransformersEngineConfig(dtype="float32"), model, gpu_rank(compute_dtype="bfloat16")) == "float32"


def test_auto_decode_is_the_graph_on_a_gpu_and_the_loop_where_a_setting_needs_it():
    auto, rollout = TransformersEngineConfig(), RolloutConfig()
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert engine_decode(auto, rollout, gpu_rank(0), cuda) == ("graph", True)
    assert engine_decode(auto, rollout, EngineContext.single_process(), cpu) == ("loop", False)
    assert engine_decode(auto, RolloutConfig(true_on_policy=True), gpu_rank(0), cuda) == ("loop", False)
    assert engine_decode(auto, rollout, gpu_rank(0, draft=object()), cuda) == ("loop", False)
    # what the user names is what runs, and a failed capture then refuses instead of falling back
    assert engine_decode(TransformersEngineConfig(decode="static"), rollout, gpu_rank(0), cuda) == ("static", False)
    assert engine_decode(TransformersEngineConfig(decode="graph"), rollout, gpu_rank(0), cuda) == ("graph", False)


def test_shared_weights_are_the_default_except_while_rollouts_overlap_the_update():
    assert shares_weights(TransformersEngineConfig(), RolloutConfig()) is True
    assert shares_weights(TransformersEngineConfig(), RolloutConfig(mode="one_step_off")) is False
    assert shares_weights(TransformersEngineConfig(), RolloutConfig(mode="async", max_staleness=0)) is True
    assert shares_weights(TransformersEngineConfig(share_weights=False), RolloutConfig()) is False


@pytest.mark.parametrize("key, value, allowed", [
    ("attn_implementation", "bogus", "sdpa, eager, flash_attention_2"),
    ("decode", "fast", "auto, loop, static, graph, generate"),
    ("device", "tpu", "auto, cpu"),
    ("dtype", "int8", "auto, float32, bfloat16, float16"),
])
def test_engine_arguments_are_checked_when_the_config_loads(tmp_path, key, value, allowed):
    model_dir = build_tiny_model_dir(tmp_path / "m")
    with pytest.raises(ConfigError, match=f"rollout.engine.args: {key} must be one of {allowed}.*got '{value}'"):
        tiny_config(model_dir, tmp_path / "run", f"rollout.engine.args.{key}={value}")


def test_the_engine_built_for_a_run_samples_in_the_trainers_compute_dtype(tmp_path):
    """parallelism.param_dtype=bfloat16 over float32 master weights: the engine keeps a bfloat16 copy (no
    sharing across dtypes), and what it holds is the trainer's weights rounded to bfloat16."""
    from rlite.distributed import shutdown_distributed
    from rlite.plugin_manager import get_plugin_manager
    from rlite.run.build import build_run

    cfg = tiny_config(build_tiny_model_dir(tmp_path / "m"), tmp_path / "run", "parallelism.param_dtype=bfloat16")
    run = build_run(cfg, get_plugin_manager())
    try:
        engine = run.engine
        assert engine.shared_bytes == 0 and engine.decode == "loop"
        trainer = dict(run.policy.backend.full_weights())
        for name, param in engine.model.named_parameters():
            assert param.dtype == torch.bfloat16 and torch.equal(param, trainer[name].to(torch.bfloat16)), name
    finally:
        run.engine.shutdown()
        run.policy.backend.close()
        shutdown_distributed(run.ctx)
