"""Building a run from its config: data, the training backend and its reference/critic, the loss, the
engine (last, so a failure before it leaves no engine process behind), and resuming from a checkpoint.

:class:`Run` holds what :func:`rlite.loop.train` works with; every field names its type.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlite.config import ConfigError, RunConfig, config_to_yaml
from rlite.data import PromptSampler, PromptSet, load_prompt_splits
from rlite.distributed import DataLayout, DistContext, init_distributed
from rlite.drafts import DraftContext, SpeculativeDraft
from rlite.engines.base import IdleEngine, RolloutEngine
from rlite.engines.placement import describe_rank, gather_engine_context
from rlite.kl_control import KLController, build_kl_controller
from rlite.metrics import StepTimer, trim_metrics_file
from rlite.mismatch import build_corrections, needs_current_logprobs
from rlite.plugin_manager import RlitePluginManager, resolve_choice
from rlite.rewards import FailureLimits, RewardRunner, build_reward_runner
from rlite.run.lifecycle import maybe_resume
from rlite.stages.collect import Rollouts
from rlite.stages.routing import RoutingSetup, replay_plan, routing_setup
from rlite.stages.sync import Quantizer, check_sync_mode, sync_weights_to_engine
from rlite.stages.targets import TargetsSpec
from rlite.stages.update import LossSpec
from rlite.training.backend import CriticModel, ForwardSpec, ScoringModel, TrainingBackend

log = logging.getLogger("rlite")


@dataclass
class Run:
    """Everything ``train()`` works with, built once by :func:`build_run`."""

    config: RunConfig
    ctx: DistContext
    layout: DataLayout
    """The data-parallel shard of this rank (from the backend)."""
    pm: RlitePluginManager
    run_dir: Path
    tokenizer: Any  # a transformers tokenizer
    eval_prompts: PromptSet | None
    sampler: PromptSampler
    rollouts: Rollouts
    backend: TrainingBackend
    reference: ScoringModel | None
    critic: CriticModel | None
    engine: RolloutEngine
    forward: ForwardSpec
    loss: LossSpec
    targets: TargetsSpec
    quantizer: Quantizer | None
    kl_controller: KLController
    loggers: list = field(default_factory=list)
    timer: StepTimer = field(default_factory=StepTimer)
    start_step: int = 0
    routing: RoutingSetup | None = None
    """MoE routing replay and metrics (``None``: a dense model, or both off)."""
    draft: SpeculativeDraft | None = None
    """The speculative-decoding draft (``rollout.draft``; ``None``: plain decoding)."""

    def sync_weights(self, version: int) -> None:
        sync_weights_to_engine(
            self.engine, self.backend, lora_sync=self.config.rollout.lora_sync, quantizer=self.quantizer,
            version=version, draft=self.draft,
        )


def build_run(cfg: RunConfig, pm: RlitePluginManager) -> Run:
    ctx = init_distributed()
    if cfg.training.num_threads is not None:
        torch.set_num_threads(cfg.training.num_threads)
    if cfg.training.keep_freed_memory:
        from rlite.allocator import keep_freed_memory

        keep_freed_memory()
    torch.manual_seed(cfg.training.seed)
    run_dir = Path(cfg.logging.run_dir)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    tokenizer = load_tokenizer(cfg)
    try:
        train_prompts, eval_prompts = load_prompt_splits(cfg.data, tokenizer)
    except (FileNotFoundError, ValueError, KeyError) as exc:  # bad data files: the messages name the key
        raise ConfigError(str(exc).strip("'\"")) from exc
    rewards = build_rewards(cfg, pm, train_prompts)  # before any model loads: a bad reward fails fast
    algo = cfg.algorithm
    total_opt_steps = cfg.training.steps * algo.minibatches_per_step * algo.epochs_per_step
    make_backend, backend_cfg = resolve_choice(pm.registry("training_backend"), cfg.parallelism.backend)
    backend: TrainingBackend = make_backend(cfg, backend_cfg, ctx.device, total_opt_steps)
    layout = backend.data_layout()
    sampler = PromptSampler(
        train_prompts.items, cfg.rollout.prompts_per_step, layout.rank, layout.size, cfg.data.seed, cfg.data.shuffle
    )
    reference = backend.build_reference() if algo.kl.coef != 0.0 else None
    critic = None
    if algo.critic.enabled:
        if not backend.capabilities.critic:
            raise ConfigError(f"algorithm.critic.enabled: the {cfg.parallelism.backend.name!r} backend has no critic")
        critic = backend.build_critic(algo.critic)
    policy_loss, policy_cfg = resolve_choice(pm.registry("policy_loss"), algo.policy_loss)
    corrections = build_corrections(algo.corrections, pm.registry("mismatch_correction"))
    loss_time = needs_current_logprobs(corrections)
    loss = LossSpec(
        policy_loss=policy_loss,
        policy_cfg=policy_cfg,
        agg_mode=algo.loss_agg_mode,
        horizon=float(algo.loss_agg_horizon or cfg.rollout.max_new_tokens),
        kl_fn=pm.registry("kl_estimator").get(algo.kl.estimator).implementation,
        kl_coef=0.0 if algo.kl.in_reward else algo.kl.coef,
        entropy_coef=algo.entropy_coef,
        loss_time_corrections=corrections if loss_time else [],
    )
    forward = ForwardSpec(
        micro_batch_size=cfg.training.micro_batch_size,
        temperature=cfg.rollout.temperature,
        chunk_size=cfg.training.logprob_chunk_size,
        exact_layout=cfg.rollout.true_on_policy,
        use_liger=check_liger(cfg),
        entropy_grad=algo.entropy_coef != 0.0,
        recompute_above_bytes=cfg.training.logprob_recompute_mb * 2**20,
        # HF activation checkpointing turns the KV cache off, so sharing needs it off
        share_prompts=cfg.training.share_prompt_prefix and not cfg.parallelism.activation_checkpointing,
    )
    targets = TargetsSpec(
        advantage=resolve_choice(pm.registry("advantage_estimator"), algo.advantage),
        old_logprob_mode=algo.old_logprob_mode,
        minibatches=algo.minibatches_per_step,
        epochs=algo.epochs_per_step,
        kl_in_reward=algo.kl.in_reward,
        mask_truncated=algo.mask_truncated,
        corrections=[] if loss_time else corrections,
        micro_batch_size=cfg.training.micro_batch_size,
    )
    quantizer = None
    if cfg.rollout.quantization.name != "none":
        quantizer = resolve_choice(pm.registry("rollout_quantizer"), cfg.rollout.quantization)
    kl_controller = build_kl_controller(algo.kl)
    if layout.leader:  # the replica's leader scores its batches
        rewards.start()
    draft = build_draft(cfg, pm, tokenizer, ctx.device, layout)
    start_step = maybe_resume(
        cfg.checkpoint.resume, run_dir, backend, critic, sampler, kl_controller, ctx, pm, draft=draft
    )
    loggers = []
    if ctx.is_main:
        trim_metrics_file(run_dir / "metrics.jsonl", start_step if start_step else None)
        loggers = build_loggers(cfg, run_dir, pm)
    # the engine last: a failure above leaves no engine process behind; every rank tells the engine
    # factories where it runs and what its trainer will still allocate (a collective)
    context = gather_engine_context(
        describe_rank(ctx.rank, ctx.local_rank, ctx.device, bytes_to_come=backend.device_bytes_to_come(),
                      builds_engine=layout.leader),
        quantizer,
        draft=None if draft is None else draft.spec,
    )  # fmt: skip
    engine: RolloutEngine = IdleEngine()  # ranks that receive their replica leader's batches
    if layout.leader:
        make_engine, engine_cfg = resolve_choice(pm.registry("rollout_engine"), cfg.rollout.engine)
        engine = make_engine(cfg.model, tokenizer, cfg.rollout, engine_cfg, context)
    timer = StepTimer()
    run = Run(
        config=cfg,
        ctx=ctx,
        pm=pm,
        run_dir=run_dir,
        tokenizer=tokenizer,
        eval_prompts=eval_prompts,
        sampler=sampler,
        layout=layout,
        rollouts=Rollouts(engine, sampler, rewards, tokenizer, cfg.rollout, algo, cfg.training.seed, layout, pm.hook, timer),
        backend=backend,
        reference=reference,
        critic=critic,
        engine=engine,
        forward=forward,
        loss=loss,
        targets=targets,
        quantizer=quantizer,
        kl_controller=kl_controller,
        loggers=loggers,
        timer=timer,
        start_step=start_step,
        draft=draft,
    )
    try:
        check_sync_mode(cfg.rollout.lora_sync, engine, backend, cfg.rollout.engine.name, quantizer, draft)
        run.routing = routing_setup(cfg, backend, engine, layout)
        run.forward.routing = replay_plan(run.routing)
        run.rollouts.record_routing = run.routing is not None
        run.rollouts.use_draft(draft, engine, cfg.rollout.engine.name)
        run.sync_weights(version=start_step)
    except BaseException:
        engine.shutdown()
        rewards.close()
        raise
    return run


def build_rewards(cfg: RunConfig, pm: RlitePluginManager, train_prompts) -> RewardRunner:
    """The reward runner of ``cfg.rewards``, each function checked against the first training row as
    the functions will see it."""
    example = None
    if len(train_prompts):
        example = dict(train_prompts.items[0].row, response_length=1, finish_reason="stop")
    limits = FailureLimits(cfg.reward_max_failure_fraction, cfg.reward_max_timeout_fraction)
    return build_reward_runner(cfg.rewards, pm.registry("reward_function"), timeout_s=cfg.reward_timeout_s,
                               workers=cfg.reward_workers, limits=limits, example_sample=example)


def build_draft(cfg: RunConfig, pm: RlitePluginManager, tokenizer, device: torch.device,
                layout: DataLayout) -> SpeculativeDraft | None:
    """The draft plugin's draft (``rollout.draft``), or ``None`` for plain decoding."""
    if cfg.rollout.draft.name == "none":
        return None
    make_draft, draft_cfg = resolve_choice(pm.registry("speculative_draft"), cfg.rollout.draft)
    return make_draft(DraftContext(cfg.model, tokenizer, cfg.rollout, device, layout), draft_cfg)


def check_liger(cfg: RunConfig) -> bool:
    """Validate ``training.liger_fused_logprobs`` against this machine (its kernels need CUDA)."""
    if not cfg.training.liger_fused_logprobs:
        return False
    if not torch.cuda.is_available():
        raise ConfigError(
            "training.liger_fused_logprobs needs CUDA: liger-kernel's Triton kernels do not run on CPU "
            "(the default chunked path keeps memory bounded there)"
        )
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        raise ConfigError("training.liger_fused_logprobs: liger-kernel is not installed; pip install 'rlite[liger]'") from None
    check_liger_version(installed_version("liger-kernel"))
    if cfg.algorithm.entropy_coef != 0.0:
        raise ConfigError(
            "training.liger_fused_logprobs computes no entropy gradient; set algorithm.entropy_coef=0 or turn liger off"
        )
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


def check_liger_version(found: str | None) -> None:
    """Refuse a liger-kernel older than :data:`LIGER_MIN_VERSION` (or of unknown version)."""
    import re

    numbers = [int(n) for n in re.findall(r"\d+", found or "")[:3]]
    if not numbers or tuple(numbers + [0] * (3 - len(numbers))) < LIGER_MIN_VERSION:
        wanted = ".".join(map(str, LIGER_MIN_VERSION))
        raise ConfigError(
            f"training.liger_fused_logprobs: liger-kernel {found or '(version unknown)'} computes wrong weight "
            f"gradients for per-token losses before {wanted}; pip install 'liger-kernel>={wanted}' "
            "(or turn training.liger_fused_logprobs off)"
        )


def load_tokenizer(cfg: RunConfig):
    from transformers import AutoTokenizer

    source = cfg.model.tokenizer or cfg.model.path
    kwargs = {"gguf_file": cfg.model.gguf_file} if cfg.model.gguf_file and not cfg.model.tokenizer else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
        raise ConfigError(f"{key}: cannot load a tokenizer from {source!r} ({exc})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_loggers(cfg: RunConfig, run_dir: Path, pm: RlitePluginManager) -> list:
    loggers = []
    registry = pm.registry("logger")
    for choice in cfg.logging.loggers:
        factory, logger_cfg = resolve_choice(registry, choice)
        logger = factory(run_dir, cfg, logger_cfg)
        if logger is not None:
            loggers.append(logger)
    return loggers
