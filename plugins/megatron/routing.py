"""Routing replay and agreement for megatron-core MoE models, through megatron-core's ``RouterReplay``.

The model is built with ``moe_enable_routing_replay=True``, which gives every ``TopKRouter`` a
``RouterReplay``; its top-k goes through ``RouterReplay.get_replay_topk``. For the forwards of a
:class:`rlite.moe_routing.RoutingPlan`, :func:`routing_context` wraps that method on each router of
*this* model (megatron's static API addresses every router of the process, the reference model's
too): it computes the router's own top-k (for the agreement counts), fills tokens without a
recorded choice with it, and then lets ``RouterReplay`` route with ``REPLAY_FORWARD``: the weights
are the router's scores gathered at the replayed experts, so gradients reach the router logits.
The patch lives only for the forward, so a recomputed forward (``parallelism.activation_checkpointing``)
would route naturally: the backend refuses recompute with routing replay (``REPLAY_BACKWARD`` unused).

Token order: megatron's routers see ``[sequence, batch]`` tokens; rlite's routing grid is
``[batch, sequence, layers, top_k]``, transposed here.
"""

from __future__ import annotations

import contextlib

import torch

from rlite.api import RoutingPlan


def moe_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(decoder layer index, TopKRouter)`` of each MoE layer of a ``GPTModel``."""
    routers = []
    for index, layer in enumerate(model.decoder.layers):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            routers.append((index, router))
    return routers


@contextlib.contextmanager
def routing_context(model: torch.nn.Module, plan: RoutingPlan | None, routing: torch.Tensor | None):
    """Run the forwards inside under ``plan``; ``routing`` is the engine's ``[b, s, L, K]`` routing
    of the forward's (padded) tokens, -1 where none was recorded."""
    if plan is None or routing is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    tokens_first = routing.transpose(0, 1).reshape(-1, *routing.shape[2:])  # [s * b, L, K]
    patched = []
    for layer, router in moe_routers(model):
        replay = router.router_replay
        if replay is None:
            raise RuntimeError("routing replay: the megatron model was built without moe_enable_routing_replay")
        want_all = tokens_first[:, layer]
        original = replay.get_replay_topk

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None,
                            *, layer=layer, replay=replay, original=original, want_all=want_all):
            natural_probs, natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            want = want_all.to(natural.device, torch.long)
            if want.shape[0] != natural.shape[0]:
                raise RuntimeError(f"routing replay: layer {layer} routes {natural.shape[0]} tokens, the routing has {want.shape[0]}")
            if plan.stats is not None:
                plan.stats.add(layer, natural, want)
            if not plan.replay:
                if plan.used_stats is not None:
                    plan.used_stats.add(layer, natural, want)
                return natural_probs, natural
            chosen = torch.where((want[:, :1] >= 0).expand_as(want), want, natural)
            if plan.used_stats is not None:
                plan.used_stats.add(layer, chosen, want)
            replay.set_target_indices(chosen)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            try:
                return original(scores, topk, num_groups, group_topk, default_compute_topk)
            finally:
                replay.clear_indices()
                replay.clear_router_replay_action()

        replay.get_replay_topk = get_replay_topk
        patched.append(replay)
    try:
        yield
    finally:
        for replay in patched:
            del replay.get_replay_topk  # back to the class's method
