"""The public plugin API: everything a plugin (built in or third-party) imports from rlite.

Built-in plugins (``rlite.plugins.*``) import from here and nowhere else in rlite, so a third-party
package can do all they do. What is listed here is stable across minor versions; everything else is
rlite's inside. Implementations with heavy dependencies (the FSDP2 backend, the engines, Hugging Face
loading) are attributes loaded on first use, so ``import rlite.api`` stays light.

Contracts: :class:`TrainingBackend` (with :class:`ForwardSpec`, :class:`BackendCapabilities`,
:class:`LoraAdapter`, :class:`ScoringModel`, :class:`CriticModel`), :class:`RolloutEngine` (with
:class:`EngineCapabilities`, :class:`SamplingParams`, :class:`Completion`, and for speculative decoding
:class:`DraftSpec` and :class:`SpeculationStats`) and :class:`SpeculativeDraft` (with
:class:`DraftContext`; built on :class:`ModelDraft` or :class:`FixedDraft`). Rewards that run a
model's code: :func:`run_untrusted` (with :class:`SandboxLimits`, :class:`SandboxResult`), and a reward
may return a :class:`RewardOutcome` to report counts. Hook specs:
:mod:`rlite.hookspecs`; writing plugins: ``docs/plugins.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlite.algorithms import AdvantageInput, masked_mean, masked_whiten
from rlite.config import ConfigError, RunConfig
from rlite.distributed import DataLayout
from rlite.drafts import DraftContext, FixedDraft, ModelDraft, SpeculativeDraft, check_draft_vocabulary
from rlite.engines.base import (
    DRAFT_PREFIX,
    Completion,
    DraftSpec,
    EngineCapabilities,
    EngineDied,
    EngineError,
    RolloutEngine,
    SamplingParams,
    SpeculationStats,
)
from rlite.engines.placement import EngineContext, RankDevice
from rlite.hookspecs import Register, hookimpl
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
from rlite.rollout import RolloutBatch, TrainTargets, model_inputs, pad_to_width
from rlite.sandbox import KINDS as SANDBOX_KINDS
from rlite.sandbox import (
    Isolation,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    probe_isolation,
    run_untrusted,
)
from rlite.training.backend import (
    BackendBase,
    BackendCapabilities,
    CriticModel,
    ForwardSpec,
    LoraAdapter,
    ScoringModel,
    TrainingBackend,
    optimizer_state_bytes_to_come,
)
from rlite.training.schedule import build_lr_scheduler
from rlite.workflows import Action, Environment, SingleTurn

_LAZY = {
    "FSDP2Backend": "rlite.backends.fsdp2.backend",
    "TransformersEngine": "rlite.engines.transformers.engine",
    "ProcessEngine": "rlite.engines.transformers.process",
    "load_draft_model": "rlite.engines.transformers.engine",
    "SGLangEngine": "rlite.engines.sglang.engine",
    "read_model_config": "rlite.engines.sglang.engine",
    "SGLangGroupMember": "rlite.engines.sglang.group",
    "EngineGroup": "rlite.engines.sglang.group",
    "plan_engines": "rlite.engines.sglang.placement",
    "plan_of": "rlite.engines.sglang.placement",
    "engine_weight_bytes": "rlite.engines.sglang.placement",
    "resolve_engine_dtype": "rlite.engines.sglang.payloads",
    "sglang_metadata_cls": "rlite.engines.sglang.payloads",
    "load_causal_lm": "rlite.hf_models",
    "apply_lora": "rlite.hf_models",
    "skeleton_causal_lm": "rlite.hf_models",
    "samples_markdown": "rlite.samples",
    "chunked_logprobs": "rlite.training.logprobs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlite.api' has no attribute {name!r}")


__all__ = [
    "registered",
    "Action",
    "AdvantageInput",
    "BackendBase",
    "BackendCapabilities",
    "Completion",
    "ConfigError",
    "CorrectionOutput",
    "CriticModel",
    "DRAFT_PREFIX",
    "DataLayout",
    "DraftContext",
    "DraftSpec",
    "EngineCapabilities",
    "EngineContext",
    "EngineDied",
    "EngineError",
    "Environment",
    "Isolation",
    "FixedDraft",
    "ForwardSpec",
    "LoraAdapter",
    "ModelDraft",
    "Register",
    "RankDevice",
    "RewardOutcome",
    "RolloutBatch",
    "RolloutEngine",
    "RouterHooks",
    "RoutingPlan",
    "RoutingStats",
    "RunConfig",
    "SANDBOX_KINDS",
    "SamplingParams",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "ScoringModel",
    "SingleTurn",
    "SpeculationStats",
    "SpeculativeDraft",
    "TrainTargets",
    "TrainingBackend",
    "build_lr_scheduler",
    "check_draft_vocabulary",
    "fraction",
    "hookimpl",
    "log_or_neg_inf",
    "masked_log_ratio",
    "masked_mean",
    "masked_whiten",
    "model_inputs",
    "optimizer_state_bytes_to_come",
    "pad_to_width",
    "probe_isolation",
    "run_untrusted",
    "sequence_mean",
    "sequence_sum",
    "weight_stats",
    *_LAZY,
]
