"""``rlite.api.EngineWrapper`` hands every call of the rollout-engine contract on to its inner engine, so a
wrapper overrides only what it changes."""

from __future__ import annotations

import pytest
import torch

from rlite.api import Completion, EngineCapabilities, EngineWrapper, RolloutEngine, SamplingParams


class RecordingEngine:
    """An engine that records every call it receives."""

    capabilities = EngineCapabilities(lora_adapters=True, draft_methods=("ngram",))

    def __init__(self) -> None:
        self.weight_version = 0
        self.calls: list[tuple] = []
        self.extra = "only the inner engine has this"

    def generate(self, prompts, params):
        self.calls.append(("generate", prompts, params))
        return [Completion(i, [7], [-0.5], "length", self.weight_version) for i in range(len(prompts))]

    def update_weights(self, named_tensors, version):
        self.calls.append(("update_weights", [name for name, _ in named_tensors], version))
        self.weight_version = version

    def update_lora_adapter(self, named_tensors, config, version):
        self.calls.append(("update_lora_adapter", [name for name, _ in named_tensors], config, version))
        self.weight_version = version

    def speculation_stats(self):
        self.calls.append(("speculation_stats",))
        return "stats"

    def release_memory(self):
        self.calls.append(("release_memory",))

    def resume_memory(self):
        self.calls.append(("resume_memory",))

    def shutdown(self):
        self.calls.append(("shutdown",))


class TaggingEngine(EngineWrapper):
    """Overrides generate only."""

    def generate(self, prompts, params):
        completions = self.inner.generate(prompts, params)
        for completion in completions:
            completion.finish_reason = "stop"
        return completions


def test_every_contract_call_reaches_the_inner_engine() -> None:
    inner = RecordingEngine()
    wrapper = EngineWrapper(inner)
    assert isinstance(wrapper, RolloutEngine)
    params = SamplingParams(n=1, max_new_tokens=1)
    assert [c.prompt_index for c in wrapper.generate([[1, 2], [3]], params)] == [0, 1]
    wrapper.release_memory()
    wrapper.update_weights([("w", torch.zeros(1))], 3)
    wrapper.resume_memory()
    assert wrapper.weight_version == 3  # read through: the inner engine took the sync
    wrapper.update_lora_adapter([("a", torch.zeros(1))], {"r": 2}, 4)
    assert wrapper.weight_version == 4
    assert wrapper.speculation_stats() == "stats"
    wrapper.shutdown()
    assert [call[0] for call in inner.calls] == ["generate", "release_memory", "update_weights", "resume_memory",
                                                 "update_lora_adapter", "speculation_stats", "shutdown"]
    assert inner.calls[0][1:] == ([[1, 2], [3]], params)
    assert inner.calls[2][1:] == (["w"], 3) and inner.calls[4][1:] == (["a"], {"r": 2}, 4)
    assert wrapper.capabilities is inner.capabilities
    assert wrapper.extra == inner.extra  # anything else is looked up on the inner engine
    wrapper.weight_version = 9
    assert inner.weight_version == 9
    with pytest.raises(AttributeError, match="nonesuch"):
        wrapper.nonesuch  # noqa: B018


def test_a_subclass_overrides_only_what_it_changes() -> None:
    inner = RecordingEngine()
    wrapper = TaggingEngine(inner)
    (completion,) = wrapper.generate([[1]], SamplingParams())
    assert completion.finish_reason == "stop" and inner.calls[0][0] == "generate"
    wrapper.update_weights([("w", torch.zeros(1))], 1)
    assert wrapper.weight_version == inner.weight_version == 1


def test_a_subclass_reading_attributes_before_init_gets_attribute_error_not_recursion() -> None:
    class Early(EngineWrapper):
        def __init__(self, inner):
            self.seen = hasattr(self, "generate_count")  # before super().__init__: no inner yet
            super().__init__(inner)

    assert Early(RecordingEngine()).seen is False
