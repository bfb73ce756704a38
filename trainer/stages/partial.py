"""Partial rollouts within one generation (``rollout.partial_segment_tokens``): an asynchronous
producer's engine calls are sampled in segments, and a pending weight sync gets in between two.

:class:`SegmentedGeneration` stands in for the engine's ``generate``. A call samples at most
``segment_tokens`` new tokens per sequence; every sequence that neither produced a stop token (its
finish reason is ``stop``) nor reached the call's ``max_new_tokens`` goes on in the next segment from
its exact token context, the prompt and every token sampled so far as ids (nothing is decoded and
encoded again), with ``n = 1``. Before each later segment ``between_segments()`` runs: the producer
lets a waiting weight sync in there, so the rest of the sequence samples with the new weights. Each
token records the version that sampled it (``Completion.token_weight_versions``), and a completion's
``weight_version`` is its oldest token's, so a staleness bound on samples holds for every token.

Seeds: the first segment samples with the call's seed, later ones with seeds derived from it and the
segment's index, so a seeded run is reproducible; the first segment's tokens are what an unsegmented
call samples first. Greedy sampling is the unsegmented call's token for token (each continuation is
the argmax given the same context); seeded sampling from the same weights has the same distribution
but not the same random draws after the first segment.

Where this stands next to the field: slime's, AReaL's and verl's partial rollouts interrupt a
running SGLang or vLLM engine (``pause_generation``/``abort``: the running requests come back with
the tokens they have) and submit each unfinished request again, its prompt plus its output, after
the weight update. rlite's engine contract is a blocking ``generate`` over token ids, so the
interruption point is a segment boundary instead: the same token-exact continuation, at the cost of
one prefill of the context per segment and a sync waiting for at most one segment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rlite.engines.base import Completion, RolloutEngine, SamplingParams


def segment_seed(seed: int | None, segment: int) -> int | None:
    """The seed of segment ``segment`` of a call seeded with ``seed`` (the call's own for segment 0)."""
    if seed is None or segment == 0:
        return seed
    return (int(seed) * 1000003 + 0x5EED * segment) % (2**31 - 1)


@dataclass
class _Sequence:
    prompt_index: int
    context: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    first_version: int | None = None
    ended: bool = False
    """The engine ended it for a reason of its own: a stop token, or a segment cut short (its context limit)."""

    def extend(self, completion: Completion, room: int) -> None:
        n = len(completion.token_ids)
        if len(completion.logprobs) != n:
            raise RuntimeError(f"the engine returned {len(completion.logprobs)} log-probs for {n} tokens")
        self.token_ids += list(completion.token_ids)
        self.logprobs += [float(x) for x in completion.logprobs]
        self.versions += list(completion.token_weight_versions or [int(completion.weight_version)] * n)
        self.finish_reason = completion.finish_reason
        self.ended = completion.finish_reason != "length" or n < room
        if self.first_version is None:
            self.first_version = int(completion.weight_version)


class SegmentedGeneration:
    """``generate`` in segments of at most ``segment_tokens`` new tokens per sequence, with
    ``between_segments()`` run before every segment but the first (see the module docstring)."""

    def __init__(self, engine: RolloutEngine, segment_tokens: int, between_segments: Callable[[], None]) -> None:
        if segment_tokens <= 0:
            raise ValueError(f"rollout.partial_segment_tokens must be positive here, got {segment_tokens}")
        self.engine, self.segment_tokens, self.between_segments = engine, segment_tokens, between_segments

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if params.return_routed_experts or params.top_logprobs:
            raise RuntimeError(
                "rollout.partial_segment_tokens: MoE routing and a draft's top log-probs are recorded per engine "
                "call and not joined across segments; set rollout.partial_segment_tokens=0"
            )
        limit = params.max_new_tokens
        first = SamplingParams(**{**params.__dict__, "max_new_tokens": min(self.segment_tokens, limit)})
        sequences = []
        for completion in self.engine.generate(prompts, first):
            sequence = _Sequence(completion.prompt_index, list(prompts[completion.prompt_index]))
            sequence.extend(completion, first.max_new_tokens)
            sequences.append(sequence)
        segment = 1
        while live := [s for s in sequences if not s.ended and len(s.token_ids) < limit]:
            self.between_segments()
            by_room: dict[int, list[_Sequence]] = {}  # one engine call per token limit
            for s in live:
                by_room.setdefault(min(self.segment_tokens, limit - len(s.token_ids)), []).append(s)
            for room, group in sorted(by_room.items(), reverse=True):
                call = SamplingParams(**{**params.__dict__, "n": 1, "max_new_tokens": room,
                                         "seed": segment_seed(params.seed, segment)})  # fmt: skip
                completions = self.engine.generate([s.context + s.token_ids for s in group], call)
                if len(completions) != len(group):
                    raise RuntimeError(f"the engine returned {len(completions)} completions for {len(group)} sequences")
                for s, completion in zip(group, completions):
                    s.extend(completion, room)
            segment += 1
        return [
            Completion(s.prompt_index, s.token_ids, s.logprobs, s.finish_reason, min(s.versions, default=s.first_version),
                       token_weight_versions=s.versions)
            for s in sequences
        ]  # fmt: skip
