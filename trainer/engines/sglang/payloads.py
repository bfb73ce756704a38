"""SGLang payloads: flattened-bucket weight updates, sampling params, completions."""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from rlite.engines.base import Completion, EngineError, SamplingParams
from rlite.sync.buckets import iter_buckets, pack_bucket

FLATTENED_BUCKET = "flattened_bucket"
WEIGHT_TAGS = ["weights"]
"""Memory-saver tag resumed before a weight update."""
REST_TAGS = ["kv_cache", "cuda_graph"]
"""Memory-saver tags resumed after the weight update, before generation."""


# --------------------------------------------------------------------------------------------------
# pure pieces: payload, sampling parameters, outputs
# --------------------------------------------------------------------------------------------------


@dataclass
class FlattenedTensorMetadataFields:
    """The fields of SGLang's ``FlattenedTensorMetadata`` (a stand-in where SGLang is not installed)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def sglang_metadata_cls() -> type:
    """SGLang's own metadata class: its unpickler accepts no other."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    return FlattenedTensorMetadata


def flattened_bucket_payload(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    metadata_cls: type,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """``{"flattened_tensor", "metadata"}`` as SGLang's ``FlattenedTensorBucket`` reads it back.

    The buffer is made on ``device`` (default: where the first tensor is).
    """
    buffer, metas = pack_bucket(named_tensors, device=device)
    metadata = [
        metadata_cls(
            name=m.name,
            shape=torch.Size(m.shape),
            dtype=m.dtype,
            start_idx=m.offset,
            end_idx=m.offset + m.nbytes,
            numel=m.nbytes,
        )
        for m in metas
    ]
    return {"flattened_tensor": buffer, "metadata": metadata}


def serialize_payload(obj: Any, *, output_str: bool) -> bytes | str:
    """What ``MultiprocessingSerializer.serialize`` produces: ForkingPickler bytes, or their base64."""
    data = bytes(ForkingPickler.dumps(obj))
    return base64.b64encode(data).decode("ascii") if output_str else data


def build_update_payloads(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    tp_size: int,
    metadata_cls: type,
    output_str: bool,
    device: torch.device | str | None = None,
) -> list[bytes | str]:
    """One serialized flattened bucket per tensor-parallel rank (each rank rebuilds its own handle)."""
    payload = flattened_bucket_payload(named_tensors, metadata_cls=metadata_cls, device=device)
    return [serialize_payload(payload, output_str=output_str) for _ in range(tp_size)]


def sampling_params_for(
    params: SamplingParams, *, stop_token_ids: Iterable[int], seeds: list[int] | None
) -> list[dict[str, Any]]:
    """One SGLang sampling-params dict per request (``n`` is expanded by the caller)."""
    base = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k and params.top_k > 0 else -1,
        "stop_token_ids": sorted({int(t) for t in stop_token_ids}) or None,
    }
    if seeds is None:
        return [dict(base)]
    return [dict(base, sampling_seed=seed) for seed in seeds]


def completion_from_output(
    output: dict[str, Any],
    *,
    prompt_index: int,
    weight_version: int,
    routing: tuple[int, int, int] | None = None,
) -> Completion:
    """An SGLang output dict (``return_logprob=True``) as a :class:`Completion`.

    Tokens and log-probs come from ``meta_info["output_token_logprobs"]`` (``(logprob, token_id, text)``
    per sampled token), which SGLang computes from the temperature-scaled logits, the trainer's formula.
    ``routing = (prompt_len, num_hidden_layers, top_k)`` decodes ``meta_info["routed_experts"]``
    (``return_routed_experts=True``: base64 int32 of ``[prompt_len + len(tokens) - 1, layers, top_k]``).
    """
    meta = output.get("meta_info", {})
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise EngineError("SGLang output has no output_token_logprobs (was return_logprob set?)")
    token_ids = [int(e[1]) for e in entries]
    logprobs = [float(e[0]) for e in entries]
    output_ids = output.get("output_ids")
    if output_ids is not None and list(output_ids)[: len(token_ids)] != token_ids:
        raise EngineError(f"SGLang output_ids {list(output_ids)[:8]}... disagree with its logprob tokens")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in ("stop", "length"):
        raise EngineError(f"SGLang request ended with finish_reason {reason!r}")
    routed = None
    if routing is not None:
        from rlite.moe_routing import completion_rows, decode_routed_experts

        payload = meta.get("routed_experts")
        if payload is None:
            raise EngineError("SGLang output has no routed_experts (start it with enable_return_routed_experts=True)")
        prompt_len, layers, top_k = routing
        routed = decode_routed_experts(payload, completion_rows(prompt_len, len(token_ids)), layers, top_k)
    return Completion(
        prompt_index=prompt_index,
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=kind,
        weight_version=weight_version,
        routed_experts=routed,
    )


def check_reply(result: Any, what: str) -> Any:
    """Raise if an SGLang control call reported failure (``(success, message)`` or ``.success``).

    The reason is ``message``, or ``error_message`` for the LoRA calls (SGLang's ``LoRAUpdateOutput``).
    """
    if isinstance(result, tuple) and len(result) >= 2 and isinstance(result[0], bool):
        ok, message = result[0], result[1]
    elif hasattr(result, "success"):
        ok = bool(result.success)
        message = getattr(result, "message", None) or getattr(result, "error_message", None) or ""
    elif isinstance(result, dict) and "success" in result:
        ok, message = bool(result["success"]), result.get("message") or result.get("error_message") or ""
    else:
        return result
    if not ok:
        raise EngineError(f"SGLang {what} failed: {message}")
    return result


def sync_weights(
    engine: Any,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    version: int,
    *,
    bucket_bytes: int,
    tp_size: int,
    metadata_cls: type,
    output_str: bool,
    device: torch.device | str | None = None,
    selector: str | None = None,
    set_version: bool = True,
) -> int:
    """The SGLang weight-update call sequence; returns the number of buckets sent.

    ``engine`` has SGLang ``Engine``'s method names plus ``update_weight_version``; buckets are packed
    on ``device`` (the GPU, so that they travel as CUDA-IPC handles). ``selector`` (``"target"`` or
    ``"draft"``; None: SGLang's default ``"all"``) picks the runners that load them, for the session
    and for every bucket; ``set_version=False`` leaves the version to a later session.
    """
    chosen = {} if selector is None else {"selector": selector}
    check_reply(engine.begin_weight_update(**chosen), "begin_weight_update")
    buckets = 0
    try:
        for bucket in iter_buckets(named_tensors, bucket_bytes):
            payloads = build_update_payloads(
                bucket, tp_size=tp_size, metadata_cls=metadata_cls, output_str=output_str, device=device
            )
            del bucket
            check_reply(
                engine.update_weights_from_tensor(payloads, load_format=FLATTENED_BUCKET, flush_cache=False, **chosen),
                f"update_weights_from_tensor (bucket {buckets})",
            )
            del payloads  # a fresh buffer per bucket; IPC refcounts free this one once SGLang is done
            buckets += 1
    finally:
        ended = engine.end_weight_update()
    check_reply(ended, "end_weight_update")
    if set_version:
        check_reply(engine.update_weight_version(str(int(version))), "update_weight_version")
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
    return buckets


