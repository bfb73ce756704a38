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


@dataclass
class TrainTargets:
    """What the loss needs beyond the samples, per row, filled by :mod:`rlite.stages.targets`."""

    advantages: torch.Tensor
    """[B, T] advantage of each response token (0 outside the response)."""
    returns: torch.Tensor
    """[B, T] return targets (the critic's regression target; equal to the advantages without one)."""
    loss_mask: torch.Tensor
    """[B, T] 1 for the tokens in the loss (response mask, minus truncated samples and rejected tokens)."""
    old_logprobs: torch.Tensor | None = None
    """[B, T] pi_old of the PPO ratio; ``None``: the first training forward's (ratio exactly 1)."""
    ref_logprobs: torch.Tensor | None = None
    """[B, T] reference-model log-probs (KL term)."""
    is_weights: torch.Tensor | None = None
    """[B, T] importance weights of the mismatch corrections multiplying the per-token loss."""
    old_values: torch.Tensor | None = None
    """[B, T] the critic's values before the update (PPO with GAE)."""

    def select(self, idx: torch.Tensor) -> TrainTargets:
        return TrainTargets(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[idx]
                               for f in fields(self)})


@dataclass
class RolloutBatch:
    """Samples of one step on one rank; tensors have B rows (groups contiguous)."""

    prompt_ids: torch.Tensor
    """[B, P] left-padded prompt tokens."""
    prompt_mask: torch.Tensor
    """[B, P] 1 for real prompt tokens."""
    response_ids: torch.Tensor
    """[B, T] generated tokens, right-padded."""
    response_mask: torch.Tensor
    """[B, T] 1 for tokens that count in the loss (the sampled ones: a multi-turn response has zero
    spans inside, where an environment's observation tokens sit)."""
    rollout_logprobs: torch.Tensor
    """[B, T] log-probs reported by the engine."""
    group_ids: torch.Tensor
    """[B] global prompt slot of each sample: equal ids form a GRPO group."""
    finish_reasons: list[str]
    """``stop`` or ``length`` per sample."""
    samples: list[dict[str, Any]]
    """The data row of each sample's prompt (answer, metadata)."""
    completion_texts: list[str] = field(default_factory=list)
    """Decoded completions (filled before rewards)."""
    scores: torch.Tensor | None = None
    """[B] scalar rewards (filled by the reward step)."""
    correct: torch.Tensor | None = None
    """[B] bool: the answer is right (:func:`rlite.tasks.is_correct`; filled by the reward step)."""
    reward_components: torch.Tensor | None = None
    """[B, K] each reward function's unweighted value (``scores`` is their weighted sum)."""
    baseline_texts: list[str] = field(default_factory=list)
    """The decoded greedy completion of each sample's prompt (with ``baseline_scores``; else empty)."""
    baseline_scores: torch.Tensor | None = None
    """[B] reward of one greedy completion of each sample's prompt; only for an advantage estimator
    registered with ``needs_greedy_baseline=True`` (ReMax)."""
    weight_versions: list[int] = field(default_factory=list)
    """Weight version each sample was drawn with."""
    targets: TrainTargets | None = None
    """Advantages, loss mask and the log-probs of the loss (filled before the update)."""
    routed_experts: torch.Tensor | None = None
    """[B, P + T, L, K] experts the engine routed each token to in every decoder layer (int16; -1
    where nothing was recorded: padding, dense layers, each response's last token), on the grid of
    ``cat(prompt_ids, response_ids)``; ``None`` unless the engine was asked (:mod:`rlite.moe_routing`)."""
    policy_top_ids: torch.Tensor | None = None
    """[B, T, k] the policy's k most likely tokens at each response position, as the engine reported
    them while sampling (``SamplingParams.top_logprobs``: a draft distils from them); ``None`` unless asked."""
    policy_top_logprobs: torch.Tensor | None = None
    """[B, T, k] their log-probs (``log_softmax(logits / temperature)``; 0 after each response)."""
    response_attention_mask: torch.Tensor | None = None
    """[B, T] 1 for every real response token, sampled or observed (multi-turn, :mod:`rlite.workflows`);
    ``None``: every response token is sampled, and this equals ``response_mask``."""
    token_weight_versions: torch.Tensor | None = None
    """[B, T] the weight version that sampled each response token (-1 on observations and padding), for
    rollouts whose later turns or segments may be sampled after a weight sync (asynchronous rollouts);
    ``None``: every token has its sample's ``weight_versions`` entry."""

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    def select(self, rows: slice | list[int]) -> RolloutBatch:
        """A view of some rows (micro-/mini-batches)."""
        index = list(range(len(self)))[rows] if isinstance(rows, slice) else list(rows)
        idx = torch.tensor(index, dtype=torch.long)
        return RolloutBatch(
            prompt_ids=self.prompt_ids[idx],
            prompt_mask=self.prompt_mask[idx],
            response_ids=self.response_ids[idx],
            response_mask=self.response_mask[idx],
            rollout_logprobs=self.rollout_logprobs[idx],
            group_ids=self.group_ids[idx],
            finish_reasons=[self.finish_reasons[i] for i in index],
            samples=[self.samples[i] for i in index],
            completion_texts=[self.completion_texts[i] for i in index] if self.completion_texts else [],
            scores=None if self.scores is None else self.scores[idx],
            correct=None if self.correct is None else self.correct[idx],
            reward_components=None if self.reward_components is None else self.reward_components[idx],
            baseline_texts=[self.baseline_texts[i] for i in index] if self.baseline_texts else [],
            baseline_scores=None if self.baseline_scores is None else self.baseline_scores[idx],
            weight_versions=[self.weight_versions[i] for i in index] if self.weight_versions else [],
            targets=None if self.targets is None else self.targets.select(idx),
            routed_experts=None if self.routed_experts is None else self.routed_experts[idx],
            policy_top_ids=None if self.policy_top_ids is None else self.policy_top_ids[idx],
            policy_top_logprobs=None if self.policy_top_logprobs is None else self.policy_top_logprobs[idx],
            response_attention_mask=None if self.response_attention_mask is None
            else self.response_attention_mask[idx],
            token_weight_versions=None if self.token_weight_versions is None else self.token_weight_versions[idx],
        )

    @property
    def response_present(self) -> torch.Tensor:
        """[B, T] 1 for every real response token (sampled or observed)."""
        return self.response_mask if self.response_attention_mask is None else self.response_attention_mask


def build_rollout_batch(
    prompts: list[list[int]],
    completions: list[Completion],
    samples: list[dict[str, Any]],
    group_offset: int,
    pad_token_id: int,
    fixed_width: int | None = None,
    loss_masks: list[list[int]] | None = None,
) -> RolloutBatch:
    """Pack engine completions (grouped by prompt) into padded tensors.

    ``fixed_width`` pads responses to exactly that many columns (true on-policy layout).
    ``loss_masks``: per completion, 1 for its sampled tokens and 0 for observation tokens (multi-turn);
    the batch's ``response_mask`` is then these and ``response_attention_mask`` marks every token.
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
    """Stack batches row-wise, re-padding prompts (left) and responses (right) to common widths."""
    if len(batches) == 1:
        return batches[0]
    prompt_width = max(b.prompt_ids.shape[1] for b in batches)
    response_width = max(b.response_ids.shape[1] for b in batches)

    def left(x, fill):
        return torch.nn.functional.pad(x, (prompt_width - x.shape[1], 0), value=fill)

    def right(x, fill):
        return torch.nn.functional.pad(x, (0, response_width - x.shape[1]), value=fill)

    def right3(x):  # [b, t, k] along t
        return torch.nn.functional.pad(x, (0, 0, 0, response_width - x.shape[1]))

    cat = torch.cat
    return RolloutBatch(
        prompt_ids=cat([left(b.prompt_ids, pad_token_id) for b in batches]),
        prompt_mask=cat([left(b.prompt_mask, 0) for b in batches]),
        response_ids=cat([right(b.response_ids, pad_token_id) for b in batches]),
        response_mask=cat([right(b.response_mask, 0) for b in batches]),
        rollout_logprobs=cat([right(b.rollout_logprobs, 0) for b in batches]),
        group_ids=cat([b.group_ids for b in batches]),
        finish_reasons=[r for b in batches for r in b.finish_reasons],
        samples=[s for b in batches for s in b.samples],
        completion_texts=[t for b in batches for t in b.completion_texts],
        scores=None if any(b.scores is None for b in batches) else cat([b.scores for b in batches]),
        correct=None if any(b.correct is None for b in batches) else cat([b.correct for b in batches]),
        reward_components=None if any(b.reward_components is None for b in batches)
        else cat([b.reward_components for b in batches]),
        baseline_texts=[t for b in batches for t in b.baseline_texts],
        baseline_scores=None if any(b.baseline_scores is None for b in batches)
        else cat([b.baseline_scores for b in batches]),
        weight_versions=[v for b in batches for v in b.weight_versions],
        routed_experts=concat_routing(batches, prompt_width, response_width),
        policy_top_ids=None if batches[0].policy_top_ids is None else cat([right3(b.policy_top_ids) for b in batches]),
        policy_top_logprobs=None if batches[0].policy_top_logprobs is None
        else cat([right3(b.policy_top_logprobs) for b in batches]),
        response_attention_mask=None if all(b.response_attention_mask is None for b in batches)
        else cat([right(b.response_present, 0) for b in batches]),
        token_weight_versions=None if any(b.token_weight_versions is None for b in batches)
        else cat([right(b.token_weight_versions, -1) for b in batches]),
    )


def concat_routing(batches: list[RolloutBatch], prompt_width: int, response_width: int) -> torch.Tensor | None:
    """The batches' routing grids re-padded with -1 like their prompts (left) and responses (right)."""
    if any(b.routed_experts is None for b in batches):
        return None
    parts = []
    for b in batches:
        p = b.prompt_ids.shape[1]
        prompt, response = b.routed_experts[:, :p], b.routed_experts[:, p:]
        pad = (0, 0, 0, 0)
        prompt = torch.nn.functional.pad(prompt, (*pad, prompt_width - p, 0), value=-1)
        response = torch.nn.functional.pad(response, (*pad, 0, response_width - response.shape[1]), value=-1)
        parts.append(torch.cat([prompt, response], dim=1))
    return torch.cat(parts)
