"""The batch of samples one rank trains on, the completions it is built from, and the tensors the model sees.

This module is below the engines: an engine returns :class:`Completion` s, and nothing here imports an
engine (``tests/architecture/test_layering.py``).

Layout: prompts left-padded to width P, responses right-padded to width T, so that response token
``t`` of every row sits at column ``P + t`` and is predicted by column ``P - 1 + t``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int
    """Index of the prompt in the request."""
    token_ids: list[int]
    """Generated tokens, including the stop token if one ended the completion."""
    logprobs: list[float]
    """Log-probability of each generated token under the engine's (temperature-scaled) distribution."""
    finish_reason: str
    """``stop`` (a stop token was produced) or ``length`` (max_new_tokens reached)."""
    weight_version: int
    """Version of the weights the engine sampled with."""
    routed_experts: Any = None
    """With ``SamplingParams.return_routed_experts``: int32 ``[len(prompt) + len(token_ids) - 1,
    num_hidden_layers, top_k]`` numpy array, the experts each MoE layer routed every token the
    engine ran to (prompt, then generated tokens but the last; -1 in dense layers), SGLang's
    ``routed_experts`` layout (:mod:`rlite.moe_routing`)."""
    top_ids: Any = None
    """With ``SamplingParams.top_logprobs = k``: int64 ``[len(token_ids), k]`` numpy array, the k most
    likely tokens of the policy at each generated position (most likely first)."""
    top_logprobs: Any = None
    """Their log-probs, float32 ``[len(token_ids), k]``, from ``log_softmax(logits / temperature)``."""
    token_weight_versions: list[int] | None = None
    """Per generated token, the weight version that sampled it, for a generation that a weight sync
    interrupted and that went on with the new weights (``rollout.partial_segment_tokens``); then
    ``weight_version`` is the oldest. ``None``: every token was sampled with ``weight_version``."""


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack prompts into ``[B, P]`` ids and mask, padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return ids, mask


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first real token is position 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


PROMPT, RESPONSE, SEQUENCE = "prompt", "response", "prompt+response"
"""The padded second axis of a batch field (:class:`RowLayout`)."""
PAD_TOKEN = "pad_token"
"""A :class:`RowLayout` ``fill``: the tokenizer's pad token (:func:`concat_batches`' ``pad_token_id``)."""


@dataclass(frozen=True)
class RowLayout:
    """How one field of a batch moves when rows are selected (:func:`select_rows`) or batches are stacked
    (:func:`concat_rows`): every field of :class:`RolloutBatch` and of the dataclasses it holds declares one."""

    pad: str | None = None
    """Its padded second axis: ``"prompt"`` (left-padded to the prompt width P), ``"response"``
    (right-padded to the response width T), ``"prompt+response"`` (the grid of both, split at each
    batch's P), ``None`` (none: ``[B]`` and ``[B, K]`` tensors, lists, a dataclass of rows)."""
    fill: float | str = 0
    """The padding value (``"pad_token"``: the tokenizer's)."""
    missing_as: str | None = None
    """Stacking batches of which only some have this field (``None`` or an empty list): the field that
    stands in for it in the others; ``None``: the stacked batch lacks it too."""


def column(*, pad: str | None = None, fill: float | str = 0, missing_as: str | None = None, **kwargs: Any) -> Any:
    """A dataclass field of a batch with its :class:`RowLayout` (``kwargs``: ``default`` or ``default_factory``)."""
    return field(metadata={"rows": RowLayout(pad, fill, missing_as)}, **kwargs)


def row_layout(cls: type, f: Any) -> RowLayout:
    try:
        return f.metadata["rows"]
    except KeyError:
        raise TypeError(f"{cls.__name__}.{f.name} declares no row layout: declare it with rlite.rollout.column()") from None


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, list) and not value)


def select_rows(batch: Any, index: list[int]) -> Any:
    """The rows ``index`` of a batch dataclass, every field by its :class:`RowLayout` (missing stays missing)."""
    idx = torch.tensor(index, dtype=torch.long)

    def take(value: Any) -> Any:
        if _missing(value):
            return [] if isinstance(value, list) else None
        if isinstance(value, torch.Tensor):
            return value[idx]
        if isinstance(value, list):
            return [value[i] for i in index]
        return select_rows(value, index)

    cls = type(batch)
    values = {}
    for f in fields(cls):
        row_layout(cls, f)  # a field nobody declared is an error, never silently dropped
        values[f.name] = take(getattr(batch, f.name))
    return cls(**values)


def pad_rows(x: torch.Tensor, pad: str | None, fill: float, prompt_width: int, widths: tuple[int, int]) -> torch.Tensor:
    """``x`` of a batch whose prompts are ``prompt_width`` wide re-padded to ``widths`` (P, T) along ``pad``."""
    trailing = (0, 0) * (x.dim() - 2)
    if pad == PROMPT:
        return torch.nn.functional.pad(x, (*trailing, widths[0] - x.shape[1], 0), value=fill)
    if pad == RESPONSE:
        return torch.nn.functional.pad(x, (*trailing, 0, widths[1] - x.shape[1]), value=fill)
    if pad == SEQUENCE:
        return torch.cat([pad_rows(x[:, :prompt_width], PROMPT, fill, prompt_width, widths),
                          pad_rows(x[:, prompt_width:], RESPONSE, fill, prompt_width, widths)], dim=1)
    return x


def concat_rows(parts: list[Any], prompt_widths: list[int], widths: tuple[int, int], pad_token_id: int) -> Any:
    """Batch dataclasses stacked row-wise, every field by its :class:`RowLayout`; ``prompt_widths``: each
    part's P, ``widths``: the stacked batch's (P, T)."""
    cls = type(parts[0])
    values = {}
    for f in fields(cls):
        layout = row_layout(cls, f)
        column_parts = [getattr(part, f.name) for part in parts]
        missing = [_missing(v) for v in column_parts]
        if any(missing):
            if all(missing) or layout.missing_as is None:
                values[f.name] = [] if isinstance(column_parts[0], list) else None
                continue
            column_parts = [getattr(part, layout.missing_as) if gone else v
                            for part, v, gone in zip(parts, column_parts, missing)]  # fmt: skip
        first = column_parts[0]
        if isinstance(first, list):
            values[f.name] = [x for v in column_parts for x in v]
        elif isinstance(first, torch.Tensor):
            fill = pad_token_id if layout.fill == PAD_TOKEN else layout.fill
            values[f.name] = torch.cat([pad_rows(v, layout.pad, fill, p, widths) for v, p in zip(column_parts, prompt_widths)])
        else:
            values[f.name] = concat_rows(column_parts, prompt_widths, widths, pad_token_id)
    return cls(**values)


@dataclass
class EnvResults:
    """What the environments of a multi-turn rollout (:mod:`rlite.workflows`) said about each trajectory."""

    rewards: torch.Tensor = column()
    """[B] float64: the environment's rewards, summed over the trajectory (the ``env_reward`` reward function's value)."""
    turns: torch.Tensor = column()
    """[B] int64: the turns sampled."""
    metrics: list[dict[str, float]] = column()
    """The environment's own numbers about each ended episode (``metrics()``; ``correct`` decides accuracy)."""

    @classmethod
    def of(cls, trajectories: list) -> EnvResults:
        """The results of ended :class:`rlite.workflows.Trajectory` s."""
        return cls(rewards=torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float64),
                   turns=torch.tensor([int(t.turns) for t in trajectories], dtype=torch.long),
                   metrics=[t.metrics for t in trajectories])  # fmt: skip


@dataclass
class RolloutBatch:
    """The samples of one step on one rank, as the rollout (stage 1) made them, built whole by
    :func:`build_rollout_batch`; tensors have B rows (groups contiguous). What the later stages make of
    them are their own products: the rewards' :class:`Scores` (together: a :class:`ScoredBatch`), the
    targets' :class:`TrainTargets`. The optional fields are what only some runs sample (MoE routing, a
    draft's top log-probs, multi-turn and asynchronous rollouts)."""

    prompt_ids: torch.Tensor = column(pad=PROMPT, fill=PAD_TOKEN)
    """[B, P] left-padded prompt tokens."""
    prompt_mask: torch.Tensor = column(pad=PROMPT)
    """[B, P] 1 for real prompt tokens."""
    response_ids: torch.Tensor = column(pad=RESPONSE, fill=PAD_TOKEN)
    """[B, T] generated tokens, right-padded."""
    response_mask: torch.Tensor = column(pad=RESPONSE)
    """[B, T] 1 for tokens that count in the loss (the sampled ones: a multi-turn response has zero
    spans inside, where an environment's observation tokens sit)."""
    rollout_logprobs: torch.Tensor = column(pad=RESPONSE)
    """[B, T] log-probs reported by the engine."""
    group_ids: torch.Tensor = column()
    """[B] global prompt slot of each sample: equal ids form a GRPO group."""
    finish_reasons: list[str] = column()
    """``stop`` or ``length`` per sample."""
    samples: list[dict[str, Any]] = column()
    """The data row of each sample's prompt (answer, metadata), as loaded: what the rollout adds is in typed
    fields (``finish_reasons``, ``response_lengths``, ``env``); a reward function sees both
    (:func:`rlite.reward_runner.reward_sample`)."""
    completion_texts: list[str] = column(default_factory=list)
    """Decoded completions."""
    weight_versions: list[int] = column(default_factory=list)
    """Weight version each sample was drawn with."""
    routed_experts: torch.Tensor | None = column(pad=SEQUENCE, fill=-1, default=None)
    """[B, P + T, L, K] experts the engine routed each token to in every decoder layer (int16; -1
    where nothing was recorded: padding, dense layers, each response's last token), on the grid of
    ``cat(prompt_ids, response_ids)``; ``None`` unless the engine was asked (:mod:`rlite.moe_routing`)."""
    policy_top_ids: torch.Tensor | None = column(pad=RESPONSE, default=None)
    """[B, T, k] the policy's k most likely tokens at each response position, as the engine reported
    them while sampling (``SamplingParams.top_logprobs``: a draft distils from them); ``None`` unless asked."""
    policy_top_logprobs: torch.Tensor | None = column(pad=RESPONSE, default=None)
    """[B, T, k] their log-probs (``log_softmax(logits / temperature)``; 0 after each response)."""
    response_attention_mask: torch.Tensor | None = column(pad=RESPONSE, missing_as="response_mask", default=None)
    """[B, T] 1 for every real response token, sampled or observed (multi-turn, :mod:`rlite.workflows`);
    ``None``: every response token is sampled, and this equals ``response_mask``."""
    token_weight_versions: torch.Tensor | None = column(pad=RESPONSE, fill=-1, default=None)
    """[B, T] the weight version that sampled each response token (-1 on observations and padding), for
    rollouts whose later turns or segments may be sampled after a weight sync (asynchronous rollouts);
    ``None``: every token has its sample's ``weight_versions`` entry."""
    env: EnvResults | None = column(default=None)
    """What the environments said about each trajectory (a multi-turn rollout; ``None``: single turn)."""

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    def select(self, rows: slice | list[int]) -> RolloutBatch:
        """A view of some rows (micro-/mini-batches, groups): every field by its :class:`RowLayout`."""
        return select_rows(self, list(range(len(self)))[rows] if isinstance(rows, slice) else list(rows))

    @property
    def response_present(self) -> torch.Tensor:
        """[B, T] 1 for every real response token (sampled or observed)."""
        return self.response_mask if self.response_attention_mask is None else self.response_attention_mask


@dataclass(kw_only=True)
class Scores:
    """Stage 2's product: what the reward functions made of each row of a :class:`RolloutBatch`
    (:meth:`rlite.stages.scoring.RolloutScoring.score`)."""

    scores: torch.Tensor = column()
    """[B] scalar rewards: the weighted sum of ``reward_components``."""
    correct: torch.Tensor = column()
    """[B] bool: the answer is right (:func:`rlite.tasks.is_correct`, or a multi-turn environment's ``correct``)."""
    reward_components: torch.Tensor = column()
    """[B, K] each reward function's unweighted value."""
    baseline_texts: list[str] = column(default_factory=list)
    """The decoded greedy completion of each sample's prompt (with ``baseline_scores``; else empty)."""
    baseline_scores: torch.Tensor | None = column(default=None)
    """[B] reward of one greedy completion of each sample's prompt; only for an advantage estimator
    registered with ``needs_greedy_baseline=True`` (ReMax)."""


@dataclass
class ScoredBatch(RolloutBatch, Scores):
    """A step's samples with their :class:`Scores`, each field declared once, in its own class: what the
    ``after_rewards`` hook sees (it may change the scores) and what the targets, the update and the report
    take. Built whole by :meth:`of`; its rows move together (:func:`select_rows`, :func:`concat_rows`)."""

    @classmethod
    def of(cls, batch: RolloutBatch, scores: Scores) -> ScoredBatch:
        """``batch``'s samples with ``scores``, row for row (the same tensors, not copies)."""
        values = {f.name: getattr(batch, f.name) for f in fields(RolloutBatch)}
        values.update({f.name: getattr(scores, f.name) for f in fields(Scores)})
        return cls(**values)


@dataclass
class TrainTargets:
    """Stage 3's product: what the loss needs beyond the samples, per row (:mod:`rlite.stages.targets`)."""

    advantages: torch.Tensor = column(pad=RESPONSE)
    """[B, T] advantage of each response token (0 outside the response)."""
    returns: torch.Tensor = column(pad=RESPONSE)
    """[B, T] return targets (the critic's regression target; equal to the advantages without one)."""
    loss_mask: torch.Tensor = column(pad=RESPONSE)
    """[B, T] 1 for the tokens in the loss (response mask, minus truncated samples and rejected tokens)."""
    old_logprobs: torch.Tensor | None = column(pad=RESPONSE, default=None)
    """[B, T] pi_old of the PPO ratio; ``None``: the first training forward's (ratio exactly 1)."""
    ref_logprobs: torch.Tensor | None = column(pad=RESPONSE, default=None)
    """[B, T] reference-model log-probs (KL term)."""
    is_weights: torch.Tensor | None = column(pad=RESPONSE, default=None)
    """[B, T] importance weights of the mismatch corrections multiplying the per-token loss."""
    old_values: torch.Tensor | None = column(pad=RESPONSE, default=None)
    """[B, T] the critic's values before the update (PPO with GAE)."""

    def __len__(self) -> int:
        return self.loss_mask.shape[0]

    def select(self, rows: slice | torch.Tensor | list[int]) -> TrainTargets:
        """Some rows (the update's mini- and micro-batches, cut as the batch is): every field by its :class:`RowLayout`."""
        if isinstance(rows, slice):
            return select_rows(self, list(range(len(self)))[rows])
        return select_rows(self, rows.tolist() if isinstance(rows, torch.Tensor) else list(rows))


def build_rollout_batch(
    prompts: list[list[int]],
    completions: list[Completion],
    samples: list[dict[str, Any]],
    group_offset: int,
    pad_token_id: int,
    fixed_width: int | None = None,
    loss_masks: list[list[int]] | None = None,
    completion_texts: list[str] | None = None,
) -> RolloutBatch:
    """Pack engine completions (grouped by prompt) into padded tensors.

    ``fixed_width`` pads responses to exactly that many columns (true on-policy layout).
    ``loss_masks``: per completion, 1 for its sampled tokens and 0 for observation tokens (multi-turn);
    the batch's ``response_mask`` is then these and ``response_attention_mask`` marks every token.
    ``completion_texts``: the decoded completions (default: none).
    """
    prompt_rows = [prompts[c.prompt_index] for c in completions]
    prompt_ids, prompt_mask = left_pad(prompt_rows, pad_token_id)
    width = fixed_width or max(1, max(len(c.token_ids) for c in completions))
    response_ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(completions), width), dtype=torch.float32)
    rollout_logprobs = torch.zeros((len(completions), width), dtype=torch.float32)
    for row, comp in enumerate(completions):
        n = len(comp.token_ids)
        if n:
            response_ids[row, :n] = torch.tensor(comp.token_ids, dtype=torch.long)
            response_mask[row, :n] = 1.0
            rollout_logprobs[row, :n] = torch.tensor(comp.logprobs, dtype=torch.float32)
    token_versions = None
    if any(c.token_weight_versions is not None for c in completions):  # a weight sync came mid-generation
        token_versions = torch.full((len(completions), width), -1, dtype=torch.long)
        for row, comp in enumerate(completions):
            versions = comp.token_weight_versions or [comp.weight_version] * len(comp.token_ids)
            token_versions[row, : len(versions)] = torch.tensor(versions, dtype=torch.long)
    attention = None
    if loss_masks is not None:
        attention = response_mask
        response_mask = torch.zeros_like(attention)
        for row, mask in enumerate(loss_masks):
            if len(mask) != len(completions[row].token_ids):
                raise ValueError(f"loss mask of completion {row}: {len(mask)} entries for {len(completions[row].token_ids)} tokens")
            response_mask[row, : len(mask)] = torch.tensor(mask, dtype=torch.float32)
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        rollout_logprobs=rollout_logprobs,
        group_ids=torch.tensor([group_offset + c.prompt_index for c in completions], dtype=torch.long),
        finish_reasons=[c.finish_reason for c in completions],
        samples=[samples[c.prompt_index] for c in completions],
        completion_texts=list(completion_texts or []),
        weight_versions=[c.weight_version for c in completions],
        routed_experts=routing_grid(completions, [len(r) for r in prompt_rows], prompt_ids.shape[1], width),
        response_attention_mask=attention,
        token_weight_versions=token_versions,
        **top_logprobs_grid(completions, width),
    )


def top_logprobs_grid(completions: list[Completion], width: int) -> dict[str, torch.Tensor | None]:
    """The completions' top log-probs (and their tokens) as ``[B, width, k]`` tensors, zero-padded."""
    if not completions or completions[0].top_ids is None:
        return {"policy_top_ids": None, "policy_top_logprobs": None}
    k = completions[0].top_ids.shape[1]
    ids = torch.zeros((len(completions), width, k), dtype=torch.long)
    logprobs = torch.zeros((len(completions), width, k), dtype=torch.float32)
    for row, comp in enumerate(completions):
        n = len(comp.token_ids)
        if n:
            ids[row, :n] = torch.as_tensor(comp.top_ids, dtype=torch.long)
            logprobs[row, :n] = torch.as_tensor(comp.top_logprobs, dtype=torch.float32)
    return {"policy_top_ids": ids, "policy_top_logprobs": logprobs}


def routing_grid(
    completions: list[Completion], prompt_lengths: list[int], prompt_width: int, response_width: int
) -> torch.Tensor | None:
    """The completions' routings on the batch grid ``[B, P + T, L, K]`` (``None`` when they carry none)."""
    from rlite.moe_routing import ROUTING_DTYPE, completion_rows, place_on_grid

    if not completions or completions[0].routed_experts is None:
        return None
    _, layers, top_k = completions[0].routed_experts.shape
    grid = torch.full((len(completions), prompt_width + response_width, layers, top_k), -1, dtype=ROUTING_DTYPE)
    for row, (comp, prompt_len) in enumerate(zip(completions, prompt_lengths)):
        routing = comp.routed_experts
        expected = completion_rows(prompt_len, len(comp.token_ids))
        if routing is None or tuple(routing.shape) != (expected, layers, top_k):
            got = None if routing is None else tuple(routing.shape)
            raise ValueError(
                f"routed_experts of completion {row}: shape {got}, expected {(expected, layers, top_k)} "
                "(prompt + response - 1 tokens): the engine reported routing for other tokens"
            )
        place_on_grid(grid, row, routing, prompt_width, prompt_len)
    return grid


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_start: int
    response_mask: torch.Tensor
    routed_experts: torch.Tensor | None = None
    """[B, S, L, K] the engine's routing on the grid of ``input_ids`` (see ``RolloutBatch``)."""


def model_inputs(batch: RolloutBatch, *, exact_layout: bool = False) -> ModelInputs:
    """Concatenate prompt and response; trim all-padding columns unless ``exact_layout``.

    In the exact layout every response column is attended (as in the engine's fixed-shape sampler);
    causal attention makes columns after a token irrelevant to its log-prob.
    """
    prompt_ids, prompt_mask = batch.prompt_ids, batch.prompt_mask
    response_ids, response_mask, present = batch.response_ids, batch.response_mask, batch.response_present
    routing = batch.routed_experts
    if exact_layout:
        attn_response = torch.ones_like(response_ids)
    else:
        first = int((prompt_mask.sum(0) > 0).nonzero()[0]) if prompt_mask.any() else 0
        width = max(1, int(present.sum(-1).max().item()))
        if routing is not None:
            width_p = prompt_ids.shape[1]
            routing = torch.cat([routing[:, first:width_p], routing[:, width_p : width_p + width]], dim=1)
        prompt_ids, prompt_mask = prompt_ids[:, first:], prompt_mask[:, first:]
        response_ids, response_mask = response_ids[:, :width], response_mask[:, :width]
        attn_response = present[:, :width].long()
    attention_mask = torch.cat([prompt_mask.long(), attn_response.long()], dim=1)
    return ModelInputs(
        input_ids=torch.cat([prompt_ids, response_ids], dim=1),
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        response_start=prompt_ids.shape[1],
        response_mask=response_mask,
        routed_experts=routing,
    )


def pad_to_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad a [b, t] tensor with zeros to ``width`` columns."""
    if x.shape[1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def concat_batches(batches: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """Stack batches row-wise, re-padding prompts (left) and responses (right) to common widths: every
    field by its :class:`RowLayout`."""
    if len(batches) == 1:
        return batches[0]
    widths = (max(b.prompt_ids.shape[1] for b in batches), max(b.response_ids.shape[1] for b in batches))
    return concat_rows(batches, [b.prompt_ids.shape[1] for b in batches], widths, pad_token_id)
