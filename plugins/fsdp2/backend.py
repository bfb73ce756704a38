"""The FSDP2 training backend: the policy (and reference) model, AdamW and the LR schedule.

``fully_shard`` is applied to every decoder block and then to the root with several ranks, and in a
single process on a CPU (the very code path that N ranks run); gradients of several micro-batches
accumulate in the sharded ``.grad`` of each parameter. A single process on one GPU keeps the model
plain unless FSDP2 implements what the run asks for (``parallelism.shard_single_process=auto``,
:func:`rlite.plugins.fsdp2.sharding.shards_single_process`); a plain model's weight gradients are added
into ``.grad`` in place (:mod:`rlite.training.grad_accumulation`). Log-probs are returned on the device
the model computes on, where the loss is computed (:func:`policy_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from rlite.api import (
    BackendBase,
    BackendCapabilities,
    CriticConfig,
    ForwardPlan,
    ForwardSpec,
    LoraAdapter,
    ModelConfig,
    ModelInputs,
    ParallelismConfig,
    PolicyModel,
    RolloutBatch,
    TrainingConfig,
    apply_lora,
    build_lr_scheduler,
    causal_lm_of,
    model_inputs,
    optimizer_state_bytes_to_come,
    pad_to_width,
    to_device,
)
from rlite.plugins.fsdp2.compile import compile_decoder_blocks, decoder_blocks
from rlite.plugins.fsdp2.sharding import load_sharded


def enable_activation_checkpointing(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Recompute each decoder layer in backward. transformers 5.x calls it ``activation_checkpointing_enable``
    (the older ``gradient_checkpointing_enable`` still works there, with a FutureWarning)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def build_policy(model_cfg: ModelConfig, par_cfg: ParallelismConfig, device: torch.device, *, trainable: bool,
                 compile_blocks: bool = False):  # fmt: skip
    """The policy (``trainable``) or the frozen reference model, loaded sharded (:func:`load_sharded`).
    ``compile_blocks`` (``training.compile``, the policy only): each decoder block through ``torch.compile``
    (:mod:`rlite.plugins.fsdp2.compile`), where lean activations and in-place accumulation stay out."""

    def wrap(lm: nn.Module) -> PolicyModel:
        if trainable and model_cfg.lora.enabled:
            lm = apply_lora(lm, model_cfg.lora)
        compiled = decoder_blocks(lm) if compile_blocks else []
        if par_cfg.lean_activations and trainable:
            from rlite.plugins.fsdp2.lean_activations import apply_lean_activations

            apply_lean_activations(lm, skip=compiled)
        lm.config.use_cache = False
        policy = PolicyModel(lm)
        if par_cfg.activation_checkpointing and trainable:
            kwargs: dict[str, Any] = {"use_reentrant": False}
            if policy.routers is not None:  # recomputation in backward replays the forward's routing
                kwargs["context_fn"] = policy.routers.checkpoint_context
            enable_activation_checkpointing(causal_lm_of(lm), kwargs)
        if not trainable:
            policy.requires_grad_(False)
        compile_decoder_blocks(compiled)  # before FSDP2 wraps them: its hooks then run between the graphs
        return policy

    policy = load_sharded(model_cfg, par_cfg, device, wrap)
    if trainable and par_cfg.fused_grad_accumulation and not isinstance(policy, FSDPModule):
        from rlite.api import accumulate_in_place

        accumulate_in_place(policy, skip=decoder_blocks(policy.lm) if compile_blocks else ())
    return policy


def policy_logprobs(
    model: nn.Module, batch: RolloutBatch, spec: ForwardSpec, *, with_entropy: bool = False,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T]`` log-probs (and entropy) of a batch's responses under a :class:`PolicyModel`, on ``device``
    (where the model computes; default: where its first parameter lives).

    The model's inputs and its :class:`ForwardPlan` are built from the batch's host tensors (every value
    the forward depends on is read there, before anything runs on the device) and moved to ``device``
    asynchronously (:func:`rlite.training.device.to_device`); the results stay there, for the loss. So on
    a GPU a micro-batch's forward, loss and backward queue up without the host waiting for the device.
    """
    inputs, plan = forward_inputs(batch, spec)
    if spec.routing is not None and spec.routing.replay and inputs.routed_experts is None:
        raise ValueError("routing replay: the batch carries no routed experts (the engine was not asked for them)")
    if device is None:
        device = next(model.parameters()).device
    inputs, plan = to_device((inputs, plan), device)
    logprobs, entropy = model(inputs, spec, with_entropy=with_entropy, plan=plan)
    width = batch.response_ids.shape[1]
    return pad_to_width(logprobs, width), None if entropy is None else pad_to_width(entropy, width)


def forward_inputs(batch: RolloutBatch, spec: ForwardSpec) -> tuple[ModelInputs, ForwardPlan]:
    """A micro-batch's model inputs and forward plan, computed from its host tensors: the one place of the
    forward that reads tensor values (lengths, which prompts repeat, which tokens are scored)."""
    inputs = model_inputs(batch, exact_layout=spec.exact_layout)
    return inputs, ForwardPlan.of(inputs, spec)


@dataclass
class FrozenPolicy:
    """The reference model: the initial policy on FSDP2, without LoRA or gradients."""

    model: PolicyModel
    device: torch.device | None = None
    """Where the model computes (and the log-probs are returned); ``None``: its parameters' device."""

    def logprobs(self, batch: RolloutBatch, spec: ForwardSpec, *, with_entropy: bool = False):
        return policy_logprobs(self.model, batch, spec, with_entropy=with_entropy, device=self.device)


@dataclass
class FSDP2Backend(BackendBase):
    """Policy model on FSDP2 with AdamW and an LR schedule (the :class:`~rlite.training.backend.TrainingBackend`
    contract). The optimizer step, clipping, the scheduler's and the checkpoint's state and ``close`` are
    :class:`~rlite.training.backend.BackendBase`'s (the data layout too: every rank a shard of its own)."""

    model: PolicyModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float
    lora: bool
    model_cfg: ModelConfig
    par_cfg: ParallelismConfig
    device: torch.device
    critics: list = field(default_factory=list)
    """The critics this backend built (their optimizers count in :meth:`device_bytes_to_come`)."""

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(lora=self.lora, critic=True, weight_views=not self.lora, routing_replay=True,
                                   fused_logprobs=True)

    @classmethod
    def build(
        cls,
        model_cfg: ModelConfig,
        par_cfg: ParallelismConfig,
        train_cfg: TrainingConfig,
        device: torch.device,
        total_optimizer_steps: int,
        offload_dir: str | Path | None = None,
    ) -> FSDP2Backend:
        policy = build_policy(model_cfg, par_cfg, device, trainable=True, compile_blocks=train_cfg.compile)
        params = [p for p in policy.parameters() if p.requires_grad]
        adamw = dict(lr=train_cfg.lr, betas=tuple(train_cfg.betas), eps=train_cfg.eps, weight_decay=train_cfg.weight_decay)
        if train_cfg.optimizer_offload == "disk":
            from rlite.api import DiskOffloadAdamW

            if offload_dir is None:
                raise ValueError("training.optimizer_offload=disk: the backend was built without a folder for the moments")
            if any(p.device.type != "cpu" for p in params):
                raise ValueError(
                    "training.optimizer_offload=disk steps parameters held in CPU memory: on a GPU also set "
                    "parallelism.cpu_offload=true (or use optimizer_offload=none)"
                )
            optimizer = DiskOffloadAdamW(params, offload_dir, **adamw)
        else:
            # fused: one kernel over all parameters (CPU and CUDA); 4-6x faster than per-parameter steps
            optimizer = torch.optim.AdamW(params, **adamw, fused=True)
        scheduler = build_lr_scheduler(optimizer, train_cfg, total_optimizer_steps)
        return cls(policy, optimizer, scheduler, train_cfg.grad_clip, model_cfg.lora.enabled, model_cfg, par_cfg, device)

    # -- training (the step, clipping, train_mode and backward: BackendBase) ----------------------------
    def logprobs(self, batch: RolloutBatch, spec: ForwardSpec, *, with_entropy: bool = False):
        return policy_logprobs(self.model, batch, spec, with_entropy=with_entropy, device=self.device)

    # -- weights out ------------------------------------------------------------------------------
    def full_weights(self, *, views: bool = False):
        from rlite.plugins.fsdp2.weights import iter_full_tensors

        return iter_full_tensors(self.model.lm, lora_merge=self.lora, views=views and not self.lora)

    def lora_adapter(self) -> LoraAdapter | None:
        if not self.lora:
            return None
        from rlite.plugins.fsdp2.weights import iter_lora_adapter_tensors, lora_adapter_config

        return LoraAdapter(iter_lora_adapter_tensors(self.model.lm), lora_adapter_config(self.model.lm))

    def hf_config(self) -> Any:
        return causal_lm_of(self.model.lm).config

    # -- other models -----------------------------------------------------------------------------
    def build_reference(self) -> FrozenPolicy:
        return FrozenPolicy(build_policy(self.model_cfg, self.par_cfg, self.device, trainable=False), self.device)

    def build_critic(self, cfg: CriticConfig):
        from rlite.plugins.fsdp2.critic import Critic

        critic = Critic.build(self.model_cfg, self.par_cfg, cfg, self.device)
        self.critics.append(critic)
        return critic

    def device_bytes_to_come(self) -> int:
        optimizers = [self.optimizer] + [critic.optimizer for critic in self.critics]
        # a torch AdamW creates its moments at the first step (disk-offloaded AdamW keeps them in files)
        return sum(optimizer_state_bytes_to_come(o, self.device) for o in optimizers if isinstance(o, torch.optim.AdamW))
