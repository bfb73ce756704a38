"""The policy as a run's component (:class:`Policy`): the models a run trains and scores with (the policy's
training backend, its frozen reference, PPO's critic), the forward spec they score and train with, the loss,
and stage 4, their update; built by :func:`build_models` (before the engine: a failure there leaves no engine
process behind) and :func:`build_policy` (once the engine has said what MoE routing the forwards replay).

``training.liger_fused_logprobs`` is resolved here too, for the forward spec (:func:`check_liger`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch

from rlite.config import ConfigError, RunConfig
from rlite.distributed import DataLayout, DistContext
from rlite.metrics import Reported, StepTimer, drained
from rlite.plugin_manager import RlitePluginManager, resolve_choice
from rlite.rollout import ScoredBatch, TrainTargets
from rlite.run.faults import NonFiniteGuard
from rlite.stages.update import LossSpec, PolicyUpdate, update_critic, update_policy
from rlite.training.backend import (
    BackendCapabilities,
    CriticModel,
    ForwardSpec,
    ScoringModel,
    TrainingBackend,
)
from rlite.workflows import TurnRunner


@dataclass(frozen=True)
class Models:
    """The models a run trains or scores with, built before the engine (:func:`build_models`)."""

    backend: TrainingBackend
    """The policy's training backend."""
    reference: ScoringModel | None
    """The frozen reference (``algorithm.kl.coef`` not 0), else ``None``."""
    critic: CriticModel | None
    """PPO's critic (``algorithm.critic.enabled``), else ``None``."""


@dataclass(frozen=True)
class UpdateSchedule:
    """How a step's update is cut and clipped (``algorithm.*``)."""

    minibatches: int
    """Optimizer steps per epoch (``minibatches_per_step``)."""
    epochs: int
    """Passes over the batch (``epochs_per_step``; the critic makes one)."""
    value_clip: float
    """The critic's value clip (``critic.value_clip``)."""


class Policy:
    """Stage 4 as a run's component: the trained models, how they score and train (``forward``, ``loss``),
    and their update (:meth:`update`). Skipped updates in a row are counted for each trained model (its
    :class:`~rlite.run.faults.NonFiniteGuard`, the state this component owns) and stop the run at the limit."""

    def __init__(self, models: Models, forward: ForwardSpec, loss: LossSpec, *, schedule: UpdateSchedule,
                 layout: DataLayout, hooks: Any, timer: StepTimer, guards: tuple[NonFiniteGuard, NonFiniteGuard]) -> None:  # fmt: skip
        self.backend, self.reference, self.critic = models.backend, models.reference, models.critic
        self.forward, self.loss, self.schedule, self.layout = forward, loss, schedule, layout
        self.hooks, self.timer = hooks, timer
        self.guard, self.critic_guard = guards

    @property
    def model(self) -> torch.nn.Module:
        """The policy's module (what the optimizer hooks receive)."""
        return self.backend.model

    def update(self, step: int, batch: ScoredBatch, targets: TrainTargets) -> PolicyUpdate:
        """Stage 4: the policy's update, then the critic's (one loop, :func:`rlite.stages.update.train_minibatches`);
        their metrics (the critic's in the policy's) and the policy's first-pass log-probs. Too many skipped
        updates in a row stop the run (:class:`~rlite.errors.RunStopped`)."""
        schedule, layout = self.schedule, self.layout
        before_step = functools.partial(self.hooks.before_optimizer_step, step=step, model=self.backend.model,
                                        optimizer=self.backend.optimizer)
        update = update_policy(self.backend, batch, targets, self.forward, self.loss, minibatches=schedule.minibatches,
                               epochs=schedule.epochs, dp_size=layout.size, dp_group=layout.group,
                               before_step=before_step, timer=self.timer)
        self.guard.record(step, update.outcomes)
        if self.critic is not None:
            critic = update_critic(
                self.critic, batch, targets, self.forward, value_clip=schedule.value_clip, agg_mode=self.loss.agg_mode,
                horizon=self.loss.horizon, minibatches=schedule.minibatches, dp_size=layout.size, dp_group=layout.group,
            )
            self.critic_guard.record(step, critic.outcomes)
            update.metrics.update(critic.metrics)
        return update

    def drain_reports(self) -> list[Reported]:
        """What the trained models reported through their metrics sinks since the last call (the backend's,
        the critic's)."""
        return [drained(self.backend), drained(self.critic)]

    def checkpoint_state(self) -> dict[str, Any]:
        """The trained models' state for a checkpoint (the backend's, then the critic's)."""
        return model_state(self.backend, self.critic)

    def close(self) -> None:
        self.backend.close()


def model_state(backend: TrainingBackend, critic: CriticModel | None) -> dict[str, Any]:
    """The backend's checkpoint state, with the critic's (``None``: none)."""
    state = backend.checkpoint_state()
    if critic is not None:
        state.update(critic.checkpoint_state())
    return state


def build_models(cfg: RunConfig, pm: RlitePluginManager, ctx: DistContext) -> Models:
    """The policy's training backend (``parallelism.backend``), its reference and critic."""
    algo = cfg.algorithm
    total_opt_steps = cfg.training.steps * algo.minibatches_per_step * algo.epochs_per_step
    make_backend, backend_cfg = resolve_choice(pm.registry("training_backend"), cfg.parallelism.backend)
    backend: TrainingBackend = make_backend(cfg, backend_cfg, ctx.device, total_opt_steps)
    reference = backend.build_reference() if algo.kl.coef != 0.0 else None
    critic = None
    if algo.critic.enabled:
        if not backend.capabilities.critic:
            raise ConfigError(f"algorithm.critic.enabled: the {cfg.parallelism.backend.name!r} backend has no critic")
        critic = backend.build_critic(algo.critic)
    return Models(backend, reference, critic)


def build_loss(cfg: RunConfig, pm: RlitePluginManager, turns: TurnRunner | None, loss_time_corrections: list) -> LossSpec:
    """The loss of ``algorithm``: the policy loss plugin, the KL term (none when the KL is in the reward) and the
    entropy bonus; ``loss_time_corrections``: the corrections that need the current log-probs."""
    algo = cfg.algorithm
    policy_loss, policy_cfg = resolve_choice(pm.registry("policy_loss"), algo.policy_loss)
    return LossSpec(
        policy_loss=policy_loss,
        policy_cfg=policy_cfg,
        agg_mode=algo.loss_agg_mode,
        horizon=float(algo.loss_agg_horizon or (cfg.rollout.max_response_tokens if turns else cfg.rollout.max_new_tokens)),
        kl_fn=pm.registry("kl_estimator").get(algo.kl.estimator).implementation,
        kl_coef=0.0 if algo.kl.in_reward else algo.kl.coef,
        entropy_coef=algo.entropy_coef,
        loss_time_corrections=loss_time_corrections,
    )


def build_policy(cfg: RunConfig, models: Models, forward: ForwardSpec, loss: LossSpec, *, layout: DataLayout,
                 hooks: Any, timer: StepTimer) -> Policy:
    """The run's :class:`Policy`: ``forward`` as the run resolved it (MoE routing replay included)."""
    limit = cfg.training.max_nonfinite_in_a_row  # skipped updates in a row, each trained model on its own
    guards = (NonFiniteGuard(limit, cfg.logging.run_dir), NonFiniteGuard.for_critic(limit, cfg.logging.run_dir))
    algo = cfg.algorithm
    schedule = UpdateSchedule(algo.minibatches_per_step, algo.epochs_per_step, algo.critic.value_clip)
    return Policy(models, forward, loss, schedule=schedule, layout=layout, hooks=hooks, timer=timer, guards=guards)


def forward_spec(cfg: RunConfig, device_type: str, capabilities: BackendCapabilities) -> ForwardSpec:
    """How the run's backend scores and trains (the same spec for both), resolved for this device type and
    backend: ``training.liger_fused_logprobs=auto`` among others (:func:`check_liger`)."""
    return ForwardSpec(
        micro_batch_size=cfg.training.micro_batch_size,
        temperature=cfg.rollout.temperature,
        chunk_size=cfg.training.logprob_chunk_size,
        exact_layout=cfg.rollout.true_on_policy,
        max_tokens_per_micro_batch=cfg.training.max_tokens_per_micro_batch,
        pack_sequences=cfg.training.pack_sequences,
        use_liger=check_liger(cfg, device_type=device_type, backend_fuses=capabilities.fused_logprobs),
        entropy_grad=cfg.algorithm.entropy_coef != 0.0,
        recompute_above_bytes=cfg.training.logprob_recompute_mb * 2**20,
        # HF activation checkpointing turns the KV cache off, so sharing needs it off
        share_prompts=cfg.training.share_prompt_prefix and not cfg.parallelism.activation_checkpointing,
    )


def check_liger(cfg: RunConfig, *, device_type: str | None = None, backend_fuses: bool = True) -> bool:
    """Resolve ``training.liger_fused_logprobs`` on this machine: whether the run's log-probs come from
    liger-kernel's fused linear cross-entropy (:func:`resolve_liger`). ``device_type``: the trainer's
    (default: ``cuda`` when a GPU is visible); ``backend_fuses``: the backend follows ``ForwardSpec.use_liger``."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    setting = cfg.training.liger_fused_logprobs
    installed = None
    if device_type == "cuda" and setting is not False and _liger_importable():  # (no liger import on a CPU)
        installed = installed_version("liger-kernel") or "unknown"
    return resolve_liger(setting, device_type=device_type, backend_fuses=backend_fuses,
                         entropy_in_loss=cfg.algorithm.entropy_coef != 0.0, installed=installed)


def resolve_liger(setting: bool | str, *, device_type: str, backend_fuses: bool, entropy_in_loss: bool,
                  installed: str | None) -> bool:
    """``training.liger_fused_logprobs`` resolved: ``false`` never; ``true`` wherever it can run and a
    :class:`ConfigError` saying why where it cannot; ``auto`` exactly where ``true`` would run (on CUDA,
    liger-kernel >= :data:`LIGER_MIN_VERSION` importable (``installed`` its version, ``None`` when it is
    not), a backend that takes it, no entropy term in the loss), else the chunked output layer."""
    if setting is False:
        return False
    if setting == "auto":
        return (device_type == "cuda" and backend_fuses and not entropy_in_loss and installed is not None
                and liger_version_ok(installed))
    if device_type != "cuda":
        raise ConfigError(
            "training.liger_fused_logprobs needs CUDA: liger-kernel's Triton kernels do not run on CPU "
            "(the default chunked path keeps memory bounded there)"
        )
    if installed is None:
        raise ConfigError("training.liger_fused_logprobs: liger-kernel is not installed; pip install 'rlite[liger]'")
    check_liger_version(installed)
    if entropy_in_loss:
        raise ConfigError(
            "training.liger_fused_logprobs computes no entropy gradient; set algorithm.entropy_coef=0 or turn liger off"
        )
    if not backend_fuses:
        raise ConfigError("training.liger_fused_logprobs: this training backend computes its log-probs itself; "
                          "set training.liger_fused_logprobs=auto or false, or use parallelism.backend=fsdp2")
    return True


def _liger_importable() -> bool:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return False
    return True


LIGER_MIN_VERSION = (0, 8, 2)
"""Before 0.8.2 liger's fused linear cross-entropy with ``reduction="none"`` scaled every token's weight
gradient by the first token's upstream gradient (linkedin/Liger-Kernel#1298): rlite's per-token
log-probs would train silently wrong."""


def installed_version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def liger_version_ok(found: str | None) -> bool:
    """Whether a liger-kernel version is at least :data:`LIGER_MIN_VERSION`."""
    numbers = [int(n) for n in re.findall(r"\d+", found or "")[:3]]
    return bool(numbers) and tuple(numbers + [0] * (3 - len(numbers))) >= LIGER_MIN_VERSION


def check_liger_version(found: str | None) -> None:
    """Refuse a liger-kernel older than :data:`LIGER_MIN_VERSION` (or of unknown version)."""
    if not liger_version_ok(found):
        wanted = ".".join(map(str, LIGER_MIN_VERSION))
        raise ConfigError(
            f"training.liger_fused_logprobs: liger-kernel {found or '(version unknown)'} computes wrong weight "
            f"gradients for per-token losses before {wanted}; pip install 'liger-kernel>={wanted}' "
            "(or turn training.liger_fused_logprobs off)"
        )
