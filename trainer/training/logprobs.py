"""Per-token log-probs and entropy of a causal LM, without keeping [tokens, vocab] logits for backward.

:class:`PolicyModel` wraps a Hugging Face causal LM so that FSDP2's root unit owns the whole forward:
the decoder produces hidden states, then only the *response* positions go through the output layer,
in chunks of ``chunk_size`` tokens. Each chunk computes

    z = (h @ W^T) / temperature        (float32)
    log p(y) = z_y - logsumexp(z)
    H = logsumexp(z) - sum softmax(z) * z

and the backward pass re-computes one chunk's logits at a time instead of storing all of them. When a
micro-batch's response logits are small (``training.logprob_recompute_mb``) each chunk's softmax is
simply kept, which saves the recomputation. The entropy is kept out of the autograd graph unless it
is in the loss (``algorithm.entropy_coef != 0``); without it (and without an output-layer bias)
:class:`LinearLogprobFunction` does the work with a hand-written backward, otherwise each chunk runs
under activation checkpointing.
Temperature is the sampling temperature: the engine draws from softmax(z) with the same division.

``use_liger=True`` (CUDA only) gets the log-probs from liger-kernel's fused linear cross-entropy with
``reduction="none"`` on ``h / temperature`` (the same maths, in Triton kernels that never materialise
the logits); entropy is then computed without gradient by the chunked path, for metrics only.

``share_prompts=True`` runs each distinct prompt of a micro-batch once (a GRPO group's n samples
share it) and gathers its keys and values to the n rows before the responses run; gradients sum over
the samples through the gather. Same maths as the full forward, about n times fewer prompt FLOPs.

``exact_layout=True`` instead calls the output layer on every position and ``log_softmax`` on the
full logits, exactly as the transformers engine's fixed-shape sampler does, so that the trainer's
numbers equal the engine's bit for bit (true on-policy mode).

Whatever depends on the values of a micro-batch's masks (the scored tokens, the distinct prompts, the
length buckets, the packing) is a :class:`ForwardPlan`, computed on the host before the forward; the
forward itself selects and scatters by index only, so on a GPU it never waits for the device.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rlite.hf_models import cache_kwarg
from rlite.training.grad_accumulation import add_matmul, in_place, matmul_grad
from rlite.training.packing import PackedRows

if TYPE_CHECKING:
    from rlite.rollout import ModelInputs
    from rlite.training.backend import ForwardSpec


def softmax_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(z)[y]`` and (with ``with_entropy``) ``H = logsumexp(z) - softmax(z) . z`` of one
    chunk's float32 logits ``z`` ``[tokens, vocab]``, the whole vocabulary on this rank: the default
    ``score`` of :func:`chunked_logprobs`. The entropy has gradients only with ``entropy_grad``."""
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        z = logits if entropy_grad else logits.detach()
        entropy = (lse if entropy_grad else lse.detach()) - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logprobs, entropy


def _chunk_logprob_entropy(hidden, weight, bias, targets, temperature: float, with_entropy: bool, entropy_grad: bool,
                           score=softmax_logprobs):
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logits = logits.float() / temperature
    logprobs, entropy = score(logits, targets, with_entropy=with_entropy, entropy_grad=entropy_grad)
    return logprobs, torch.zeros_like(logprobs) if entropy is None else entropy


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    recompute: bool = True,
    score=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs ``[N]`` of ``targets`` and entropies ``[N]`` from hidden states ``[N, H]``.

    ``recompute`` recomputes each chunk's logits in backward instead of keeping them;
    ``entropy_grad=False`` computes the entropy outside the autograd graph (a metric only).
    ``score(logits, targets, *, with_entropy, entropy_grad) -> (logprobs, entropy or None)`` turns one
    chunk's float32 logits ``(h W^T + b) / T`` into log-probs and entropies; the default,
    :func:`softmax_logprobs`, has the whole vocabulary, and a backend whose ranks each hold a slice of
    the output layer passes one that combines the slices' sums across ranks (megatron's tensor parallelism).
    Without a bias or a ``score`` and with no gradient through the entropy this is
    :class:`LinearLogprobFunction`; otherwise each chunk runs under activation checkpointing.
    """
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if score is None and bias is None and not (with_entropy and entropy_grad and needs_grad):
        keep_probs = needs_grad and not recompute
        return LinearLogprobFunction.apply(hidden, weight, targets, temperature, chunk_size, with_entropy, keep_probs)
    score = score or softmax_logprobs
    outputs_lp, outputs_ent = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        args = (hidden[start : start + chunk_size], weight, bias, targets[start : start + chunk_size])
        if needs_grad and recompute:
            lp, ent = checkpoint(
                _chunk_logprob_entropy, *args, temperature, with_entropy, entropy_grad, score, use_reentrant=False
            )
        else:
            lp, ent = _chunk_logprob_entropy(*args, temperature, with_entropy, entropy_grad, score)
        outputs_lp.append(lp)
        outputs_ent.append(ent)
    if not outputs_lp:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(outputs_lp), torch.cat(outputs_ent)


class LinearLogprobFunction(torch.autograd.Function):
    """``log softmax(h W^T / T)[y]`` in chunks of tokens, with its own backward; the entropy, when
    asked for, is a metric (no gradient).

    Forward, per chunk: ``z = (h W^T) / T``, ``lp = z_y - logsumexp(z)``, ``p = softmax(z)`` and
    ``H = logsumexp(z) - p . z``. Backward, per chunk, with ``g = dL/dlp``:
    ``dz = g (onehot(y) - p) / T``, written over ``p`` in place; ``dh = dz W``; ``dW = dz^T h``, added
    chunk by chunk into one buffer, or straight into ``W.grad`` where the weight accumulates in place
    (:mod:`rlite.training.grad_accumulation`). ``keep_probs`` keeps each chunk's ``p`` from the forward;
    otherwise the backward recomputes the chunk's logits. Either way a chunk's ``[tokens, vocab]``
    floats are the only large temporary: autograd's version of the same maths holds three or four
    (logits, softmax, the one-hot scatter, the gradient) and a fresh ``[vocab, hidden]`` gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, keep_probs):
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_zeros(n, dtype=torch.float32)
        kept = []
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            z = (hidden[rows] @ weight.t()).float().div_(temperature)  # in place: one [tokens, vocab] buffer
            lse = torch.logsumexp(z, dim=-1)
            logprobs[rows] = z.gather(-1, targets[rows, None]).squeeze(-1) - lse
            if with_entropy or keep_probs:
                p = torch.softmax(z, dim=-1)
                if with_entropy:  # z is not needed after this: the products go into it (no temporary)
                    entropy[rows] = lse - z.mul_(p).sum(-1)
                if keep_probs:
                    kept.append(p)
            del z
        ctx.save_for_backward(hidden, weight, targets)
        ctx.kept, ctx.temperature, ctx.chunk_size = kept, temperature, chunk_size
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        temperature, kept = ctx.temperature, ctx.kept
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_h else None
        grad_weight = None
        for index, start in enumerate(range(0, hidden.shape[0], ctx.chunk_size)):
            rows = slice(start, start + ctx.chunk_size)
            if kept:
                p, kept[index] = kept[index], None  # freed as soon as it is used
            else:
                p = torch.softmax((hidden[rows] @ weight.t()).float().div_(temperature), dim=-1)
            g = grad_logprobs[rows, None]
            dz = p.mul_(-g).scatter_add_(-1, targets[rows, None], g).div_(temperature).to(hidden.dtype)
            del p
            if want_h:
                grad_hidden[rows] = dz @ weight
            if want_w and in_place(weight):
                matmul_grad(weight, dz, hidden[rows])  # added into weight.grad
            elif want_w:  # summed across chunks in one buffer
                grad_weight = add_matmul(grad_weight, dz, hidden[rows])
        ctx.kept = None
        return grad_hidden, grad_weight, None, None, None, None, None


def liger_logprobs(hidden, weight, targets, *, bias=None, temperature: float = 1.0) -> torch.Tensor:
    """log p(targets) through liger's fused linear cross-entropy: -CE(h / T @ W^T + b / T, y)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")
    scaled_bias = None if bias is None else bias / temperature
    return -loss(weight, hidden / temperature, targets, scaled_bias).float()


def unique_prompt_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Collapse runs of identical consecutive prompt rows (a GRPO group's samples).

    Returns ``(unique_rows, inverse)``: row indices of the first row of each run, and for every row
    the index of its run, so that ``x[unique_rows][inverse]`` rebuilds ``x`` for prompt tensors.
    """
    same_as_previous = torch.zeros(prompt_ids.shape[0], dtype=torch.bool, device=prompt_ids.device)
    if prompt_ids.shape[0] > 1:
        same_as_previous[1:] = (prompt_ids[1:] == prompt_ids[:-1]).all(-1) & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)
    unique_rows = (~same_as_previous).nonzero().squeeze(-1)
    inverse = (~same_as_previous).long().cumsum(0) - 1
    return unique_rows, inverse


BUCKET_OVERHEAD_TOKENS = 32
"""What one more response forward costs, in tokens of compute (Python and kernel launches of every
layer, forward and backward); :func:`length_buckets` splits a micro-batch only where that pays."""


def length_buckets(
    lengths: list[int], *, overhead: int | None = None, max_buckets: int = 4
) -> list[tuple[list[int], int]]:
    """Group rows into at most ``max_buckets`` runs of similar length: ``[(rows, width), ...]``.

    Rows are sorted by length and cut where it minimises ``sum(len(rows) * width) + overhead *
    buckets`` (``width`` = the longest length in the bucket; ``overhead``, default
    :data:`BUCKET_OVERHEAD_TOKENS`, prices one more forward in tokens), by dynamic programming over
    the distinct lengths (first rounded up to at most 64 distinct values). Every row is in exactly
    one bucket, in ascending order inside it; the result depends only on ``lengths``, so scoring and
    training cut a micro-batch the same way.
    """
    if not lengths:
        return []
    overhead = BUCKET_OVERHEAD_TOKENS if overhead is None else overhead
    step = max(1, -(-max(lengths) // 64))
    keys = [-(-length // step) * step for length in lengths]
    values = sorted(set(keys))
    counts = [keys.count(v) for v in values]
    m, inf = len(values), float("inf")
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    # best[k][j]: cost of the first j distinct lengths in k buckets; cut[k][j]: where the last begins
    best = [[inf] * (m + 1) for _ in range(max_buckets + 1)]
    cut = [[0] * (m + 1) for _ in range(max_buckets + 1)]
    best[0][0] = 0.0
    for k in range(1, max_buckets + 1):
        for j in range(1, m + 1):
            for i in range(j):
                cost = best[k - 1][i] + (prefix[j] - prefix[i]) * values[j - 1] + overhead
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    k = min(range(1, max_buckets + 1), key=lambda b: best[b][m])
    bounds, j = [], m
    while j > 0:
        bounds.append((cut[k][j], j))
        j, k = cut[k][j], k - 1
    buckets = []
    for i, j in reversed(bounds):
        members = set(values[i:j])
        rows = [r for r, key in enumerate(keys) if key in members]
        buckets.append((rows, max(lengths[r] for r in rows)))
    return buckets


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside a plain or peft-wrapped model."""
    if hasattr(model, "get_base_model"):  # peft
        return model.get_base_model()
    return model


@dataclass
class SharedPrompts:
    """The shared-prompt forward of one micro-batch (:meth:`PolicyModel._shared_prompt_hidden`), decided
    from its token and mask values."""

    unique_rows: torch.Tensor
    """[U] long: the first row of each run of identical prompts (:func:`unique_prompt_rows`)."""
    inverse: torch.Tensor
    """[B] long: each row's run."""
    buckets: list[tuple[torch.Tensor, torch.Tensor, int]]
    """The response passes (:func:`length_buckets`): ``(rows [b], their runs inverse[rows] [b], tokens run)``."""


@dataclass
class ForwardPlan:
    """Everything about a micro-batch's forward that depends on the *values* of its masks: which response
    tokens are scored, which prompts are shared and how the responses are bucketed, how sequences pack.

    :meth:`of` reads those values (``nonzero``, ``tolist``), so it is computed from the host copy of the
    micro-batch and moved to the model's device with the inputs (:func:`rlite.training.device.to_device`).
    The forward then selects, gathers and scatters with index tensors and Python ints only: on a GPU it
    never waits for the device to answer a question about the data."""

    rows: torch.Tensor
    """[N] long: the row of each scored response token (row-major order)."""
    columns: torch.Tensor
    """[N] long: its column in the response."""
    shared: SharedPrompts | None = None
    """The shared-prompt forward (``share_prompts`` and a prompt repeated in the micro-batch), else ``None``."""
    packed: PackedRows | None = None
    """The padding-free layout (``packed`` and no shared prompts), else ``None``."""

    @property
    def tokens(self) -> int:
        """N: the response tokens scored."""
        return self.rows.shape[0]

    @classmethod
    def of(cls, inputs: ModelInputs, spec: ForwardSpec) -> ForwardPlan:
        """The plan of the forward :meth:`PolicyModel.forward` runs on ``inputs`` as ``spec`` says
        (``share_prompts``, ``pack_sequences``, ``exact_layout``)."""
        rows, columns = inputs.response_mask.bool().nonzero(as_tuple=True)
        plan = cls(rows, columns)
        if spec.exact_layout:
            return plan
        if spec.share_prompts:
            prompt = slice(0, inputs.response_start)
            unique_rows, inverse = unique_prompt_rows(inputs.input_ids[:, prompt], inputs.attention_mask[:, prompt])
            if len(unique_rows) < inputs.input_ids.shape[0]:
                plan.shared = SharedPrompts(unique_rows, inverse, response_buckets(inputs.response_mask, inverse))
                return plan
        if spec.pack_sequences:
            plan.packed = PackedRows.of(inputs.attention_mask)
        return plan


def response_buckets(response_mask: torch.Tensor, inverse: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """The response passes of the shared-prompt forward: response token t is predicted from response token
    t - 1, so a row whose last response token is at column L runs L - 1 tokens; rows run in
    :func:`length_buckets` of similar length (none when every row runs 0)."""
    width = response_mask.shape[1]
    if width == 1:
        return []
    positions = torch.arange(1, width + 1, device=response_mask.device)
    needs = ((response_mask.bool() * positions).amax(-1) - 1).clamp(min=0).tolist()
    buckets = []
    for rows, run in length_buckets(needs):
        if run:
            index = torch.tensor(rows, dtype=torch.long, device=response_mask.device)
            buckets.append((index, inverse[index], run))
    return buckets


class PolicyModel(nn.Module):
    """A causal LM whose forward returns response-token log-probs (and entropy) directly.

    ``forward(inputs, spec)`` scores the tokens ``inputs.input_ids[:, response_start:]`` of a micro-batch's
    :class:`~rlite.rollout.ModelInputs`, as its :class:`~rlite.training.backend.ForwardSpec` says: position
    ``response_start - 1 + t`` predicts response token ``t``. Returns ``[B, T]`` log-probs and entropies,
    zero where ``response_mask`` is 0, on the model's device.
    """

    def __init__(self, lm: nn.Module) -> None:
        from rlite.moe_routing import RouterHooks

        super().__init__()
        self.lm = lm
        self.routers = RouterHooks.attach(lm)
        """Hooks on the routers of an MoE model (``None`` when dense): routing replay and agreement."""

    @property
    def causal_lm(self) -> nn.Module:
        return causal_lm_of(self.lm)

    def forward(
        self, inputs: ModelInputs, spec: ForwardSpec, *, with_entropy: bool = False, plan: ForwardPlan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-probs (and entropies) of ``inputs`` (:func:`rlite.rollout.model_inputs` of a micro-batch)
        by the forward ``spec`` describes: temperature, chunking and recomputation of the output layer,
        liger, the entropy's gradient, shared prompts, packing (the real tokens laid end to end, no padding
        computed; a micro-batch whose prompts are shared takes the shared-prompt forward instead, whose
        responses are already cut into length buckets), the exact layout, and ``spec.routing`` (a
        :class:`rlite.moe_routing.RoutingPlan`: replay ``inputs.routed_experts`` ``[B, S, L, K]``, the
        engine's routing, or route naturally, and what to count). ``plan``: the :class:`ForwardPlan` of
        these inputs, computed on the host and moved with them (``None``: computed here, from these
        tensors, which on a GPU waits for the device)."""
        if plan is None:
            plan = ForwardPlan.of(inputs, spec)
        input_ids, response_start = inputs.input_ids, inputs.response_start
        lm = self.causal_lm
        routed_experts = None
        if self.routers is not None and spec.routing is not None and inputs.routed_experts is not None:
            routed_experts = inputs.routed_experts.to(input_ids.device)
        route = functools.partial(self._route, spec.routing, routed_experts)
        head = lm.get_output_embeddings()
        targets = input_ids[:, response_start:]
        width = targets.shape[1]
        score = functools.partial(self._score, head=head, targets=targets, plan=plan, spec=spec,
                                  with_entropy=with_entropy)
        if plan.shared is not None and not spec.exact_layout:
            return score(self._shared_prompt_hidden(inputs, plan.shared, route))
        if plan.packed is not None and not spec.exact_layout:
            rows = plan.packed
            routing_context = (contextlib.nullcontext() if routed_experts is None
                               else self.routers.applying(spec.routing, rows.pack(routed_experts, filler=-1)))
            with routing_context:
                # no attention mask: the restarting position ids make transformers build a
                # block-diagonal causal mask (varlen attention where the implementation has it)
                flat = lm.get_decoder()(
                    input_ids=rows.pack(input_ids), position_ids=rows.positions(inputs.position_ids), use_cache=False
                ).last_hidden_state.flatten(0, 1)
            return score(rows.unpack(flat, slice(response_start - 1, response_start - 1 + width)))
        with route(slice(None), slice(None)):
            hidden = lm.get_decoder()(
                input_ids=input_ids, attention_mask=inputs.attention_mask, position_ids=inputs.position_ids,
                use_cache=False,
            ).last_hidden_state
        if spec.exact_layout:
            return self._exact_layout_scores(head(hidden), targets, inputs, spec, with_entropy)
        return score(hidden[:, response_start - 1 : response_start - 1 + width])

    @staticmethod
    def _exact_layout_scores(logits, targets, inputs: ModelInputs, spec: ForwardSpec, with_entropy: bool):
        """The transformers engine's fixed-shape sampler's numbers: ``log_softmax`` of every position's
        full float32 logits (true on-policy mode)."""
        logits = logits.float()
        logprobs_all = torch.log_softmax(logits[:, inputs.response_start - 1 : -1] / spec.temperature, dim=-1)
        logprobs = logprobs_all.gather(-1, targets[..., None]).squeeze(-1)
        entropy = torch.zeros_like(logprobs)
        if with_entropy:
            entropy = -(logprobs_all.exp() * logprobs_all).sum(-1)
        mask = inputs.response_mask.to(logprobs.dtype)
        return logprobs * mask, entropy * mask

    def _route(self, plan, routed_experts, rows, columns):
        """The routing context of one decoder call over ``input_ids[rows, columns]``."""
        if routed_experts is None:
            return contextlib.nullcontext()
        return self.routers.applying(plan, routed_experts[rows][:, columns])

    def _shared_prompt_hidden(self, inputs: ModelInputs, shared: SharedPrompts, route=None):
        """Hidden states predicting the response tokens, running each distinct prompt once.

        The prompt's keys and values are computed for the distinct prompts and gathered to every row
        (autograd flows through the gather, so each prompt token's gradient sums over its samples);
        then the responses run against that cache. Same maths as the full forward, fewer FLOPs.
        Responses run in a few groups of similar length (:func:`length_buckets`, ``shared.buckets``),
        each only as wide as its longest member, so the padding after short responses costs (almost)
        nothing.
        """
        from transformers import DynamicCache

        input_ids, attention_mask, position_ids = inputs.input_ids, inputs.attention_mask, inputs.position_ids
        response_start = inputs.response_start
        lm = self.causal_lm
        decoder = lm.get_decoder()
        prompt = slice(0, response_start)
        cache = DynamicCache(config=lm.config)
        route = route or (lambda rows, columns: contextlib.nullcontext())
        with route(shared.unique_rows, prompt):  # a group's samples share the prompt's routing: the first's
            prompt_out = decoder(
                input_ids=input_ids[shared.unique_rows, prompt],
                attention_mask=attention_mask[shared.unique_rows, prompt],
                position_ids=position_ids[shared.unique_rows, prompt],
                use_cache=True,
                **{cache_kwarg(decoder): cache},
            )
        last_prompt_hidden = prompt_out.last_hidden_state[:, -1:][shared.inverse]
        batch, width = input_ids.shape[0], input_ids.shape[1] - response_start
        if width == 1:
            return last_prompt_hidden
        prompt_kv = [(layer.keys, layer.values) for layer in cache.layers]
        hidden = last_prompt_hidden.new_zeros(batch, width - 1, last_prompt_hidden.shape[-1])
        for index, source, run in shared.buckets:
            bucket_cache = DynamicCache(ddp_cache_data=[(k[source], v[source]) for k, v in prompt_kv], config=lm.config)
            responses = slice(response_start, response_start + run)
            with route(index, responses):
                out = decoder(
                    input_ids=input_ids[index, responses],
                    attention_mask=attention_mask[index, : response_start + run],
                    position_ids=position_ids[index, responses],
                    use_cache=True,
                    **{cache_kwarg(decoder): bucket_cache},
                ).last_hidden_state
            out = torch.nn.functional.pad(out, (0, 0, 0, width - 1 - run))
            hidden = hidden.index_copy(0, index, out)
        return torch.cat([last_prompt_hidden, hidden], dim=1)

    def _score(self, h, *, head, targets, plan: ForwardPlan, spec: ForwardSpec, with_entropy: bool):
        """``[B, T]`` log-probs and entropies of the response tokens ``plan`` selects, from the hidden states
        ``h`` ``[B, T, H]`` that predict them (gathered and scattered back by index)."""
        batch, width = targets.shape
        args = (h[plan.rows, plan.columns], head.weight, targets[plan.rows, plan.columns])
        bias = getattr(head, "bias", None)
        # keep a micro-batch's response logits for backward when they are small; recompute otherwise
        recompute = plan.tokens * head.weight.shape[0] * 4 > spec.recompute_above_bytes
        chunked = dict(bias=bias, temperature=spec.temperature, chunk_size=spec.chunk_size, with_entropy=with_entropy)
        if spec.use_liger:
            lp_flat = liger_logprobs(*args, bias=bias, temperature=spec.temperature)
            with torch.no_grad():
                _, ent_flat = chunked_logprobs(*args, **chunked)
        else:
            lp_flat, ent_flat = chunked_logprobs(*args, **chunked, entropy_grad=spec.entropy_grad, recompute=recompute)
        selected = (plan.rows, plan.columns)
        logprobs = h.new_zeros(batch, width, dtype=torch.float32).index_put(selected, lp_flat)
        entropy = h.new_zeros(batch, width, dtype=torch.float32).index_put(selected, ent_flat)
        return logprobs, entropy
