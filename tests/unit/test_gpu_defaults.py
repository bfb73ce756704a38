"""The trainer's GPU defaults resolve as documented, decided by pure functions of the device type (so they are
checked here, on a CPU, for a CUDA device too), and the CPU keeps what it always ran.

- ``parallelism.shard_single_process=auto``: FSDP2 on a CPU; on one CUDA GPU the plain model unless
  ``cpu_offload`` or fp32 master weights with bf16 compute ask for FSDP2
  (:func:`rlite.plugins.fsdp2.sharding.shards_single_process`).
- ``training.liger_fused_logprobs=auto``: liger's fused output layer on CUDA with liger-kernel >= 0.8.2, a
  backend that takes it and no entropy term in the loss; never on a CPU (:func:`rlite.run.policy.resolve_liger`).
- AdamW is torch's fused kernel, on every device, for the policy and the critic.
"""

from __future__ import annotations

import pytest
import torch

from rlite.config import ConfigError
from rlite.plugins.fsdp2.sharding import shards_single_process
from rlite.run.policy import resolve_liger


@pytest.mark.parametrize(
    "device,param_dtype,model_dtype,cpu_offload,sharded",
    [
        ("cpu", "float32", "float32", False, True),  # the CPU: FSDP2, as before
        ("cpu", "bfloat16", "bfloat16", False, True),
        ("cpu", "bfloat16", "float32", False, True),
        ("cuda", "float32", "float32", False, False),  # one GPU, fp32: plain
        ("cuda", "bfloat16", "bfloat16", False, False),  # pure bf16: plain
        ("cuda", "bfloat16", "float32", False, True),  # fp32 masters, bf16 compute: FSDP2's mixed precision
        ("cuda", "float32", "float32", True, True),  # offload: FSDP2's CPUOffloadPolicy
        ("cuda", "bfloat16", "bfloat16", True, True),
    ],
)
def test_shard_single_process_auto_resolves_by_device_and_precision(device, param_dtype, model_dtype, cpu_offload,
                                                                     sharded):
    assert shards_single_process("auto", device, param_dtype=param_dtype, model_dtype=model_dtype,
                                 cpu_offload=cpu_offload) is sharded


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_shard_single_process_true_and_false_are_taken_as_they_are(device):
    for setting in (True, False):
        assert shards_single_process(setting, device, param_dtype="float32", model_dtype="float32",
                                     cpu_offload=False) is setting


def _liger(setting, device="cuda", *, fuses=True, entropy=False, installed="0.8.5"):
    return resolve_liger(setting, device_type=device, backend_fuses=fuses, entropy_in_loss=entropy, installed=installed)


def test_liger_auto_is_on_exactly_where_it_can_run():
    assert _liger("auto") is True
    assert _liger("auto", "cpu") is False, "the CPU keeps the chunked output layer"
    assert _liger("auto", installed=None) is False, "not installed"
    assert _liger("auto", installed="0.8.1") is False, "a liger-kernel with wrong per-token gradients"
    assert _liger("auto", installed="unknown") is False
    assert _liger("auto", entropy=True) is False, "an entropy term in the loss needs the chunked path's gradient"
    assert _liger("auto", fuses=False) is False, "a backend that computes its own log-probs (megatron)"
    assert _liger(False) is False


def test_liger_true_runs_where_auto_would_and_says_why_elsewhere():
    assert _liger(True) is True
    for kwargs, message in [
        (dict(device="cpu"), "needs CUDA"),
        (dict(installed=None), "not installed"),
        (dict(installed="0.8.1"), ">=0.8.2"),
        (dict(entropy=True), "entropy"),
        (dict(fuses=False), "computes its log-probs itself"),
    ]:
        device = kwargs.pop("device", "cuda")
        with pytest.raises(ConfigError, match=message):
            _liger(True, device, **kwargs)


def test_the_cpu_defaults_are_what_they_were(tmp_path):
    """On this machine the defaults resolve to FSDP2 at world size 1 and the chunked output layer, and AdamW
    is fused for the policy and the critic."""
    from torch.distributed.fsdp import FSDPModule

    from rlite.distributed import shutdown_distributed
    from rlite.plugin_manager import get_plugin_manager
    from rlite.run.build import build_run
    from rlite.testing import tiny_config
    from rlite.tokenizer import build_tiny_model_dir

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/gpu checks the GPU defaults")
    model_dir = build_tiny_model_dir(tmp_path / "tiny")
    cfg = tiny_config(model_dir, tmp_path / "run", "algorithm.advantage=gae", "algorithm.critic.enabled=true")
    assert cfg.parallelism.shard_single_process == "auto" and cfg.training.liger_fused_logprobs == "auto"
    assert cfg.training.compile is False and cfg.training.max_tokens_per_micro_batch == 0
    run = build_run(cfg, get_plugin_manager())
    try:
        assert isinstance(run.policy.backend.model, FSDPModule), "FSDP2 at world size 1 on a CPU, as before"
        assert isinstance(run.policy.critic.model, FSDPModule)
        assert run.policy.forward.use_liger is False
        assert run.policy.backend.optimizer.defaults["fused"] is True
        assert run.policy.critic.optimizer.defaults["fused"] is True
    finally:
        run.engine.shutdown()
        shutdown_distributed(run.ctx)


def test_a_plain_pure_bf16_model_trains(tmp_path):
    """``shard_single_process=false`` with ``model.dtype=param_dtype=bfloat16`` (what auto picks for pure bf16 on
    one GPU): plain bf16 parameters, gradients added in place, and an optimizer step that moves them."""
    import torch.distributed as dist

    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.plugins.fsdp2.backend import FSDP2Backend
    from rlite.testing import fixed_batch
    from rlite.tokenizer import build_tiny_model_dir
    from rlite.training.backend import ForwardSpec

    model_dir = str(build_tiny_model_dir(tmp_path / "tiny"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        backend = FSDP2Backend.build(ModelConfig(path=model_dir, dtype="bfloat16"),
                                     ParallelismConfig(param_dtype="bfloat16", shard_single_process=False),
                                     TrainingConfig(lr=1e-2), torch.device("cpu"), total_optimizer_steps=1)
        params = dict(backend.model.named_parameters())
        assert all(type(p) is torch.nn.Parameter and p.dtype == torch.bfloat16 for p in params.values())
        before = {n: p.detach().clone() for n, p in params.items()}
        batch = fixed_batch(num_prompts=2, samples=2, prompt_len=5, max_len=6, vocab=250)
        spec = ForwardSpec(micro_batch_size=4, temperature=1.0, chunk_size=8, exact_layout=False, share_prompts=True)
        backend.train_mode()
        logprobs, _ = backend.logprobs(batch, spec, with_entropy=True)
        assert logprobs.dtype == torch.float32, "log-probs in float32 whatever the weights"
        backend.backward(-(logprobs * batch.response_mask).sum())
        assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in params.values())
        assert backend.step() > 0
        assert sum(not torch.equal(before[n], p) for n, p in params.items()) > len(params) // 2
    finally:
        dist.destroy_process_group()


def test_plain_mixed_precision_is_refused_naming_both_keys(tmp_path):
    from rlite.testing import tiny_config

    with pytest.raises(ConfigError, match=r"shard_single_process=false .* model.dtype=float32.*parallelism.param_dtype=bfloat16"):
        tiny_config(tmp_path, tmp_path / "run", "parallelism.shard_single_process=false",
                    "parallelism.param_dtype=bfloat16", pm=False)
    with pytest.raises(ConfigError, match="shard_single_process: invalid value 'sometimes'"):
        tiny_config(tmp_path, tmp_path / "run", "parallelism.shard_single_process=sometimes", pm=False)
    with pytest.raises(ConfigError, match="liger_fused_logprobs: invalid value 'maybe'"):
        tiny_config(tmp_path, tmp_path / "run", "training.liger_fused_logprobs=maybe", pm=False)
