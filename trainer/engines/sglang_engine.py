"""SGLang rollout engine (GPU), colocated with the trainer, fed weights as flattened CUDA-IPC buckets.

Written against SGLang 0.5.23 (``shared/notes/sglang-megatron.md`` and its source). SGLang is never
imported at module level: everything here that runs without it (the payload, the call sequence, the
conversion of outputs) is a pure function, tested on CPU against a fake engine that enforces SGLang's
rules and against SGLang's own deserializer.

One colocated step, as :class:`SGLangEngine` drives it::

    release_memory()  -> release_memory_occupation()              # all tags, before training
    update_weights()  -> resume_memory_occupation(["weights"])
                         begin_weight_update()
                         update_weights_from_tensor(payloads, load_format="flattened_bucket",
                                                    flush_cache=False)      # once per bucket
                         end_weight_update()                                 # also on failure
                         update_weight_version(str(version))
    resume_memory()   -> resume_memory_occupation(["kv_cache", "cuda_graph"]); flush_cache()

A payload is, per tensor-parallel rank, ``MultiprocessingSerializer.serialize({"flattened_tensor":
uint8 buffer, "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)]})``
(``numel`` and the indices count bytes). The buffer is rlite's :func:`pack_bucket` layout, each tensor
at a 64-byte-aligned offset, so every ``view(dtype)`` on the receiving side is aligned. A CUDA buffer
pickles to a CUDA-IPC handle (no copy). A fresh buffer is made for every bucket and dropped after
SGLang has loaded it: SGLang does not synchronize the device before answering, so reusing a buffer
could race its copy; torch's IPC reference counting keeps a dropped buffer alive until SGLang lets go.

Two launch modes: ``"engine"`` (``sglang.Engine`` in this process, driven from one worker thread so
every call can time out) and ``"server"`` (``python -m sglang.launch_server`` on 127.0.0.1, spoken to
over HTTP, with a health check and a start timeout). Fallbacks that move no IPC handles:
:meth:`SGLangEngine.update_weights_from_disk` and :meth:`SGLangEngine.update_weights_from_distributed`
(NCCL broadcast).

Adapter-only LoRA sync (:meth:`SGLangEngine.update_lora_adapter`) works in both modes: the adapter goes
through ``load_lora_adapter_from_tensors`` under a versioned name, and every request names it
(``lora_path``); the HTTP contract is written out at :meth:`_ServerBackend.load_lora_adapter_from_tensors`.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch

from rlite.engines.base import Completion, EngineError, SamplingParams
from rlite.engines.weight_sync import iter_buckets, pack_bucket

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


def completion_from_output(output: dict[str, Any], *, prompt_index: int, weight_version: int) -> Completion:
    """An SGLang output dict (``return_logprob=True``) as a :class:`Completion`.

    Tokens and log-probs come from ``meta_info["output_token_logprobs"]`` (``(logprob, token_id, text)``
    per sampled token), which SGLang computes from the temperature-scaled logits, the trainer's formula.
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
    return Completion(
        prompt_index=prompt_index,
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=kind,
        weight_version=weight_version,
    )


def _check(result: Any, what: str) -> Any:
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
) -> int:
    """The SGLang weight-update call sequence; returns the number of buckets sent.

    ``engine`` has SGLang ``Engine``'s method names plus ``update_weight_version``; buckets are packed
    on ``device`` (the GPU, so that they travel as CUDA-IPC handles).
    """
    _check(engine.begin_weight_update(), "begin_weight_update")
    buckets = 0
    try:
        for bucket in iter_buckets(named_tensors, bucket_bytes):
            payloads = build_update_payloads(
                bucket, tp_size=tp_size, metadata_cls=metadata_cls, output_str=output_str, device=device
            )
            del bucket
            _check(
                engine.update_weights_from_tensor(payloads, load_format=FLATTENED_BUCKET, flush_cache=False),
                f"update_weights_from_tensor (bucket {buckets})",
            )
            del payloads  # a fresh buffer per bucket; IPC refcounts free this one once SGLang is done
            buckets += 1
    finally:
        ended = engine.end_weight_update()
    _check(ended, "end_weight_update")
    _check(engine.update_weight_version(str(int(version))), "update_weight_version")
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
    return buckets


# --------------------------------------------------------------------------------------------------
# backends: SGLang in this process, or an HTTP server
# --------------------------------------------------------------------------------------------------


class _InProcessBackend:
    """``sglang.Engine`` driven from one worker thread, so every call can time out."""

    output_str = False

    def __init__(self, engine_kwargs: dict[str, Any], *, start_timeout_s: float, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlite-sglang")
        self.engine = None
        self._children_before = set(_child_pids())
        self._engine_pids: set[int] | None = None  # the processes SGLang started (known once it is up)
        self.engine = self._run(self._start, engine_kwargs, timeout_s=start_timeout_s, what="Engine start")
        self._engine_pids = (set(_child_pids()) - self._children_before) | set(
            self.engine.get_all_child_pids()
        )

    @staticmethod
    def _start(engine_kwargs: dict[str, Any]):
        import sglang

        return sglang.Engine(**engine_kwargs)

    def _run(self, fn, *args, timeout_s: float | None = None, what: str = "", **kwargs):
        future = self._pool.submit(fn, *args, **kwargs)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            self.kill()
            raise EngineError(
                f"SGLang {what or fn.__name__} did not return within {timeout:g} s (engine killed)"
            ) from None

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "engine":
            raise AttributeError(name)
        method = getattr(self.engine, name)
        return lambda *args, **kwargs: self._run(method, *args, what=name, **kwargs)

    def update_weight_version(self, version: str):
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        engine = self.engine
        request = UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False)
        return self._run(
            lambda: engine.loop.run_until_complete(engine.tokenizer_manager.update_weight_version(request)),
            what="update_weight_version",
        )

    def kill(self) -> None:
        """SIGKILL the engine's processes (its own shutdown may hang when the engine does)."""
        pids = self._engine_pids
        if pids is None:  # still starting: whatever appeared since the start is SGLang's
            pids = set(_child_pids()) - self._children_before
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.engine = None

    def shutdown(self) -> None:
        if self.engine is not None:
            try:
                self._run(self.engine.shutdown, what="shutdown", timeout_s=60.0)
            except EngineError:
                pass
            self.engine = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def _child_pids() -> list[int]:
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return []
    return [p.pid for p in psutil.Process().children(recursive=True)]


def server_command(server_args: dict[str, Any], *, port: int) -> list[str]:
    """The ``sglang.launch_server`` command line for ``server_args`` (``ServerArgs`` field names).

    ``True`` is a bare flag; ``False`` and ``None`` are left out (SGLang's default); a list, tuple or set
    is one flag followed by its items (SGLang's ``nargs`` options, e.g. ``--lora-target-modules q_proj
    v_proj``); a dict is passed as JSON; anything else as ``str``.
    """
    cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port)]
    for key, value in server_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple, set, frozenset)):
            cmd += [flag, *map(str, sorted(value) if isinstance(value, (set, frozenset)) else value)]
        elif isinstance(value, dict):
            cmd += [flag, json.dumps(value)]
        else:
            cmd += [flag, str(value)]
    return cmd


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ServerBackend:
    """``python -m sglang.launch_server`` on 127.0.0.1, spoken to over HTTP."""

    output_str = True
    process: subprocess.Popen | None
    log_path: Path | None

    def __init__(self, server_args: dict[str, Any], *, start_timeout_s: float, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        server_args = dict(server_args)
        self.port = int(server_args.pop("port", None) or _free_port())
        self.url = f"http://127.0.0.1:{self.port}"
        self.tp_size = int(server_args.get("tp_size") or 1)
        """One serialized copy of a LoRA adapter per tensor-parallel rank (each rank reads its own)."""
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
        fd, log_name = tempfile.mkstemp(prefix="rlite-sglang-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log_name)
        cmd = server_command(server_args, port=self.port)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.process.poll() is not None:
                message = f"SGLang server exited with code {self.process.returncode}:\n{self._log_tail()}"
                self.shutdown()
                raise EngineError(message)
            try:
                with self._opener.open(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                message = f"SGLang server not healthy within {start_timeout_s:g} s:\n{self._log_tail()}"
                self.shutdown()
                raise EngineError(message)
            time.sleep(1.0)

    @classmethod
    def connect(cls, url: str, *, timeout_s: float, tp_size: int = 1) -> _ServerBackend:
        """A backend for a server already running at ``url``: this object neither started it nor stops it."""
        self = cls.__new__(cls)
        self.timeout_s = timeout_s
        self.url = url.rstrip("/")
        self.port = urllib.parse.urlsplit(self.url).port
        self.tp_size = int(tp_size)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.process = None
        self.log_path = None
        return self

    def _log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path is not None else ""

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as e:
            raise EngineError(
                f"SGLang {path} answered {e.code}: {e.read().decode(errors='replace')[:2000]}"
            ) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            if self.process is None:
                state = f"server at {self.url}"
            elif self.process.poll() is None:
                state = "server still running"
            else:
                state = f"server exited with code {self.process.returncode}"
            raise EngineError(f"SGLang {path} failed ({state}): {e}") from None
        return json.loads(text) if text.strip().startswith(("{", "[")) else text

    def generate(self, *, input_ids, sampling_params, return_logprob, lora_path=None):
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        if lora_path is not None:  # adapter names, one per request (GenerateReqInput.lora_path)
            body["lora_path"] = lora_path
        return self._post("/generate", body)

    def release_memory_occupation(self, tags=None):
        return self._post("/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags=None):
        return self._post("/resume_memory_occupation", {"tags": tags})

    def begin_weight_update(self):
        return self._post("/begin_weight_update", {})

    def end_weight_update(self):
        return self._post("/end_weight_update", {})

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        body = {
            "serialized_named_tensors": named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        return self._post("/update_weights_from_tensor", body)

    def update_weight_version(self, version: str):
        return self._post("/update_weight_version", {"new_version": version, "abort_all_requests": False})

    def flush_cache(self):
        return self._post("/flush_cache")

    def update_weights_from_disk(self, model_path, load_format=None):
        return self._post("/update_weights_from_disk", {"model_path": model_path, "load_format": load_format})

    def init_weights_update_group(self, **kwargs):
        return self._post("/init_weights_update_group", kwargs)

    def update_weights_from_distributed(self, **kwargs):
        return self._post("/update_weights_from_distributed", kwargs)

    # LoRA adapters over HTTP. Contract read from the installed sglang 0.5.23 wheel:
    #  - entrypoints/http_server.py: POST /load_lora_adapter_from_tensors and /unload_lora_adapter
    #    validate the JSON body as io_struct.LoadLoRAAdapterFromTensorsReqInput /
    #    UnloadLoRAAdapterReqInput (unknown keys are ignored, not refused) and answer
    #    io_struct.LoRAUpdateOutput {"success", "error_message", "loaded_adapters", ...}, with HTTP 400
    #    when success is false (so _post raises, naming the endpoint).
    #  - LoadLoRAAdapterFromTensorsReqInput: lora_name: str, config_dict: dict (peft adapter config),
    #    serialized_named_tensors: List[bytes] given as base64 strings (msgspec_utils.Base64Bytes),
    #    ONE entry PER TP RANK (tp_worker.deserialize_own_rank reads [tp_rank]); optional pinned=False,
    #    added_tokens_config=None, load_format=None, expected_checksums=None, lora_id (set by SGLang).
    #  - With load_format None each entry is MultiprocessingSerializer.serialize({name: tensor})
    #    (tp_worker.load_lora_adapter_from_tensors uses the deserialized dict as is), as
    #    Engine._serialize_tensors_per_rank does it: one serialize call per rank.
    #  - UnloadLoRAAdapterReqInput: lora_name: str (lora_id is set by SGLang).
    def load_lora_adapter_from_tensors(
        self, *, lora_name: str, tensors: dict[str, torch.Tensor], config_dict: dict[str, Any]
    ):
        body = {
            "lora_name": lora_name,
            "config_dict": config_dict,
            "serialized_named_tensors": [
                serialize_payload(tensors, output_str=True) for _ in range(self.tp_size)
            ],
            "load_format": None,
            "pinned": False,
        }
        return self._post("/load_lora_adapter_from_tensors", body)

    def unload_lora_adapter(self, *, lora_name: str):
        return self._post("/unload_lora_adapter", {"lora_name": lora_name})

    def kill(self) -> None:
        """SIGKILL the server's whole session (its schedulers too, even if the server itself exited)."""
        if self.process is None:  # connected to a server started elsewhere
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait(timeout=30)

    def shutdown(self) -> None:
        if self.process is None:  # connected to a server started elsewhere: not ours to stop
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self.log_path.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------------------


class SGLangEngine:
    """A colocated SGLang engine with rlite's :class:`~rlite.engines.base.RolloutEngine` interface."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        eos_token_ids: Iterable[int] = (),
        pad_token_id: int | None = None,
        timeout_s: float = 600.0,
        start_timeout_s: float | None = None,
        true_on_policy: bool = False,
        bucket_mb: int = 512,
        tp_size: int = 1,
        launch: str = "engine",
        load_format: str = "dummy",
        mem_fraction_static: float | None = None,
        dtype: str = "auto",
        engine_kwargs: dict[str, Any] | None = None,
        backend: Any = None,
    ) -> None:
        """Start SGLang on ``model_path`` (``launch="engine"`` or ``"server"``) with random weights.

        ``load_format="dummy"`` (the default) starts from random weights: the first
        :meth:`update_weights` brings the trainer's. ``true_on_policy`` turns on SGLang's deterministic
        inference and its FSDP on-policy target. ``engine_kwargs`` go to SGLang's ``ServerArgs``
        unchanged. ``backend`` replaces SGLang altogether (tests).
        """
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})
        self.pad_token_id = pad_token_id
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = int(bucket_mb) << 20
        self.tp_size = int(tp_size)
        self.true_on_policy = true_on_policy
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        """Where buckets are packed: CPU-offloaded trainer weights go to the GPU before the handoff."""
        self.weight_version = 0
        self.lora_name: str | None = None
        """The adapter every request names (adapter-only LoRA sync), or None."""
        self._released: list[str] = []
        self._weights_backup = bool((engine_kwargs or {}).get("enable_weights_cpu_backup", False))
        self._weights_lost = False
        """Weights were released without a CPU backup and no sync has rewritten them yet."""
        if backend is None:
            kwargs: dict[str, Any] = dict(
                model_path=str(model_path),
                skip_tokenizer_init=True,
                enable_memory_saver=True,
                load_format=load_format,
                tp_size=self.tp_size,
                dtype=dtype,
            )
            if mem_fraction_static is not None:
                kwargs["mem_fraction_static"] = mem_fraction_static
            if true_on_policy:
                kwargs.update(enable_deterministic_inference=True, rl_on_policy_target="fsdp")
            kwargs.update(engine_kwargs or {})
            start = start_timeout_s if start_timeout_s is not None else self.timeout_s
            if launch == "engine":
                backend = _InProcessBackend(kwargs, start_timeout_s=start, timeout_s=self.timeout_s)
            elif launch == "server":
                backend = _ServerBackend(kwargs, start_timeout_s=start, timeout_s=self.timeout_s)
            else:
                raise ValueError(f"launch must be 'engine' or 'server', got {launch!r}")
        self.backend = backend

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if not prompts:
            return []
        if self._released:
            self.resume_memory()
        if self._weights_lost:
            raise EngineError(
                "SGLang's weights were released (no CPU backup) and not synced since; call update_weights"
            )
        expanded = [list(map(int, p)) for p in prompts for _ in range(params.n)]  # groups stay contiguous
        seeds = None
        if self.true_on_policy:  # SGLang uses per-request seeds only with deterministic inference
            base = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
            seeds = [base + i for i in range(len(expanded))]
        sampling = sampling_params_for(
            params, stop_token_ids=set(self.eos_token_ids) | set(params.stop_token_ids), seeds=seeds
        )
        if seeds is None:
            sampling = sampling * len(expanded)
        adapter = {"lora_path": [self.lora_name] * len(expanded)} if self.lora_name is not None else {}
        outputs = self.backend.generate(
            input_ids=expanded, sampling_params=sampling, return_logprob=True, **adapter
        )
        if isinstance(outputs, dict):
            outputs = [outputs]
        if len(outputs) != len(expanded):
            raise EngineError(f"SGLang returned {len(outputs)} outputs for {len(expanded)} requests")
        completions = []
        for row, output in enumerate(outputs):
            served = output.get("meta_info", {}).get("weight_version")
            if served is not None and str(served) not in (str(self.weight_version), "default"):
                raise EngineError(
                    f"SGLang sampled with weight version {served!r}, expected {self.weight_version}"
                )
            completions.append(
                completion_from_output(
                    output, prompt_index=row // params.n, weight_version=self.weight_version
                )
            )
        return completions

    # -- weights ------------------------------------------------------------------------------
    takes_lora_adapters = True
    """This engine can serve a LoRA adapter on top of its base weights (``update_lora_adapter``)."""

    def update_lora_adapter(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any], version: int
    ) -> None:
        """Adapter-only sync: load the new adapter under a versioned name, then drop the old one.

        The engine must have been started with its real base weights and ``enable_lora`` (the
        ``sglang`` engine plugin does this when ``rollout.lora_sync: adapter``). Generation then
        names the adapter in every request, so a sample can never come from a stale adapter.
        """
        self._resume(WEIGHT_TAGS)
        name = f"rlite_v{int(version)}"
        tensors = {key: tensor.contiguous() for key, tensor in named_tensors}
        _check(
            self.backend.load_lora_adapter_from_tensors(lora_name=name, tensors=tensors, config_dict=config),
            "load_lora_adapter_from_tensors",
        )
        previous, self.lora_name = self.lora_name, name
        if previous is not None:
            _check(self.backend.unload_lora_adapter(lora_name=previous), "unload_lora_adapter")
        _check(self.backend.update_weight_version(str(int(version))), "update_weight_version")
        self.weight_version = int(version)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None, version: int) -> None:
        """Flattened CUDA-IPC buckets through ``update_weights_from_tensor``, then switch to ``version``."""
        self._resume(WEIGHT_TAGS)
        sync_weights(
            self.backend,
            named_tensors or (),
            version,
            bucket_bytes=self.bucket_bytes,
            tp_size=self.tp_size,
            metadata_cls=getattr(self.backend, "metadata_cls", None) or sglang_metadata_cls(),
            output_str=self.backend.output_str,
            device=self.device,
        )
        self._weights_lost = False
        self.weight_version = int(version)

    def update_weights_from_disk(self, model_path: str | Path, version: int) -> None:
        """Fallback: SGLang reloads a saved Hugging Face checkpoint (no begin/end session needed)."""
        self._resume(WEIGHT_TAGS)
        _check(self.backend.update_weights_from_disk(model_path=str(model_path)), "update_weights_from_disk")
        self._weights_lost = False
        _check(self.backend.update_weight_version(str(int(version))), "update_weight_version")
        self.weight_version = int(version)

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str
    ) -> None:
        """Join SGLang to a NCCL group in which the trainer's rank 0 broadcasts (non-colocated fallback)."""
        _check(
            self.backend.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend="nccl",
            ),
            "init_weights_update_group",
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int,
        *,
        group_name: str = "weight_update_group",
        load_format: str | None = None,
    ) -> None:
        """Fallback: SGLang receives the tensors by NCCL broadcast from the trainer's rank 0.

        Blocks until the broadcasts are done, so call it from a thread while rank 0 broadcasts each
        tensor in order in the group of :meth:`init_weights_update_group` (or, with
        ``load_format="flattened_bucket"``, one buffer packed without gaps, as SGLang's
        ``FlattenedTensorBucket.empty`` lays it out).
        """
        self._resume(WEIGHT_TAGS)
        _check(self.backend.begin_weight_update(), "begin_weight_update")
        try:
            result = self.backend.update_weights_from_distributed(
                names=names,
                dtypes=dtypes,
                shapes=shapes,
                group_name=group_name,
                flush_cache=False,
                load_format=load_format,
            )
        finally:
            ended = self.backend.end_weight_update()
        _check(result, "update_weights_from_distributed")
        _check(ended, "end_weight_update")
        self._weights_lost = False
        _check(self.backend.update_weight_version(str(int(version))), "update_weight_version")
        self.weight_version = int(version)

    # -- memory -------------------------------------------------------------------------------
    def release_memory(self) -> None:
        """Free weights, KV cache and CUDA graphs (the engine must be idle)."""
        if self._released:
            return
        _check(self.backend.release_memory_occupation(), "release_memory_occupation")
        self._released = WEIGHT_TAGS + REST_TAGS

    def resume_memory(self) -> None:
        """Re-acquire what :meth:`release_memory` freed (weights too, if no sync resumed them) and flush."""
        self._resume(WEIGHT_TAGS)
        self._resume(REST_TAGS)
        _check(self.backend.flush_cache(), "flush_cache")

    def _resume(self, tags: list[str]) -> None:
        todo = [t for t in tags if t in self._released]
        if "weights" in todo and not self._weights_backup:
            self._weights_lost = True  # resumed memory, old contents gone until a sync writes them
        if todo:
            _check(self.backend.resume_memory_occupation(tags=todo), f"resume_memory_occupation({todo})")
            self._released = [t for t in self._released if t not in todo]

    def shutdown(self) -> None:
        backend, self.backend = self.backend, None
        if backend is not None:
            backend.shutdown()
