"""Stage 5 of a step: the engine receives the new weights and samples the next batch from exactly them.

How LoRA weights travel is a table (:data:`LORA_SYNC`): ``merged`` streams ``W + scale * B @ A`` like
full weights; ``adapter`` sends only the adapter to an engine that serves adapters on a fixed base.

A speculative draft that learns during the run rides in the same stream, after the policy's tensors,
under ``draft.`` names: one weight version and one set of checksums for both.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlite.config import ConfigError
from rlite.drafts import SpeculativeDraft
from rlite.engines.base import DRAFT_PREFIX, RolloutEngine
from rlite.errors import RunStopped
from rlite.training.backend import NamedTensors, TrainingBackend

Quantizer = tuple[Callable, object]
"""A rollout quantizer plugin and its config: ``quantize(name, tensor, cfg)``."""


FLOATING = (torch.float32, torch.float16, torch.bfloat16)
"""The dtypes of trainer weights that are cast to the engine's ``weight_dtype`` (never FP8 or integers)."""


def in_dtype(named: NamedTensors, dtype: torch.dtype) -> NamedTensors:
    """The stream with every fp32/fp16/bf16 tensor cast to ``dtype`` (other tensors unchanged)."""
    for name, tensor in named:
        yield name, tensor.to(dtype) if tensor.dtype in FLOATING and tensor.dtype != dtype else tensor


def send_full_weights(
    engine: RolloutEngine, backend: TrainingBackend, quantizer: Quantizer | None, version: int,
    draft: SpeculativeDraft | None = None,
) -> None:
    capabilities = engine.capabilities
    # the parameters' own storage where the backend can give it (no gathered copy at world size 1): an
    # engine that shares the trainer's weights binds it, any other reads it once (RolloutEngine.update_weights)
    views = backend.capabilities.weight_views and quantizer is None
    named = refuse_nonfinite(backend.full_weights(views=views), version)
    if capabilities.weight_dtype is not None:  # the engine's dtype travels, not the fp32 master weights
        named = in_dtype(named, capabilities.weight_dtype)
    if quantizer is not None:  # the engine samples with quantized weights; the trainer keeps full precision
        quantize, quant_cfg = quantizer
        if capabilities.quantized_layout:  # the quantized weights themselves, with their scales
            layout = quantize.engine_layout
            named = (pair for name, tensor in named for pair in layout(name, tensor, quant_cfg))
        else:  # weights that carry the quantization's rounding, for an engine without its kernels
            named = ((name, quantize(name, tensor, quant_cfg)) for name, tensor in named)
    if draft is not None and draft.spec.trained:  # the draft travels unquantized, in the engine's dtype
        drafted = ((DRAFT_PREFIX + name, tensor) for name, tensor in draft.named_weights())
        if capabilities.weight_dtype is not None:
            drafted = in_dtype(drafted, capabilities.weight_dtype)
        named = itertools.chain(named, drafted)
    engine.update_weights(named, version)


def send_lora_adapter(
    engine: RolloutEngine, backend: TrainingBackend, quantizer: Quantizer | None, version: int,
    draft: SpeculativeDraft | None = None,
) -> None:
    adapter = backend.lora_adapter()
    engine.update_lora_adapter(refuse_nonfinite(adapter.tensors, version), adapter.config, version)


LORA_SYNC: dict[str, Callable[..., None]] = {
    "merged": send_full_weights,
    "adapter": send_lora_adapter,
}
"""``rollout.lora_sync`` -> how the weights reach the engine (full-weight runs use ``merged``)."""


def check_sync_mode(
    lora_sync: str, engine: RolloutEngine, backend: TrainingBackend, engine_name: str,
    quantizer: Quantizer | None = None, draft: SpeculativeDraft | None = None,
) -> None:
    """Refuse a LoRA sync mode or a quantizer that the engine or the backend cannot serve (before the
    first sync)."""
    if quantizer is not None and engine.capabilities.quantized_layout:
        if getattr(quantizer[0], "engine_layout", None) is None:
            raise ConfigError(
                f"rollout.quantization: the {engine_name!r} engine loads pre-quantized weights, and this "
                "quantizer has no engine layout (quantizer.engine_layout); use one that has (fp8_blockwise)"
            )
        if lora_sync == "adapter":
            raise ConfigError(
                f"rollout.lora_sync=adapter: the {engine_name!r} engine runs rollout.quantization on weights it "
                "is sent, and an adapter sync sends none; use rollout.lora_sync=merged"
            )
    if lora_sync != "adapter":
        return
    if draft is not None and draft.spec.trained:
        raise ConfigError(
            "rollout.lora_sync=adapter sends only the LoRA adapter, and a trained draft's weights travel with "
            "the full weights: use rollout.lora_sync=merged, or a draft that does not train (args.train=false)"
        )
    if not engine.capabilities.lora_adapters:
        raise ConfigError(
            f"rollout.lora_sync=adapter: the {engine_name!r} engine cannot serve adapters; "
            "use rollout.lora_sync=merged or an engine that can (sglang)"
        )
    if not backend.capabilities.lora:
        raise ConfigError("rollout.lora_sync=adapter: the training backend trains no LoRA adapter")


def return_cached_device_memory() -> None:
    """Give the blocks torch's CUDA caching allocator keeps for reuse back to the driver.

    A colocated engine in another process (SGLang's schedulers) re-acquires its memory from the driver;
    blocks the trainer freed but torch still caches count as taken, and the engine's resume would run
    out of memory on a GPU whose memory is all but free.
    """
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class WeightSync:
    """Stage 6 as a run's component: what travels to the engine (the policy's weights or its LoRA adapter,
    ``rollout.lora_sync``; quantized by ``rollout.quantization`` or not; a trained draft's weights after them),
    built once by :func:`rlite.run.build.build_weight_sync`. :meth:`send` streams it into an engine: the
    run's, a restarted one (:class:`rlite.engines.supervisor.SupervisedEngine`), or a stand-in that records it."""

    backend: TrainingBackend
    lora_sync: str
    quantizer: Quantizer | None = None
    draft: SpeculativeDraft | None = None

    def send(self, engine: RolloutEngine, version: int) -> None:
        """The weights into ``engine`` as ``version`` (:func:`sync_weights_to_engine`)."""
        sync_weights_to_engine(engine, self.backend, lora_sync=self.lora_sync, quantizer=self.quantizer,
                               version=version, draft=self.draft)

    def check(self, engine: RolloutEngine, engine_name: str) -> None:
        """Refuse what ``engine`` or the backend cannot serve (:func:`check_sync_mode`), before the first sync."""
        check_sync_mode(self.lora_sync, engine, self.backend, engine_name, self.quantizer, self.draft)


def sync_weights_to_engine(
    engine: RolloutEngine, backend: TrainingBackend, *, lora_sync: str, quantizer: Quantizer | None, version: int,
    draft: SpeculativeDraft | None = None,
) -> None:
    """Stream the policy's weights (and a trained draft's) into the engine, then let it take back the
    rest of its memory; the engine must report ``version``.

    The engine released its memory after the last rollout (:meth:`Rollouts.collect`). Loading
    re-acquires the weights' memory first (SGLang resumes its weights before the update, the KV cache
    after it): :meth:`RolloutEngine.update_weights` does that, :meth:`RolloutEngine.resume_memory`
    the rest, so the engine is whole again for the rollout (or evaluation) that follows.
    """
    elsewhere = engine.capabilities.reacquires_device_memory
    if elsewhere:  # the training step's activations: the engine's weights go there
        return_cached_device_memory()
    LORA_SYNC[lora_sync](engine, backend, quantizer, version, draft)
    if elsewhere:  # the sync's buckets and gathered tensors: the KV cache goes there
        return_cached_device_memory()
    engine.resume_memory()
    if engine.weight_version != version:
        raise RuntimeError(f"weight sync: engine reports version {engine.weight_version}, expected {version}")


NONFINITE_CHECK_BYTES = 256 << 20
"""Device tensors are checked for NaN/inf in groups of about this many bytes, one host synchronisation a
group (a check per tensor stalled the GPU about 300 times a sync of a 0.5B model)."""


def refuse_nonfinite(named, version: int, group_bytes: int = NONFINITE_CHECK_BYTES):
    """The ``(name, tensor)`` stream unchanged, but a tensor with a NaN or infinite value stops the run
    before the engine is handed it (an update can overflow with a finite gradient: a huge step size).

    A host tensor is checked on its own; device tensors wait in groups of ``group_bytes`` (each tensor's
    largest magnitude, ``max |w|``, is reduced on the device: NaN and infinity survive it, and unlike a sum
    it cannot overflow), and a group is handed on only after one look at all of them."""
    waiting: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    waiting_bytes = 0

    def release():
        nonlocal waiting, waiting_bytes
        if waiting:
            largest = torch.stack([magnitude for _, _, magnitude in waiting])
            if not bool(torch.isfinite(largest).all()):
                _stop_on(next(name for (name, _, _), ok in zip(waiting, torch.isfinite(largest).tolist()) if not ok),
                         version)
        group, waiting, waiting_bytes = waiting, [], 0
        return ((name, tensor) for name, tensor, _ in group)

    for name, tensor in named:
        if not tensor.is_floating_point():
            yield name, tensor
        elif tensor.device.type == "cpu":
            if not math.isfinite(float(torch.linalg.vector_norm(tensor, ord=math.inf, dtype=torch.float32))):
                _stop_on(name, version)
            yield name, tensor
        else:
            waiting.append((name, tensor, torch.linalg.vector_norm(tensor, ord=math.inf, dtype=torch.float32)))
            waiting_bytes += tensor.numel() * tensor.element_size()
            if waiting_bytes >= group_bytes:
                yield from release()
    yield from release()


def _stop_on(name: str, version: int) -> None:
    raise RunStopped(
        f"step {version}: the updated weight {name} holds NaN or infinite values although the loss "
        "and the gradient norm were finite; it is not sent to the engine or saved. Likely cause: the "
        "learning rate is too high (lower training.lr)"
    )
