"""The training-backend contract: all that the loop, weight sync, export, checkpointing and PPO's critic
ask of a backend.

FSDP2 (:mod:`rlite.plugins.fsdp2`, built in) implements it; another backend (Megatron for MoE, a
single-device toy) is a plugin that registers a factory through ``register_training_backends`` and
returns an object with this interface. Nothing in rlite's core looks past it: when a backend needs a
branch in the loop, the contract is missing a method, and the method goes here.

A step uses the contract in this order::

    backend.logprobs(batch, spec)                       # pi_old (no gradient, caller's torch.no_grad)
    reference.logprobs(batch, spec)                     # pi_ref, from backend.build_reference()
    for each micro-batch:
        logprobs, entropy = backend.logprobs(mb, spec, with_entropy=True)   # with gradient
        backend.backward(loss)
    grad_norm = backend.step(before_step)               # clip, hook, optimizer and LR scheduler
    engine.update_weights(backend.full_weights(), ...)  # collective: every rank drains it

PPO's critic (``backend.build_critic(cfg)``) is trained by the same loop, with ``critic.values(mb, spec)`` for
the forward. :class:`BackendBase` implements the step and what backends share; :class:`BackendWrapper`
wraps a backend (a plugin's wrapper around a registered one).

Batches are :class:`rlite.rollout.RolloutBatch` (prompts left-padded, responses right-padded);
:func:`rlite.rollout.model_inputs` turns one into the token, mask and position tensors a forward needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from rlite.metrics import MetricsSink

if TYPE_CHECKING:
    from rlite.config import CriticConfig
    from rlite.distributed import DataLayout
    from rlite.moe_routing import RoutingPlan
    from rlite.rollout import RolloutBatch

NamedTensors = Iterator[tuple[str, torch.Tensor]]
"""``(Hugging Face parameter name, full tensor)`` pairs, one tensor at a time."""


@dataclass
class ForwardSpec:
    """How a backend runs the policy forward for log-probs (the same for scoring and training, so the
    first training forward repeats the scoring forward bit for bit)."""

    micro_batch_size: int
    temperature: float
    """Logits are divided by it, exactly as the engine samples."""
    chunk_size: int
    """Response tokens per chunk of the output layer (bounds the ``[tokens, vocab]`` logits)."""
    exact_layout: bool
    """Score the engine's fixed ``[B, P + T]`` layout (true on-policy mode)."""
    use_liger: bool = False
    """Take the log-probs from liger-kernel's fused linear cross-entropy (``training.liger_fused_logprobs`` as
    resolved for this device and backend; only a backend with ``capabilities.fused_logprobs`` follows it)."""
    entropy_grad: bool = True
    """Whether the entropy term is in the loss (else it is a metric, computed without gradient)."""
    recompute_above_bytes: float = 0.0
    """Checkpoint output-layer chunks only when a micro-batch's response logits exceed this size."""
    share_prompts: bool = False
    """Run each distinct prompt of a micro-batch once and share its KV cache with its samples."""
    pack_sequences: bool = False
    """Run the forward on each micro-batch's real tokens laid end to end, computing no padding
    (``training.pack_sequences``, :mod:`rlite.training.packing`)."""
    max_tokens_per_micro_batch: int = 0
    """A token budget per micro-batch (``training.max_tokens_per_micro_batch``; 0: fixed-size micro-batches),
    read by the stages that cut batches (:mod:`rlite.training.micro_batching`)."""
    routing: RoutingPlan | None = None
    """MoE models: replay the engine's routing of the batch (``batch.routed_experts``) or route
    naturally, and count agreement on the way (:mod:`rlite.moe_routing`); ``None``: route naturally.
    Only for backends with ``capabilities.routing_replay``."""


@dataclass
class LoraAdapter:
    """A LoRA adapter as an engine that serves adapters loads it."""

    tensors: NamedTensors
    """The ``lora_A`` / ``lora_B`` matrices, named as peft saves them (a collective stream)."""
    config: dict[str, Any]
    """The adapter's peft config as JSON-able values."""


@runtime_checkable
class ScoringModel(Protocol):
    """A model that gives per-token log-probs of a batch's responses (the reference model)."""

    def logprobs(
        self, batch: RolloutBatch, spec: ForwardSpec, *, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B, T]`` log-probs of ``batch.response_ids`` (0 past each response), and the ``[B, T]``
        entropy of the (temperature-scaled) distribution when ``with_entropy`` (else ``None``).
        Gradients flow unless the caller runs under ``torch.no_grad()``.

        ``batch`` lives in host memory; the results are on the device the model computes on (a GPU's),
        where the caller computes the loss: the training loop moves the loss inputs there and copies what
        it keeps to the host once per step. On a GPU nothing here should make the host wait for the
        device (read the batch's values on the host, move inputs with :func:`rlite.training.device.to_device`)."""


@runtime_checkable
class TrainedModel(Protocol):
    """What the update loop (:func:`rlite.stages.update.train_minibatches`) asks of a model it trains: the
    policy (:class:`TrainingBackend`) and PPO's critic (:class:`CriticModel`) alike, so both get the same
    non-finite skip, clipping and counting (:class:`BackendBase` implements all four)."""

    def train_mode(self) -> None:
        """Put the model in training mode (dropout and the like) before an update."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss`` (one micro-batch's share of the objective)."""

    def step(self, before_step: Callable[[], None] | None = None, *, skip: bool = False) -> float:
        """As :meth:`TrainingBackend.step`."""

    def current_lr(self) -> float:
        """The learning rate the next :meth:`step` applies."""


@runtime_checkable
class CriticModel(Protocol):
    """PPO's value model, built by :meth:`TrainingBackend.build_critic`. The loop that trains the policy
    trains it too (:func:`rlite.stages.update.update_critic`): it scores micro-batches, accumulates
    gradients and steps like the policy (a :class:`TrainedModel`), and :class:`BackendBase` gives it the
    step with the non-finite skip."""

    def values(self, batch: RolloutBatch, spec: ForwardSpec) -> torch.Tensor:
        """``[B, T]`` value predictions for the batch's response tokens (0 past each response), on the device
        the critic computes on, from the forward ``spec`` describes (its layout: ``exact_layout``,
        ``pack_sequences``). Gradients flow unless the caller runs under ``torch.no_grad()`` (V_old)."""

    def train_mode(self) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, before_step: Callable[[], None] | None = None, *, skip: bool = False) -> float:
        """As :meth:`TrainingBackend.step`: a NaN/inf gradient norm (or ``skip``) steps nothing."""

    def current_lr(self) -> float: ...

    def checkpoint_state(self) -> dict[str, Any]:
        """Model and optimizer state for ``torch.distributed.checkpoint`` (keys are prefixed ``critic``)."""

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Apply a state loaded from a checkpoint (the structure :meth:`checkpoint_state` returned)."""


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do beyond the required methods; the loop checks these, never the type."""

    lora: bool = False
    """Trains LoRA adapters; :meth:`TrainingBackend.lora_adapter` returns them."""
    critic: bool = False
    """:meth:`TrainingBackend.build_critic` works (PPO with GAE)."""
    weight_views: bool = False
    """:meth:`TrainingBackend.full_weights` can yield the parameters' own storage (an in-process engine
    then shares the trainer's weights and a sync moves no bytes)."""
    routing_replay: bool = False
    """Follows ``ForwardSpec.routing`` for a Mixture-of-Experts policy: replays ``batch.routed_experts``
    and fills its agreement counts (``algorithm.routing_replay``, routing metrics)."""
    fused_logprobs: bool = False
    """Follows ``ForwardSpec.use_liger``: takes its log-probs from liger-kernel's fused linear cross-entropy
    (``training.liger_fused_logprobs``; ``auto`` leaves it off for a backend without this)."""


@runtime_checkable
class TrainingBackend(Protocol):
    """A policy model with its optimizer and LR schedule, as the training loop drives it."""

    capabilities: BackendCapabilities

    model: Any
    """The backend's own model object. It is handed to the optimizer-step hooks and otherwise opaque:
    rlite's core never looks inside it."""
    optimizer: Any
    """The backend's optimizer, handed to ``before_optimizer_step``; opaque to the core."""

    def logprobs(
        self, batch: RolloutBatch, spec: ForwardSpec, *, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`ScoringModel.logprobs`, through the trainable policy. Called under
        ``torch.no_grad()`` to score pi_old, with gradient (``with_entropy=True``) in training."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss`` (one micro-batch's share of the objective)."""

    def step(self, before_step: Callable[[], None] | None = None, *, skip: bool = False) -> float:
        """Clip the accumulated gradients, call ``before_step()``, step optimizer and LR scheduler,
        zero the gradients; return the gradient norm before clipping (global over ranks).

        When the norm is NaN or infinite, or with ``skip=True`` (the loop saw a non-finite loss; it
        passes ``skip`` only then), drop the gradients without calling ``before_step`` or stepping
        optimizer and scheduler, and still return the norm: a non-finite update never reaches the
        weights. Since the norm is global, every rank skips the same steps."""

    def current_lr(self) -> float:
        """The learning rate the next :meth:`step` applies."""

    def data_layout(self) -> DataLayout:
        """Which data shard this rank trains on: ``DataLayout.whole_world()`` when every rank is a
        data-parallel rank of its own (FSDP2); tensor-parallel ranks share a shard (a replica)."""

    def train_mode(self) -> None:
        """Put the policy in training mode (dropout and the like) before an update."""

    def full_weights(self, *, views: bool = False) -> NamedTensors:
        """Every weight of the policy as served: Hugging Face names, full (unsharded) tensors, LoRA
        merged, tied weights once. A collective: every rank must exhaust it in the same order.
        ``views=True`` may yield the parameters' own storage (see ``capabilities.weight_views``);
        the consumer must not write to them."""

    def lora_adapter(self) -> LoraAdapter | None:
        """The LoRA adapter alone (for engines that serve adapters on a fixed base), or ``None``
        when the backend trains full weights."""

    def hf_config(self) -> Any:
        """The Hugging Face ``PretrainedConfig`` of the policy (export writes it with the weights)."""

    def checkpoint_state(self) -> dict[str, Any]:
        """Model and optimizer state for ``torch.distributed.checkpoint`` (sharded tensors allowed;
        keys ``model`` and ``optim``)."""

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Apply a state loaded in place into the structure :meth:`checkpoint_state` returned."""

    def lr_scheduler_state(self) -> dict[str, Any]:
        """The LR scheduler's state (saved per rank with the trainer state)."""

    def load_lr_scheduler_state(self, state: dict[str, Any]) -> None: ...

    def after_checkpoint(self) -> None:
        """Called after a checkpoint was written (for example to drop pages the save read in)."""

    def build_reference(self) -> ScoringModel:
        """A frozen copy of the initial policy (no LoRA), laid out like the policy, for pi_ref."""

    def build_critic(self, cfg: CriticConfig) -> CriticModel:
        """PPO's value model (only when ``capabilities.critic``)."""

    def device_bytes_to_come(self) -> int:
        """Device memory the backend (policy, and the reference and critic it built) has not allocated
        yet but will, and keeps from step to step: optimizer states that appear at the first step. A
        colocated engine that sizes itself from the memory free when it starts leaves room for it
        (:func:`optimizer_state_bytes_to_come` counts it for a torch optimizer)."""

    def close(self) -> None:
        """Release what the backend holds outside Python's reach (files, pinned memory)."""


def optimizer_state_bytes_to_come(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """The bytes an Adam-family optimizer without state yet will allocate on ``device`` at its first
    step: two moments shaped like each trainable parameter that lives there (a DTensor's local shard).
    0 once it has state, or for parameters elsewhere (CPU-offloaded)."""
    if optimizer.state:
        return 0
    total = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            local = param.to_local() if hasattr(param, "to_local") else param
            if param.requires_grad and local.device == device:
                total += 2 * local.numel() * local.element_size()
    return total


class BackendBase:
    """What every training backend repeats, written once: the optimizer step with its non-finite skip,
    gradient clipping, the LR scheduler's and the checkpoint's plumbing. Subclass it; it expects
    ``self.model`` (a torch module), ``self.optimizer`` (a torch optimizer), ``self.scheduler`` (a torch
    LR scheduler, or ``None`` for a constant learning rate) and ``self.grad_clip``. Override what your
    model or optimizer does otherwise: :meth:`clip_gradients`, :meth:`optimizer_step`, :meth:`zero_grad`,
    :meth:`checkpoint_state` (megatron overrides all four). PPO's critic is one too (a second trained model).

    :meth:`step` computes the global gradient norm, skips a non-finite update (gradients dropped, no
    ``before_step``, no optimizer or scheduler step, ``skipped_steps`` counted) and otherwise steps."""

    # what a subclass sets (annotations only: a dataclass subclass declares them as fields of its own)
    scheduler: Any
    """The LR scheduler stepped after each optimizer step; ``None``: the learning rate stays as set."""
    grad_clip: float
    """Clip the global gradient norm to this (0: no clipping)."""
    checkpoint_keys: tuple[str, str] = ("model", "optim")
    """The keys of the model's and the optimizer's state in :meth:`checkpoint_state` (a second model of
    the run, PPO's critic, takes keys of its own)."""
    skipped_steps: int = 0
    """Optimizer steps this backend skipped because the loss or the gradient norm was not finite."""

    # -- training ---------------------------------------------------------------------------------
    def train_mode(self) -> None:
        self.model.train()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def clip_gradients(self) -> float:
        """Return the global gradient norm before clipping (the same on every rank) and clip the
        accumulated gradients to ``grad_clip`` when it is finite. The default: torch's ``clip_grad_norm_``
        over :meth:`trainable_parameters`, whose norm of FSDP2's sharded gradients is the global one."""
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_norm)
        if hasattr(norm, "full_tensor"):  # the global norm: every rank decides the same
            norm = norm.full_tensor()
        return float(norm)

    def optimizer_step(self) -> None:
        """Apply the (clipped) gradients: the optimizer's step, then the LR scheduler's."""
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, before_step: Callable[[], None] | None = None, *, skip: bool = False) -> float:
        """As :meth:`TrainingBackend.step`."""
        norm = self.clip_gradients()
        if skip or not math.isfinite(norm):  # the norm is global: every rank skips alike
            self.skipped_steps += 1
        else:
            if before_step is not None:
                before_step()
            self.optimizer_step()
        self.zero_grad()
        return norm

    def current_lr(self) -> float:
        if self.scheduler is None:
            return self.optimizer.param_groups[0]["lr"]
        return self.scheduler.get_last_lr()[0]

    def data_layout(self) -> DataLayout:
        """Every rank a data-parallel rank of its own (override where ranks share a shard)."""
        from rlite.distributed import DataLayout

        return DataLayout.whole_world()

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """The model's and the optimizer's state dicts from ``torch.distributed.checkpoint.state_dict``
        (FSDP2's shards as they are). It loads in place into what this returns, so a backend that has not
        stepped yet must already hold AdamW's moments: ``get_state_dict`` creates them (a plain
        ``optimizer.state_dict()`` would be empty)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        model_key, optim_key = self.checkpoint_keys
        return {model_key: model_sd, optim_key: optim_sd}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model_key, optim_key = self.checkpoint_keys
        set_state_dict(self.model, self.optimizer, model_state_dict=state[model_key], optim_state_dict=state[optim_key])

    def lr_scheduler_state(self) -> dict[str, Any]:
        return {} if self.scheduler is None else self.scheduler.state_dict()

    def load_lr_scheduler_state(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state)

    def after_checkpoint(self) -> None:
        release = getattr(self.optimizer, "release_pages", None)  # DiskOffloadAdamW only
        if release is not None:  # a save or load touched the moments' mappings: give those pages back
            release()

    def close(self) -> None:
        close = getattr(self.optimizer, "close", None)  # DiskOffloadAdamW: deletes the moment files
        if close is not None:
            close()


class BackendWrapper:
    """A training backend that hands every member of the :class:`TrainingBackend` contract on to ``inner``:
    subclass it and override only what your wrapper changes (time or count the steps, add a hook around
    the optimizer step, log what ``logprobs`` returns).

    ``capabilities``, ``model``, ``optimizer`` and ``skipped_steps`` are read through from the inner
    backend, and every method calls the inner backend's, so the wrapper is a ``TrainingBackend`` whatever
    it overrides. Only the contract is forwarded (no ``__getattr__``: nothing to guard against recursion,
    and a member the contract lacks fails here, not deep in a run); reach anything else of the inner
    backend through ``self.inner``. Get the inner backend by name with
    ``rlite.api.registered("training_backend", name)`` in your factory (``docs/plugins.md``)."""

    def __init__(self, inner: TrainingBackend) -> None:
        self.inner = inner
        inner_sink = getattr(inner, "metrics", None)
        self.metrics = inner_sink if isinstance(inner_sink, MetricsSink) else MetricsSink()
        """The backend's metrics channel (``docs/plugins.md``, Reporting metrics), drained by the loop after
        the update: the inner backend's when it has one, so that its reports and the wrapper's reach the row
        together; else the wrapper's own."""

    @property
    def capabilities(self) -> BackendCapabilities:
        return self.inner.capabilities

    @property
    def model(self) -> Any:
        return self.inner.model

    @property
    def optimizer(self) -> Any:
        return self.inner.optimizer

    @property
    def skipped_steps(self) -> int:
        """The inner backend's count of skipped steps (:class:`BackendBase`)."""
        return self.inner.skipped_steps

    def logprobs(
        self, batch: RolloutBatch, spec: ForwardSpec, *, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.inner.logprobs(batch, spec, with_entropy=with_entropy)

    def backward(self, loss: torch.Tensor) -> None:
        return self.inner.backward(loss)

    def step(self, before_step: Callable[[], None] | None = None, *, skip: bool = False) -> float:
        if skip:  # the loop passes skip only when it is set: so does the wrapper, for a step without it
            return self.inner.step(before_step, skip=True)
        return self.inner.step(before_step)

    def current_lr(self) -> float:
        return self.inner.current_lr()

    def data_layout(self) -> DataLayout:
        return self.inner.data_layout()

    def train_mode(self) -> None:
        return self.inner.train_mode()

    def full_weights(self, *, views: bool = False) -> NamedTensors:
        return self.inner.full_weights(views=views)

    def lora_adapter(self) -> LoraAdapter | None:
        return self.inner.lora_adapter()

    def hf_config(self) -> Any:
        return self.inner.hf_config()

    def checkpoint_state(self) -> dict[str, Any]:
        return self.inner.checkpoint_state()

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        return self.inner.load_checkpoint_state(state)

    def lr_scheduler_state(self) -> dict[str, Any]:
        return self.inner.lr_scheduler_state()

    def load_lr_scheduler_state(self, state: dict[str, Any]) -> None:
        return self.inner.load_lr_scheduler_state(state)

    def after_checkpoint(self) -> None:
        return self.inner.after_checkpoint()

    def build_reference(self) -> ScoringModel:
        return self.inner.build_reference()

    def build_critic(self, cfg: CriticConfig) -> CriticModel:
        return self.inner.build_critic(cfg)

    def device_bytes_to_come(self) -> int:
        return self.inner.device_bytes_to_come()

    def close(self) -> None:
        return self.inner.close()
