"""The public plugin API: everything a plugin (built in or third-party) imports from rlite.

Built-in plugins (``rlite.plugins.*``: the estimators and losses, but also the ``transformers`` and
``sglang`` engines and the ``fsdp2`` and ``megatron`` backends, each a package of its own) import from here
and from their own package, nowhere else in rlite, so a third-party package can do all they do. What
``__all__`` lists, exactly the list under "The public API" in ``docs/plugins.md`` (tested), is stable across
minor versions; everything else is rlite's inside.

It holds interfaces (the contracts, the config a plugin receives) and kits (the helpers rlite's own
implementations are built from and a third party's may reuse: the chunked log-probs of a Hugging Face
model, the sampler, the weight-sync buckets, AdamW with its moments on disk, ...), never an implementation
of a built-in plugin: to build on one, compose it through :func:`registered` (in an :class:`EngineWrapper`
or a :class:`BackendWrapper`). Kits with heavy
imports (Hugging Face loading, the log-prob kernels) are attributes loaded on first use, so
``import rlite.api`` stays light.

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
from rlite.algorithms.mismatch import (
    CorrectionOutput,
    fraction,
    log_or_neg_inf,
    masked_log_ratio,
    sequence_mean,
    sequence_sum,
    weight_stats,
)
from rlite.config import (
    ConfigError,
    CriticConfig,
    ModelConfig,
    ParallelismConfig,
    RunConfig,
    TrainingConfig,
    require_optional_package,
)
from rlite.config.capabilities import Unsupported
from rlite.distributed import DataLayout, thread_group
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
from rlite.moe_routing import RouterHooks, RoutingPlan, RoutingStats, completion_rows, decode_routed_experts
from rlite.plugin_manager import registered
from rlite.reward_runner import RewardOutcome
from rlite.rollout import (
    EnvResults,
    ModelInputs,
    RolloutBatch,
    TrainTargets,
    left_pad,
    model_inputs,
    pad_to_width,
    position_ids_from_mask,
)
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
    from rlite.engines.sampling import draw_from_cdf, filter_logits, sample_categorical
    from rlite.engines.speculative import prompt_lookup, verify_proposals
    from rlite.hf_models import apply_lora, cache_kwarg, empty_causal_lm, load_causal_lm, skeleton_causal_lm
    from rlite.samples import samples_markdown
    from rlite.training.grad_accumulation import accumulate_in_place, matmul_grad, vector_grad
    from rlite.training.logprobs import (
        ForwardPlan,
        PolicyModel,
        causal_lm_of,
        chunked_logprobs,
        length_buckets,
        unique_prompt_rows,
    )
    from rlite.training.optim_offload import DiskOffloadAdamW, optimizer_offload_dir
    from rlite.training.packing import PackedRows

_LAZY = {
    "load_causal_lm": "rlite.hf_models",
    "apply_lora": "rlite.hf_models",
    "skeleton_causal_lm": "rlite.hf_models",
    "empty_causal_lm": "rlite.hf_models",
    "cache_kwarg": "rlite.hf_models",
    "samples_markdown": "rlite.samples",
    "chunked_logprobs": "rlite.training.logprobs",
    "length_buckets": "rlite.training.logprobs",
    "unique_prompt_rows": "rlite.training.logprobs",
    "PolicyModel": "rlite.training.logprobs",
    "ForwardPlan": "rlite.training.logprobs",
    "causal_lm_of": "rlite.training.logprobs",
    "PackedRows": "rlite.training.packing",
    "accumulate_in_place": "rlite.training.grad_accumulation",
    "matmul_grad": "rlite.training.grad_accumulation",
    "vector_grad": "rlite.training.grad_accumulation",
    "DiskOffloadAdamW": "rlite.training.optim_offload",
    "optimizer_offload_dir": "rlite.training.optim_offload",
    "filter_logits": "rlite.engines.sampling",
    "sample_categorical": "rlite.engines.sampling",
    "draw_from_cdf": "rlite.engines.sampling",
    "verify_proposals": "rlite.engines.speculative",
    "prompt_lookup": "rlite.engines.speculative",
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
    "ModelConfig",
    "ParallelismConfig",
    "TrainingConfig",
    "CriticConfig",
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
    "ModelInputs",
    "pad_to_width",
    "left_pad",
    "position_ids_from_mask",
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
    "PolicyModel",
    "ForwardPlan",
    "causal_lm_of",
    "PackedRows",
    "accumulate_in_place",
    "matmul_grad",
    "vector_grad",
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
    "filter_logits",
    "sample_categorical",
    "draw_from_cdf",
    "thread_group",
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
    "verify_proposals",
    "prompt_lookup",
    # MoE routing
    "RoutingPlan",
    "RoutingStats",
    "RouterHooks",
    "completion_rows",
    "decode_routed_experts",
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
    "empty_causal_lm",
    "apply_lora",
    "cache_kwarg",
]
