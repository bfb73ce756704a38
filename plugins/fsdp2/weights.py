"""Streaming the FSDP2 policy's full weights in Hugging Face names (LoRA merged on the fly)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rlite.api import EngineError

try:  # torch.distributed is missing from some builds (e.g. macOS wheels without it)
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover
    DTensor = Replicate = AsyncCollectiveTensor = None  # type: ignore[assignment,misc]

ALIGNMENT = 64
"""Byte alignment of every tensor in a bucket (a multiple of every dtype's size, and of 8 for the checksum)."""

NamedTensors = Iterable[tuple[str, torch.Tensor]]


# --------------------------------------------------------------------------------------------------
# full tensors from the trainer
# --------------------------------------------------------------------------------------------------


def _full(tensor: torch.Tensor, views: bool = False) -> torch.Tensor:
    """The whole tensor on this rank: all-gathers a DTensor (collective), passes a plain tensor through.

    ``views=True`` returns a DTensor whose mesh has one rank as its local tensor (the parameter's own
    storage, no copy) instead of the copy an all-gather of one rank makes.
    """
    if DTensor is not None and isinstance(tensor, DTensor):
        if views and tensor.device_mesh.size() == 1:
            local = tensor.to_local().detach()
            if local.shape == tensor.shape:
                return local
        return tensor.full_tensor()
    return tensor.detach()


def _start_full(tensor: torch.Tensor, views: bool = False) -> torch.Tensor:
    """Like :func:`_full`, but a DTensor's all-gather is only started (``async_op=True``): the result
    waits for it when :func:`_finish_full` (or any use) needs the data."""
    if DTensor is not None and isinstance(tensor, DTensor):
        if views and tensor.device_mesh.size() == 1:
            return _full(tensor, views=True)
        replicated = [Replicate()] * tensor.device_mesh.ndim
        return tensor.detach().redistribute(placements=replicated, async_op=True).to_local()
    return tensor.detach()


def _finish_full(started: torch.Tensor) -> torch.Tensor:
    if AsyncCollectiveTensor is not None and isinstance(started, AsyncCollectiveTensor):
        return started.wait()
    return started


def _gather_ahead(plan: Iterable[tuple[torch.Tensor, bool, Any]]) -> Iterator[tuple[Any, torch.Tensor]]:
    """``(entry, full tensor)`` for each ``(tensor, views, entry)`` of ``plan``, in order, with the
    all-gather of the next tensor already in flight while the consumer works on this one.

    One all-gather at a time: the next starts only once this one is complete. Two in flight at once on
    a gloo group (each on one of the group's worker threads) corrupted the heap ("malloc(): unaligned
    tcache chunk detected", SIGSEGV) about once in a thousand streams of a tiny model's weights over two
    ranks, in a loop that did nothing else (benchmarks/RESULTS.md, 2026-11-26); on a GPU the all-gathers
    queue on one stream anyway.
    A consumer that stops early (an exception in the engine's update, the stream closed) leaves the
    started all-gather to be waited for here, as the stream ends: every rank started it, so the wait
    ends, and no collective is left in flight on the default group (a functional collective must be
    waited for) when the rank goes on to its next collective or tears the group down."""
    ahead = None  # (entry, its all-gather): started, not yet waited for

    def finish() -> tuple[Any, torch.Tensor]:
        nonlocal ahead
        entry, started = ahead
        ahead = None
        return entry, _finish_full(started)

    try:
        for tensor, views, entry in plan:
            done = finish() if ahead is not None else None
            ahead = (entry, _start_full(tensor, views))
            if done is not None:
                yield done
        if ahead is not None:
            yield finish()
    finally:
        if ahead is not None:
            finish()


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return all(hasattr(module, attr) for attr in ("base_layer", "lora_A", "lora_B", "scaling"))


def _hf_name(name: str) -> str:
    """A peft / torch.compile parameter name as the Hugging Face checkpoint spells it."""
    name = name.replace("_orig_mod.", "")
    if name.startswith("base_model.model."):
        name = name[len("base_model.model.") :]
    return name.replace(".base_layer.", ".")


def _lora_delta(layer: torch.nn.Module, adapter: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``scaling * (B @ A)`` rounded exactly as peft's ``LoraLayer.get_delta_weight`` rounds it."""
    dtype = b.dtype
    cast_to_fp32 = b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if cast_to_fp32:
        a, b = a.float(), b.float()
    delta = b @ a
    if getattr(layer, "fan_in_fan_out", False):
        delta = delta.T
    delta = delta * layer.scaling[adapter]
    return delta.to(dtype) if cast_to_fp32 else delta


def _active_adapters(layer: torch.nn.Module) -> list[str]:
    if getattr(layer, "disable_adapters", False):
        return []  # adapters switched off: the base weights are what the model serves
    active = getattr(layer, "active_adapters", None)
    if active is None:
        active = list(layer.lora_A.keys())
    if isinstance(active, str):
        active = [active]
    return [a for a in active if a in layer.lora_A]


def _check_mergeable(prefix: str, layer: torch.nn.Module, adapters: list[str]) -> None:
    if getattr(layer, "merged", False):
        raise EngineError(
            f"LoRA layer {prefix} is already merged into its base weight; unmerge it before syncing"
        )
    for adapter in adapters:
        if adapter in getattr(layer, "lora_variant", {}):
            raise NotImplementedError(
                f"weight sync merges plain LoRA only; {prefix} uses a variant (e.g. DoRA)"
            )
        if getattr(layer, "lora_bias", {}).get(adapter, False):
            raise NotImplementedError(f"weight sync does not merge lora_bias=True adapters ({prefix})")
    if len(getattr(layer, "lora_embedding_A", {})) > 0:
        raise NotImplementedError(f"weight sync merges LoRA on linear layers only; {prefix} is an embedding")


@torch.no_grad()
def iter_full_tensors(
    model: torch.nn.Module, *, lora_merge: bool, dtype: torch.dtype | None = None, views: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(hf_name, full_tensor)`` for every parameter of ``model``, one tensor at a time.

    A collective on an FSDP2 model: **every rank must exhaust the iterator** in the same order
    (ranks without an engine just drain it), since each ``DTensor`` is all-gathered; the all-gather
    of the next tensor runs (``async_op=True``) while the consumer copies this one.
    Tied parameters are yielded once, under their first name (``lm_head.weight`` is skipped when it
    is the embedding). With ``lora_merge=True`` each peft LoRA layer is merged,
    ``W' = W + scaling * (B @ A)`` (peft's rounding, bitwise equal to ``merge_and_unload``), names lose
    the ``base_model.model.`` prefix and ``.base_layer``, and ``lora_*`` tensors are dropped; with
    ``lora_merge=False`` the parameters are streamed under their own names. ``dtype`` casts each
    tensor (e.g. fp32 master weights to bf16 for the engine). ``views=True`` yields the parameters'
    own storage where the model runs on one rank (for an engine that shares the trainer's weights);
    the consumer must not write to them.
    """
    lora_layers = {}
    if lora_merge:
        lora_layers = {name: m for name, m in model.named_modules() if _is_lora_layer(m)}
    pending: dict[str, dict[str, torch.Tensor]] = {}

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    # what to stream, decided from names alone (the same on every rank): (param, use views, entry)
    plan = []
    for name, param in model.named_parameters():  # remove_duplicate=True: tied weights once
        if lora_merge and ".original_module." in name:
            continue  # peft modules_to_save keeps the trained copy under modules_to_save.<adapter>
        layer_name = None
        for cut in (".base_layer", ".lora_A.", ".lora_B."):
            if cut in name:
                layer_name = name.split(cut)[0]
                break
        layer = lora_layers.get(layer_name) if layer_name is not None else None
        if layer is None:
            out_name = name
            if lora_merge:
                out_name = _hf_name(_strip_modules_to_save(name) if ".modules_to_save." in name else name)
            plan.append((param, views, ("plain", out_name, None, None)))
            continue
        rest = name[len(layer_name) + 1 :]
        if rest == "base_layer.bias":
            plan.append((param, False, ("plain", _hf_name(name), None, None)))
            continue
        adapters = _active_adapters(layer)
        needed = {"base_layer.weight"} | {f"lora_{ab}.{a}.weight" for a in adapters for ab in "AB"}
        if rest in needed:  # else an inactive adapter: not part of the served weights
            plan.append((param, False, ("part", layer_name, rest, needed)))

    for (kind, out_name, rest, needed), full in _gather_ahead(plan):
        if kind == "plain":
            yield out_name, cast(full)
            continue
        layer_name, layer = out_name, lora_layers[out_name]
        parts = pending.setdefault(layer_name, {})
        parts[rest] = full
        if set(parts) == needed:
            adapters = _active_adapters(layer)
            _check_mergeable(layer_name, layer, adapters)
            merged = base = parts["base_layer.weight"]
            for adapter in adapters:  # like peft's in-place `weight += delta`: the base dtype stays
                delta = _lora_delta(
                    layer, adapter, parts[f"lora_A.{adapter}.weight"], parts[f"lora_B.{adapter}.weight"]
                )
                merged = (merged + delta).to(base.dtype)
            del pending[layer_name]
            yield _hf_name(f"{layer_name}.base_layer.weight"), cast(merged)
    if pending:
        raise EngineError(f"LoRA layers left unmerged (missing tensors): {sorted(pending)[:3]}")


def _strip_modules_to_save(name: str) -> str:
    """``x.modules_to_save.default.weight`` -> ``x.weight``."""
    head, _, tail = name.partition(".modules_to_save.")
    return f"{head}.{tail.partition('.')[2]}"


def iter_lora_adapter_tensors(
    model: torch.nn.Module, adapter: str = "default"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Only the LoRA matrices of a peft model (full tensors; a collective under FSDP2), named as peft
    saves an adapter (``...q_proj.lora_A.weight``: the adapter name removed). This is what an engine
    that serves adapters on top of a fixed base (SGLang's ``load_lora_adapter_from_tensors``) loads,
    instead of the merged weights."""
    marker = f".{adapter}."
    for name, param in model.named_parameters():
        if (".lora_A." in name or ".lora_B." in name) and marker in name:
            yield name.replace(marker, ".", 1), _full(param)


def lora_adapter_config(model: torch.nn.Module, adapter: str = "default") -> dict:
    """The adapter's peft config as plain JSON-able values (sets become sorted lists)."""
    config = model.peft_config[adapter].to_dict()
    return {key: sorted(value) if isinstance(value, set) else value for key, value in config.items()}


def drain(named_tensors: NamedTensors) -> None:
    """Exhaust a collective stream on a rank that has no engine to feed."""
    for _ in named_tensors:
        pass




def stream_self_check(model: torch.nn.Module) -> tuple[bool, bool]:
    """For tests (a collective): whether :func:`iter_full_tensors` gives exactly what a plain
    ``full_tensor()`` of each parameter gives, and whether the gather ahead is asynchronous."""
    streamed = dict(iter_full_tensors(model, lora_merge=False))
    reference = {name: _full(p.detach()) for name, p in model.named_parameters()}
    exact = streamed.keys() == reference.keys() and all(torch.equal(streamed[n], reference[n]) for n in streamed)
    probe = _start_full(next(model.parameters()))
    async_gather = type(probe).__name__ == "AsyncCollectiveTensor"
    _finish_full(probe)
    return exact, async_gather
