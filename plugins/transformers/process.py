"""The transformers rollout engine in its own spawned process, fed weights through shared memory.

Colocated with the trainer, like :class:`~rlite.plugins.transformers.engine.TransformersEngine`, and with the
same interface, but isolated: a crash or hang of the engine cannot take the trainer down, and every
call has a timeout. The process is started with ``multiprocessing.get_context("spawn")`` and talks
over one pipe.

Weights (``update_weights``) go through the shared-bucket protocol of
:mod:`rlite.sync`: the first sync allocates the buckets in shared memory and sends
their handles; the engine then **replaces each parameter's storage by a view into the shared bucket**
(``param.data = view``), so from then on the engine samples straight from the buffers the trainer
writes. A later sync costs the trainer's ``copy_`` into the buckets plus a checksum on each side and
a few small messages; nothing is serialized or copied in the engine. (A parameter whose dtype or
device differs from the tensor sent is copied instead.) While a sync is in progress, or after one
failed, the engine refuses to generate until a sync completes.

Failures surface as :class:`~rlite.engines.base.EngineError` naming what happened: a process that
died (with its exit code), a call that timed out (the process is then killed), a version or checksum
mismatch, or the engine's own traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch

from rlite.api import (
    Completion,
    DraftSpec,
    EngineCapabilities,
    EngineDied,
    EngineError,
    SamplingParams,
    SharedBucketSender,
    SpeculationStats,
    SyncServer,
    SyncStats,
)
from rlite.plugins.transformers.engine import give_storage, is_tied_output_layer

_DIRECT_SEND_BYTES = 16 << 10
"""Messages up to this size fit in the pipe's buffer and are written directly; larger ones are written
from a helper thread, so a child that stopped reading cannot block the trainer past the timeout."""


class _PipeChannel:
    """The trainer's end of the pipe: every receive has a timeout and notices a dead process."""

    def __init__(self, conn: Connection, process: mp.process.BaseProcess) -> None:
        self.conn = conn
        self.process = process
        self.broken: str | None = None
        self.timeout_hint = 600.0
        """How long a large write may block (the engine's call timeout)."""

    def send(self, message: Any) -> None:
        self._check()
        data = bytes(ForkingPickler.dumps(message))
        try:
            if len(data) <= _DIRECT_SEND_BYTES:
                self.conn.send_bytes(data)
                return
            errors: list[BaseException] = []

            def write() -> None:
                try:
                    self.conn.send_bytes(data)
                except BaseException as e:  # noqa: BLE001 (re-raised below)
                    errors.append(e)

            writer = threading.Thread(target=write, daemon=True)
            writer.start()
            writer.join(self.timeout_hint)
            if writer.is_alive():
                self._fail(f"did not read a {len(data)}-byte message within {self.timeout_hint:g} s")
            if errors:
                raise errors[0]
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as e:
            self.process.join(timeout=5.0)
            self._fail(f"died ({self._exit_text()}) while being sent a message: {e!r}")

    def recv(self, timeout_s: float) -> Any:
        self._check()
        ready = wait([self.conn, self.process.sentinel], timeout=timeout_s)
        if self.conn in ready:
            try:
                return pickle.loads(self.conn.recv_bytes())
            except (EOFError, ConnectionResetError, OSError):
                pass  # fall through: the process closed its end
        if ready or not self.process.is_alive():
            self.process.join(timeout=5.0)
            self._fail(f"died ({self._exit_text()})")
        self._fail(f"did not answer within the timeout of {timeout_s:g} s (killed)")

    def _exit_text(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"exit code {code}, killed by signal {-code}"
        return f"exit code {code}"

    def _fail(self, what: str) -> None:
        self.broken = f"engine process {self.process.pid} {what}"
        _stop_process(self.process, self.conn, grace_s=0.0)
        raise EngineDied(self.broken)

    def _check(self) -> None:
        if self.broken is not None:
            raise EngineDied(f"engine process is gone: {self.broken}")


def _stop_process(process: mp.process.BaseProcess, conn: Connection, grace_s: float = 5.0) -> None:
    """Ask, then terminate, then kill; always returns with the process reaped and the pipe closed."""
    if process.is_alive() and grace_s > 0:

        def ask() -> None:  # from a thread: a hung child with a full pipe must not block us
            try:
                conn.send_bytes(ForkingPickler.dumps(("shutdown",)))
            except (OSError, EOFError, ValueError):
                pass

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        asker.join(1.0)
        process.join(grace_s)
    if process.is_alive():
        process.terminate()
        process.join(2.0)
    if process.is_alive():
        process.kill()
        process.join(5.0)
    try:
        conn.close()
    except OSError:
        pass


class ProcessEngine:
    """A :class:`~rlite.plugins.transformers.engine.TransformersEngine` in a spawned process (same interface)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        pad_token_id: int,
        eos_token_ids: Iterable[int],
        timeout_s: float = 600.0,
        true_on_policy: bool = False,
        dtype: torch.dtype = torch.float32,
        attn_implementation: str = "sdpa",
        gguf_file: str | None = None,
        bucket_bytes: int = 512 << 20,
        start_timeout_s: float | None = None,
        num_threads: int = 1,
        verify_checksums: bool = True,
        verify_threads: int | None = None,
        engine_factory: Callable[..., Any] | None = None,
        factory_kwargs: dict[str, Any] | None = None,
        draft: DraftSpec | None = None,
        weights_from_sync: bool = False,
        device: torch.device | str = "cpu",
        decode: str = "loop",
        auto_decode: bool = False,
    ) -> None:
        """Start the engine process and wait (``start_timeout_s``, default ``timeout_s``) until it is ready.

        ``bucket_bytes`` sizes the shared buckets (``RolloutConfig.bucket_bytes``: ``rollout.sync_bucket_mb``).
        All of them stay allocated (the engine's weights live in them), so the size does not change memory;
        each bucket costs a message and an ack (about 0.5 ms on a loaded 2-core machine), so the default
        512 MB keeps the handoff flat in model size
        (``benchmarks/RESULTS.md``), while smaller buckets hold fewer tensors during the first sync.
        ``engine_factory(**factory_kwargs)`` replaces the transformers engine built from ``model_dir``
        in the child (for tests and benchmarks); it must be a module-level function and return an object
        with ``model`` (an ``nn.Module``), ``weight_version`` and the engine methods.
        ``verify_threads`` (default: ``num_threads``) is how many threads the engine uses for the
        checksum of each bucket; it sums a bucket while the trainer sums the same bytes on its own
        core, so the verification adds nothing to a sync on a machine with a core free for it.
        ``draft``: decode speculatively; a trained draft's weights travel in the same buckets as the
        policy's (after them, under ``draft.`` names), version and checksums included.
        ``weights_from_sync``: the child builds the model from its config without reading the weights
        (``skeleton_causal_lm``); the first sync, which must come before any generate, gives them.
        ``device``: where the engine samples. On a GPU the buckets are allocated in that GPU's memory and
        the child gets CUDA-IPC handles to them (its parameters become views of the buckets: the trainer's
        copy into a bucket is the whole sync); the weights travel in ``dtype``. ``decode``/``auto_decode``:
        the transformers engine's (:class:`~rlite.plugins.transformers.engine.TransformersEngine`).
        """
        device = torch.device(device)
        if engine_factory is None:
            engine_factory = build_transformers_engine
            factory_kwargs = dict(
                model_dir=str(model_dir),
                pad_token_id=int(pad_token_id),
                eos_token_ids=[int(t) for t in eos_token_ids],
                true_on_policy=true_on_policy,
                dtype=dtype,
                attn_implementation=attn_implementation,
                gguf_file=gguf_file,
                draft=draft,
                weights_from_sync=weights_from_sync,
                device=str(device),
                decode=decode,
                auto_decode=auto_decode,
            )
        self.timeout_s = float(timeout_s)
        self.weight_version = 0
        # weights arrive in shared buckets, copied by no one, in the engine's dtype; on a GPU the child's caching
        # allocator takes back what the trainer's gave up, so the trainer returns its cached blocks first
        self.capabilities = EngineCapabilities(
            routed_experts=True, draft_methods=("model", "ngram"), reacquires_device_memory=device.type == "cuda",
            weight_dtype=dtype if engine_factory is build_transformers_engine else None,  # another factory's: unknown
        )
        self.last_sync: SyncStats | None = None
        ctx = mp.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(
            target=_serve,
            args=(
                child_conn,
                engine_factory,
                factory_kwargs or {},
                num_threads,
                verify_checksums,
                verify_threads,
                str(device),
            ),
            name="rlite-engine",
            daemon=True,
        )
        self._process.start()
        child_conn.close()
        self._finalizer = weakref.finalize(self, _stop_process, self._process, parent_conn)
        self._channel = _PipeChannel(parent_conn, self._process)
        # buckets where the engine samples: CPU shared memory, or the GPU's memory behind CUDA-IPC handles
        self._sender = SharedBucketSender(
            self._channel, bucket_bytes=int(bucket_bytes), device=device, timeout_s=self.timeout_s
        )
        try:
            status, detail = self._channel.recv(
                start_timeout_s if start_timeout_s is not None else self.timeout_s
            )
        except EngineDied as e:  # killed (out of memory, a signal) or hung: a fresh process may well start
            self.shutdown()
            raise EngineDied(f"engine process died while starting: {e}") from None
        except EngineError as e:
            raise EngineError(f"engine process failed to start: {e}") from None
        if status != "ready":
            self.shutdown()
            raise EngineError(f"engine process failed to start:\n{detail}")

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # -- the engine interface -----------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self._call("generate", prompts, asdict(params))

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None, version: int
    ) -> SyncStats:
        """Hand ``(name, tensor)`` pairs over through the shared buckets and switch to ``version``."""
        self._sender.timeout_s = self._channel.timeout_hint = self.timeout_s
        self.weight_version = -1  # until the engine confirms the new version (stays -1 if the sync fails)
        self.last_sync = self._sender.sync(named_tensors or (), version)
        self.weight_version = int(version)
        return self.last_sync

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Copies of the engine's parameters (for checks; costs a copy of the model)."""
        return self._call("named_weights")

    def speculation_stats(self) -> SpeculationStats:
        """What the draft did in the last ``generate``."""
        return self._call("speculation_stats")

    def release_memory(self) -> None:
        self._call("release_memory")

    def resume_memory(self) -> None:
        self._call("resume_memory")

    def shutdown(self) -> None:
        """Stop the process (ask, terminate, kill) and release the shared buckets; idempotent."""
        self._finalizer()
        self._channel.broken = self._channel.broken or "shut down"
        self._sender.reset()

    # -- plumbing -----------------------------------------------------------------------------
    def _call(self, op: str, *args: Any) -> Any:
        self._channel.timeout_hint = self.timeout_s
        try:
            self._channel.send((op, *args))
            reply = self._channel.recv(self.timeout_s)
        except EngineError as e:  # EngineDied stays EngineDied: the process can be replaced
            raise type(e)(f"{op}: {e}") from None
        status, value = reply
        if status == "error":
            raise EngineError(f"engine process failed in {op}:\n{value}")
        return value


# --------------------------------------------------------------------------------------------------
# the child process
# --------------------------------------------------------------------------------------------------


def build_transformers_engine(
    *,
    model_dir: str,
    pad_token_id: int,
    eos_token_ids: list[int],
    true_on_policy: bool,
    dtype: torch.dtype,
    attn_implementation: str,
    gguf_file: str | None,
    draft: DraftSpec | None = None,
    weights_from_sync: bool = False,
    device: str = "cpu",
    decode: str = "loop",
    auto_decode: bool = False,
):
    """The engine the child runs by default: a TransformersEngine on the model folder, on ``device``
    (with ``weights_from_sync``, built from its config only: the first sync gives the weights)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from rlite.plugins.transformers.engine import TransformersEngine, load_draft_model

    hf_logging.disable_progress_bar()

    kwargs: dict[str, Any] = dict(dtype=dtype, attn_implementation=attn_implementation)
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    if weights_from_sync:
        from rlite.api import skeleton_causal_lm

        dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        model = skeleton_causal_lm(model_dir, dtype_name, attn_implementation, gguf_file, device=device)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).to(device)
    return TransformersEngine(
        model, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids, true_on_policy=true_on_policy,
        draft=draft, draft_model=load_draft_model(draft, attn_implementation, weights_from_sync, torch.device(device)),
        decode=decode, auto_decode=auto_decode,
    )


class _ViewLoader:
    """Points the model's parameters at the bucket views (or copies where dtype/device differ)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        synced = getattr(engine, "synced_parameters", None)  # a trained draft's too, under draft. names
        self.params = synced() if synced is not None else dict(engine.model.named_parameters())
        self.seen: set[str] = set()

    @torch.no_grad()
    def load(self, views: list[tuple[str, torch.Tensor]]) -> None:
        for name, view in views:
            param = self.params.get(name)
            if param is None:
                if is_tied_output_layer(name):  # tied to the embedding: named_parameters() lists it once
                    continue
                raise EngineError(f"engine model has no parameter named {name!r}")
            if param.shape != view.shape:
                raise EngineError(
                    f"{name} has shape {tuple(view.shape)}, engine expects {tuple(param.shape)}"
                )
            if param.is_meta:  # built without weights (skeleton_causal_lm): the first sync gives the storage
                models = [self.engine.model, getattr(self.engine, "draft_model", None)]
                bind = view if param.dtype == view.dtype else None  # the bucket's view itself: no copy at all
                param = self.params[name] = give_storage(models, param, view.device, storage=bind)
            if param.dtype == view.dtype and param.device == view.device:
                if param.data_ptr() != view.data_ptr():
                    param.data = view  # zero-copy from now on: the trainer writes, we read
            else:
                param.copy_(view)
            self.seen.add(name)

    def check_complete(self, version: int) -> None:
        missing = sorted(set(self.params) - self.seen)
        self.seen = set()
        if missing:
            raise EngineError(
                f"weight sync v{version} left {len(missing)} engine parameters stale, e.g. {missing[:3]}"
            )


class _EngineServer:
    """Answers the trainer's messages inside the engine process (the sync protocol through
    :class:`~rlite.sync.SyncServer`, the same one an engine of your own uses)."""

    def __init__(self, engine: Any, verify_checksums: bool, verify_threads: int | None = None) -> None:
        self.engine = engine
        self.loader = _ViewLoader(engine)
        self.sync = SyncServer(self.loader.load, check_complete=self._check_complete,
                               verify_checksums=verify_checksums, verify_threads=verify_threads)
        self.sync.weights_valid = True  # the engine starts with the checkpoint's weights

    def handle(self, message: tuple) -> tuple | None:
        """Answer one message: a sync-protocol message (its own acknowledgement, or None when a later
        message answers for it), or an engine call (``("ok", value)`` / ``("error", traceback)``)."""
        if self.sync.handles(message):
            if message[0] == "begin_sync":
                self.loader.seen = set()
            return self.sync.handle(message)
        op, *args = message
        if op == "_debug_hang":
            return self._debug_hang(*args)
        calls = {
            "generate": self._generate,
            "named_weights": self._named_weights,
            "speculation_stats": lambda: self.engine.speculation_stats(),
            "shared_weights": self._shared_weights,
            "release_memory": self._release_memory,
            "resume_memory": self.engine.resume_memory,
            "ping": os.getpid,
        }
        try:
            if op not in calls:
                raise EngineError(f"unknown engine operation {op!r}")
            return ("ok", calls[op](*args))
        except Exception:
            return ("error", traceback.format_exc())

    def _release_memory(self) -> None:
        """The engine's own release, then this process's cached GPU blocks back to the driver: the trainer
        beside it allocates from the driver, not from this process's cache."""
        self.engine.release_memory()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _check_complete(self, version: int) -> None:
        self.loader.check_complete(version)
        self.engine.weight_version = int(version)

    def _debug_hang(self, seconds) -> None:  # test hook: stop answering
        time.sleep(float(seconds))
        return None

    # -- engine calls ---------------------------------------------------------------------------
    def _generate(self, prompts, params) -> list[Completion]:
        if not self.sync.weights_valid:
            raise EngineError(f"refusing to generate with incomplete weights: {self.sync.invalid_reason}; sync again")
        return self.engine.generate(prompts, SamplingParams(**params))

    def _named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p.detach().clone()) for name, p in self.loader.params.items()]

    def _shared_weights(self) -> list[str]:  # which parameters live in shared memory (zero-copy check)
        return [n for n, p in self.engine.model.named_parameters() if p.untyped_storage().is_shared()]


def _serve(
    conn: Connection,
    engine_factory: Callable[..., Any],
    factory_kwargs: dict[str, Any],
    num_threads: int,
    verify_checksums: bool,
    verify_threads: int | None,
    device: str = "cpu",
) -> None:
    """Entry point of the engine process: build the engine, then answer messages until told to stop."""
    torch.set_num_threads(num_threads)
    try:
        if torch.device(device).type == "cuda":  # the GPU of the trainer rank that started it
            torch.cuda.set_device(torch.device(device))
        server = _EngineServer(engine_factory(**factory_kwargs), verify_checksums, verify_threads)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the trainer is gone
        if message[0] == "shutdown":
            return
        try:
            reply = server.handle(message)
        except Exception:
            reply = ("error", traceback.format_exc())
        if reply is not None:
            conn.send(reply)
