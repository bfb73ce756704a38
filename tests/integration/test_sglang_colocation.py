"""The colocated SGLang engine in the real training loop, on CPU.

``rollout.engine=sglang`` runs unchanged (the ``sglang`` engine plugin, its ServerArgs, the in-process
launch, :class:`SGLangEngine`) against an importable stand-in for SGLang
(``tests/workers/fake_sglang.py``) that records every call and breaks where SGLang 0.5.23 breaks. The
trainer's log-probs and optimizer steps go into the same record, so the test sees when the engine
holds its memory relative to the training phase.
"""

from __future__ import annotations

import sys

import pytest
from fake_sglang import FakeSGLangEngine, fake_sglang_modules

from rlite.plugins.fsdp2.backend import FSDP2Backend
from rlite.run.loop import run_training
from rlite.testing import tiny_config

ALL = ["weights", "kv_cache", "cuda_graph"]
REST = ["kv_cache", "cuda_graph"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlite.tokenizer import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2)


@pytest.fixture
def fake_sglang(monkeypatch):
    """``import sglang`` gives the fake; the trainer's log-probs and optimizer steps are recorded in the
    engine's call list too."""
    for name, module in fake_sglang_modules().items():
        monkeypatch.setitem(sys.modules, name, module)

    def record(what, method):
        def wrapper(self, *args, **kwargs):
            for engine in FakeSGLangEngine.instances:
                engine.calls.append((what,))
            return method(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(FSDP2Backend, "logprobs", record("trainer_logprobs", FSDP2Backend.logprobs))
    monkeypatch.setattr(FSDP2Backend, "step", record("optimizer_step", FSDP2Backend.step))
    return FakeSGLangEngine


def trace(calls: list[tuple]) -> list[str]:
    """The calls in short, with runs of the same kind (buckets, micro-batch log-probs) collapsed."""
    out: list[str] = []
    for call in calls:
        name = call[0]
        if name in ("begin_weight_update", "update_weights_from_tensor", "end_weight_update"):
            item = "sync weights"
        elif name == "load_lora_adapter_from_tensors":
            item = "load adapter"
        elif name in ("release_memory_occupation", "resume_memory_occupation"):
            item = f"{name.split('_')[0]} {call[1]}"
        elif name == "update_weight_version":
            item = f"version {call[1]}"
        elif name == "generate":
            item = f"generate {call[1]}"  # requests: prompts x samples
        elif name in ("flush_cache", "unload_lora_adapter", "check_weights"):
            continue
        else:
            item = name
        if not out or out[-1] != item or item.startswith("generate"):
            out.append(item)
    return out


def training_step(version: int, *, load: str = "sync weights", release=ALL, resume_weights=True) -> list[str]:
    return [
        "generate 8",  # the rollout: 2 prompts x 4 samples
        f"release {release}",  # at once: the trainer's turn
        "trainer_logprobs",  # pi_old, then the training forwards
        "optimizer_step",
        *([f"resume {['weights']}"] if resume_weights else []),  # the weights first ...
        load,
        f"version {version}",
        f"resume {REST}",  # ... the KV cache after the update
    ]


def test_engine_memory_is_released_after_rollout_and_taken_back_only_by_the_sync(tmp_path, model_dir, fake_sglang):
    run_training(tiny_config(model_dir, tmp_path / "run", "rollout.engine=sglang", "data.num_eval=3"))
    (engine,) = fake_sglang.instances
    evaluation = ["generate 3", "generate 3"]  # greedy and sampled
    assert trace(engine.calls) == [
        "sync weights", "version 0",  # the first sync at build: the engine starts whole
        *evaluation,  # the baseline, on the memory the engine started with
        *training_step(1),
        *training_step(2),
        *evaluation, f"release {ALL}",  # nothing generates after the last one: the checkpoint and export get the memory
        "shutdown",
    ]  # fmt: skip


def test_dynamic_sampling_releases_once_after_the_last_round(tmp_path, model_dir, fake_sglang):
    # the fake's completions do not depend on the sample, so every group is dropped and all rounds run
    cfg = tiny_config(
        model_dir, tmp_path / "run", "rollout.engine=sglang", "algorithm.dynamic_sampling=true",
        "algorithm.dynamic_sampling_max_rounds=3", "training.steps=1", "data.num_eval=0",
    )  # fmt: skip
    run_training(cfg)
    (engine,) = fake_sglang.instances
    calls = [c for c in engine.calls if c[0] in ("generate", "release_memory_occupation", "trainer_logprobs")]
    assert [c[0] for c in calls][:5] == ["generate"] * 3 + ["release_memory_occupation", "trainer_logprobs"]


@pytest.mark.parametrize("cpu_backup", [False, True], ids=["base-kept", "base-backed-up"])
def test_adapter_sync_keeps_the_base_weights_through_release_and_generates(
    tmp_path, model_dir, fake_sglang, cpu_backup
):
    """lora_sync=adapter: the engine loaded its real base and only ever gets adapters, so a release of
    its weights without SGLang's CPU backup would lose them for good (the fake refuses to generate)."""
    overrides = ["rollout.engine=sglang", "model.lora.enabled=true", "model.lora.rank=4", "rollout.lora_sync=adapter"]
    if cpu_backup:
        overrides.append("rollout.engine.args={engine_kwargs: {enable_weights_cpu_backup: true}}")
    run_training(tiny_config(model_dir, tmp_path / "run", *overrides, "data.num_eval=3"))
    (engine,) = fake_sglang.instances
    assert engine.server_args["load_format"] == "auto" and engine.server_args["enable_lora"] is True
    release = ALL if cpu_backup else REST
    assert trace(engine.calls) == [
        "load adapter", "version 0",
        "generate 3", "generate 3",
        *training_step(1, load="load adapter", release=release, resume_weights=cpu_backup),
        *training_step(2, load="load adapter", release=release, resume_weights=cpu_backup),
        "generate 3", "generate 3", f"release {release}",
        "shutdown",
    ]  # fmt: skip
    assert engine.weights_valid and list(engine.adapters) == ["rlite_v2"]
    assert all(".lora_A." in name or ".lora_B." in name for name in engine.adapters["rlite_v2"])


def test_the_trainer_hands_its_cached_blocks_back_before_the_engine_takes_its_memory(
    tmp_path, model_dir, fake_sglang, monkeypatch
):
    """SGLang re-acquires its memory from the driver in other processes: blocks the trainer freed but
    torch's allocator still caches would count as taken (an out-of-memory on a GPU that is all but free)."""
    import torch

    def empty_cache():
        for engine in fake_sglang.instances:
            engine.calls.append(("empty_cache",))

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # as on a GPU, where the trainer runs CUDA
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    run_training(tiny_config(model_dir, tmp_path / "run", "rollout.engine=sglang", "training.steps=1", "data.num_eval=0"))
    (engine,) = fake_sglang.instances
    step = trace(engine.calls)[trace(engine.calls).index("optimizer_step") :]
    assert step[:6] == [
        "optimizer_step", "empty_cache",  # the activations' blocks, before the weights come back
        f"resume {['weights']}", "sync weights", "version 1",
        "empty_cache",  # the sync's buckets, before the KV cache comes back
    ]  # fmt: skip
    assert step[6] == f"resume {REST}"
