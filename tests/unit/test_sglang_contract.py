"""SGLang engine contract on CPU: call order against a rule-enforcing fake, payloads, SGLang's deserializer.

The tests that need SGLang's own code (``MultiprocessingSerializer``, ``FlattenedTensorBucket``, the
LoRA route's ``Base64Bytes`` and its ``lora`` argument parser) run only where ``sglang`` is importable; ``tests/sglang_compat/run.sh`` builds a small venv for them.
There, ``RLITE_SGLANG_NARROW_IMPORT=1`` imports just ``sglang.srt.utils.common`` and
``sglang.srt.weight_sync`` (skipping ``sglang/__init__``, which needs transformers and more), and
``RLITE_REQUIRE_SGLANG=1`` turns a failed import into a failure instead of a skip.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import sys
import time
import types

import pytest
import torch
from fake_sglang import FakeSGLang, RuleBroken, pure_deserialize, pure_reconstruct

from rlite.engines.base import EngineError, SamplingParams
from rlite.plugins.sglang.engine import SGLangEngine
from rlite.plugins.sglang.payloads import (
    FLATTENED_BUCKET,
    REST_TAGS,
    WEIGHT_TAGS,
    FlattenedTensorMetadataFields,
    build_update_payloads,
    completion_from_output,
    sampling_params_for,
    sync_weights,
)
from rlite.sync.buckets import ALIGNMENT

torch.set_num_threads(1)


def _load_sglang():
    """SGLang's serializer, bucket and metadata classes, or None where SGLang is not installed."""
    if importlib.util.find_spec("sglang") is None:
        if os.environ.get("RLITE_REQUIRE_SGLANG") == "1":
            raise RuntimeError("RLITE_REQUIRE_SGLANG=1 but sglang is not installed")
        return None
    try:
        if os.environ.get("RLITE_SGLANG_NARROW_IMPORT") == "1" and "sglang" not in sys.modules:
            # a bare package object: sglang/__init__.py (transformers, lang api, ...) never runs
            package = types.ModuleType("sglang")
            package.__path__ = list(importlib.util.find_spec("sglang").submodule_search_locations)
            sys.modules["sglang"] = package
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
    except Exception:
        if os.environ.get("RLITE_REQUIRE_SGLANG") == "1":
            raise
        return None
    return types.SimpleNamespace(
        serializer=MultiprocessingSerializer, bucket=FlattenedTensorBucket, metadata=FlattenedTensorMetadata
    )


SGLANG = _load_sglang()
needs_sglang = pytest.mark.skipif(
    SGLANG is None, reason="sglang is not importable here (see tests/sglang_compat)"
)


def named_tensors(step: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [
        ("model.embed_tokens.weight", torch.randn(50, 16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(7, generator=g).to(torch.bfloat16)),  # 14 bytes
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(16, 16, generator=g)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(32, 16, generator=g).half().T),  # non-contiguous
        ("model.norm.weight", torch.randn(16, generator=g)),
        ("model.step", torch.tensor(step, dtype=torch.int64)),
    ]


# -- how the receiving side reads a payload ------------------------------------------------------


def sglang_deserialize(payload):
    return SGLANG.serializer.deserialize(payload)


def sglang_reconstruct(data):
    return SGLANG.bucket(
        flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
    ).reconstruct_tensors()


READERS = [pytest.param((pure_deserialize, pure_reconstruct, FlattenedTensorMetadataFields), id="pure")]
if SGLANG is not None:
    READERS.append(pytest.param((sglang_deserialize, sglang_reconstruct, SGLANG.metadata), id="sglang"))


def _engine(fake: FakeSGLang, bucket_bytes: int = 2048) -> SGLangEngine:
    engine = SGLangEngine("unused", eos_token_ids=[1], tp_size=fake.tp_size, backend=fake)
    engine.bucket_bytes = bucket_bytes
    return engine


# -- (c) pure payload tests -----------------------------------------------------------------------


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("output_str", [False, True])
def test_payload_round_trip_is_bitwise(reader, output_str):
    deserialize, reconstruct, metadata_cls = reader
    tensors = named_tensors(3)
    payloads = build_update_payloads(tensors, tp_size=2, metadata_cls=metadata_cls, output_str=output_str)
    assert len(payloads) == 2 and all(isinstance(p, str if output_str else bytes) for p in payloads)
    for payload in payloads:
        data = deserialize(payload)
        assert set(data) == {"flattened_tensor", "metadata"}
        flat = data["flattened_tensor"]
        assert flat.dtype == torch.uint8 and flat.dim() == 1
        for meta, (name, tensor) in zip(data["metadata"], tensors):
            assert type(meta) is metadata_cls
            assert meta.name == name and meta.dtype == tensor.dtype and meta.shape == tensor.shape
            assert isinstance(meta.shape, torch.Size)
            assert meta.start_idx % ALIGNMENT == 0
            assert meta.end_idx - meta.start_idx == meta.numel == tensor.numel() * tensor.element_size()
        rebuilt = reconstruct(data)
        assert [n for n, _ in rebuilt] == [n for n, _ in tensors]
        for (_, got), (_, want) in zip(rebuilt, tensors):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(
                got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)
            )


def test_sampling_params_and_seeds():
    params = SamplingParams(n=2, max_new_tokens=5, temperature=0.7, top_k=0, top_p=0.9, stop_token_ids=[9])
    (sp,) = sampling_params_for(params, stop_token_ids={1, 9}, seeds=None)
    assert sp == {
        "max_new_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "stop_token_ids": [1, 9],
    }
    greedy = sampling_params_for(SamplingParams(greedy=True, top_k=5), stop_token_ids=[], seeds=[3, 4])
    assert [s["temperature"] for s in greedy] == [0.0, 0.0] and [s["sampling_seed"] for s in greedy] == [3, 4]
    assert greedy[0]["top_k"] == 5 and greedy[0]["stop_token_ids"] is None


def test_completion_from_output():
    output = {
        "output_ids": [5, 6, 1],
        "meta_info": {
            "output_token_logprobs": [(-0.1, 5, None), (-0.2, 6, None), (-0.3, 1, None)],
            "finish_reason": {"type": "stop", "matched": 1},
            "weight_version": "4",
        },
    }
    c = completion_from_output(output, prompt_index=2, weight_version=4)
    assert (c.prompt_index, c.token_ids, c.logprobs, c.finish_reason, c.weight_version) == (
        2,
        [5, 6, 1],
        [-0.1, -0.2, -0.3],
        "stop",
        4,
    )
    output["meta_info"]["finish_reason"] = {"type": "abort", "message": "oom"}
    with pytest.raises(EngineError, match="abort"):
        completion_from_output(output, prompt_index=0, weight_version=4)
    with pytest.raises(EngineError, match="output_token_logprobs"):
        completion_from_output({"meta_info": {}}, prompt_index=0, weight_version=4)


# -- (a) call order against the fake -------------------------------------------------------------


@pytest.mark.parametrize("reader", READERS)
def test_colocated_cycle_follows_sglang_rules(reader):
    fake = FakeSGLang(tp_size=2, reader=reader)
    engine = _engine(fake)
    for version in (1, 2):
        completions = engine.generate([[3, 4], [5]], SamplingParams(n=2, max_new_tokens=3))  # the rollout
        assert len(completions) == 4 and [c.prompt_index for c in completions] == [0, 0, 1, 1]
        assert all(c.weight_version == version - 1 for c in completions)
        assert completions[0].logprobs == [-0.25, -0.5, -0.75]
        engine.release_memory()  # right after it: the trainer's turn
        tensors = named_tensors(version)
        engine.update_weights(iter(tensors), version)  # after the optimizer step
        engine.resume_memory()  # before the next rollout
        for name, tensor in tensors:
            assert torch.equal(fake.weights[name], tensor), name
    n_buckets = fake.buckets
    assert n_buckets > 1  # the small bucket size split the model
    cycle = (
        [
            ("generate", 4),
            ("release_memory_occupation", WEIGHT_TAGS + REST_TAGS),
            ("resume_memory_occupation", WEIGHT_TAGS),
            ("begin_weight_update",),
        ]
        + [("update_weights_from_tensor", FLATTENED_BUCKET, False)] * n_buckets
        + [("end_weight_update",), ("update_weight_version", "2"), ("check_weights", "checksum")]
        + [("resume_memory_occupation", REST_TAGS)]
        + [("flush_cache",)]
    )
    assert fake.calls[-len(cycle) :] == cycle


def test_a_failed_bucket_still_closes_the_session():
    fake = FakeSGLang(fail_on_bucket=1)
    engine = _engine(fake)
    with pytest.raises(
        EngineError, match="update_weights_from_tensor \\(bucket 1\\) failed: injected failure"
    ):
        engine.update_weights(iter(named_tensors(1)), 1)
    assert not fake.session and fake.calls[-1] == ("end_weight_update",)
    assert engine.weight_version == 0
    fake.fail_on_bucket = None
    engine.update_weights(iter(named_tensors(2)), 2)
    assert engine.weight_version == 2 and fake.version == "2"


def test_generate_refuses_weights_released_without_a_sync():
    fake = FakeSGLang()
    engine = _engine(fake)
    engine.release_memory()
    with pytest.raises(EngineError, match="not synced since"):
        engine.generate([[1, 2]], SamplingParams())
    engine.update_weights(iter(named_tensors(1)), 1)
    assert len(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))) == 1


def test_the_fake_breaks_where_sglang_breaks():
    fake = FakeSGLang()
    payloads = build_update_payloads(
        named_tensors(), tp_size=1, metadata_cls=FlattenedTensorMetadataFields, output_str=False
    )
    with pytest.raises(RuleBroken, match="outside begin"):
        fake.update_weights_from_tensor(payloads, load_format=FLATTENED_BUCKET)
    with pytest.raises(RuleBroken, match="not released"):
        fake.resume_memory_occupation(["kv_cache"])
    fake.release_memory_occupation()
    with pytest.raises(RuleBroken, match="released memory"):
        fake.begin_weight_update()
    with pytest.raises(RuleBroken, match="released"):
        fake.generate(input_ids=[[1]], sampling_params=[{"max_new_tokens": 1}], return_logprob=True)
    fake.resume_memory_occupation(["weights"])
    fake.begin_weight_update()
    with pytest.raises(RuleBroken, match="during a weight-update session"):
        fake.release_memory_occupation(["kv_cache"])


# -- (b) SGLang's own deserializer ----------------------------------------------------------------


@needs_sglang
def test_sglang_unpickler_accepts_our_payload_and_rejects_foreign_classes():
    tensors = named_tensors(7)
    for output_str in (False, True):
        (payload,) = build_update_payloads(
            tensors, tp_size=1, metadata_cls=SGLANG.metadata, output_str=output_str
        )
        rebuilt = sglang_reconstruct(SGLANG.serializer.deserialize(payload))
        for (_, got), (_, want) in zip(rebuilt, tensors):
            assert torch.equal(
                got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)
            )
    # SGLang's SafeUnpickler allows only its own metadata class: the stand-in must never reach it
    (foreign,) = build_update_payloads(
        tensors, tp_size=1, metadata_cls=FlattenedTensorMetadataFields, output_str=True
    )
    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        SGLANG.serializer.deserialize(foreign)


# -- the HTTP server mode against a stand-in `sglang.launch_server` -------------------------------

FAKE_LAUNCH_SERVER = """
import argparse, json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

mode = os.environ.get("FAKE_SGLANG_MODE", "serve")
log = os.environ["FAKE_SGLANG_LOG"]
parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
parser.add_argument("--api-key")
parser.add_argument("--config")
args, _ = parser.parse_known_args()
api_key = args.api_key
# SGLang's --config: a YAML file of ServerArgs fields (rlite writes JSON, which is YAML)
if args.config:
    import yaml
    config = yaml.safe_load(open(args.config))
else:
    config = {}
api_key = config.get("api-key", api_key)  # a key k becomes the flag --k
with open(log, "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "api_key": api_key, "config": config}) + "\\n")
if mode == "exit":
    sys.exit(3)
if mode == "hang":
    time.sleep(3600)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _reply(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self):  # SGLang's api-key middleware: a Bearer token on everything but /health
        if self.path.startswith("/health") or not api_key or self.headers.get("Authorization") == "Bearer " + api_key:
            return True
        self._reply(401, {"error": "Unauthorized"})
        return False

    def do_GET(self):
        if self._authorized():
            self._reply(200, {"ok": True})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
        if not self._authorized():
            return
        with open(log, "a") as f:
            f.write(json.dumps({"path": self.path, "body": body}) + "\\n")
        if self.path == "/generate":
            outs = []
            for ids, sp in zip(body["input_ids"], body["sampling_params"]):
                toks = [(sum(ids) + k) % 50 + 2 for k in range(sp["max_new_tokens"])]
                meta = {"output_token_logprobs": [[-0.5, t, None] for t in toks],
                        "finish_reason": {"type": "length"}, "weight_version": "1"}
                outs.append({"output_ids": toks, "meta_info": meta})
            self._reply(200, outs)
        elif self.path == "/update_weights_from_tensor" and body.get("flush_cache"):
            self._reply(400, {"success": False, "message": "rlite should not flush per bucket"})
        else:
            self._reply(200, {"success": True, "message": "ok"})


HTTPServer((args.host, args.port), Handler).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """Put a stand-in ``sglang.launch_server`` on the server's path; returns a reader of its log."""
    package = tmp_path / "fake" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_SGLANG_LOG", str(log))

    def calls() -> list[dict]:
        import json

        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return calls


def test_server_mode_launches_on_loopback_and_speaks_the_http_api(fake_server):
    from rlite.plugins.sglang.launch import ServerBackend

    backend = ServerBackend(
        {
            "model_path": "/m",
            "skip_tokenizer_init": True,
            "enable_memory_saver": True,
            "load_format": "dummy",
            "disable_cuda_graph": False,
            "mem_fraction_static": None,
        },
        start_timeout_s=60.0,
        timeout_s=30.0,
    )
    backend.metadata_cls = FlattenedTensorMetadataFields
    engine = _engine_on(backend)
    try:
        engine.release_memory()
        engine.update_weights(iter(named_tensors(1)), 1)
        engine.resume_memory()
        completions = engine.generate([[3, 4]], SamplingParams(n=2, max_new_tokens=3))
        assert [c.weight_version for c in completions] == [1, 1] and completions[0].logprobs == [-0.5] * 3
    finally:
        engine.shutdown()
    assert backend.process.poll() is not None  # stopped
    calls = fake_server()
    argv = calls[0]["argv"]
    assert argv[:4] == ["--host", "127.0.0.1", "--port", str(backend.port)]
    assert {"--skip-tokenizer-init", "--enable-memory-saver", "--model-path"} <= set(argv)
    assert argv[argv.index("--load-format") + 1] == "dummy"
    assert "--disable-cuda-graph" not in argv and "--mem-fraction-static" not in argv
    paths = [c["path"] for c in calls[1:]]
    n_buckets = paths.count("/update_weights_from_tensor")
    assert n_buckets > 1
    assert paths == (
        ["/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update"]
        + ["/update_weights_from_tensor"] * n_buckets
        + [
            "/end_weight_update",
            "/update_weight_version",
            "/resume_memory_occupation",
            "/flush_cache",
            "/generate",
        ]
    )
    update = next(c["body"] for c in calls if c.get("path") == "/update_weights_from_tensor")
    assert update["load_format"] == FLATTENED_BUCKET and update["flush_cache"] is False
    (payload,) = update["serialized_named_tensors"]
    assert base64.b64decode(payload, validate=True)[:1] == b"\x80"  # a pickle, base64-encoded
    assert calls[-1]["body"]["return_logprob"] is True


def test_a_launched_server_takes_a_fresh_key_that_only_rlite_sends(fake_server):
    """Anyone on the node reaches 127.0.0.1 and a weight update is a pickle the server unpickles: each
    server gets its own random ``--api-key`` (read from a 0600 ``--config`` file, never on the command
    line, which every user sees), rlite sends it on every request, and a request without it is refused."""
    import json
    import urllib.error
    import urllib.request

    from rlite.plugins.sglang.launch import ServerBackend

    backends = [ServerBackend({"model_path": "/m"}, start_timeout_s=60.0, timeout_s=30.0) for _ in range(2)]
    try:
        backends[0].metadata_cls = FlattenedTensorMetadataFields
        engine = _engine_on(backends[0])
        engine.update_weights(iter(named_tensors(1)), 1)
        assert [c.weight_version for c in engine.generate([[3, 4]], SamplingParams(n=1, max_new_tokens=2))] == [1]
        launches = [c for c in fake_server() if "argv" in c]
        keys = [launch["api_key"] for launch in launches]
        assert len(keys) == 2 and all(keys) and keys[0] != keys[1] and len(keys[0]) >= 32
        assert keys == [backend.api_key for backend in backends]
        for launch in launches:
            argv = launch["argv"]
            assert "--api-key" not in argv and not any(key in " ".join(argv) for key in keys)
            assert not os.path.exists(argv[argv.index("--config") + 1])  # removed once the server was up
        assert "/generate" in [c.get("path") for c in fake_server()]  # rlite's own calls got through

        for path, body in [("/generate", {"input_ids": [[3]], "sampling_params": [{"max_new_tokens": 1}]}),
                           ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]})]:
            for headers in [{}, {"Authorization": "Bearer " + keys[1]}]:  # none, and another run's key
                request = urllib.request.Request(backends[0].url + path, data=json.dumps(body).encode(),
                                                 headers={"Content-Type": "application/json", **headers})
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
                with pytest.raises(urllib.error.HTTPError) as refused:
                    opener.open(request, timeout=10)
                assert refused.value.code == 401
    finally:
        for backend in backends:
            backend.shutdown()


def test_a_users_config_file_is_merged_with_the_key_into_rlites_own_and_the_key_stays_off_the_command_line(
    fake_server, tmp_path
):
    """With a ``config:`` argument of the user's, the key went on the server's command line (``ps`` shows it to
    every user of the node): SGLang reads one --config file, so rlite now writes one holding both."""
    from rlite.plugins.sglang.launch import ServerBackend

    user = tmp_path / "sglang.yaml"
    user.write_text("# the user's server settings\nmem-fraction-static: 0.5\nchunked-prefill-size: 4096\n")
    original = user.read_text()
    backend = ServerBackend({"model_path": "/m", "config": str(user)}, start_timeout_s=60.0, timeout_s=30.0)
    try:
        (launch,) = [call for call in fake_server() if "argv" in call]
        argv = launch["argv"]
        assert "--api-key" not in argv and backend.api_key not in " ".join(argv)
        used = argv[argv.index("--config") + 1]
        assert used != str(user) and not os.path.exists(used)  # rlite's own 0600 file, removed once the server was up
        assert launch["config"] == {"mem-fraction-static": 0.5, "chunked-prefill-size": 4096, "api-key": backend.api_key}
        assert launch["api_key"] == backend.api_key and user.read_text() == original
    finally:
        backend.shutdown()


def test_a_users_config_file_that_is_no_mapping_is_refused_naming_it(tmp_path):
    from rlite.api import ConfigError
    from rlite.plugins.sglang.launch import ServerBackend

    user = tmp_path / "sglang.yaml"
    user.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match=f"rollout.engine.args.config: {user} must hold a mapping"):
        ServerBackend({"model_path": "/m", "config": str(user)}, start_timeout_s=60.0, timeout_s=30.0)


def test_the_auth_config_file_is_readable_by_its_owner_only():
    import json
    import stat

    from rlite.plugins.sglang.launch import write_auth_config

    path = write_auth_config("secret-key")
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.suffix == ".yaml"
        assert json.loads(path.read_text()) == {"api-key": "secret-key"}  # JSON is YAML
    finally:
        path.unlink()


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_server_mode_reports_a_server_that_dies_or_never_gets_healthy(fake_server, monkeypatch, mode):
    from rlite.plugins.sglang.launch import ServerBackend

    monkeypatch.setenv("FAKE_SGLANG_MODE", mode)
    expected = "exited with code 3" if mode == "exit" else "not healthy within 2 s"
    with pytest.raises(EngineError, match=expected):
        ServerBackend({"model_path": "/m"}, start_timeout_s=2.0, timeout_s=5.0)


def test_a_server_that_dies_is_restarted_by_the_supervisor_with_the_trainers_weights(fake_server):
    """A launched server that dies is an ``EngineDied`` (not a plain error), so the run's supervisor
    (``rollout.engine_restarts``) starts a fresh server, syncs the trainer's weights into it and makes
    the failed call again; a server rlite did not start is never treated as restartable."""
    import signal

    from rlite.engines.base import EngineDied
    from rlite.engines.supervisor import SupervisedEngine
    from rlite.plugins.sglang.launch import ServerBackend

    backends = []

    def start():
        backend = ServerBackend({"model_path": "/m"}, start_timeout_s=60.0, timeout_s=30.0)
        backend.metadata_cls = FlattenedTensorMetadataFields
        backends.append(backend)
        return _engine_on(backend)

    synced = []

    def resync(supervisor, version):
        synced.append(version)
        supervisor.engine.update_weights(iter(named_tensors(1)), version)

    engine = SupervisedEngine(start(), start, max_restarts=1, resync=resync)
    try:
        engine.update_weights(iter(named_tensors(1)), 1)
        first = backends[0]
        os.killpg(first.process.pid, signal.SIGKILL)
        first.process.wait(timeout=30)
        with pytest.raises(EngineDied, match="server exited with code -9"):
            first.generate(input_ids=[[3]], sampling_params=[{"max_new_tokens": 1}], return_logprob=True)
        completions = engine.generate([[3, 4]], SamplingParams(n=2, max_new_tokens=3))
        assert len(backends) == 2 and engine.restarts == 1 and synced == [1]
        assert [c.weight_version for c in completions] == [1, 1]
        assert backends[1].process.poll() is None
        elsewhere = ServerBackend.connect(backends[1].url, timeout_s=5.0)
        os.killpg(backends[1].process.pid, signal.SIGKILL)
        backends[1].process.wait(timeout=30)
        with pytest.raises(EngineError) as failed:
            elsewhere.generate(input_ids=[[3]], sampling_params=[{"max_new_tokens": 1}], return_logprob=True)
        assert not isinstance(failed.value, EngineDied)
    finally:
        engine.shutdown()


def test_in_process_engine_whose_processes_exited_is_dead(monkeypatch):
    """``sglang.Engine`` in this process: a call that fails after the engine's own processes exited
    is an ``EngineDied`` (restartable); one that fails while they run is the error it was."""
    import subprocess

    from rlite.engines.base import EngineDied

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    class Engine(FakeSGLang):
        def __init__(self, **kwargs):
            super().__init__()

        def get_all_child_pids(self):
            return [child.pid]

        def generate(self, **kwargs):
            raise RuntimeError("scheduler unreachable")

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Engine))
    engine = SGLangEngine("/m", eos_token_ids=[1], timeout_s=30.0)
    try:
        with pytest.raises(RuntimeError, match="scheduler unreachable") as alive:
            engine.generate([[1, 2]], SamplingParams())
        assert not isinstance(alive.value, EngineDied)
        child.kill()
        child.wait(timeout=30)
        with pytest.raises(EngineDied, match="its processes have exited: RuntimeError: scheduler unreachable"):
            engine.generate([[1, 2]], SamplingParams())
    finally:
        child.kill()
        engine.shutdown()


def _engine_on(backend) -> SGLangEngine:
    # the stand-in servers keep no weights to check (the weight check over HTTP has its own test)
    engine = SGLangEngine("unused", eos_token_ids=[1], backend=backend, verify_weights=False)
    engine.bucket_bytes = 2048
    return engine


def test_in_process_mode_builds_the_engine_in_a_worker_and_times_out_hung_calls(monkeypatch):
    import threading

    release = threading.Event()
    built = {}

    class Engine(FakeSGLang):
        def __init__(self, **kwargs):
            super().__init__()
            built.update(kwargs, thread=threading.current_thread().name)

        def get_all_child_pids(self):
            return []

        def generate(self, **kwargs):
            release.wait(60)  # hangs until the test lets it go

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=Engine))
    engine = SGLangEngine("/m", eos_token_ids=[1], timeout_s=1.0, true_on_policy=True)
    try:
        assert built["thread"].startswith("rlite-sglang")  # every call runs on the one worker thread
        assert {
            k: built[k] for k in ("model_path", "skip_tokenizer_init", "enable_memory_saver", "load_format")
        } == {
            "model_path": "/m",
            "skip_tokenizer_init": True,
            "enable_memory_saver": True,
            "load_format": "dummy",
        }
        assert built["enable_deterministic_inference"] and built["rl_on_policy_target"] == "fsdp"
        from rlite.engines.base import EngineDied

        with pytest.raises(EngineDied, match="generate did not return within 1 s"):  # killed: restartable
            engine.generate([[1, 2]], SamplingParams())
    finally:
        release.set()
        engine.shutdown()


# -- adapter-only LoRA sync over HTTP (launch="server") against a recording server in a thread -----


def adapter_tensors() -> dict[str, torch.Tensor]:
    """A LoRA adapter as peft names it, in several dtypes (what ``iter_lora_adapter_tensors`` yields)."""
    g = torch.Generator().manual_seed(3)
    prefix = "base_model.model.model.layers.0.self_attn"
    return {
        f"{prefix}.q_proj.lora_A.weight": torch.randn(4, 16, generator=g).to(torch.bfloat16),
        f"{prefix}.q_proj.lora_B.weight": torch.randn(16, 4, generator=g).to(torch.bfloat16),
        f"{prefix}.v_proj.lora_A.weight": torch.randn(4, 16, generator=g),
        f"{prefix}.v_proj.lora_B.weight": torch.randn(8, 4, generator=g).half(),
    }


ADAPTER_CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
LOAD_KEYS = {"lora_name", "config_dict", "serialized_named_tensors", "load_format", "pinned"}


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), (
            name
        )


class RecordingServer:
    """An HTTP server on 127.0.0.1 (stdlib, in a thread) that records every POST path and JSON body.

    Answers like SGLang's routes: ``LoRAUpdateOutput``-shaped dicts, ``/generate`` outputs stamped with
    the last ``/update_weight_version``. ``replies[path] = (status, body_or_text, delay_s)`` overrides one.
    """

    def __init__(self):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.calls: list[tuple[str, dict]] = []
        self.replies: dict[str, tuple[int, object, float]] = {}
        self.version = "default"
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
                outer.calls.append((self.path, body))
                status, reply, delay = outer.replies.get(self.path, (200, None, 0.0))
                if delay:
                    time.sleep(delay)
                if reply is None:
                    reply = outer.default_reply(self.path, body)
                data = (reply if isinstance(reply, str) else json.dumps(reply)).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def default_reply(self, path: str, body: dict):
        if path == "/update_weight_version":
            self.version = body["new_version"]
        if path == "/generate":
            meta = {
                "output_token_logprobs": [[-0.5, 7, None]],
                "finish_reason": {"type": "length"},
                "weight_version": self.version,
            }
            return [{"output_ids": [7], "meta_info": meta} for _ in body["input_ids"]]
        return {"success": True, "error_message": None, "loaded_adapters": {}}

    def paths(self) -> list[str]:
        return [path for path, _ in self.calls]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recording_server():
    server = RecordingServer()
    yield server
    server.close()


def _server_engine(url: str, *, tp_size: int = 1, timeout_s: float = 30.0) -> SGLangEngine:
    from rlite.plugins.sglang.launch import ServerBackend

    backend = ServerBackend.connect(url, timeout_s=timeout_s, tp_size=tp_size)
    return SGLangEngine("unused", eos_token_ids=[1], tp_size=tp_size, fixed_base=True, backend=backend)


@pytest.mark.parametrize("reader", READERS)
def test_server_mode_adapter_sync_sends_what_sglang_reads(recording_server, reader):
    deserialize = reader[0]
    engine = _server_engine(recording_server.url, tp_size=2)
    first, second = adapter_tensors(), {k: v * 2 for k, v in adapter_tensors().items()}
    for version, tensors in ((1, first), (2, second)):
        engine.update_lora_adapter(iter(tensors.items()), ADAPTER_CONFIG, version)
        out = engine.generate([[3, 4]], SamplingParams(n=2, max_new_tokens=1))
        assert [c.weight_version for c in out] == [version, version]
    assert recording_server.paths() == [
        "/load_lora_adapter_from_tensors", "/update_weight_version", "/generate",
        "/load_lora_adapter_from_tensors", "/unload_lora_adapter", "/update_weight_version", "/generate",
    ]  # fmt: skip
    calls = recording_server.calls
    loads = [body for path, body in calls if path == "/load_lora_adapter_from_tensors"]
    for body, name, tensors in zip(loads, ("rlite_v1", "rlite_v2"), (first, second)):
        assert set(body) == LOAD_KEYS  # SGLang ignores unknown keys, so a misspelt one would be lost
        assert body["lora_name"] == name and body["config_dict"] == ADAPTER_CONFIG
        assert body["load_format"] is None and body["pinned"] is False
        payloads = body["serialized_named_tensors"]
        assert len(payloads) == 2  # one per tensor-parallel rank: rank i reads entry i
        for payload in payloads:
            assert isinstance(payload, str) and base64.b64decode(payload, validate=True)[:1] == b"\x80"
            assert_bitwise_equal(deserialize(payload), tensors)
    assert [body for path, body in calls if path == "/unload_lora_adapter"] == [{"lora_name": "rlite_v1"}]
    generates = [body for path, body in calls if path == "/generate"]
    assert [g["lora_path"] for g in generates] == [["rlite_v1"] * 2, ["rlite_v2"] * 2]
    assert [body["new_version"] for path, body in calls if path == "/update_weight_version"] == ["1", "2"]


@pytest.mark.parametrize(
    "path, status, reply, expected",
    [
        (
            "/load_lora_adapter_from_tensors",
            400,
            {"success": False, "error_message": "LoRA is not enabled. Please set `--enable-lora`"},
            r"SGLang /load_lora_adapter_from_tensors answered 400: .*LoRA is not enabled",
        ),
        ("/load_lora_adapter_from_tensors", 500, "Internal Server Error", r"/load_lora_adapter_from_tensors answered 500"),
        ("/load_lora_adapter_from_tensors", 200, {"success": False, "error_message": "rank mismatch"},
         r"SGLang load_lora_adapter_from_tensors failed: rank mismatch"),
        ("/unload_lora_adapter", 400, {"success": False, "error_message": "not loaded"},
         r"SGLang /unload_lora_adapter answered 400: .*not loaded"),
    ],
)  # fmt: skip
def test_server_mode_adapter_errors_name_the_endpoint(recording_server, path, status, reply, expected):
    engine = _server_engine(recording_server.url)
    engine.update_lora_adapter(iter(adapter_tensors().items()), ADAPTER_CONFIG, 1)
    recording_server.replies[path] = (status, reply, 0.0)
    with pytest.raises(EngineError, match=expected):
        engine.update_lora_adapter(iter(adapter_tensors().items()), ADAPTER_CONFIG, 2)
    assert engine.weight_version == 1  # the failed sync did not switch versions
    if path == "/load_lora_adapter_from_tensors":
        assert engine.lora_name == "rlite_v1"  # requests keep naming the adapter that is loaded


def test_server_mode_adapter_calls_time_out_and_report_a_dead_server(recording_server):
    engine = _server_engine(recording_server.url, timeout_s=0.5)
    recording_server.replies["/load_lora_adapter_from_tensors"] = (200, None, 3.0)
    with pytest.raises(
        EngineError, match=r"SGLang /load_lora_adapter_from_tensors failed \(server at .*timed out"
    ):
        engine.update_lora_adapter(iter(adapter_tensors().items()), ADAPTER_CONFIG, 1)
    url = recording_server.url
    recording_server.close()
    engine = _server_engine(url, timeout_s=5.0)
    engine.lora_name = "rlite_v1"
    with pytest.raises(EngineError, match=r"SGLang /load_lora_adapter_from_tensors failed \(server at "):
        engine.update_lora_adapter(iter(adapter_tensors().items()), ADAPTER_CONFIG, 2)


def test_server_command_spells_lists_as_separate_arguments():
    from rlite.plugins.sglang.launch import server_command

    cmd = server_command(
        {
            "model_path": "/m",
            "enable_lora": True,
            "max_lora_rank": 4,
            "lora_target_modules": ["q_proj", "v_proj"],
            "disable_cuda_graph": False,
            "mem_fraction_static": None,
        },
        port=1234,
    )
    assert cmd[1:] == [
        "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", "1234", "--model-path", "/m",
        "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "q_proj", "v_proj",
    ]  # fmt: skip


# -- (b) the LoRA request as SGLang's own code reads it (tests/sglang_compat) ----------------------


def _sglang_source(relative: str) -> str:
    from pathlib import Path

    import sglang  # the bare package under RLITE_SGLANG_NARROW_IMPORT: no __spec__, but a __path__

    return (Path(list(sglang.__path__)[0]) / relative).read_text()


def _struct_fields(source: str, name: str) -> dict[str, bool]:
    """``{field: required}`` of a class in SGLang's source (io_struct imports the whole model stack,
    far beyond the compat venv, so its classes are read, not imported)."""
    import ast

    (cls,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name]
    fields = {"rid": False, "http_worker_ipc": False}  # BaseReq's, both optional
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            fields[stmt.target.id] = stmt.value is None
    return fields


@needs_sglang
def test_sglang_reads_rlite_lora_requests_as_its_http_routes_do(recording_server):
    import re

    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    from sglang.srt.utils.msgspec_utils import Base64Bytes

    io_struct = _sglang_source("srt/managers/io_struct.py")
    http_server = _sglang_source("srt/entrypoints/http_server.py")
    for route, struct in (
        ("/load_lora_adapter_from_tensors", "LoadLoRAAdapterFromTensorsReqInput"),
        ("/unload_lora_adapter", "UnloadLoRAAdapterReqInput"),
    ):
        assert re.search(
            rf'@app\.api_route\("{route}".*?\n(?:.*\n){{0,3}}.*Annotated\[{struct}, Body\(\)\]', http_server
        )
    engine = _server_engine(recording_server.url, tp_size=2)
    tensors = adapter_tensors()
    engine.update_lora_adapter(iter(tensors.items()), ADAPTER_CONFIG, 1)
    engine.update_lora_adapter(iter(tensors.items()), ADAPTER_CONFIG, 2)
    bodies = dict(recording_server.calls)
    for path, struct in (
        ("/load_lora_adapter_from_tensors", "LoadLoRAAdapterFromTensorsReqInput"),
        ("/unload_lora_adapter", "UnloadLoRAAdapterReqInput"),
    ):
        fields = _struct_fields(io_struct, struct)
        assert set(bodies[path]) <= set(fields), (
            f"{path}: keys SGLang would drop: {set(bodies[path]) - set(fields)}"
        )
        assert {f for f, required in fields.items() if required} <= set(bodies[path])
    assert {"success", "error_message"} <= set(_struct_fields(io_struct, "LoRAUpdateOutput"))
    # the route's validator (Base64Bytes), the tokenizer manager's normalization, then each TP rank's
    # MultiprocessingSerializer.deserialize of its own entry (tp_worker.deserialize_own_rank)
    raw = Base64Bytes._decode_value(bodies["/load_lora_adapter_from_tensors"]["serialized_named_tensors"])
    payloads = normalize_serialized_named_tensor_payloads(raw)
    assert len(payloads) == 2
    for rank in range(2):
        assert_bitwise_equal(SGLANG.serializer.deserialize(payloads[rank]), tensors)


@needs_sglang
def test_sglang_parses_rlites_lora_server_flags():
    import argparse

    from sglang.srt.arg_groups.arg_utils import add_cli_args_from_dataclass
    from sglang.srt.arg_groups.fields.lora import Lora

    from rlite.plugins.sglang.launch import server_command

    parser = argparse.ArgumentParser()
    add_cli_args_from_dataclass(parser, Lora)
    cmd = server_command(
        {
            "model_path": "/m",
            "enable_lora": True,
            "max_lora_rank": 4,
            "lora_target_modules": ["q_proj", "v_proj"],
        },
        port=1,
    )
    args, _ = parser.parse_known_args(cmd[3:])
    assert args.enable_lora is True and args.max_lora_rank == 4
    assert args.lora_target_modules == ["q_proj", "v_proj"]


def test_server_mode_checks_the_weights_through_sglangs_weights_checker_route(recording_server):
    """``POST /weights_checker {"action": "checksum"}`` answers ``{"success", "message", "ranks": [...]}``
    (``entrypoints/http_server.py``); the sync compares its checksums with the sent tensors'."""
    from fake_sglang import FakeSGLang

    from rlite.plugins.sglang.launch import ServerBackend

    backend = ServerBackend.connect(recording_server.url, timeout_s=30.0)
    backend.metadata_cls = FlattenedTensorMetadataFields

    class Backend(type(backend)):  # SGLang's Triton hash needs SGLang and a GPU: its CPU form stands in
        tensor_hash = staticmethod(FakeSGLang.tensor_hash)

    backend.__class__ = Backend
    engine = SGLangEngine("unused", eos_token_ids=[1], backend=backend)
    tensors = [("model.norm.weight", torch.arange(8, dtype=torch.float32)), ("x.q_proj.weight", torch.ones(4, 4))]
    held = FakeSGLang.tensor_hash(tensors[0][1].to(engine.weight_dtype))  # SGLang holds it in its dtype
    recording_server.replies["/weights_checker"] = (200, {"success": True, "message": "Success.", "ranks": [
        {"checksums": {"model.norm.weight": f"{held:016x}"}, "per_gpu_checksum": "", "parallelism_info": []}
    ]}, 0.0)  # fmt: skip
    engine.update_weights(iter(tensors), 1)
    assert ("/weights_checker", {"action": "checksum"}) in recording_server.calls
    recording_server.replies["/weights_checker"] = (200, {"success": True, "message": "", "ranks": [
        {"checksums": {"model.norm.weight": "0" * 16}}]}, 0.0)  # fmt: skip
    with pytest.raises(EngineError, match="SGLang holds model.norm.weight with checksum 0000000000000000"):
        engine.update_weights(iter(tensors), 2)


@needs_sglang
def test_sglangs_patched_receiver_opens_rlites_cuda_handle_on_the_gpu_with_that_uuid(monkeypatch):
    """rlite's payload for a tensor on the trainer's cuda:3, read by SGLang's own ``SafeUnpickler`` and its
    ``monkey_patch_torch_reductions()`` rebuild in a process that sees that GPU as its cuda:1."""
    import types as pytypes

    from torch.multiprocessing import reductions

    from rlite.plugins.sglang.payloads import CUDA_DEVICE_ARG, flattened_bucket_payload, serialize_payload

    saved = {name: getattr(reductions, name) for name in ("reduce_tensor", "rebuild_cuda_tensor")}
    for name, value in saved.items():  # restored after the test, with everything below
        monkeypatch.setattr(reductions, name, value)

    def reduce_as_cuda(tensor):  # torch's reduction of a tensor on cuda:3 (a CPU has none)
        args = (type(tensor), tensor.size(), tensor.stride(), 0, torch.UntypedStorage, tensor.dtype, 3,
                b"ipc-handle", tensor.untyped_storage().nbytes(), 0, False, b"ref", 0, b"event", True)  # fmt: skip
        return saved["rebuild_cuda_tensor"], args

    monkeypatch.setattr(reductions, "reduce_tensor", reduce_as_cuda)
    monkeypatch.setattr("rlite.plugins.sglang.payloads.cuda_device_uuid", lambda index: f"GPU-uuid-{index}")
    payload = flattened_bucket_payload([("w", torch.ones(4))], metadata_cls=SGLANG.metadata)
    data = serialize_payload(payload, output_str=True)

    from sglang.srt.utils import patch_torch

    visible = ["GPU-uuid-0", "GPU-uuid-3"]  # the receiving process: the trainer's cuda:3 is its cuda:1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: pytypes.SimpleNamespace(uuid=visible[i]))
    monkeypatch.delattr(reductions, "_reduce_tensor_original", raising=False)
    patch_torch.monkey_patch_torch_reductions()
    opened = []
    monkeypatch.setattr(reductions, "_rebuild_cuda_tensor_original", lambda *args: opened.append(args) or "tensor")
    data_out = SGLANG.serializer.deserialize(data)
    for name in ("_reduce_tensor_original", "_rebuild_cuda_tensor_original"):
        monkeypatch.delattr(reductions, name, raising=False)
    reductions.init_reductions()  # torch's own reducers again (monkeypatch restored the functions)
    assert data_out["flattened_tensor"] == "tensor" and [m.name for m in data_out["metadata"]] == ["w"]
    (args,) = opened
    assert args[CUDA_DEVICE_ARG] == 1  # SGLang found the GPU by its UUID


# -- speculative decoding: arguments, selectors, acceptance (rlite.plugins.sglang.speculative) -------


def test_drafts_become_sglangs_speculative_arguments():
    from rlite.engines.base import DraftSpec
    from rlite.plugins.sglang.speculative import speculative_server_args

    trained = speculative_server_args(DraftSpec("model", 3, model_path="/draft", trained=True))
    assert trained == {
        "speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/draft",
        "speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
    }  # fmt: skip
    frozen = speculative_server_args(DraftSpec("eagle", 2, model_path="/head"))
    assert frozen["speculative_algorithm"] == "EAGLE" and frozen["speculative_num_draft_tokens"] == 3
    # loaded from its folder whatever the target's dummy format, and kept across a release
    assert frozen["speculative_draft_load_format"] == "auto" and frozen["enable_draft_weights_cpu_backup"] is True
    ngram = speculative_server_args(DraftSpec("ngram", 4, engine_args=(("speculative_ngram_max_trie_depth", 8),)))
    assert ngram == {
        "speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5, "speculative_num_steps": 4,
        "speculative_ngram_min_bfs_breadth": 1, "speculative_ngram_max_bfs_breadth": 1,
        "speculative_ngram_max_trie_depth": 8,
    }  # fmt: skip


def test_acceptance_is_read_from_meta_info_under_either_name():
    from rlite.engines.base import DraftSpec
    from rlite.plugins.sglang.speculative import speculation_from_outputs, top_logprobs_from_output

    draft = DraftSpec("model", 3, model_path="/d")
    outputs = [
        {"meta_info": {"completion_tokens": 9, "spec_verify_ct": 3, "spec_num_correct_drafts": 6,
                       "spec_num_proposed_drafts": 9}},
        {"meta_info": {"completion_tokens": 4, "spec_verify_ct": 2, "spec_accept_token_num": 2,
                       "spec_draft_token_num": 6}},  # the names of older releases
        {"meta_info": {"completion_tokens": 2}},  # nothing speculated: one forward per token
    ]  # fmt: skip
    stats = speculation_from_outputs(outputs, draft, time_s=2.0)
    assert (stats.proposed, stats.accepted, stats.verifications, stats.emitted) == (9 + 6 + 6, 6 + 2 + 0, 7, 15)
    assert stats.no_draft_estimate_s == pytest.approx(2.0 * 15 / 7)  # a verification costs a decode step
    output = {"meta_info": {"output_top_logprobs": [[(-0.1, 5, "a"), (-2.0, 9, "b")], [(-0.3, 2, None), (-1.5, 3, None)]]}}
    ids, logprobs = top_logprobs_from_output(output, 2)
    assert ids.tolist() == [[5, 9], [2, 3]]
    assert logprobs.flatten().tolist() == pytest.approx([-0.1, -2.0, -0.3, -1.5])


def test_a_standalone_draft_needs_selectors_and_a_backed_up_or_synced_draft():
    from rlite.engines.base import DraftSpec

    policy = named_tensors(1)
    draft = [("model.embed_tokens.weight", torch.randn(8, 4)), ("lm_head.weight", torch.randn(8, 4))]
    fake = FakeSGLang(speculative_algorithm="STANDALONE", num_draft_tokens=4)
    with pytest.raises(EngineError, match="selector 'all' with a draft worker"):  # the default would load the
        sync_weights(fake, iter(policy), 1, bucket_bytes=2048, tp_size=1,  # policy into the draft too
                     metadata_cls=FlattenedTensorMetadataFields, output_str=False)
    fake = FakeSGLang(speculative_algorithm="STANDALONE", num_draft_tokens=4)
    engine = SGLangEngine("unused", eos_token_ids=[1], backend=fake, draft=DraftSpec("model", 3, model_path="/d", trained=True))
    engine.bucket_bytes = 2048
    engine.release_memory()
    engine.update_weights(iter(policy + [("draft." + n, t) for n, t in draft]), 1)
    engine.resume_memory()
    out = engine.generate([[3, 4]], SamplingParams(n=2, max_new_tokens=5, top_logprobs=2))
    sessions = [c for c in fake.calls if c[0] in ("begin_weight_update", "end_weight_update", "update_weight_version")]
    assert sessions == [("begin_weight_update", "target"), ("end_weight_update",), ("begin_weight_update", "draft"),
                        ("end_weight_update",), ("update_weight_version", "1")]
    assert set(fake.weights) == {n for n, _ in policy} and set(fake.draft_weights) == {n for n, _ in draft}
    assert all(torch.equal(fake.draft_weights[n], t) for n, t in draft)
    assert out[0].top_ids.shape == (5, 2) and out[0].top_logprobs.shape == (5, 2)
    stats = engine.speculation_stats()  # the fake: every other verification accepts one draft token
    assert (stats.verifications, stats.emitted, stats.accepted, stats.proposed) == (6, 10, 4, 18)
    # a draft loaded from its folder is lost on a release unless SGLang backs it up
    for backup in (False, True):
        fake = FakeSGLang(speculative_algorithm="STANDALONE", draft_cpu_backup=backup)
        engine = SGLangEngine("unused", eos_token_ids=[1], backend=fake, draft=DraftSpec("model", 3, model_path="/d"))
        engine.bucket_bytes = 2048
        engine.release_memory()
        engine.update_weights(iter(policy), 1)
        engine.resume_memory()
        if backup:
            engine.generate([[3, 4]], SamplingParams(n=1, max_new_tokens=2))
        else:
            with pytest.raises(RuleBroken, match="lost draft weights"):
                engine.generate([[3, 4]], SamplingParams(n=1, max_new_tokens=2))


def test_server_mode_sends_selectors_and_asks_for_top_logprobs(recording_server):
    from rlite.engines.base import DraftSpec
    from rlite.plugins.sglang.launch import ServerBackend

    backend = ServerBackend.connect(recording_server.url, timeout_s=30.0)
    backend.metadata_cls = FlattenedTensorMetadataFields
    engine = SGLangEngine("unused", eos_token_ids=[1], backend=backend, verify_weights=False,  # (needs SGLang's hash)
                          draft=DraftSpec("model", 2, model_path="/d", trained=True))
    engine.update_weights(iter(named_tensors(1)[:2] + [("draft.lm_head.weight", torch.ones(4, 2))]), 1)
    calls = recording_server.calls
    begins = [body for path, body in calls if path == "/begin_weight_update"]
    updates = [body["selector"] for path, body in calls if path == "/update_weights_from_tensor"]
    assert begins == [{"selector": "target"}, {"selector": "draft"}] and updates == ["target", "draft"]
    assert recording_server.paths()[-1] == "/update_weight_version"  # once, after both sessions
    backend.generate(input_ids=[[3]], sampling_params=[{}], return_logprob=True, top_logprobs_num=3)
    assert calls[-1][0] == "/generate" and calls[-1][1]["top_logprobs_num"] == 3


@needs_sglang
def test_sglang_reads_rlites_speculative_flags_and_selector_requests():
    import argparse

    from sglang.srt.arg_groups.arg_utils import add_cli_args_from_dataclass
    from sglang.srt.arg_groups.fields.exec_ import ExecFeatures
    from sglang.srt.arg_groups.fields.spec import Spec

    from rlite.engines.base import DraftSpec
    from rlite.plugins.sglang.launch import server_command
    from rlite.plugins.sglang.speculative import speculative_server_args

    parser = argparse.ArgumentParser()
    add_cli_args_from_dataclass(parser, Spec)
    add_cli_args_from_dataclass(parser, ExecFeatures)
    for draft in (DraftSpec("model", 3, model_path="/d"), DraftSpec("ngram", 4), DraftSpec("eagle", 2, model_path="/h")):
        server_args = speculative_server_args(draft)
        args, unknown = parser.parse_known_args(server_command(server_args, port=1)[3:])
        for key, value in server_args.items():
            assert getattr(args, key) == value, key
    io_struct = _sglang_source("srt/managers/io_struct.py")
    assert "selector" in _struct_fields(io_struct, "UpdateWeightsFromTensorReqInput")
    assert "selector" in _struct_fields(io_struct, "BeginWeightUpdateReqInput")
    assert "top_logprobs_num" in _struct_fields(io_struct, "GenerateReqInput")
    manager = _sglang_source("srt/managers/tokenizer_manager.py")
    for key in ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts", "output_top_logprobs"):
        assert f'"{key}"' in manager, key  # the meta_info keys rlite reads


# -- (c) the API key as SGLang's own code reads and checks it (tests/sglang_compat) -----------------


@needs_sglang
def test_sglang_reads_the_key_from_rlites_config_file_and_accepts_only_rlites_bearer_header():
    """``--config`` (SGLang's ConfigArgumentMerger) turns rlite's file into ``--api-key KEY``; ``api_key`` is
    a ServerArgs field; and SGLang's auth decision lets rlite's ``Authorization: Bearer KEY`` through on a
    normal route (/generate) and an admin-optional one (the weight updates), refuses no key or another
    key, and leaves /health open (rlite's start-up poll sends none)."""
    import argparse
    import re

    from sglang.srt.utils.auth import AuthLevel, decide_request_auth
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    from rlite.plugins.sglang.launch import server_command, write_auth_config

    assert re.search(r"^\s+api_key: A\[", _sglang_source("srt/arg_groups/fields/serving.py"), re.MULTILINE)
    path = write_auth_config("k-123")
    try:
        parser = argparse.ArgumentParser()
        for flag in ("--host", "--port", "--model-path", "--api-key", "--config"):
            parser.add_argument(flag)
        argv = server_command({"model_path": "/m", "config": str(path)}, port=1234)[3:]
        args = parser.parse_args(ConfigArgumentMerger(parser).merge_config_with_args(argv))
        assert args.api_key == "k-123" and args.model_path == "/m"
    finally:
        path.unlink()

    def allowed(header, path="/generate", level=AuthLevel.NORMAL):
        return decide_request_auth(method="POST", path=path, authorization_header=header, api_key="k-123",
                                   admin_api_key=None, auth_level=level).allowed

    for level in (AuthLevel.NORMAL, AuthLevel.ADMIN_OPTIONAL):
        assert allowed("Bearer k-123", level=level)
        assert not allowed(None, level=level) and not allowed("Bearer another-run", level=level)
    assert allowed(None, path="/health")
