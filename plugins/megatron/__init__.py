"""The ``megatron`` training backend: megatron-core ``GPTModel`` with tensor and expert parallelism,
for Mixture-of-Experts models (``pip install 'rlite[megatron]'``).

Registered through the ``rlite`` entry-point group exactly like a third-party plugin, and imports
only :mod:`rlite.api` and its own modules. ``parallelism.backend: megatron`` in any recipe switches a
run to it; everything else (data, rewards, algorithms, corrections, weight sync, engines,
checkpoints, metrics) stays the same. See ``docs/megatron.md``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from rlite.api import ConfigError, Unsupported, hookimpl


def megatron_installed() -> bool:
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


@dataclass
class MegatronConfig:
    tensor_parallel: int = 1
    """Tensor-parallel size (attention heads, MLP and vocabulary split over this many ranks)."""
    expert_parallel: int = 1
    """Expert-parallel size (each rank holds num_experts / expert_parallel experts)."""
    distributed_optimizer: bool = False
    """ZeRO-1, megatron's "distributed optimizer": each data-parallel rank keeps AdamW's moments (and the master
    weights under ``parallelism.param_dtype=bfloat16``) for its own slice of every parameter only, steps that
    slice and all-gathers the result (experts are split over their expert-data-parallel ranks). With one
    data-parallel rank there is nothing to split and it changes nothing."""

    def __post_init__(self) -> None:
        if not isinstance(self.distributed_optimizer, bool):
            raise ConfigError(
                f"parallelism.backend.args.distributed_optimizer must be true or false, got {self.distributed_optimizer!r}"
            )
        if self.tensor_parallel < 1 or self.expert_parallel < 1:
            raise ConfigError("parallelism.backend.args: tensor_parallel and expert_parallel must be >= 1")
        if not megatron_installed():
            raise ConfigError(
                "parallelism.backend=megatron needs megatron-core, which is not installed: "
                "pip install 'rlite[megatron]' (megatron-core 0.16.1 on Python 3.11, newer on 3.12+)"
            )


def make_megatron(config, cfg: MegatronConfig, device, total_optimizer_steps: int):
    from rlite.plugins.megatron.backend import MegatronBackend

    return MegatronBackend(config, cfg, device, total_optimizer_steps)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def megatron_trainer_memory(config, cfg: MegatronConfig, parameters: int, world_size: int) -> dict[str, int]:
    """One rank's trainer state, for the memory check run before a run allocates (``rlite.run.limits``,
    docs/memory.md). Unlike FSDP2's shards, every data-parallel rank holds a whole replica of its
    tensor-parallel slice: the model in ``parallelism.param_dtype``, float32 masters where ``model.dtype``
    differs from it, gradients in ``reduce_dtype`` where that differs (megatron's main_grad) and AdamW's two
    moments in ``model.dtype``; ZeRO-1 splits masters and moments over the data-parallel ranks. Experts are
    counted as if every parameter were split over tensor x expert parallel ranks, so the estimate errs low,
    as the rest of the check does (a refused run would not have fit)."""
    n = -(-parameters // (cfg.tensor_parallel * cfg.expert_parallel))
    data_parallel = max(1, world_size // cfg.tensor_parallel)
    zero = data_parallel if cfg.distributed_optimizer else 1
    model_b = DTYPE_BYTES[config.model.dtype]
    param_b = DTYPE_BYTES[config.parallelism.param_dtype]
    reduce_b = DTYPE_BYTES[config.parallelism.reduce_dtype]
    return {
        "weights": n * param_b,
        "master weights": -(-n * model_b // zero) if config.model.dtype != config.parallelism.param_dtype else 0,
        "gradients": n * (reduce_b if config.parallelism.reduce_dtype != config.parallelism.param_dtype else param_b),
        "AdamW moments": -(-2 * n * model_b // zero) if config.training.optimizer_offload == "none" else 0,
        "reference model": n * param_b if config.algorithm.kl.coef != 0 else 0,
    }


UNSUPPORTED = {
    "cpu_offload": Unsupported(
        "the megatron backend keeps parameters and gradients on the training device between uses, where FSDP2's "
        "CPUOffloadPolicy moves them to the host (megatron-core 0.16.1's optimizer CPU offload, HybridDeviceOptimizer, "
        "copies state over CUDA streams and comes only with megatron's distributed optimizer over its own DDP "
        "buffers, which this backend does not build; on a CPU the weights are in host memory anyway), so it would "
        "be silently ignored",
        "set parallelism.cpu_offload=false (training.optimizer_offload=disk moves AdamW's moments off the device "
        "on a CPU)"),
    "fused_logprobs": Unsupported(
        "the megatron backend computes log-probs over its tensor-parallel vocabulary slices itself (liger's kernel "
        "would be silently ignored)", "set training.liger_fused_logprobs=auto (off for this backend) or false"),
    "compile": Unsupported(
        "the megatron backend builds megatron-core's own modules and does not compile them (it would be silently "
        "ignored)", "set training.compile=false"),
    "lora": Unsupported("the megatron backend trains full weights", "set model.lora.enabled=false"),
    "critic": Unsupported("the megatron backend has no critic yet",
                          "use an estimator without a critic (algorithm.advantage=grpo)"),
    "packed_sequences": Unsupported(
        "the megatron backend does not run packed (THD) sequences yet (it would pad them)",
        "set training.pack_sequences=false (training.max_tokens_per_micro_batch works)"),
    "true_on_policy": Unsupported(
        "true on-policy sampling makes the engine's log-probs equal the trainer's bitwise by running the "
        "trainer's own Hugging Face forward, and megatron's GPTModel computes in another order (measured on a tiny "
        "model: 75-91% of sampled tokens bitwise equal)",
        "set rollout.true_on_policy=false (algorithm.old_logprob_mode=decoupled keeps the first ratio exactly 1)"),
}
"""What the compatibility rules refuse with this backend, when the config loads (docs/compatibility.md)."""


def check_megatron_config(config, cfg: MegatronConfig) -> None:
    """What this backend refuses when the config loads, beyond :data:`UNSUPPORTED`'s pairs. Left to the
    backend's construction: what needs the model (MoE with tensor parallel, experts per expert-parallel
    rank, its architecture), the world size (tensor and expert parallel must divide it) or the device
    (the disk-offloaded AdamW on a GPU)."""
    if cfg.tensor_parallel > 1 and config.rollout.mode != "sync":
        raise ConfigError(
            f"rollout.mode={config.rollout.mode}: asynchronous rollouts need every rank to sample its own batch, and "
            f"parallelism.backend.args.tensor_parallel={cfg.tensor_parallel} lays out replicas of that many ranks "
            "whose leader samples for them; use rollout.mode=sync, or tensor_parallel=1"
        )
    if config.parallelism.activation_checkpointing and config.algorithm.routing_replay != "none":
        raise ConfigError(
            "parallelism.activation_checkpointing=true with algorithm.routing_replay: megatron recomputes each "
            "layer in backward, where rlite's replay of the engine's routing is no longer installed (the "
            "recomputed routers would route naturally); set one of them off"
        )


@hookimpl
def register_training_backends(register):
    register("megatron", make_megatron, MegatronConfig, trainer_memory=megatron_trainer_memory,
             unsupported=UNSUPPORTED, model_parallel=("tensor_parallel", "expert_parallel"),
             check_config=check_megatron_config)
