"""SGLang payloads: flattened-bucket weight updates, sampling params, completions."""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from rlite.api import Completion, EngineError, SamplingParams, iter_buckets, pack_bucket

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


CUDA_DEVICE_ARG = 6
"""Where ``torch.multiprocessing.reductions.reduce_tensor`` puts a CUDA tensor's device index among the
arguments of ``rebuild_cuda_tensor`` (SGLang's ``_REDUCE_TENSOR_ARG_DEVICE_INDEX``)."""


def cuda_device_uuid(index: int) -> str:
    """The GPU's UUID as SGLang's ``patch_torch._device_to_uuid`` writes it."""
    return str(torch.cuda.get_device_properties(index).uuid)


def reduce_tensor_by_device_uuid(tensor: torch.Tensor):
    """torch's reduction of ``tensor`` for another process, with a CUDA tensor's device named by the
    GPU's UUID instead of its index.

    A device index means nothing across processes that see different GPUs: SGLang's schedulers may run
    under another ``CUDA_VISIBLE_DEVICES`` than the trainer (or see the GPUs in another order), and
    ``cuda:3`` of the trainer is then another GPU there, or none. SGLang's receivers call
    ``monkey_patch_torch_reductions()`` before they unpickle, so their ``rebuild_cuda_tensor`` maps a
    UUID string back to their own index (``_device_from_maybe_uuid``) and passes an int through
    unchanged; this is the sending half of that patch (``_reduce_tensor_modified``), applied to rlite's
    payloads only, so that torch's reductions stay untouched for everything else in the process (the
    spawned transformers engine, DataLoader workers). CPU tensors reduce exactly as torch does.
    """
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if getattr(rebuild, "__name__", "") in ("rebuild_cuda_tensor", "_rebuild_cuda_tensor_modified"):
        device = args[CUDA_DEVICE_ARG]
        if isinstance(device, int):
            args = (*args[:CUDA_DEVICE_ARG], cuda_device_uuid(device), *args[CUDA_DEVICE_ARG + 1 :])
    return rebuild, args


def serialize_payload(obj: Any, *, output_str: bool) -> bytes | str:
    """What ``MultiprocessingSerializer.serialize`` produces after SGLang's ``monkey_patch_torch_reductions``:
    ForkingPickler bytes (or their base64) in which a CUDA tensor is a CUDA-IPC handle whose device is the
    GPU's UUID (:func:`reduce_tensor_by_device_uuid`)."""
    import io

    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    for cls in (torch.Tensor, torch.nn.Parameter):
        pickler.dispatch_table[cls] = reduce_tensor_by_device_uuid
    pickler.dump(obj)
    data = buffer.getvalue()
    return base64.b64encode(data).decode("ascii") if output_str else data


ENGINE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "half": torch.float16, "float": torch.float32}  # fmt: skip
"""SGLang's ``dtype`` names (``_STR_DTYPE_TO_TORCH_DTYPE``) rlite passes or reads."""


def resolve_engine_dtype(dtype: str, hf_config: dict[str, Any]) -> torch.dtype:
    """The dtype SGLang 0.5.23 runs a model in (``configs/model_config.py: _get_and_verify_dtype``).

    ``"auto"`` takes the checkpoint's ``dtype`` (or ``torch_dtype``) from its ``config.json``; a float32
    checkpoint runs in float16, except Gemma models (bfloat16); a missing dtype counts as float32.
    """
    if dtype != "auto":
        if dtype not in ENGINE_DTYPES:
            raise ValueError(f"rollout.engine.args.dtype: unknown dtype {dtype!r}; one of auto, {', '.join(ENGINE_DTYPES)}")
        return ENGINE_DTYPES[dtype]
    declared = ENGINE_DTYPES.get(str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"), torch.float32)
    if declared == torch.float32:
        return torch.bfloat16 if str(hf_config.get("model_type", "")).startswith("gemma") else torch.float16
    return declared


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
    if params.ignore_eos:  # SGLang's own flag: its tokenizer's EOS stops nothing; stop_token_ids still do
        base["ignore_eos"] = True
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
        from rlite.api import completion_rows, decode_routed_experts

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


def payloads_for_engine(payloads: list[bytes], *, tp_size: int, output_str: bool) -> list[bytes | str]:
    """One payload per TP rank of the engine, in TP order, as bytes or base64."""
    if len(payloads) != tp_size:
        raise EngineError(f"{len(payloads)} weight payloads for an engine of tp_size {tp_size}")
    return [base64.b64encode(p).decode("ascii") if output_str else p for p in payloads]


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
    group: Any = None,
    tensor_hash: Any = None,
    weight_dtype: torch.dtype | None = None,
    selector: str | None = None,
    set_version: bool = True,
) -> int:
    """The SGLang weight-update call sequence; returns the number of buckets sent.

    ``engine`` has SGLang ``Engine``'s method names plus ``update_weight_version`` (None on the members
    of an :class:`~rlite.plugins.sglang.group.EngineGroup`: they only hand their payloads to the
    leader); buckets are packed on ``device`` (the GPU, so that they travel as CUDA-IPC handles). With a
    group, every rank packs the same stream on its own GPU and TP rank i of the engine loads rank i's
    payload. ``tensor_hash`` (SGLang's ``tensor_hash``): after the update the engine's checksums of the
    sent tensors it holds unchanged are compared with the sent values' in the engine's ``weight_dtype``
    (:func:`check_engine_weights`). ``selector`` (``"target"`` or ``"draft"``; None: SGLang's default
    ``"all"``) picks the runners that load them, for the session and for every bucket;
    ``set_version=False`` leaves the version to a later session.
    """
    leader = group is None or group.is_leader
    chosen = {} if selector is None else {"selector": selector}
    sent_hashes: dict[str, str] = {}
    failure = None
    if leader:
        failure = reply_error(engine.begin_weight_update(**chosen), "begin_weight_update")
    if group is not None:
        failure = group.share(failure)
    if failure is not None:
        raise EngineError(failure)
    buckets = 0
    try:
        for bucket in iter_buckets(named_tensors, bucket_bytes):
            payload = flattened_bucket_payload(bucket, metadata_cls=metadata_cls, device=device)
            if leader and tensor_hash is not None:
                sent_hashes.update(sampled_hashes(bucket, tensor_hash, weight_dtype))
            del bucket
            # each TP rank opens a handle of its own (a handle is single-use for a shared-memory fd, and
            # each one counts a reference of SGLang's on the buffer); with a group, TP rank i gets rank i's
            if group is None:
                own = None
                payloads = [serialize_payload(payload, output_str=False) for _ in range(tp_size)]
            else:
                own = serialize_payload(payload, output_str=False)
                payloads = group.gather(own)
            if leader:
                try:
                    reply = engine.update_weights_from_tensor(
                        payloads_for_engine(payloads, tp_size=tp_size, output_str=output_str),
                        load_format=FLATTENED_BUCKET, flush_cache=False, **chosen,
                    )  # fmt: skip
                    failure = reply_error(reply, f"update_weights_from_tensor (bucket {buckets})")
                except Exception as exc:  # the members must hear of it before the leader raises
                    failure = f"SGLang update_weights_from_tensor (bucket {buckets}) raised {exc!r}"
            if group is not None:
                failure = group.share(failure)
            del payload, own, payloads  # a fresh buffer per bucket; IPC refcounts free it once SGLang is done
            if failure is not None:
                raise EngineError(failure)
            buckets += 1
    finally:
        if leader:
            ended = reply_error(engine.end_weight_update(), "end_weight_update")
            failure = failure or ended
    if leader and failure is None and set_version:
        failure = reply_error(engine.update_weight_version(str(int(version))), "update_weight_version")
    if leader and failure is None and tensor_hash is not None:
        try:
            check_engine_weights(engine.check_weights(action="checksum"), sent_hashes, version)
        except EngineError as exc:
            failure = str(exc)
    if group is not None:
        failure = group.share(failure)
    if failure is not None:
        raise EngineError(failure)
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
    return buckets


def reply_error(result: Any, what: str) -> str | None:
    """:func:`check_reply`'s error message, or None if the call succeeded."""
    try:
        check_reply(result, what)
    except EngineError as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------------------------------
# checking what SGLang holds after a sync
# --------------------------------------------------------------------------------------------------


def sampled_hashes(
    named_tensors: Iterable[tuple[str, torch.Tensor]], tensor_hash, dtype: torch.dtype | None = None
) -> dict[str, str]:
    """SGLang's checksum (``f"{tensor_hash(t):016x}"``, ``utils/weight_checker.py: _hash_tensor``) of
    every 1-D tensor sent, in the engine's ``dtype`` (SGLang's loader casts what it is given into its
    parameters): norm weights and unfused biases, which SGLang keeps byte for byte under their Hugging
    Face names on every TP rank."""
    out = {}
    for name, tensor in named_tensors:
        if tensor.dim() == 1:
            if dtype is not None and tensor.dtype in (torch.float32, torch.float16, torch.bfloat16):
                tensor = tensor.to(dtype)
            out[name] = f"{tensor_hash(tensor.contiguous()):016x}"
    return out


def set_weight_version(engine: Any, version: int, group: Any = None) -> None:
    """``update_weight_version`` on the leader after sessions that left it unset
    (:func:`sync_weights` with ``set_version=False``); the group's members hear of a failure too."""
    failure = None
    if group is None or group.is_leader:
        failure = reply_error(engine.update_weight_version(str(int(version))), "update_weight_version")
    if group is not None:
        failure = group.share(failure)
    if failure is not None:
        raise EngineError(failure)


def check_engine_weights(reply: Any, sent: dict[str, str], version: int) -> int:
    """Compare SGLang's per-tensor checksums (``check_weights(action="checksum")``, one entry per TP
    rank) with the sent tensors'; returns the number of tensors compared.

    Compared: every sent 1-D tensor that each TP rank reports under the same name with the same checksum
    on all ranks (a tensor whose ranks differ is sharded across them, not a copy of what was sent). A
    mismatch means SGLang serves other bytes than the trainer sent (a stale or reused buffer, a handle
    opened on the wrong GPU, a name its loader dropped).
    """
    ranks = checksum_ranks(reply)
    compared = 0
    for name, expected in sorted(sent.items()):
        seen = {r["checksums"].get(name) for r in ranks}
        if len(seen) != 1 or None in seen:
            continue  # not held under this name, or sharded across the TP ranks
        (got,) = seen
        if got != expected:
            raise EngineError(
                f"weight check after sync v{version}: SGLang holds {name} with checksum {got}, the trainer "
                f"sent {expected}"
            )
        compared += 1
    if sent and not compared:
        raise EngineError(
            f"weight check after sync v{version}: SGLang reports none of the {len(sent)} 1-D tensors sent "
            f"(e.g. {next(iter(sent))}) under its name; turn the check off (rollout.engine.args.verify_weights=false) "
            "for a model whose loader renames them"
        )
    return compared


def checksum_ranks(reply: Any) -> list[dict[str, Any]]:
    """The per-rank ``ChecksumInfo`` dicts of a ``check_weights`` answer: the in-process tuple
    ``(success, message, ranks, per_engine_checksum)`` or the HTTP body ``{"success", "message", "ranks"}``."""
    if isinstance(reply, tuple):
        success, message, ranks = reply[0], reply[1], reply[2]
    else:
        success, message, ranks = reply.get("success"), reply.get("message"), reply.get("ranks")
    if not success or not ranks:
        raise EngineError(f"SGLang check_weights failed: {message or 'no checksums returned'}")
    return list(ranks)
