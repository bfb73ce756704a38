"""Mixture-of-Experts routing in a step: whether the engine reports its routing, whether the trainer
replays it (``algorithm.routing_replay``), and the routing metrics (``algorithm.routing_metrics``).

The metrics are measured on the step's batch with the weights that sampled it (before the update),
by two no-grad forwards of the policy, one routing naturally and one replaying the engine's routing:

=========================================== =====================================================
``routing/agreement_without_replay``        fraction of (token, MoE layer) pairs whose trainer
                                            top-k expert set equals the engine's, routing naturally
``routing/agreement_with_replay``           the same for the experts used under replay (1 by
                                            construction; measured, not assumed)
``routing/router_agreement_under_replay``   under replay, where the trainer's router *would* have
                                            chosen the engine's set (same inputs to every layer)
``..._min_layer`` / ``..._max_layer``       the lowest / highest fraction of one layer
``routing/mismatch_kl_{without,with}_replay``   ``mismatch/kl`` (k1) of each forward against the
                                            engine's log-probs; ``routing/mismatch_k3_kl_*`` the k3
=========================================== =====================================================

Only tokens the engine recorded count (prompt and response tokens but each response's last).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from rlite.algorithms.mismatch import mismatch_metrics
from rlite.config import ConfigError, RunConfig
from rlite.config.compat import check_compatibility
from rlite.distributed import DataLayout, all_gather_objects, all_reduce_sum, broadcast_object
from rlite.engines.base import RolloutEngine
from rlite.moe_routing import RoutingPlan, RoutingStats
from rlite.rollout import RolloutBatch, pad_to_width
from rlite.stages.minibatches import score_logprobs
from rlite.training.backend import ForwardSpec, TrainingBackend

log = logging.getLogger("rlite")


@dataclass(frozen=True)
class RoutingSetup:
    """What a run does with MoE routing (``None`` in :class:`~rlite.run.state.Run` for dense models)."""

    replay: bool
    """The trainer's forwards replay the engine's routing."""
    metrics: bool
    """Measure agreement and mismatch with and without replay every step."""
    num_layers: int


def num_experts_of(hf_config: Any) -> int:
    """Routed experts per MoE layer of a Hugging Face config (0 for a dense model)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    return int(getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0)


def routing_setup(cfg: RunConfig, backend: TrainingBackend, engine: RolloutEngine, layout: DataLayout,
                  pm: Any = None) -> RoutingSetup | None:
    """Check ``algorithm.routing_replay`` / ``routing_metrics`` against the model, the backend and the
    engine; ``None`` when the run does nothing with routing. Every rank decides alike (the engine's
    capability comes from the replica's leader). ``pm``: the run's plugin manager, whose registrations the
    rules checked here read (a multi-turn workflow)."""
    algo = cfg.algorithm
    hf_config = backend.hf_config()
    replay = algo.routing_replay == "rollout"
    moe = bool(num_experts_of(hf_config))
    check_compatibility(cfg, pm, moe=moe)
    if not moe:
        return None
    if not (replay or algo.routing_metrics):
        return None
    engine_reports = engine.capabilities.routed_experts if layout.leader else None
    if layout.replica_size > 1:  # a replica of one has no group of its own (None would be the whole world)
        engine_reports = broadcast_object(engine_reports, layout.replica_leader, layout.replica_group)
    missing = []
    if not engine_reports:
        missing.append(f"the {cfg.rollout.engine.name!r} engine (rollout.engine) does not report routed experts")
    if not backend.capabilities.routing_replay:
        missing.append(f"the {cfg.parallelism.backend.name!r} backend (parallelism.backend) cannot replay routing")
    if missing:
        if replay:
            raise ConfigError(f"algorithm.routing_replay=rollout: {'; '.join(missing)}")
        log.warning("routing metrics off: %s (set algorithm.routing_metrics=false to silence this)", "; ".join(missing))
        return None
    text = getattr(hf_config, "text_config", None) or hf_config
    return RoutingSetup(replay=replay, metrics=algo.routing_metrics, num_layers=int(text.num_hidden_layers))


def replay_plan(setup: RoutingSetup | None) -> RoutingPlan | None:
    """``ForwardSpec.routing`` of the run's forwards."""
    return RoutingPlan(replay=True) if setup is not None and setup.replay else None


def measure_routing(
    policy: TrainingBackend,
    batch: RolloutBatch,
    forward: ForwardSpec,
    setup: RoutingSetup,
    *,
    minibatches: int,
    layout: DataLayout,
) -> dict[str, float]:
    """The ``routing/*`` metrics of the module docstring, global over the data-parallel ranks."""
    if batch.routed_experts is None:
        raise RuntimeError("routing metrics: the batch carries no routed experts (the engine was not asked for them)")
    metrics: dict[str, float] = {}
    for replay in (False, True):
        name = "with_replay" if replay else "without_replay"
        router, used = RoutingStats(setup.num_layers), RoutingStats(setup.num_layers)
        logprobs = score_logprobs(policy, batch, replace(forward, routing=RoutingPlan(replay, router, used)), minibatches)
        counts = all_reduce_sum(torch.cat([router.as_tensor(), used.as_tensor()]), layout.group)
        metrics.update(RoutingStats.from_tensor(counts[2:]).metrics(f"routing/agreement_{name}"))
        if replay:
            metrics.update(RoutingStats.from_tensor(counts[:2]).metrics("routing/router_agreement_under_replay"))
        parts = all_gather_objects((logprobs, batch.rollout_logprobs, batch.response_mask), layout.group)
        width = max(p[2].shape[1] for p in parts)
        train, roll, mask = (torch.cat([pad_to_width(p[i], width) for p in parts]) for i in range(3))
        mismatch = mismatch_metrics(train, roll, mask)
        metrics[f"routing/mismatch_kl_{name}"] = mismatch["mismatch/kl"]
        metrics[f"routing/mismatch_k3_kl_{name}"] = mismatch["mismatch/k3_kl"]
    return metrics
