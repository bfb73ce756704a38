"""Speculative decoding in the transformers engine: a draft proposes up to k tokens per row, one forward
of the policy verifies them all (:func:`rlite.engines.speculative.verify_proposals`), and every row
keeps what it accepted plus one token of the policy's own.

Rows accept different numbers of tokens, so the KV caches here keep a length per row
(:class:`RowCache`): each forward writes row ``b``'s new keys at its own offset, a 4-D attention mask
shows each query exactly its row's tokens, and a rollback (the proposals the policy rejected) is
just a shorter length, the stale slots being overwritten by the next write. Slot ``s`` of row ``b``
holds the token at position ``s - pad_b`` (prompts are left-padded to one width).

Two drafts run in the engine: a small causal LM with its own row cache (:class:`ModelProposer`,
``DraftSpec.method = "model"``) and prompt lookup (:class:`NgramProposer`, ``"ngram"``). The policy
verifies either through its own row cache, or, in true on-policy mode, through the trainer's
fixed-shape forward over the whole ``[B, P + T]`` buffer (the proposals sit in the buffer where the
tokens will go; causal attention keeps every position's logits independent of what follows, so the
log-probs stay bitwise the trainer's).

The log-probs returned are always the policy's, ``log_softmax(logits / T)`` at each emitted token,
from the verifying forward: never the draft's, never the residual's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlite.api import (
    DraftSpec,
    EngineError,
    SamplingParams,
    SpeculationStats,
    cache_kwarg,
    filter_logits,
    left_pad,
    position_ids_from_mask,
    prompt_lookup,
    sample_categorical,
    verify_proposals,
)

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


# --------------------------------------------------------------------------------------------------
# a KV cache with a length per row
# --------------------------------------------------------------------------------------------------


class RowCache:
    """Keys and values of every decoder layer in ``[B, heads, capacity, dim]`` buffers, with
    ``lengths[b]`` filled slots for row ``b`` and ``pads[b]`` left-padding slots before its first token.

    Call :meth:`forward` to run a model over ``m`` new tokens per row: they are written at each row's
    own length, attend to ``[pads[b], lengths[b] + j]``, and the lengths then grow by ``counts``
    (the real tokens of each row; padding after them is written but not kept). Lowering a length is a
    rollback. It holds whatever ``update`` it is given, so it also works as a transformers cache.
    """

    def __init__(self, model: torch.nn.Module, pads: torch.Tensor, reserve: int) -> None:
        config = model.config
        self.model = model
        self.layer_types = tuple(getattr(config, "layer_types", None) or ("full_attention",))
        unsupported = sorted(set(self.layer_types) - set(SUPPORTED_LAYER_TYPES))
        if unsupported:
            raise EngineError(f"speculative decoding: layers of type {unsupported} are not supported")
        self.window = getattr(config, "sliding_window", None)
        self.pads = pads.clone()
        self.lengths = torch.zeros_like(pads)
        self.reserve = int(reserve)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._write_at: torch.Tensor | None = None
        self._end = 0

    # -- what transformers' attention layers call ----------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        batch, heads, width, dim = key_states.shape
        keys, values = self.keys.get(layer_idx), self.values.get(layer_idx)
        if keys is None or keys.shape[2] < self._end:  # zeros: masked slots must hold finite numbers
            capacity = self._end + self.reserve
            new_keys = key_states.new_zeros(batch, heads, capacity, dim)
            new_values = value_states.new_zeros(batch, heads, capacity, value_states.shape[-1])
            if keys is not None:
                new_keys[:, :, : keys.shape[2]] = keys
                new_values[:, :, : keys.shape[2]] = values
            keys, values = self.keys[layer_idx], self.values[layer_idx] = new_keys, new_values
        rows = torch.arange(batch, device=key_states.device)[:, None]
        columns = self._write_at[:, None] + torch.arange(width, device=key_states.device)
        keys[rows, :, columns] = key_states.transpose(1, 2)
        values[rows, :, columns] = value_states.transpose(1, 2)
        return keys[:, :, : self._end], values[:, :, : self._end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._end

    # -- running the model ---------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, counts: torch.Tensor, *, logits_at: torch.Tensor | None = None):
        """Logits ``[B, m, V]`` of ``input_ids`` ``[B, m]`` (or, given ``logits_at [B]``, only ``[B, V]``
        at that column of each row); row ``b``'s length then grows by ``counts[b]``."""
        batch, width = input_ids.shape
        device = input_ids.device
        self._write_at = self.lengths
        self._end = int((self.lengths + width).max())
        query = self.lengths[:, None] + torch.arange(width, device=device)  # each query's slot
        slots = torch.arange(self._end, device=device)
        allowed = (slots[None, None, :] <= query[:, :, None]) & (slots[None, None, :] >= self.pads[:, None, None])
        dtype = next(self.model.parameters()).dtype
        masks = {}
        for kind in set(self.layer_types):
            seen = allowed
            if kind == "sliding_attention" and self.window:
                seen = allowed & (slots[None, None, :] > query[:, :, None] - self.window)
            # additive: -inf would turn a fully masked row (a padding query) into NaN keys for the next layer
            masks[kind] = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(
                ~seen, torch.finfo(dtype).min)[:, None]
        mask = masks if len(masks) > 1 else next(iter(masks.values()))
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=(query - self.pads[:, None]).clamp(min=0),
            use_cache=True,
            **{cache_kwarg(self.model): self},
        ).logits
        self.lengths = self.lengths + counts
        if logits_at is not None:
            return out[torch.arange(batch, device=device), logits_at]
        return out

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows ``keep`` (finished rows leave the batch)."""
        for layer in list(self.keys):
            self.keys[layer], self.values[layer] = self.keys[layer][keep], self.values[layer][keep]
        self.pads, self.lengths = self.pads[keep], self.lengths[keep]

    def repeat_rows(self, n: int) -> None:
        """Each row ``n`` times in a row (the samples of one prompt share its prefill)."""
        for layer in list(self.keys):
            self.keys[layer] = self.keys[layer].repeat_interleave(n, dim=0)
            self.values[layer] = self.values[layer].repeat_interleave(n, dim=0)
        self.pads, self.lengths = self.pads.repeat_interleave(n), self.lengths.repeat_interleave(n)


def prefill(model: torch.nn.Module, prompts: list[list[int]], n: int, pad_token_id: int, reserve: int):
    """A :class:`RowCache` holding every prompt but its last token, computed once per prompt and
    repeated for its ``n`` samples (prompt order kept; samples of a prompt contiguous)."""
    device = next(model.parameters()).device
    ids, mask = (t.to(device) for t in left_pad(prompts, pad_token_id))
    pads = (mask == 0).sum(-1)
    cache = RowCache(model, pads, reserve)
    if ids.shape[1] > 1:
        cache.forward(ids[:, :-1], torch.full_like(pads, ids.shape[1] - 1))
    cache.repeat_rows(n)
    return cache


# --------------------------------------------------------------------------------------------------
# drafts, engine side
# --------------------------------------------------------------------------------------------------


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from: ``softmax(filter(logits / T))`` (float32 logits in)."""
    return filter_logits(logits / params.temperature, params.top_k, params.top_p).softmax(-1)


class ModelProposer:
    """A small causal LM that proposes by sampling its own (equally warped) distribution.

    Its row cache holds a prefix of each row's sequence; ``pending`` the tokens after it, not yet
    run through the draft (the last prompt token at first; after a verification the policy's own
    token, preceded by the last proposal when every proposal was accepted).
    """

    def __init__(self, model: torch.nn.Module, pad_token_id: int) -> None:
        self.model = model
        self.pad_token_id = pad_token_id

    def start(self, prompts: list[list[int]], n: int, params: SamplingParams, reserve: int) -> None:
        self.params = params
        self.cache = prefill(self.model, prompts, n, self.pad_token_id, reserve)
        last = torch.tensor([p[-1] for p in prompts for _ in range(n)], device=self.cache.pads.device)
        self.pending, self.pending_count = last[:, None], torch.ones_like(last)

    def propose(self, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``(proposals [R, K], their distributions [R, K, V] or None when greedy, counts [R])`` with
        ``K = max(limit)``; row ``r`` uses its first ``limit[r]``."""
        k = int(limit.max())
        self.base = self.cache.lengths + self.pending_count  # the slots after the pending tokens
        logits = self.cache.forward(self.pending, self.pending_count, logits_at=self.pending_count - 1)
        tokens, dists = [], []
        for i in range(k):
            logits = logits.float()
            if self.params.greedy:
                token = logits.argmax(-1)
            else:
                dists.append(sampling_probs(logits, self.params))
                token = sample_categorical(dists[-1])
            tokens.append(token)
            if i + 1 < k:
                logits = self.cache.forward(token[:, None], torch.ones_like(token))[:, -1]
        self.k = k
        return torch.stack(tokens, 1), (torch.stack(dists, 1) if dists else None), limit

    def commit(self, emitted: torch.Tensor, accepted: torch.Tensor, proposed: bool) -> None:
        """After a verification: drop the rejected proposals from the cache and queue what it lacks."""
        own = emitted.gather(1, accepted[:, None])  # the policy's token after the accepted proposals
        if not proposed:  # nothing ran through the draft: its pending tokens wait, one more joins them
            self.pending = torch.cat([self.pending, torch.full_like(own, self.pad_token_id)], 1)
            self.pending.scatter_(1, self.pending_count[:, None], own)
            self.pending_count = self.pending_count + 1
            return
        self.cache.lengths = self.base + accepted.clamp(max=self.k - 1)
        all_accepted = accepted == self.k  # the last proposal was never run through the draft
        last = emitted.gather(1, (accepted - 1).clamp(min=0)[:, None])
        self.pending = torch.where(all_accepted[:, None], torch.cat([last, own], 1), torch.cat([own, own], 1))
        self.pending_count = 1 + all_accepted.long()

    def select(self, keep: torch.Tensor) -> None:
        self.cache.select(keep)
        self.pending, self.pending_count = self.pending[keep], self.pending_count[keep]


class NgramProposer:
    """Prompt lookup: each row proposes what followed the latest earlier occurrence of its last
    tokens (:func:`rlite.engines.speculative.prompt_lookup`); deterministic, no weights."""

    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match, self.max_match = min_match, max_match

    def start(self, prompts: list[list[int]], n: int, params: SamplingParams, reserve: int) -> None:
        self.contexts = [list(p) for p in prompts for _ in range(n)]

    def propose(self, limit: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor]:
        found = [prompt_lookup(ctx, int(k), self.min_match, self.max_match)
                 for ctx, k in zip(self.contexts, limit.tolist())]
        width = max(1, max(len(f) for f in found))
        proposals = torch.zeros(len(found), width, dtype=torch.long, device=limit.device)
        for row, tokens in enumerate(found):
            if tokens:
                proposals[row, : len(tokens)] = torch.tensor(tokens)
        return proposals, None, torch.tensor([len(f) for f in found], device=limit.device)

    def commit(self, emitted: torch.Tensor, accepted: torch.Tensor, proposed: bool) -> None:
        for ctx, tokens, n in zip(self.contexts, emitted.tolist(), accepted.tolist()):
            ctx.extend(tokens[: n + 1])

    def select(self, keep: torch.Tensor) -> None:
        self.contexts = [self.contexts[i] for i in keep.tolist()]


def build_proposer(spec: DraftSpec, draft_model: torch.nn.Module | None, pad_token_id: int):
    if spec.method == "ngram":
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if spec.method == "model":
        return ModelProposer(draft_model, pad_token_id)
    raise EngineError(f"the transformers engine cannot run a {spec.method!r} draft (it runs model and ngram drafts)")


# --------------------------------------------------------------------------------------------------
# the decoding loop
# --------------------------------------------------------------------------------------------------


@dataclass
class SpeculativeOutput:
    tokens: torch.Tensor
    """[B, T] emitted tokens (pad after each row's end)."""
    logprobs: torch.Tensor
    """[B, T] the policy's log-probs of them."""
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    stats: SpeculationStats


class SpeculativeDecoder:
    """Decodes a batch speculatively with a proposer; see the module docstring."""

    def __init__(self, model: torch.nn.Module, spec: DraftSpec, proposer, pad_token_id: int) -> None:
        self.model, self.spec, self.proposer, self.pad_token_id = model, spec, proposer, pad_token_id

    def sample(self, prompts: list[list[int]], params: SamplingParams, stop_ids: list[int], *,
               fixed_shape: bool) -> SpeculativeOutput:
        start = time.perf_counter()
        n, k_max, total = params.n, self.spec.num_speculative_tokens, params.max_new_tokens
        device = next(self.model.parameters()).device
        expanded = [p for p in prompts for _ in range(n)]
        batch = len(expanded)
        tokens = torch.full((batch, total), self.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros(batch, total, device=device)
        top = params.top_logprobs
        top_ids = torch.zeros(batch, total, top, dtype=torch.long, device=device) if top else None
        top_lps = torch.zeros(batch, total, top, device=device) if top else None
        stats = SpeculationStats()
        reserve = total + k_max + 2
        t = time.perf_counter()
        self.proposer.start(prompts, n, params, reserve)
        stats.draft_s += time.perf_counter() - t
        t = time.perf_counter()
        target = Verifier(self.model, prompts, n, self.pad_token_id, total, reserve, fixed_shape)
        prefill_s = time.perf_counter() - t
        rows = torch.arange(batch, device=device)  # the rows still generating
        done = torch.zeros(batch, dtype=torch.long, device=device)  # tokens emitted per row
        stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
        first_step_s, plain_steps = 0.0, 0
        while len(rows):
            # the first step is a plain one: it times a decode step without a draft (the estimate)
            limit = (total - done[rows] - 1).clamp(min=0, max=k_max) * int(plain_steps > 0)
            proposed = bool((limit > 0).any())
            proposals = torch.zeros(len(rows), 0, dtype=torch.long, device=device)
            draft_probs, counts = None, torch.zeros_like(limit)
            if proposed:
                t = time.perf_counter()
                proposals, draft_probs, counts = self.proposer.propose(limit)
                counts = torch.minimum(counts, limit)
                stats.draft_s += time.perf_counter() - t
                width = int(counts.max())  # the policy verifies no more than the longest row proposes
                proposals = proposals[:, :width]
                draft_probs = None if draft_probs is None else draft_probs[:, :width]
            t = time.perf_counter()
            logits = target.logits(rows, done[rows], proposals).float() / params.temperature  # [R, K + 1, V]
            if plain_steps == 0:
                first_step_s = time.perf_counter() - t
            plain_steps += 1
            probs = logits if params.greedy else filter_logits(logits, params.top_k, params.top_p).softmax(-1)
            accepted, own = verify_proposals(probs, proposals, counts, draft_probs, greedy=params.greedy)
            # x_1..x_n, then the policy's own token y at index n
            emitted = torch.cat([proposals, proposals.new_zeros(len(rows), 1)], 1).scatter(1, accepted[:, None], own[:, None])
            width = emitted.shape[1]
            count = accepted + 1
            stopped = torch.zeros_like(count, dtype=torch.bool)
            if len(stop_ids):  # a stop token ends the row, an accepted proposal's too
                is_stop = torch.isin(emitted, stop) & (torch.arange(width, device=device) < count[:, None])
                stopped = is_stop.any(1)
                count = torch.where(stopped, is_stop.float().argmax(1) + 1, count)
            step_lp = torch.log_softmax(logits, -1)
            keep = torch.arange(width, device=device) < count[:, None]
            columns = done[rows, None] + torch.arange(width, device=device)
            row_index, column_index = rows[:, None].expand_as(columns)[keep], columns[keep]
            tokens[row_index, column_index] = emitted[keep]
            logprobs[row_index, column_index] = step_lp.gather(-1, emitted[..., None]).squeeze(-1)[keep]
            if top:
                values, ids = step_lp.topk(top, dim=-1)
                top_ids[row_index, column_index] = ids[keep]
                top_lps[row_index, column_index] = values[keep]
            stats.proposed += int(counts.sum())
            stats.accepted += int(accepted.sum())
            stats.verifications += len(rows)
            stats.emitted += int(count.sum())
            target.commit(rows, done[rows], emitted, accepted, own)
            self.proposer.commit(emitted, accepted, proposed)
            done[rows] += count
            finished = stopped | (done[rows] >= total)
            if bool(finished.any()):
                going = (~finished).nonzero().squeeze(1)
                target.select(going)
                self.proposer.select(going)
                rows = rows[going]
        stats.time_s = time.perf_counter() - start
        stats.no_draft_estimate_s = prefill_s + first_step_s * int(done.max())
        return SpeculativeOutput(tokens, logprobs, top_ids, top_lps, stats)


class Verifier:
    """The policy's side: logits after each row's last token and after each of its proposals."""

    def __init__(self, model, prompts, n, pad_token_id, total, reserve, fixed_shape: bool) -> None:
        self.model, self.fixed_shape = model, fixed_shape
        if fixed_shape:  # the trainer's layout: one [B, P + T] buffer, full forwards, no cache
            device = next(model.parameters()).device
            ids, mask = (t.to(device) for t in left_pad([p for p in prompts for _ in range(n)], pad_token_id))
            self.prompt_len = ids.shape[1]
            self.buffer = torch.cat([ids, ids.new_full((len(ids), total), pad_token_id)], 1)
            self.mask = torch.cat([mask, mask.new_ones(len(ids), total)], 1)
            self.positions = position_ids_from_mask(self.mask)
        else:
            self.cache = prefill(model, prompts, n, pad_token_id, reserve)
            self.pending = torch.tensor([p[-1] for p in prompts for _ in range(n)], device=self.cache.pads.device)

    def logits(self, rows: torch.Tensor, done: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
        width = proposals.shape[1] + 1
        if not self.fixed_shape:
            inputs = torch.cat([self.pending[:, None], proposals], 1)
            return self.cache.forward(inputs, torch.ones_like(self.pending))
        columns = self.prompt_len + done[:, None] + torch.arange(proposals.shape[1], device=done.device)
        limit = self.buffer.shape[1]
        inside = columns < limit  # proposals never pass the end: the engine leaves room for the last token
        self.buffer[rows[:, None].expand_as(columns)[inside], columns[inside]] = proposals[inside]
        logits = self.model(input_ids=self.buffer, attention_mask=self.mask, position_ids=self.positions).logits
        at = (self.prompt_len - 1 + done[:, None] + torch.arange(width, device=done.device)).clamp(max=limit - 1)
        return logits[rows[:, None], at]

    def commit(self, rows, done, emitted, accepted, own) -> None:
        """Keep the accepted proposals; the policy's own token is the next one to run."""
        if self.fixed_shape:  # the emitted tokens go into the buffer (the proposals are there already)
            columns = self.prompt_len + done + accepted
            inside = columns < self.buffer.shape[1]
            self.buffer[rows[inside], columns[inside]] = own[inside]
            return
        self.cache.lengths = self.cache.lengths + accepted  # the last committed token is in already
        self.pending = own

    def select(self, keep: torch.Tensor) -> None:
        if not self.fixed_shape:
            self.cache.select(keep)
            self.pending = self.pending[keep]
