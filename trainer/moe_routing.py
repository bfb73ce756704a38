"""Mixture-of-Experts routing: record the experts a model routes each token to, replay a recorded
choice, and measure how often two routings agree (rollout routing replay, "R3").

The engine and the trainer compute the router's top-k in different numerics (another kernel, a
quantized rollout, another batch shape), so the same token can go to different experts in the two:
the policy gradient is then taken on another function than the one that sampled. With
``algorithm.routing_replay: rollout`` the engine records, for every token it ran, the experts of
every MoE layer, and the trainer's forward routes each token to exactly those experts.

**Layout.** A routing is an integer tensor ``[tokens, layers, top_k]``: ``layers`` counts every
decoder layer (dense layers hold -1), as SGLang's ``meta_info["routed_experts"]``; an engine's
completion covers the tokens it ran, the prompt and every generated token but the last (that one is
never fed back), ``len(prompt) + len(response) - 1`` rows. In a rollout batch the routing sits on the
batch's own ``[B, P + T]`` grid (``RolloutBatch.routed_experts``), -1 where nothing was recorded
(padding, the last token of each response).

**Replay (Hugging Face models).** :class:`RouterHooks` puts a forward hook on every top-k router of
a supported model family. Replaying, the hook keeps the router logits ``z`` the module computed and
replaces its choice by the recorded experts ``e``, recomputing the gating weights exactly as the
family does on its own choice::

    p = softmax(z) (float32),   w_j = p[e_j],   w <- w / sum(w) if the family normalises,   cast like the family

so gradients still flow into the router logits (as in megatron-core's ``RouterReplay``), and a
replay of the trainer's own choice gives its natural forward bit for bit. Tokens without a recorded
choice (-1) keep the router's own. Under activation checkpointing the recomputation in backward
replays the same choice (:meth:`RouterHooks.checkpoint_context`).

**Agreement.** :class:`RoutingStats` counts, per layer, the tokens whose top-k *set* (order does not
matter: the expert outputs are summed) equals the reference's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

ROUTING_DTYPE = torch.int16
"""How a rollout batch stores expert indices (models with up to 32767 experts; 4 bytes → 2 per entry)."""


@dataclass(frozen=True)
class RouterRule:
    """How a Hugging Face router family turns its logits and chosen experts into gating weights."""

    normalize: str | bool
    """``True``/``False``, or the name of the router attribute that says (``norm_topk_prob``)."""
    cast_to_logits_dtype: bool
    """Whether the family casts the weights back to the logits' dtype."""
    score: str = "softmax"
    """``softmax`` over all experts, or ``sigmoid`` per expert (DeepSeek-V3's family, whose selection adds
    a bias and may be limited to groups of experts; its gating weights use neither)."""
    norm_eps: float = 0.0
    """Added to the sum the chosen weights are divided by when normalising."""
    scale: str | None = None
    """The router attribute the gating weights are multiplied by (``routed_scaling_factor``)."""

    def normalizes(self, router: nn.Module) -> bool:
        return bool(getattr(router, self.normalize)) if isinstance(self.normalize, str) else self.normalize


ROUTER_FAMILIES: dict[str, RouterRule] = {
    "Qwen2MoeTopKRouter": RouterRule("norm_topk_prob", True),
    "Qwen3MoeTopKRouter": RouterRule("norm_topk_prob", True),
    "OlmoeTopKRouter": RouterRule("norm_topk_prob", True),
    "MixtralTopKRouter": RouterRule(True, False),
    "DeepseekV3TopkRouter": RouterRule("norm_topk_prob", False, "sigmoid", 1e-20, "routed_scaling_factor"),
    "Glm4MoeTopkRouter": RouterRule("norm_topk_prob", False, "sigmoid", 1e-20, "routed_scaling_factor"),
}
"""Top-k routers whose replay rlite implements (``transformers`` 5.x): softmax over all experts, top-k,
optional renormalisation; or DeepSeek-V3's sigmoid scores, biased and group-limited selection, the
chosen unbiased scores renormalised and scaled. A router of another family is refused by name."""


def decoder_layers_of(model: nn.Module) -> list[nn.Module]:
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(lm.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError("routing: cannot find the decoder blocks (expected model.get_decoder().layers)")
    return list(layers)


def find_routers(model: nn.Module) -> list[tuple[int, nn.Module, RouterRule]]:
    """``(decoder layer index, router, rule)`` for every top-k router of a Hugging Face MoE model,
    in layer order; empty for a dense model. Raises for a router family rlite cannot replay."""
    found = []
    try:
        layers = decoder_layers_of(model)
    except (ValueError, AttributeError, NotImplementedError):  # not a decoder-layers model: fine if dense
        routers = [type(m).__name__ for m in model.modules() if type(m).__name__ in ROUTER_FAMILIES]
        if routers:
            raise ValueError(f"routing: found {routers[0]} but no decoder layers (model.get_decoder().layers)") from None
        return []
    for index, layer in enumerate(layers):
        for module in layer.modules():
            name = type(module).__name__
            if name in ROUTER_FAMILIES:
                found.append((index, module, ROUTER_FAMILIES[name]))
            elif name.endswith("Router") and hasattr(module, "top_k"):
                raise ValueError(
                    f"routing: the router {name} (decoder layer {index}) is not one rlite can record and replay; "
                    f"supported: {', '.join(sorted(ROUTER_FAMILIES))}"
                )
    return found


@dataclass(frozen=True)
class RoutingShape:
    """The routing layout of a model: ``[tokens, num_layers, top_k]`` indices into ``num_experts``."""

    num_layers: int
    top_k: int
    num_experts: int
    moe_layers: tuple[int, ...]


def routing_shape_of(model: nn.Module) -> RoutingShape | None:
    """The routing layout of a Hugging Face model, ``None`` for a dense one."""
    routers = find_routers(model)
    if not routers:
        return None
    top_k = {int(r.top_k) for _, r, _ in routers}
    experts = {int(r.num_experts) for _, r, _ in routers}
    if len(top_k) != 1 or len(experts) != 1:
        raise ValueError(f"routing: layers disagree on top_k {sorted(top_k)} or experts {sorted(experts)}")
    return RoutingShape(len(decoder_layers_of(model)), top_k.pop(), experts.pop(), tuple(i for i, _, _ in routers))


def same_expert_sets(chosen: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[N]`` True where the rows of two ``[N, K]`` index tensors name the same set of experts."""
    return (chosen.long().sort(-1).values == reference.long().sort(-1).values).all(-1)


class RoutingStats:
    """Per-layer counts of tokens compared with a reference routing and of those that agreed."""

    def __init__(self, num_layers: int) -> None:
        self.compared = torch.zeros(num_layers, dtype=torch.float64)
        self.matched = torch.zeros(num_layers, dtype=torch.float64)

    def add(self, layer: int, chosen: torch.Tensor, reference: torch.Tensor) -> None:
        """Count the tokens of ``reference`` ``[N, K]`` that have a choice (>= 0) and those where
        ``chosen`` picked the same set."""
        valid = reference[:, 0] >= 0
        self.compared[layer] += float(valid.sum())
        self.matched[layer] += float((same_expert_sets(chosen, reference) & valid).sum())

    def as_tensor(self) -> torch.Tensor:
        return torch.stack([self.compared, self.matched])

    @classmethod
    def from_tensor(cls, counts: torch.Tensor) -> RoutingStats:
        stats = cls(counts.shape[1])
        stats.compared, stats.matched = counts[0].clone(), counts[1].clone()
        return stats

    def metrics(self, prefix: str) -> dict[str, float]:
        """``prefix``: the fraction of (token, MoE layer) pairs that agreed; ``prefix_min_layer`` /
        ``prefix_max_layer``: the lowest and highest fraction of one layer."""
        seen = self.compared > 0
        if not bool(seen.any()):
            return {}
        per_layer = self.matched[seen] / self.compared[seen]
        return {
            prefix: float(self.matched.sum() / self.compared.sum()),
            f"{prefix}_min_layer": float(per_layer.min()),
            f"{prefix}_max_layer": float(per_layer.max()),
        }


@dataclass
class RoutingPlan:
    """How a forward routes its MoE tokens (``ForwardSpec.routing``): replay the engine's routing of
    the batch or route naturally, and what to count on the way."""

    replay: bool
    stats: RoutingStats | None = None
    """Counts where the router's own top-k equals the engine's."""
    used_stats: RoutingStats | None = None
    """Counts where the experts the forward used equal the engine's (replaying: 1 by construction,
    measured, not assumed)."""


@dataclass
class _State:
    forced: torch.Tensor | None = None
    """``[N, L, K]`` experts to route the N tokens of the next forward to (-1: the router's own)."""
    stats: RoutingStats | None = None
    """Counts the router's own choice against ``forced`` (``router``) and the routing used (``used``)."""
    used_stats: RoutingStats | None = None
    recorded: dict[int, torch.Tensor] | None = None
    """Layer -> ``[N, K]`` experts the forward used (recording)."""
    observe_only: bool = False
    """Compare the router's own choice with ``forced`` but route naturally."""


class RouterHooks:
    """Forward hooks on every router of a Hugging Face MoE model: record, replay, compare.

    Installed once (:meth:`attach`); idle (no effect on the forward) outside :meth:`recording` and
    :meth:`replaying`. One forward of the decoder at a time: the hooks see the tokens of the call in
    the decoder's row-major order, ``[rows, columns] -> N``.
    """

    def __init__(self, model: nn.Module, routers: list[tuple[int, nn.Module, RouterRule]]) -> None:
        self.shape = routing_shape_of(model)
        self.state = _State()
        self._handles = [
            router.register_forward_hook(self._hook_for(layer, rule)) for layer, router, rule in routers
        ]

    @classmethod
    def attach(cls, model: nn.Module) -> RouterHooks | None:
        """Hooks on ``model``'s routers, or ``None`` when it has none (a dense model)."""
        routers = find_routers(model)
        return cls(model, routers) if routers else None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- modes ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self):
        """Record the experts every router chooses; :meth:`take` returns those of the last forward."""
        previous, self.state = self.state, _State(recorded={})
        try:
            yield self
        finally:
            self.state = previous

    def take(self, num_tokens: int) -> torch.Tensor:
        """``[num_tokens, L, K]`` experts of the last forward (int32, -1 in dense layers)."""
        recorded = self.state.recorded
        out = torch.full((num_tokens, self.shape.num_layers, self.shape.top_k), -1, dtype=torch.int32)
        for layer, indices in recorded.items():
            if indices.shape[0] != num_tokens:
                raise RuntimeError(f"routing: layer {layer} routed {indices.shape[0]} tokens, the forward had {num_tokens}")
            out[:, layer] = indices.to("cpu", torch.int32)
        recorded.clear()
        return out

    @contextlib.contextmanager
    def replaying(
        self, forced: torch.Tensor | None, *, stats: RoutingStats | None = None, used_stats: RoutingStats | None = None
    ):
        """Route the tokens of the forwards inside to ``forced`` ``[N, L, K]`` (-1: the router's own
        choice); ``forced=None`` with ``stats`` only compares. ``stats`` counts the router's own
        choice against ``forced``, ``used_stats`` the experts actually used."""
        previous, self.state = self.state, _State(forced=forced, stats=stats, used_stats=used_stats)
        try:
            yield self
        finally:
            self.state = previous

    @contextlib.contextmanager
    def observing(
        self, reference: torch.Tensor, stats: RoutingStats | None = None, used_stats: RoutingStats | None = None
    ):
        """Natural routing, counting in ``stats`` and ``used_stats`` (the same: the router's choice is
        the one used) where it agrees with ``reference`` ``[N, L, K]``."""
        previous, self.state = self.state, _State(forced=reference, stats=stats, used_stats=used_stats, observe_only=True)
        try:
            yield self
        finally:
            self.state = previous

    def applying(self, plan: RoutingPlan | None, routing: torch.Tensor | None):
        """The context a decoder forward runs in under ``plan``: ``routing`` is the engine's routing
        of the forward's tokens on their ``[rows, columns, L, K]`` grid (or ``None``)."""
        if plan is None or routing is None:
            return contextlib.nullcontext()
        flat = routing.reshape(-1, *routing.shape[2:])
        if plan.replay:
            return self.replaying(flat, stats=plan.stats, used_stats=plan.used_stats)
        if plan.stats is None and plan.used_stats is None:
            return contextlib.nullcontext()
        return self.observing(flat, plan.stats, plan.used_stats)

    def checkpoint_context(self):
        """``context_fn`` for ``torch.utils.checkpoint``: the recomputation in backward runs under the
        routing state of the forward it repeats (and counts nothing twice)."""
        snapshot = _State(forced=self.state.forced, observe_only=self.state.observe_only)

        @contextlib.contextmanager
        def restore():
            previous, self.state = self.state, snapshot
            try:
                yield
            finally:
                self.state = previous

        return contextlib.nullcontext(), restore()

    # -- the hook ---------------------------------------------------------------------------------
    def _hook_for(self, layer: int, rule: RouterRule):
        def hook(router: nn.Module, inputs: Any, output: Any):
            state = self.state
            logits, _scores, natural = output
            if state.recorded is not None:
                state.recorded[layer] = natural.detach()
            if state.forced is None:
                return None
            if state.forced.shape[0] != natural.shape[0]:
                raise RuntimeError(
                    f"routing replay: layer {layer} routes {natural.shape[0]} tokens, the replayed routing "
                    f"has {state.forced.shape[0]}"
                )
            want = state.forced[:, layer].to(natural.device, torch.long)
            if state.stats is not None:
                state.stats.add(layer, natural, want)
            if state.observe_only:
                if state.used_stats is not None:
                    state.used_stats.add(layer, natural, want)
                return None
            has = (want[:, :1] >= 0).expand_as(want)
            chosen = torch.where(has, want, natural)
            if state.used_stats is not None:
                state.used_stats.add(layer, chosen, want)
            if rule.score == "sigmoid":
                weights = logits.float().sigmoid().gather(-1, chosen)
            else:
                weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
            if rule.normalizes(router):
                weights = weights / (weights.sum(dim=-1, keepdim=True) + rule.norm_eps)
            if rule.scale is not None:
                weights = weights * getattr(router, rule.scale)
            if rule.cast_to_logits_dtype:
                weights = weights.to(logits.dtype)
            return logits, weights, chosen

        return hook


# --------------------------------------------------------------------------------------------------
# Completions <-> the batch grid
# --------------------------------------------------------------------------------------------------


def completion_rows(prompt_len: int, response_len: int) -> int:
    """Rows a completion's routing must have: every token the engine ran (the last one it sampled
    never went through the model)."""
    return max(prompt_len + response_len - 1, 0)


def place_on_grid(
    grid: torch.Tensor, row: int, routing: np.ndarray | torch.Tensor, prompt_width: int, prompt_len: int
) -> None:
    """Write a completion's ``[p + n - 1, L, K]`` routing into row ``row`` of a ``[B, P + T, L, K]``
    grid whose prompts are left-padded to ``prompt_width``."""
    values = torch.as_tensor(np.asarray(routing)).to(grid.dtype)
    start = prompt_width - prompt_len
    grid[row, start : start + values.shape[0]] = values


def decode_routed_experts(payload: str | bytes, num_tokens: int, num_layers: int, top_k: int) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` (base64 of int32 bytes) as ``[num_tokens, num_layers, top_k]``."""
    import base64

    raw = base64.b64decode(payload if isinstance(payload, (bytes, bytearray)) else payload.encode())
    values = np.frombuffer(raw, dtype=np.int32)
    expected = num_tokens * num_layers * top_k
    if values.size != expected:
        raise ValueError(
            f"routed_experts: {values.size} values, expected {num_tokens} tokens x {num_layers} layers x {top_k} "
            f"(= {expected}); the engine's model config differs from the trainer's?"
        )
    return values.reshape(num_tokens, num_layers, top_k).copy()
