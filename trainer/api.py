"""The public plugin API: everything a plugin (built in or third-party) imports from rlite.

Built-in plugins (``rlite.plugins.*``) import from here and nowhere else in rlite, so a third-party
package can do all they do (the plugins that wire rlite's own engines and backend also reach into those
implementations' packages). What ``__all__`` lists, exactly the list under "The public API" in
``docs/plugins.md`` (tested), is stable across minor versions; everything else is rlite's inside.
Implementations with heavy dependencies (the FSDP2 backend, the engines, Hugging Face loading) are
attributes loaded on first use, so ``import rlite.api`` stays light.

Contracts: :class:`TrainingBackend` (with :class:`ForwardSpec`, :class:`BackendCapabilities`,
:class:`LoraAdapter`, :class:`ScoringModel`, :class:`CriticModel`; :class:`BackendBase` to build one,
:class:`BackendWrapper` to wrap one), :class:`RolloutEngine` (with
:class:`EngineCapabilities`, :class:`SamplingParams`, :class:`Completion`; :class:`EngineWrapper` to wrap one, and for speculative decoding
:class:`DraftSpec` and :class:`SpeculationStats`) and :class:`SpeculativeDraft` (with
:class:`DraftContext`; built on :class:`ModelDraft` or :class:`FixedDraft`). Rewards that run a
model's code: :func:`run_untrusted` (with :class:`SandboxLimits`, :class:`SandboxResult`), and a reward
may return a :class:`RewardOutcome` to report counts. Components report metrics for the step's row through a
:class:`MetricsSink` (an engine's ``EngineContext.metrics``, a backend's ``metrics``); loggers implement
:class:`Logger`. Feeding an engine of your own: the weight-sync kit
(:class:`SharedBucketSender`, :class:`SyncServer`, ..., also :mod:`rlite.sync`). Hook specs:
:mod:`rlite.hookspecs`; writing plugins: ``docs/plugins.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rlite.algorithms import AdvantageInput, masked_mean, masked_whiten
from rlite.config import ConfigError, RunConfig, require_optional_package
from rlite.config.capabilities import Unsupported
from rlite.distributed import DataLayout
from rlite.drafts import DraftContext, FixedDraft, ModelDraft, SpeculativeDraft, check_draft_vocabulary
from rlite.engines.base import (
    DRAFT_PREFIX,
    Completion,
    DraftSpec,
    EngineCapabilities,
    EngineDied,
    EngineError,
    EngineWrapper,
    RolloutEngine,
    SamplingParams,
    SpeculationStats,
)
from rlite.engines.placement import EngineContext, RankDevice
from rlite.hookspecs import Register, hookimpl
from rlite.metrics import Logger, MetricsSink
from rlite.mismatch import (
    CorrectionOutput,
    fraction,
    log_or_neg_inf,
    masked_log_ratio,
    sequence_mean,
    sequence_sum,
    weight_stats,
)
from rlite.moe_routing import RouterHooks, RoutingPlan, RoutingStats
from rlite.plugin_manager import registered
from rlite.rewards import RewardOutcome
from rlite.rollout import EnvResults, RolloutBatch, TrainTargets, model_inputs, pad_to_width
from rlite.run_files import open_run_file
from rlite.sandbox import KINDS as SANDBOX_KINDS
from rlite.sandbox import (
    Isolation,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    probe_isolation,
    run_untrusted,
)
from rlite.sync import (
    ALIGNMENT,
    BucketMeta,
    Channel,
    ConnectionChannel,
    SharedBucketReceiver,
    SharedBucketSender,
    SyncServer,
    SyncStats,
    TensorMeta,
    bucket_checksum,
    iter_buckets,
    pack_bucket,
    unpack_bucket,
)
from rlite.training.backend import (
    BackendBase,
    BackendCapabilities,
    BackendWrapper,
    CriticModel,
    ForwardSpec,
    LoraAdapter,
    ScoringModel,
    TrainingBackend,
    optimizer_state_bytes_to_come,
)
from rlite.training.device import to_device
from rlite.training.schedule import build_lr_scheduler
from rlite.workflows import Action, Environment, SingleTurn

if TYPE_CHECKING:  # the names _LAZY loads on first use, for type checkers and linters
    from rlite.backends.fsdp2.backend import FSDP2Backend
    from rlite.engines.sglang.engine import SGLangEngine
    from rlite.engines.transformers.engine import TransformersEngine
    from rlite.engines.transformers.process import ProcessEngine
    from rlite.hf_models import apply_lora, load_causal_lm, skeleton_causal_lm
    from rlite.samples import samples_markdown
    from rlite.training.logprobs import chunked_logprobs, length_buckets, unique_prompt_rows
    from rlite.training.optim_offload import DiskOffloadAdamW, optimizer_offload_dir

_LAZY = {
    "FSDP2Backend": "rlite.backends.fsdp2.backend",
    "TransformersEngine": "rlite.engines.transformers.engine",
    "ProcessEngine": "rlite.engines.transformers.process",
    "SGLangEngine": "rlite.engines.sglang.engine",
    "load_causal_lm": "rlite.hf_models",
    "apply_lora": "rlite.hf_models",
    "skeleton_causal_lm": "rlite.hf_models",
    "samples_markdown": "rlite.samples",
    "chunked_logprobs": "rlite.training.logprobs",
    "length_buckets": "rlite.training.logprobs",
    "unique_prompt_rows": "rlite.training.logprobs",
    "DiskOffloadAdamW": "rlite.training.optim_offload",
    "optimizer_offload_dir": "rlite.training.optim_offload",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlite.api' has no attribute {name!r}")


__all__ = [  # exactly the list of docs/plugins.md, "The public API" (tests/architecture/test_public_api.py)
    # Plugins and config
    "hookimpl",
    "Register",
    "registered",
    "RunConfig",
    "ConfigError",
    "require_optional_package",
    "Unsupported",
    "MetricsSink",
    # Advantages, losses, KL and corrections
    "AdvantageInput",
    "masked_mean",
    "masked_whiten",
    "CorrectionOutput",
    "fraction",
    "log_or_neg_inf",
    "masked_log_ratio",
    "sequence_mean",
    "sequence_sum",
    "weight_stats",
    # The batch
    "RolloutBatch",
    "TrainTargets",
    "EnvResults",
    "model_inputs",
    "pad_to_width",
    # Training backends
    "TrainingBackend",
    "BackendBase",
    "BackendWrapper",
    "BackendCapabilities",
    "ForwardSpec",
    "LoraAdapter",
    "ScoringModel",
    "CriticModel",
    "DataLayout",
    "build_lr_scheduler",
    "optimizer_state_bytes_to_come",
    "chunked_logprobs",
    "length_buckets",
    "unique_prompt_rows",
    "DiskOffloadAdamW",
    "optimizer_offload_dir",
    "to_device",
    # Rollout engines
    "RolloutEngine",
    "EngineWrapper",
    "EngineCapabilities",
    "EngineContext",
    "RankDevice",
    "SamplingParams",
    "Completion",
    "EngineError",
    "EngineDied",
    # Weight sync
    "SharedBucketSender",
    "SyncServer",
    "SharedBucketReceiver",
    "Channel",
    "ConnectionChannel",
    "SyncStats",
    "iter_buckets",
    "pack_bucket",
    "unpack_bucket",
    "bucket_checksum",
    "TensorMeta",
    "BucketMeta",
    "ALIGNMENT",
    # Speculative decoding
    "SpeculativeDraft",
    "DraftContext",
    "DraftSpec",
    "SpeculationStats",
    "ModelDraft",
    "FixedDraft",
    "check_draft_vocabulary",
    "DRAFT_PREFIX",
    # MoE routing
    "RoutingPlan",
    "RoutingStats",
    "RouterHooks",
    # Rewards and running a model's code
    "RewardOutcome",
    "run_untrusted",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "Isolation",
    "probe_isolation",
    "SANDBOX_KINDS",
    # Multi-turn workflows
    "Environment",
    "Action",
    "SingleTurn",
    # Loggers
    "Logger",
    "samples_markdown",
    "open_run_file",
    # Models
    "load_causal_lm",
    "skeleton_causal_lm",
    "apply_lora",
    # rlite's own implementations
    "FSDP2Backend",
    "TransformersEngine",
    "ProcessEngine",
    "SGLangEngine",
]
