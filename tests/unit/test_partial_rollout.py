"""Partial rollouts within one generation (rlite.stages.partial): a weight sync between two segments
makes the rest of a sequence exactly what the new weights sample from its exact tokens, every token
records its version, and without a sync segmenting changes nothing (greedy: bitwise)."""

from __future__ import annotations

import pytest
import torch

from rlite.engines.base import SamplingParams
from rlite.plugins.transformers.engine import TransformersEngine
from rlite.stages.partial import SegmentedGeneration, segment_seed
from rlite.tokenizer import build_tiny_model_dir
from rlite.workflows import TurnRunner, turn_format

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def make_engine(model_dir, tokenizer, **kwargs):
    return TransformersEngine.from_pretrained(model_dir, pad_token_id=tokenizer.pad_token_id,
                                              eos_token_ids=[tokenizer.eos_token_id], **kwargs)  # fmt: skip


class SpyEngine:
    """Records every call's contexts and token limit (the real engine does the work)."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params):
        self.calls.append(([list(p) for p in prompts], params.n, params.max_new_tokens))
        return self.engine.generate(prompts, params)


def perturbed(engine, scale: float = 0.5):
    """The engine's weights moved by seeded noise (another policy version)."""
    generator = torch.Generator().manual_seed(1)
    return [(name, p.detach() + scale * torch.randn(p.shape, generator=generator))
            for name, p in engine.synced_parameters().items()]  # fmt: skip


def test_greedy_segmented_is_the_unsegmented_generation_bitwise(model_dir, tokenizer):
    engine = make_engine(model_dir, tokenizer)
    params = SamplingParams(n=2, max_new_tokens=11, greedy=True, seed=3)
    whole = engine.generate(PROMPTS, params)
    spy = SpyEngine(engine)
    pieces = SegmentedGeneration(spy, 4, lambda: None).generate(PROMPTS, params)
    assert [c.token_ids for c in pieces] == [c.token_ids for c in whole]
    assert [c.finish_reason for c in pieces] == [c.finish_reason for c in whole]
    assert [c.prompt_index for c in pieces] == [c.prompt_index for c in whole]
    for a, b in zip(pieces, whole):  # the same tokens' log-probs, up to rounding (a prefill, not the KV cache)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
        assert a.token_weight_versions == [0] * len(a.token_ids) and a.weight_version == 0
    # max_new_tokens counts across segments: 4 + 4 + 3 for the sequences that run to the limit
    assert all(c.finish_reason == "length" for c in whole)  # the tiny model runs to the limit here
    assert [limit for *_, limit in spy.calls] == [4, 4, 3]
    assert spy.calls[0][1] == 2 and all(n == 1 for _, n, _ in spy.calls[1:])
    assert all(len(c.token_ids) <= 11 for c in pieces)


def test_sampling_first_segment_is_the_unsegmented_draw_and_later_ones_use_derived_seeds(model_dir, tokenizer):
    engine = make_engine(model_dir, tokenizer)
    params = SamplingParams(n=2, max_new_tokens=9, temperature=1.0, seed=5)
    whole = engine.generate(PROMPTS, params)
    spy = SpyEngine(engine)
    pieces = SegmentedGeneration(spy, 3, lambda: None).generate(PROMPTS, params)
    for a, b in zip(pieces, whole):
        assert a.token_ids[:3] == b.token_ids[:3]
    # each continuation is the engine's own draw from the sequence's exact tokens, with the segment's seed
    contexts, _, _ = spy.calls[1]
    again = engine.generate(contexts, SamplingParams(n=1, max_new_tokens=3, temperature=1.0, seed=segment_seed(5, 1)))
    live = [c for c in pieces if len(c.token_ids) > 3]
    assert [list(c.token_ids[3:6]) for c in live] == [list(c.token_ids) for c in again]


def test_a_weight_update_between_segments_continues_with_the_new_weights(model_dir, tokenizer):
    engine = make_engine(model_dir, tokenizer)
    new_weights = perturbed(engine)
    fresh = make_engine(model_dir, tokenizer)
    fresh.update_weights(new_weights, version=1)  # an engine that holds the new weights from the start
    syncs = []

    def sync():
        if not syncs:
            engine.update_weights(new_weights, version=1)
        syncs.append(engine.weight_version)

    params = SamplingParams(n=2, max_new_tokens=10, temperature=1.0, seed=9)
    pieces = SegmentedGeneration(engine, 4, sync).generate(PROMPTS, params)
    before = make_engine(model_dir, tokenizer).generate(PROMPTS, SamplingParams(**{**params.__dict__, "max_new_tokens": 4}))
    live = []
    for completion, first in zip(pieces, before):
        assert completion.token_ids[:4] == first.token_ids[:4]  # the first segment: the old weights
        versions = completion.token_weight_versions
        assert versions == sorted(versions) and completion.weight_version == min(versions) == 0
        assert versions[:4] == [0] * min(4, len(versions)) and versions[4:] == [1] * (len(versions) - 4)
        if len(completion.token_ids) > 4:
            live.append((first, completion))
    assert live, "every sequence stopped in the first segment: nothing continued"
    contexts = [PROMPTS[first.prompt_index] + list(first.token_ids) for first, _ in live]
    expected = fresh.generate(contexts, SamplingParams(n=1, max_new_tokens=4, temperature=1.0, seed=segment_seed(9, 1)))
    for (_, completion), continuation in zip(live, expected):
        assert completion.token_ids[4:8] == continuation.token_ids
        assert completion.logprobs[4:8] == continuation.logprobs  # the new weights' log-probs, bitwise


def test_a_stop_token_ends_a_sequence_inside_a_segment(model_dir, tokenizer):
    engine = make_engine(model_dir, tokenizer)
    greedy = SamplingParams(n=1, max_new_tokens=12, greedy=True)
    free = engine.generate(PROMPTS, greedy)
    stop = free[0].token_ids[5]  # sampled in the second segment of 4: the sequence must end there
    params = SamplingParams(**{**greedy.__dict__, "stop_token_ids": [stop]})
    whole = engine.generate(PROMPTS, params)
    spy = SpyEngine(engine)
    pieces = SegmentedGeneration(spy, 4, lambda: None).generate(PROMPTS, params)
    assert [c.token_ids for c in pieces] == [c.token_ids for c in whole]
    assert [c.finish_reason for c in pieces] == [c.finish_reason for c in whole]
    first = pieces[0]
    assert first.finish_reason == "stop" and first.token_ids[-1] == stop and len(first.token_ids) <= 6
    # after it stopped, the first prompt's sequence is never sent again
    later = [context for contexts, _, _ in spy.calls[2:] for context in contexts]
    assert all(context[: len(PROMPTS[0]) + 6] != PROMPTS[0] + list(first.token_ids) for context in later)


def test_multiturn_turns_are_segmented_token_exact(model_dir, tokenizer):
    class Twice:
        def reset(self, sample):
            return None

        def step(self, action):
            return " ok", 0.0, action.turn == 1

    engine = make_engine(model_dir, tokenizer)
    fmt = turn_format(tokenizer, "user", True, [tokenizer.eos_token_id])
    runner = TurnRunner(Twice, tokenizer, fmt, max_turns=2, max_response_tokens=64)
    params = SamplingParams(n=2, max_new_tokens=7, greedy=True, seed=1)
    plain = runner.run(engine, PROMPTS[:2], [{}, {}], params, lambda turn: turn)
    pieces = runner.run(SegmentedGeneration(engine, 3, lambda: None), PROMPTS[:2], [{}, {}], params, lambda turn: turn)
    assert [t.token_ids for t in pieces] == [t.token_ids for t in plain]
    assert [t.loss_mask for t in pieces] == [t.loss_mask for t in plain]
    assert [t.weight_versions for t in pieces] == [t.weight_versions for t in plain]


def test_spawned_engine_segments_like_the_in_process_one(model_dir, tokenizer):
    from rlite.plugins.transformers.process import ProcessEngine

    params = SamplingParams(n=2, max_new_tokens=7, temperature=1.0, seed=4)
    local = SegmentedGeneration(make_engine(model_dir, tokenizer), 3, lambda: None).generate(PROMPTS, params)
    spawned = ProcessEngine(str(model_dir), pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id])
    try:
        remote = SegmentedGeneration(spawned, 3, lambda: None).generate(PROMPTS, params)
    finally:
        spawned.shutdown()
    assert [c.token_ids for c in remote] == [c.token_ids for c in local]
    assert [c.token_weight_versions for c in remote] == [c.token_weight_versions for c in local]


def test_sglang_engine_continues_each_sequence_from_its_exact_input_ids():
    """Against the SGLang fake, whose tokens are a function of the input ids it is sent (it always runs
    to the token limit): every segment's tokens are that function of the prompt and the tokens so far."""
    from fake_sglang import FakeSGLang

    from rlite.plugins.sglang.engine import SGLangEngine

    fake = FakeSGLang()
    engine = SGLangEngine("unused", eos_token_ids=[1], backend=fake)
    pieces = SegmentedGeneration(engine, 3, lambda: None).generate([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=8))

    def fake_tokens(ids, count):
        return [(sum(ids) + k) % 50 + 2 for k in range(count)]

    expected = []
    for count in (3, 3, 2):  # max_new_tokens counted across segments
        expected += fake_tokens([5, 6, 7] + expected, count)
    assert [c.token_ids for c in pieces] == [expected, expected]
    assert all(c.finish_reason == "length" and c.token_weight_versions == [0] * 8 for c in pieces)
    assert [c for c in fake.calls if c[0] == "generate"] == [("generate", 2)] * 3


def test_what_is_recorded_per_engine_call_is_refused(model_dir, tokenizer):
    segmented = SegmentedGeneration(make_engine(model_dir, tokenizer), 3, lambda: None)
    for params in (SamplingParams(return_routed_experts=True), SamplingParams(top_logprobs=2)):
        with pytest.raises(RuntimeError, match="rollout.partial_segment_tokens=0"):
            segmented.generate(PROMPTS, params)
    with pytest.raises(ValueError, match="partial_segment_tokens"):
        SegmentedGeneration(segmented.engine, 0, lambda: None)


def test_a_segment_the_engine_cuts_short_ends_the_sequence():
    """An engine that returns fewer tokens than asked with finish reason ``length`` (its own context
    limit) is not asked again for that sequence: no endless loop of empty segments."""
    from rlite.engines.base import Completion

    class ContextLimit:
        weight_version = 0

        def __init__(self):
            self.calls = 0

        def generate(self, prompts, params):
            self.calls += 1
            room = max(0, 8 - len(prompts[0]))  # a context of at most 8 tokens
            return [Completion(i // params.n, [3] * min(room, params.max_new_tokens), [0.0] * min(room, params.max_new_tokens),
                               "length", 0) for i in range(len(prompts) * params.n)]  # fmt: skip

    engine = ContextLimit()
    (completion,) = SegmentedGeneration(engine, 2, lambda: None).generate([[1, 2, 3]], SamplingParams(max_new_tokens=10))
    assert completion.token_ids == [3] * 5 and completion.finish_reason == "length"
    assert engine.calls == 3  # 2 + 2 + 1 (cut short): then done
