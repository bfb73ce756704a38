"""Weight sync from the trainer to a rollout engine: full tensors, flattened buckets, shared memory.

The pieces, in the order a sync uses them:

1. :func:`iter_full_tensors` streams the trainer's parameters one at a time in Hugging Face names:
   an FSDP2 ``DTensor`` is all-gathered with ``.full_tensor()`` (a collective: every rank iterates),
   a peft LoRA layer is merged on the fly, ``W' = W + scaling * (B @ A)`` with peft's own rounding
   (bitwise equal to ``merge_and_unload``), and tied weights come out once.
2. :func:`iter_buckets` groups the stream into buckets of at most ``bucket_bytes``;
   :func:`pack_bucket` lays a bucket out in one flat ``uint8`` buffer, each tensor at an offset
   aligned to :data:`ALIGNMENT` bytes, and :func:`unpack_bucket` gives the tensors back as views.
3. :func:`bucket_checksum` (a wrapping 64-bit sum of the buffer's int64 words, about 13 GB/s on one
   CPU core against 2 GB/s for ``zlib.crc32``) and the weight version travel with each bucket.
4. :class:`SharedBucketSender` and :class:`SharedBucketReceiver` hand buckets to another process
   without copying them: the buffers are allocated once in shared memory (or on the GPU, where the
   same reductions give CUDA-IPC handles), their handles go over once, and every later sync only
   ``copy_``-s the new weights into the same buffers. The receiver verifies version and checksum of
   every bucket and acknowledges it; a buffer is never written again before its acknowledgement.

See ``docs/weight_sync.md`` for the protocol and measurements.
"""

from __future__ import annotations

import collections
import pickle
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

import torch

from rlite.engines.base import EngineError

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
    all-gather of the next tensor already in flight while the consumer works on this one."""
    ahead = None
    for tensor, views, entry in plan:
        started = (entry, _start_full(tensor, views))
        if ahead is not None:
            yield ahead[0], _finish_full(ahead[1])
        ahead = started
    if ahead is not None:
        yield ahead[0], _finish_full(ahead[1])


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


# --------------------------------------------------------------------------------------------------
# flattened buckets
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives in a flat bucket buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the buffer, a multiple of :data:`ALIGNMENT`."""
    nbytes: int


@dataclass(frozen=True)
class BucketMeta:
    """What travels with a bucket: its layout, the weight version and the checksum of its bytes."""

    index: int
    """Position of the bucket in the sync (buckets keep their index from one sync to the next)."""
    version: int
    nbytes: int
    """Bytes of the buffer covered by the checksum (the aligned end of the last tensor)."""
    checksum: int | None
    """None: the checksum follows in a ``bucket_checksum`` message (the receiver sums meanwhile)."""
    tensors: tuple[TensorMeta, ...]


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def plan_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[TensorMeta], int]:
    """Lay tensors out back to back at aligned offsets; returns the metas and the buffer size."""
    metas, offset = [], 0
    for name, tensor in named_tensors:
        size = nbytes_of(tensor)
        metas.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), offset, size))
        offset = align_up(offset + size)
    return metas, offset


def tensor_view(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The tensor ``meta`` describes, as a view into ``buffer`` (no copy)."""
    return buffer[meta.offset : meta.offset + meta.nbytes].view(meta.dtype).view(meta.shape)


def pack_bucket(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    out: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, list[TensorMeta]]:
    """Copy tensors into one flat ``uint8`` buffer (new, zero-filled, or ``out``); returns it and the layout."""
    named_tensors = list(named_tensors)
    metas, size = plan_bucket(named_tensors)
    if out is None:
        if device is None:
            device = named_tensors[0][1].device if named_tensors else "cpu"
        out = torch.zeros(size, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < size:
        raise ValueError(f"pack_bucket: out must be a 1-D uint8 tensor of at least {size} bytes")
    for (_, tensor), meta in zip(named_tensors, metas):
        tensor_view(out, meta).copy_(tensor)
    return out, metas


def unpack_bucket(buffer: torch.Tensor, metas: Iterable[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a bucket as views into ``buffer`` (zero-copy)."""
    return [(meta.name, tensor_view(buffer, meta)) for meta in metas]


def iter_buckets(named_tensors: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a tensor stream into lists whose aligned size stays within ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own. Only one bucket's tensors are
    held at a time, so a streamed model never sits whole in memory.
    """
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        need = align_up(nbytes_of(tensor))
        if bucket and size + need > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += need
    if bucket:
        yield bucket


def bucket_checksum(buffer: torch.Tensor, *, threads: int | None = None) -> int:
    """Sum of the buffer's 8-byte words modulo 2**64 (the length must be a multiple of 8).

    Cheap enough to run on every bucket on both sides (about 14 ms per 200 MB on one CPU core, 7 ms
    on two; on a GPU it runs on the device), and any change to a word changes it. It does not see two
    words swapping places; the layout itself is checked through the metas that come with the bucket.
    ``threads`` runs a CPU sum on that many intra-op threads (the process's setting is restored
    afterwards); the sum wraps modulo 2**64, so the result does not depend on the order or the
    number of threads.
    """
    if buffer.numel() % 8:
        raise ValueError(f"checksum needs a multiple of 8 bytes, got {buffer.numel()}")
    previous = torch.get_num_threads()
    wanted = previous if threads is None or buffer.device.type != "cpu" else max(1, int(threads))
    if wanted != previous:
        torch.set_num_threads(wanted)
    try:
        return int(buffer.view(torch.int64).sum().item()) % (1 << 64)
    finally:
        if wanted != previous:
            torch.set_num_threads(previous)


# --------------------------------------------------------------------------------------------------
# shared-memory / CUDA-IPC handoff
# --------------------------------------------------------------------------------------------------


def share_handle(buffer: torch.Tensor) -> bytes:
    """A picklable handle to ``buffer``: a shared-memory fd (CPU) or a CUDA-IPC handle (GPU).

    The buffer must stay alive in this process while any other process uses the handle.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    return bytes(ForkingPickler.dumps(reduce_tensor(buffer)))


def open_handle(handle: bytes) -> torch.Tensor:
    """The tensor behind a :func:`share_handle` handle, mapped into this process (no copy)."""
    import torch.multiprocessing  # noqa: F401  (registers the storage reducers)

    rebuild, args = pickle.loads(handle)
    return rebuild(*args)


class Channel(Protocol):
    """A message link to the receiving side; both calls raise :class:`EngineError` on failure."""

    def send(self, message: Any) -> None: ...

    def recv(self, timeout_s: float) -> Any: ...


@dataclass
class SyncStats:
    """Where the time of one sync went (seconds)."""

    version: int
    buckets: int = 0
    nbytes: int = 0
    first_sync: bool = False
    copy_s: float = 0.0
    """Trainer-side copies of the tensors into the bucket buffers (includes producing the tensors)."""
    checksum_s: float = 0.0
    """Trainer-side checksums."""
    handoff_s: float = 0.0
    """Messages, the receiver's verification and the waits for its acknowledgements."""
    total_s: float = 0.0


@dataclass
class _Slot:
    buffer: torch.Tensor
    metas: tuple[TensorMeta, ...]
    nbytes: int
    awaiting_ack: bool = False


@dataclass
class SharedBucketSender:
    """Trainer side of the shared-bucket protocol.

    Messages sent on ``channel``, each answered by the receiver, in order, with an ack:

    * ``("begin_sync", version)`` -> ``("ack", "begin_sync", version, True, "")``
    * ``("bucket", BucketMeta, handle_or_None)`` with ``meta.checksum = None``, unanswered: the
      receiver maps the buffer and starts summing it at once, while the trainer sums the same bytes;
    * ``("bucket_checksum", index, version, checksum)`` -> ``("ack", index, version, ok, error)``: the
      receiver compares the two sums (and reports any error of the bucket message here). The handle
      is sent with a bucket's first use only. The verification so runs alongside the trainer's own
      checksum instead of after it, and adds nothing to the sync where a core is free for it.
    * ``("end_sync", version, n_buckets)`` -> ``("ack", "end_sync", version, ok, error)``
    * ``("abort_sync", version)`` after a failure -> ``("ack", "abort_sync", version, True, "")``

    The first sync allocates one buffer per bucket (shared memory on CPU, device memory on GPU); later
    syncs must stream the same names, shapes and dtypes in the same order and only copy into the
    buffers. Nothing waits for its ack until it must: the trainer fills bucket ``i + 1`` while the
    receiver checks bucket ``i``, a buffer is written again only after its ack has been read, and the
    sync ends with one round trip (``end_sync``) after which every ack has been checked.
    """

    channel: Channel
    bucket_bytes: int = 512 << 20
    device: torch.device | str | None = None
    """Where buffers live; None: where the first tensor lives (CPU buffers go to shared memory)."""
    timeout_s: float = 600.0
    slots: list[_Slot] = field(default_factory=list)
    _debug_corrupt: bool = False
    """Test hook: flip a byte of the next bucket after its checksum was taken."""
    _debug_version_offset: int = 0
    """Test hook: stamp buckets with a wrong version."""
    _pending: collections.deque = field(default_factory=collections.deque)
    """Acks still to read, in the order the receiver sends them."""

    def sync(self, named_tensors: NamedTensors, version: int) -> SyncStats:
        """Hand the stream over as weight ``version``; raises :class:`EngineError` on any mismatch."""
        stats = SyncStats(version=int(version), first_sync=not self.slots)
        start = time.perf_counter()
        self._pending.clear()
        try:
            self._post(("begin_sync", stats.version), "begin_sync")  # answered in order, read later
            if stats.first_sync:
                self._first_sync(named_tensors, stats)
            else:
                self._steady_sync(named_tensors, stats)
            self._post(("end_sync", stats.version, len(self.slots)), "end_sync")
            while self._pending:
                self._read_ack(stats)
        except BaseException:
            self._abort(stats)
            raise
        stats.total_s = time.perf_counter() - start
        stats.handoff_s = stats.total_s - stats.copy_s - stats.checksum_s
        return stats

    def reset(self) -> None:
        """Forget the layout and buffers (the next sync allocates and sends new handles)."""
        self.slots = []

    # -- internals ----------------------------------------------------------------------------
    def _abort(self, stats: SyncStats) -> None:
        """Tell the receiver the sync is off and drop the acks still in flight, so the link is clean."""
        if stats.first_sync:
            self.reset()  # a half-built layout is no layout
        for slot in self.slots:
            slot.awaiting_ack = False
        self._pending.clear()
        try:
            self.channel.send(("abort_sync", stats.version))
            deadline = time.monotonic() + self.timeout_s
            while True:  # acks of buckets sent before the failure come first
                reply = self.channel.recv(max(deadline - time.monotonic(), 0.0))
                if isinstance(reply, tuple) and reply[:2] == ("ack", "abort_sync"):
                    break
        except Exception:
            pass  # the receiver is gone or hung; the original error says what happened

    def _first_sync(self, named_tensors: NamedTensors, stats: SyncStats) -> None:
        t = time.perf_counter()
        for group in iter_buckets(named_tensors, self.bucket_bytes):
            metas, size = plan_bucket(group)
            device = torch.device(self.device) if self.device is not None else group[0][1].device
            buffer = torch.zeros(max(size, ALIGNMENT), dtype=torch.uint8, device=device)
            if buffer.device.type == "cpu":
                buffer.share_memory_()
            pack_bucket(group, out=buffer)
            del group
            slot = _Slot(buffer, tuple(metas), size)
            self.slots.append(slot)
            stats.copy_s += time.perf_counter() - t
            self._send_bucket(len(self.slots) - 1, stats, handle=share_handle(buffer))
            t = time.perf_counter()
        stats.copy_s += time.perf_counter() - t
        if not self.slots:
            raise EngineError("weight sync: no tensors to send")

    def _steady_sync(self, named_tensors: NamedTensors, stats: SyncStats) -> None:
        expected = [(i, meta) for i, slot in enumerate(self.slots) for meta in slot.metas]
        position = 0
        t = time.perf_counter()
        for name, tensor in named_tensors:
            if position >= len(expected):
                raise EngineError(
                    f"weight sync: unexpected extra tensor {name!r}; the synced set must not change"
                )
            index, meta = expected[position]
            if (name, tensor.dtype, tuple(tensor.shape)) != (meta.name, meta.dtype, meta.shape):
                raise EngineError(
                    f"weight sync: tensor {position} is {name!r} {tuple(tensor.shape)} {tensor.dtype}, the first sync "
                    f"had {meta.name!r} {meta.shape} {meta.dtype}; the synced names, shapes and dtypes must not change"
                )
            slot = self.slots[index]
            if slot.awaiting_ack:  # never overwrite a buffer the receiver has not acknowledged
                stats.copy_s += time.perf_counter() - t
                self._await_ack(index, stats)
                t = time.perf_counter()
            tensor_view(slot.buffer, meta).copy_(tensor)
            position += 1
            if meta is slot.metas[-1]:
                stats.copy_s += time.perf_counter() - t
                self._send_bucket(index, stats, handle=None)
                t = time.perf_counter()
        stats.copy_s += time.perf_counter() - t
        if position != len(expected):
            raise EngineError(
                f"weight sync: got {position} tensors, the first sync had {len(expected)} "
                f"(next expected {expected[position][1].name!r})"
            )

    def _send_bucket(self, index: int, stats: SyncStats, *, handle: bytes | None) -> None:
        slot = self.slots[index]
        version = stats.version + self._debug_version_offset
        reference = None
        if self._debug_corrupt:  # the sum of the bytes as written, then a flipped byte "in transit"
            self._debug_corrupt = False
            reference = bucket_checksum(slot.buffer[: slot.nbytes])
            slot.buffer[0] ^= 0xFF
        if slot.buffer.device.type == "cuda":
            torch.cuda.current_stream(slot.buffer.device).synchronize()  # the copies are done
        # the receiver starts summing now, while this process sums the same bytes
        self.channel.send(("bucket", BucketMeta(index, version, slot.nbytes, None, slot.metas), handle))
        t = time.perf_counter()
        checksum = reference if reference is not None else bucket_checksum(slot.buffer[: slot.nbytes])
        stats.checksum_s += time.perf_counter() - t
        self._post(("bucket_checksum", index, version, checksum), index)
        slot.awaiting_ack = True
        stats.buckets += 1
        stats.nbytes += slot.nbytes

    def _post(self, message: tuple, expect: str | int) -> None:
        """Send without waiting; ``expect`` names the ack that must come back for it, in order."""
        self.channel.send(message)
        self._pending.append(expect)

    def _await_ack(self, index: int, stats: SyncStats) -> None:
        while self.slots[index].awaiting_ack:
            self._read_ack(stats)

    def _read_ack(self, stats: SyncStats) -> None:
        expect = self._pending.popleft()
        what = f"bucket {expect}" if isinstance(expect, int) else expect
        _, got, got_version, ok, detail = _check_ack(self.channel.recv(self.timeout_s), what)
        if isinstance(expect, int):
            self.slots[expect].awaiting_ack = False
        if not ok:
            verb = "rejected" if isinstance(expect, int) else "failed on"
            raise EngineError(f"weight sync v{stats.version}: engine {verb} {what}: {detail}")
        if got != expect or got_version != stats.version:
            raise EngineError(
                f"weight sync v{stats.version}: expected the ack of {what} v{stats.version}, "
                f"got the ack of {got} v{got_version}"
            )


def _check_ack(reply: Any, what: str) -> tuple:
    if not (isinstance(reply, tuple) and len(reply) == 5 and reply[0] == "ack"):
        raise EngineError(f"weight sync: expected the ack of {what}, got {str(reply)[:200]}")
    return reply


class SharedBucketReceiver:
    """Engine side of the shared-bucket protocol: maps the buffers, verifies, hands out views.

    The engine's message loop calls :meth:`begin`, :meth:`receive` per bucket (loading the views it
    returns into its model), :meth:`confirm` when the trainer's checksum of the bucket arrives, and
    :meth:`end`, and answers the messages with acks (see :class:`SharedBucketSender`). A bucket counts
    as received only once its checksum is confirmed.
    """

    def __init__(self, *, verify_checksums: bool = True, verify_threads: int | None = None) -> None:
        """``verify_threads``: CPU threads for the checksum of each bucket (default: the process's
        own setting; the trainer sums the same bucket at the same time on its own core)."""
        self.verify_checksums = verify_checksums
        self.verify_threads = verify_threads
        self.buffers: dict[int, torch.Tensor] = {}
        self.version: int | None = None
        """Version of the sync in progress (None between syncs)."""
        self.received: set[int] = set()
        self.sums: dict[int, int | None] = {}
        """This side's checksums of buckets whose trainer checksum has not arrived yet."""

    def begin(self, version: int) -> None:
        self.version, self.received, self.sums = int(version), set(), {}

    def receive(self, meta: BucketMeta, handle: bytes | None) -> list[tuple[str, torch.Tensor]]:
        """Verify one bucket and return its tensors as views into the shared buffer."""
        if self.version is None:
            raise EngineError(f"bucket {meta.index} arrived outside a sync (no begin_sync)")
        if meta.version != self.version:
            raise EngineError(
                f"version mismatch: bucket {meta.index} carries v{meta.version}, the sync is v{self.version}"
            )
        if handle is not None:
            self.buffers[meta.index] = open_handle(handle)
        buffer = self.buffers.get(meta.index)
        if buffer is None:
            raise EngineError(f"bucket {meta.index} came without a handle and none is known")
        if buffer.numel() < meta.nbytes:
            raise EngineError(
                f"bucket {meta.index} buffer holds {buffer.numel()} bytes, meta says {meta.nbytes}"
            )
        got = bucket_checksum(buffer[: meta.nbytes], threads=self.verify_threads) if self.verify_checksums else None
        if buffer.device.type == "cuda":
            torch.cuda.synchronize(buffer.device)  # our reads are done before the ack frees the buffer
        if meta.checksum is None:  # the trainer's checksum follows (confirm)
            self.sums[meta.index] = got
        else:
            self._compare(meta.index, meta.version, meta.checksum, got)
            self.received.add(meta.index)
        return unpack_bucket(buffer, meta.tensors)

    def confirm(self, index: int, version: int, checksum: int) -> None:
        """Compare the trainer's checksum of bucket ``index`` with this side's sum of it."""
        if self.version is None or version != self.version:
            raise EngineError(f"version mismatch: checksum of bucket {index} v{version}, the sync is v{self.version}")
        if index not in self.sums:
            raise EngineError(f"the checksum of bucket {index} v{version} came before the bucket")
        self._compare(index, version, checksum, self.sums.pop(index))
        self.received.add(index)

    @staticmethod
    def _compare(index: int, version: int, expected: int, got: int | None) -> None:
        if got is not None and got != expected:
            raise EngineError(
                f"checksum mismatch in bucket {index} v{version}: trainer {expected:#018x}, engine reads {got:#018x}"
            )

    def end(self, version: int, n_buckets: int) -> None:
        if self.version != version:
            raise EngineError(
                f"version mismatch: end_sync v{version}, the sync in progress is v{self.version}"
            )
        missing = sorted(set(range(n_buckets)) - self.received)
        self.version = None
        if missing:
            raise EngineError(f"sync v{version} ended with buckets {missing[:5]} never received")
