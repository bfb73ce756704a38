"""The rollout-engine interface that every engine (transformers, SGLang, plugins) implements.

Shaped after SGLang's offline ``Engine``: generation from token ids with ``n`` samples per prompt,
per-token log-probs of the sampled tokens, finish reasons and the weight version the sample was drawn
with; weights arrive as flattened buckets (:mod:`rlite.sync`); memory can be released
while the trainer runs and resumed before the next rollout.

A colocated step calls, in this order::

    generate(...)                 # the rollout (dynamic sampling: several calls)
    release_memory()              # the trainer computes log-probs and updates the policy
    update_weights(...)           # or update_lora_adapter: re-acquire the weights' memory, load
    resume_memory()               # the KV cache back, for the evaluation or rollout that follows

An engine that runs speculative-decoding drafts (``capabilities.draft_methods``) is built with a
:class:`DraftSpec`; a trained draft's weights arrive in the same ``update_weights`` stream as the
policy's, after them, under :data:`DRAFT_PREFIX` names, and :meth:`SpeculativeEngine.speculation_stats`
reports how the last ``generate`` went (:class:`SpeculationStats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch

from rlite.errors import EngineDied, EngineError  # noqa: F401  (raised by engines; defined below rlite.sync)
from rlite.rollout import Completion  # what generate returns; defined with the batch built from it


@dataclass
class SamplingParams:
    """How to sample. ``temperature`` is applied to logits exactly as the trainer applies it."""

    n: int = 1
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    """Do not stop at the engine's end-of-sequence tokens (``stop_token_ids`` still stop): every
    completion runs to ``max_new_tokens`` unless one of those comes (benchmarks of a fixed length)."""
    return_routed_experts: bool = False
    """Report the experts every MoE layer chose for every token (``Completion.routed_experts``);
    only for engines with ``capabilities.routed_experts``."""
    top_logprobs: int = 0
    """Also report, for every generated token, the ``top_logprobs`` most likely tokens of the policy's
    (temperature-scaled) distribution at that position and their log-probs (``Completion.top_ids`` /
    ``top_logprobs``): what a draft distils from."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do beyond the required methods; the trainer reads these, never the type."""

    shares_weights: bool = False
    """A sync binds the engine's parameters to the tensors it is given (an in-process engine on one
    rank): the trainer may then send its parameters' own storage, and a sync moves no bytes."""
    lora_adapters: bool = False
    """Serves LoRA adapters on a fixed base: :meth:`RolloutEngine.update_lora_adapter` works
    (``rollout.lora_sync: adapter``)."""
    routed_experts: bool = False
    """Reports the experts of every MoE layer for every token when asked
    (``SamplingParams.return_routed_experts``): routing replay and its metrics need it."""
    weight_dtype: torch.dtype | None = None
    """The dtype the engine holds its floating-point weights in. The sync casts the trainer's weights
    (fp32 master weights, say) to it before quantizing and sending them, so the bytes that travel are
    the engine's own. None: weights are sent in the trainer's dtype."""
    reacquires_device_memory: bool = False
    """The engine releases its device memory while the trainer runs and takes it back at the sync from
    other processes (SGLang's schedulers): the trainer first hands the blocks torch caches back to the
    driver, or the engine's resume could run out of memory on a GPU that is all but free."""
    quantized_layout: bool = False
    """With ``rollout.quantization``: the engine loads the quantizer's pre-quantized layout (for FP8:
    the e4m3 weight and its ``weight_scale_inv``) and runs quantized kernels on it. Otherwise it is sent
    the dequantized weights, which reproduce the quantization's rounding in any engine."""
    draft_methods: tuple[str, ...] = ()
    """The kinds of speculative draft (:attr:`DraftSpec.method`) the engine can run; an engine started
    with a draft has :meth:`SpeculativeEngine.speculation_stats`."""


DRAFT_METHODS = ("model", "ngram", "eagle")
"""What a draft can be (:attr:`DraftSpec.method`)."""

DRAFT_PREFIX = "draft."
"""Names of a trained draft's tensors in a weight sync: ``draft.`` + the draft model's own name."""


@dataclass(frozen=True)
class DraftSpec:
    """The speculative-decoding draft an engine runs, as a draft plugin describes it (picklable: a
    spawned engine process builds the same draft from it)."""

    method: str
    """``model``: a small causal LM sharing the policy's tokenizer proposes tokens by sampling from its
    own distribution (SGLang ``STANDALONE``); ``ngram``: proposals copied from what follows an earlier
    occurrence of the last tokens (prompt lookup; SGLang ``NGRAM``), no weights; ``eagle``: a head on
    the policy's hidden states (SGLang ``EAGLE``)."""
    num_speculative_tokens: int = 4
    """Tokens proposed per verification (k); the target checks them in one forward."""
    model_path: str | None = None
    """Hugging Face folder of the draft (``model``, ``eagle``): its architecture, and its weights unless
    ``trained``."""
    trained: bool = False
    """The draft learns during the run: its weights arrive with every weight sync after the policy's,
    under :data:`DRAFT_PREFIX` names (same version, same checksums). Otherwise the engine loads them
    from ``model_path`` once."""
    dtype: str = "float32"
    """Dtype of the draft's weights in the engine."""
    ngram_min: int = 1
    """``ngram``: the shortest suffix that is looked up."""
    ngram_max: int = 3
    """``ngram``: the longest suffix that is looked up (longer matches are tried first)."""
    engine_args: tuple[tuple[str, Any], ...] = ()
    """Extra engine-specific settings as ``(name, value)`` pairs (for SGLang, ``speculative_*`` server
    arguments that override what rlite derives)."""

    def __post_init__(self) -> None:
        if self.method not in DRAFT_METHODS:
            raise ValueError(f"draft method must be one of {', '.join(DRAFT_METHODS)}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.method != "ngram" and not self.model_path:
            raise ValueError(f"a {self.method!r} draft needs model_path")
        if self.method == "ngram" and self.trained:
            raise ValueError("an 'ngram' draft has no weights to train")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")


@dataclass
class SpeculationStats:
    """How speculative decoding went in one or more ``generate`` calls. Counts are per sequence: a
    batched target forward over R rows counts R verifications."""

    proposed: int = 0
    """Draft tokens proposed."""
    accepted: int = 0
    """Proposed tokens the target accepted."""
    verifications: int = 0
    """Target forwards (one per sequence per verification, each also yields one token of its own)."""
    emitted: int = 0
    """Tokens those verifications produced (accepted drafts plus the target's own; after a stop token
    or ``max_new_tokens`` nothing counts)."""
    time_s: float = 0.0
    """Wall time of the generate calls."""
    draft_s: float = 0.0
    """Of which the draft's proposals."""
    no_draft_estimate_s: float = 0.0
    """Estimated wall time of the same generation without a draft (how the engine estimates it is
    its own: ``docs/speculative.md``)."""

    def __add__(self, other: SpeculationStats) -> SpeculationStats:
        return SpeculationStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine."""

    weight_version: int
    """The version of the weights the engine samples with (0 before the first sync)."""
    capabilities: EngineCapabilities

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Sample ``params.n`` completions per prompt; results are grouped by prompt, in order."""

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]] | None, version: int) -> None:
        """Load new weights (Hugging Face names) and start sampling with ``version``. Called after
        :meth:`release_memory`: re-acquire what the weights need before loading them. The tensors may
        be the trainer's own parameters (no copy is made where the backend can avoid one): never write
        to them, and copy what you keep unless ``capabilities.shares_weights`` says you bind them."""

    def release_memory(self) -> None:
        """Free device memory (weights, KV cache) for the trainer, right after a rollout and after the
        last evaluation; no-op where meaningless. Keep whatever no later sync rewrites (the base
        weights of an adapter-serving engine) or keep a host copy of it."""

    def resume_memory(self) -> None:
        """Re-acquire what :meth:`release_memory` freed; called by the weight sync after the new
        weights are loaded, before the next evaluation or rollout."""

    def shutdown(self) -> None:
        """Stop the engine and free its resources."""


@runtime_checkable
class AdapterServingEngine(RolloutEngine, Protocol):
    """An engine with ``capabilities.lora_adapters``: it also loads LoRA adapters over a fixed base."""

    def update_lora_adapter(self, named_tensors, config: dict, version: int) -> None:
        """Load a LoRA adapter (peft names and config) over the fixed base and sample with it as
        ``version``."""


@runtime_checkable
class SpeculativeEngine(RolloutEngine, Protocol):
    """An engine with ``capabilities.draft_methods``, started with a :class:`DraftSpec`."""

    def speculation_stats(self) -> SpeculationStats:
        """What speculation did in the last :meth:`generate` call."""


class IdleEngine:
    """The engine of a rank that does not generate (a tensor-parallel rank other than its replica's
    leader, which receives the leader's batch): it takes part in weight syncs (they are collectives
    on the trainer's side) by draining the stream, holds no model, and refuses to generate."""

    capabilities = EngineCapabilities()

    def __init__(self) -> None:
        self.weight_version = 0

    def generate(self, prompts, params):
        raise EngineError("this rank does not generate: its replica's leader does")

    def update_weights(self, named_tensors, version: int) -> None:
        for _ in named_tensors or ():
            pass
        self.weight_version = version

    def release_memory(self) -> None:
        pass

    def resume_memory(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class EngineWrapper:
    """An engine that hands every call of the :class:`RolloutEngine` contract on to ``inner``: subclass it
    and override only what your wrapper changes (count or filter what ``generate`` returns, time a sync).

    ``weight_version`` and ``capabilities`` are the inner engine's (read through, so a sync the inner engine
    takes is the wrapper's version too); ``update_lora_adapter`` and ``speculation_stats`` are forwarded for
    inner engines that have them; any other attribute is looked up on ``inner``. Get the inner engine by
    name with ``rlite.api.registered("rollout_engine", name)`` in your factory (``docs/plugins.md``)."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner = inner

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.inner.weight_version = version

    @property
    def capabilities(self) -> EngineCapabilities:
        return self.inner.capabilities

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.inner.generate(prompts, params)

    def update_weights(self, named_tensors, version: int) -> None:
        return self.inner.update_weights(named_tensors, version)

    def update_lora_adapter(self, named_tensors, config: dict, version: int) -> None:
        return self.inner.update_lora_adapter(named_tensors, config, version)

    def speculation_stats(self) -> SpeculationStats:
        return self.inner.speculation_stats()

    def release_memory(self) -> None:
        return self.inner.release_memory()

    def resume_memory(self) -> None:
        return self.inner.resume_memory()

    def shutdown(self) -> None:
        return self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a subclass's __init__ before super().__init__): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
