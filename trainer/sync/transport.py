"""Handing buckets to another process without copies: shared-memory / CUDA-IPC handles, sender and receiver."""

from __future__ import annotations

import collections
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

import torch

from rlite.errors import EngineError
from rlite.metrics import MetricsSink, Reported
from rlite.sync.buckets import (
    ALIGNMENT,
    BucketMeta,
    NamedTensors,
    TensorMeta,
    bucket_checksum,
    copy_into,
    iter_buckets,
    pack_bucket,
    plan_bucket,
    tensor_view,
    unpack_bucket,
)

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
    * ``("metrics",)`` between syncs (:meth:`fetch_metrics`) -> ``("metrics", reported)``: what the engine's
      process reported into the :class:`~rlite.metrics.MetricsSink` its :class:`SyncServer` was given, drained
      (plain data, ``MetricsSink.drain()``'s form)

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

    def fetch_metrics(self, into: MetricsSink | None = None) -> Reported:
        """Ask the engine's process for what it reported since the last time (``("metrics",)``, answered by
        :class:`SyncServer` from the sink it was given) and add it to ``into`` (the engine's
        ``EngineContext.metrics``), so that it reaches the step's metrics row. Call it between syncs, from
        the thread that syncs; it returns what came."""
        if self._pending:
            raise EngineError("fetch_metrics: a weight sync is in progress on this channel")
        self.channel.send((METRICS_REQUEST,))
        reply = self.channel.recv(self.timeout_s)
        if not (isinstance(reply, tuple) and len(reply) == 2 and reply[0] == METRICS_REQUEST and isinstance(reply[1], dict)):
            raise EngineError(f"fetch_metrics: expected (\"metrics\", {{...}}), got {str(reply)[:200]}")
        if into is not None:
            into.merge(reply[1])
        return reply[1]

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
        pending: list[torch.Tensor] = []  # the current bucket's tensors, copied in one go at its end
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
            batched = slot.buffer.is_cuda  # a GPU bucket is filled by one multi-tensor copy at its end
            if slot.awaiting_ack and (not batched or meta is slot.metas[-1]):
                stats.copy_s += time.perf_counter() - t  # never overwrite a buffer the receiver has not acknowledged
                self._await_ack(index, stats)
                t = time.perf_counter()
            if batched:
                pending.append(tensor)
            else:
                tensor_view(slot.buffer, meta).copy_(tensor)
            position += 1
            if meta is slot.metas[-1]:
                copy_into([tensor_view(slot.buffer, m) for m in slot.metas] if batched else [], pending)
                pending = []
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


# --------------------------------------------------------------------------------------------------
# the two ends of a pipe: a channel for the sender, a server for the receiving process
# --------------------------------------------------------------------------------------------------

SYNC_MESSAGES = ("begin_sync", "bucket", "bucket_checksum", "end_sync", "abort_sync")
"""The first element of every message of a weight sync."""
METRICS_REQUEST = "metrics"
"""The message (``("metrics",)``) that asks the engine's process for its reported metrics, and its answer's tag."""


class ConnectionChannel:
    """A :class:`Channel` over a ``multiprocessing`` :class:`~multiprocessing.connection.Connection`.

    The simplest link for an engine process of your own (``ctx.Pipe()``): every receive has a timeout,
    and a closed or silent pipe raises :class:`EngineError`. (``ProcessEngine`` uses a channel that also
    watches the process and kills it on a timeout.)
    """

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def send(self, message: Any) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as e:
            raise EngineError(f"weight sync: the receiving end is gone ({e!r})") from None

    def recv(self, timeout_s: float) -> Any:
        try:
            if not self.conn.poll(timeout_s):
                raise EngineError(f"weight sync: no answer within {timeout_s:g} s")
            return self.conn.recv()
        except (ConnectionResetError, EOFError, OSError) as e:
            raise EngineError(f"weight sync: the receiving end is gone ({e!r})") from None


class SyncServer:
    """The receiving process's whole side of the protocol: answers each message of a
    :class:`SharedBucketSender` with the ack it expects, and hands every verified bucket to ``load``.

    ``load(views)`` gets a bucket's ``(name, tensor)`` pairs as views into the shared buffer (no copy):
    copy them into your model, or make them its storage (``param.data = view``: the buffers stay
    mapped and later syncs write into them). ``check_complete(version)``, if given, runs at the end of
    every sync and raises if the model is not fully covered. ``metrics``, if given, is the engine process's
    :class:`~rlite.metrics.MetricsSink`: report into it anywhere in the process, and the trainer's
    :meth:`SharedBucketSender.fetch_metrics` collects it (``("metrics",)``). Between a ``begin_sync`` and its successful
    ``end_sync`` (or after a failed sync) :attr:`weights_valid` is False: an engine must not generate
    then. :attr:`weight_version` is the version of the last complete sync (None before the first).

    Use::

        server = SyncServer(load)
        while True:
            message = conn.recv()
            if server.handles(message):
                reply = server.handle(message)
                if reply is not None:
                    conn.send(reply)
            else:
                ...  # your engine's own calls (generate, ...)
    """

    def __init__(
        self,
        load: Callable[[list[tuple[str, torch.Tensor]]], None],
        *,
        check_complete: Callable[[int], None] | None = None,
        verify_checksums: bool = True,
        verify_threads: int | None = None,
        metrics: MetricsSink | None = None,
    ) -> None:
        self.load = load
        self.check_complete = check_complete
        self.metrics = metrics
        self.receiver = SharedBucketReceiver(verify_checksums=verify_checksums, verify_threads=verify_threads)
        self.weight_version: int | None = None
        self.weights_valid = False
        self.invalid_reason = "no weight sync yet"
        self._bucket_errors: dict[int, str] = {}

    @staticmethod
    def handles(message: Any) -> bool:
        """Whether ``message`` belongs to the weight-sync protocol (the rest is the engine's own)."""
        return isinstance(message, tuple) and bool(message) and message[0] in (*SYNC_MESSAGES, METRICS_REQUEST)

    def handle(self, message: tuple) -> tuple | None:
        """The ack to send back for ``message``, or None when a later message answers for it."""
        op, *args = message
        return getattr(self, f"_{op}")(*args)

    def _metrics(self) -> tuple:
        return (METRICS_REQUEST, self.metrics.drain() if self.metrics is not None else {})

    def _begin_sync(self, version: int) -> tuple:
        self.receiver.begin(version)
        self._bucket_errors = {}
        self.weights_valid, self.invalid_reason = False, f"weight sync v{version} did not complete"
        return ("ack", "begin_sync", version, True, "")

    def _bucket(self, meta: BucketMeta, handle: bytes | None) -> tuple | None:
        try:
            self.load(self.receiver.receive(meta, handle))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            if meta.checksum is None:  # answered with the checksum message that follows
                self._bucket_errors[meta.index] = error
                return None
            return ("ack", meta.index, meta.version, False, error)
        if meta.checksum is None:
            return None
        return ("ack", meta.index, meta.version, True, "")

    def _bucket_checksum(self, index: int, version: int, checksum: int) -> tuple:
        error = self._bucket_errors.pop(index, None)
        if error is None:
            try:
                self.receiver.confirm(index, version, checksum)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        return ("ack", index, version, error is None, error or "")

    def _end_sync(self, version: int, n_buckets: int) -> tuple:
        try:
            self.receiver.end(version, n_buckets)
            if self.check_complete is not None:
                self.check_complete(version)
        except Exception as e:
            return ("ack", "end_sync", version, False, f"{type(e).__name__}: {e}")
        self.weight_version = int(version)
        self.weights_valid = True
        return ("ack", "end_sync", version, True, "")

    def _abort_sync(self, version: int) -> tuple:
        self.receiver.version = None
        self.weights_valid, self.invalid_reason = False, f"weight sync v{version} failed"
        return ("ack", "abort_sync", version, True, "")
