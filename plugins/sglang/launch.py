"""Launching SGLang: in this process (a worker thread) or as an HTTP server subprocess."""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import torch

from rlite.api import ConfigError, EngineDied, EngineError
from rlite.plugins.sglang.payloads import serialize_payload

# --------------------------------------------------------------------------------------------------
# backends: SGLang in this process, or an HTTP server
# --------------------------------------------------------------------------------------------------


class InProcessBackend:
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
            raise EngineDied(  # killed: a fresh engine can take over (rollout.engine_restarts)
                f"SGLang {what or fn.__name__} did not return within {timeout:g} s (engine killed)"
            ) from None
        except Exception as exc:
            gone = self._engine_pids is not None and self._engine_pids and not any(map(_alive, self._engine_pids))
            if gone:  # the scheduler/detokenizer processes died: the call can only fail from now on
                self.kill()
                raise EngineDied(f"SGLang {what or fn.__name__} failed and its processes have exited: "
                                 f"{type(exc).__name__}: {exc}") from exc
            raise

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "engine":
            raise AttributeError(name)
        method = getattr(self.engine, name)
        return lambda *args, **kwargs: self._run(method, *args, what=name, **kwargs)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True, selector=None):
        """``Engine.update_weights_from_tensor``; with a ``selector`` (which ``Engine`` does not expose) the
        request goes to the tokenizer manager as ``UpdateWeightsFromTensorReqInput``, as the Engine would
        send it. ``named_tensors`` are the per-rank serialized payloads (``load_format="flattened_bucket"``)."""
        engine = self.engine
        if selector is None:
            return self._run(engine.update_weights_from_tensor, named_tensors, load_format=load_format,
                             flush_cache=flush_cache, what="update_weights_from_tensor")
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=list(named_tensors), load_format=load_format, flush_cache=flush_cache,
            selector=selector,
        )
        return self._run(
            lambda: engine.loop.run_until_complete(engine.tokenizer_manager.update_weights_from_tensor(request, None)),
            what="update_weights_from_tensor",
        )

    def update_weight_version(self, version: str):
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        engine = self.engine
        request = UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False)
        return self._run(
            lambda: engine.loop.run_until_complete(engine.tokenizer_manager.update_weight_version(request)),
            what="update_weight_version",
        )

    def check_weights(self, action: str = "checksum"):
        """SGLang's weight checker (not an ``Engine`` method in 0.5.23: its tokenizer manager's); answers
        ``(success, message, ranks, per_engine_checksum)``."""
        from sglang.srt.managers.io_struct import CheckWeightsReqInput

        engine = self.engine
        request = CheckWeightsReqInput(action=action)
        return self._run(
            lambda: engine.loop.run_until_complete(engine.tokenizer_manager.check_weights(request, None)),
            what="check_weights",
        )

    @property
    def tensor_hash(self):
        return sglang_tensor_hash()

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


def sglang_tensor_hash():
    """SGLang's ``tensor_hash`` (``srt/managers/mm_utils.py``): a Triton hash of a CUDA tensor's bytes,
    the one its weight checker uses, so the trainer hashes what it sent exactly as SGLang hashes what
    it holds."""
    from sglang.srt.managers.mm_utils import tensor_hash

    return tensor_hash


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


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


def write_auth_config(api_key: str, settings: dict[str, Any] | None = None) -> Path:
    """A YAML file only this user can read, holding ``api_key`` (and ``settings``, the user's own ``--config``
    file's) for SGLang's ``--config``, so the key never shows in the server's command line (``ps`` shows that
    to every user of the node). The key is spelled as the flag, ``api-key``: SGLang 0.5.23 turns each key
    ``k`` into ``--k`` verbatim, and ``--api_key`` is not a flag it knows."""
    fd, name = tempfile.mkstemp(prefix="rlite-sglang-auth-", suffix=".yaml")  # created 0600
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps({**(settings or {}), "api-key": api_key}) + "\n")  # JSON is YAML
    return Path(name)


def read_user_config(path: str) -> dict[str, Any]:
    """The user's SGLang ``--config`` file (``rollout.engine.args.config``): a YAML mapping of server flags."""
    import yaml

    try:
        with open(path) as handle:
            settings = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"rollout.engine.args.config: cannot read {path} as YAML ({exc})") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"rollout.engine.args.config: {path} must hold a mapping of SGLang server flags "
                          f"(as sglang.launch_server --config reads it), got {type(settings).__name__}")
    return settings


class ServerBackend:
    """``python -m sglang.launch_server`` on 127.0.0.1, spoken to over HTTP.

    Anyone on the node can reach 127.0.0.1, and a weight update is a pickle the server unpickles, so the
    server is started with a fresh random API key (``--api-key``, read from a 0600 ``--config`` file that is
    removed once the server is up) and every request carries it (``Authorization: Bearer``, what SGLang's
    middleware checks; ``/health`` is open). A key given in the server args is used instead."""

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
        # SGLang reads one --config file: a user's own is merged into rlite's 0600 one with the key, which
        # never goes on the command line; a key the user's file holds is the one used
        settings = read_user_config(str(server_args.pop("config"))) if "config" in server_args else {}
        given = settings.pop("api-key", None) or settings.pop("api_key", None)
        self.api_key: str | None = server_args.pop("api_key", None) or given or secrets.token_urlsafe(32)
        self._auth_config: Path | None = write_auth_config(self.api_key, settings)
        server_args["config"] = str(self._auth_config)
        fd, log_name = tempfile.mkstemp(prefix="rlite-sglang-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log_name)
        cmd = server_command(server_args, port=self.port)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                message = f"SGLang server exited with code {code} while starting:\n{self._log_tail()}"
                self.shutdown()
                # killed by a signal (the OOM killer, a SIGKILL): a fresh server may well start
                raise (EngineDied if code < 0 else EngineError)(message)
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
        self._remove_auth_config()  # read at start-up; healthy means long after that

    def _remove_auth_config(self) -> None:
        if self._auth_config is not None:
            self._auth_config.unlink(missing_ok=True)
            self._auth_config = None

    @classmethod
    def connect(cls, url: str, *, timeout_s: float, tp_size: int = 1, api_key: str | None = None) -> ServerBackend:
        """A backend for a server already running at ``url``: this object neither started it nor stops it.
        ``api_key``: the server's ``--api-key``, sent with every request."""
        self = cls.__new__(cls)
        self.timeout_s = timeout_s
        self.url = url.rstrip("/")
        self.port = urllib.parse.urlsplit(self.url).port
        self.tp_size = int(tp_size)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self.process = None
        self.log_path = None
        self.api_key = api_key
        self._auth_config = None
        return self

    def _log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path is not None else ""

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as e:
            raise EngineError(
                f"SGLang {path} answered {e.code}: {e.read().decode(errors='replace')[:2000]}"
            ) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            if self.process is None:  # a server started elsewhere: not ours to restart
                raise EngineError(f"SGLang {path} failed (server at {self.url}): {e}") from None
            if self.process.poll() is not None:  # a fresh server can take over (rollout.engine_restarts)
                raise EngineDied(f"SGLang {path} failed: server exited with code {self.process.returncode}: "
                                 f"{e}\n{self._log_tail(2000)}") from None
            if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
                self.kill()  # hung: killed, and a fresh server can take over
                raise EngineDied(f"SGLang {path} did not answer within {self.timeout_s:g} s (server killed)") from None
            raise EngineError(f"SGLang {path} failed (server still running): {e}") from None
        return json.loads(text) if text.strip().startswith(("{", "[")) else text

    def generate(self, *, input_ids, sampling_params, return_logprob, lora_path=None, top_logprobs_num=None,
                 **extra):
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        if lora_path is not None:  # adapter names, one per request (GenerateReqInput.lora_path)
            body["lora_path"] = lora_path
        if top_logprobs_num:  # GenerateReqInput.top_logprobs_num: meta_info["output_top_logprobs"]
            body["top_logprobs_num"] = top_logprobs_num
        body.update(extra)  # other GenerateReqInput fields (return_routed_experts)
        return self._post("/generate", body)

    def release_memory_occupation(self, tags=None):
        return self._post("/release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags=None):
        return self._post("/resume_memory_occupation", {"tags": tags})

    def begin_weight_update(self, selector=None):
        return self._post("/begin_weight_update", {} if selector is None else {"selector": selector})

    def end_weight_update(self):
        return self._post("/end_weight_update", {})

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True, selector=None):
        body = {
            "serialized_named_tensors": named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if selector is not None:  # UpdateWeightsFromTensorReqInput.selector: which runners load them
            body["selector"] = selector
        return self._post("/update_weights_from_tensor", body)

    def update_weight_version(self, version: str):
        return self._post("/update_weight_version", {"new_version": version, "abort_all_requests": False})

    def flush_cache(self):
        return self._post("/flush_cache")

    def check_weights(self, action: str = "checksum"):
        """``/weights_checker``: ``{"success", "message", "ranks": [ChecksumInfo per TP rank], ...}``
        (``entrypoints/http_server.py``; HTTP 400 when it failed)."""
        return self._post("/weights_checker", {"action": action})

    @property
    def tensor_hash(self):
        return sglang_tensor_hash()

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
        self._remove_auth_config()


