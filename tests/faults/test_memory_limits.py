"""Nothing outruns memory: sequences longer than the model's context, and runs whose estimated memory
exceeds what the machine has, are refused before anything is allocated (exit status 2, naming the keys)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlite.run import limits
from rlite.testing import tiny_config
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.cli import main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))  # 512 positions


def write_config(tmp_path: Path, model_dir: str) -> str:
    config = {
        "model": {"path": model_dir},
        "data": {"task": "addition", "num_train": 64, "num_eval": 8},
        "training": {"steps": 1, "micro_batch_size": 8, "eval_every": 0},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 4},
        "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False, "plot": False, "loggers": ["jsonl"]},
        "checkpoint": {"save_final": False, "export_hf": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))
    return str(path)


def error_line(capsys) -> str:
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("rlite train: error: ")
    return line


def longest_prompt(model_dir: str, tmp_path: Path) -> int:
    """The longest prompt of the run's data, in tokens, as the run loads it."""
    from rlite.data import load_prompt_splits
    from rlite.run.build import load_tokenizer

    cfg = tiny_config(model_dir, tmp_path / "probe")
    splits = load_prompt_splits(cfg.data, load_tokenizer(cfg))
    return max(len(p.prompt_ids) for split in splits if split is not None for p in split.items)


@pytest.mark.parametrize(("overrides", "key", "response"), [
    (["rollout.max_new_tokens=100000"], "rollout.max_new_tokens", 100000),
    (["rollout.max_new_tokens=510"], "rollout.max_new_tokens", 510),
    (["rollout.workflow=calculator", "rollout.max_response_tokens=600"], "rollout.max_response_tokens", 600),
])
def test_a_sequence_longer_than_the_models_context_is_refused_naming_the_keys_and_the_limit(
    tmp_path, model_dir, capsys, overrides, key, response
) -> None:
    prompt = longest_prompt(model_dir, tmp_path)
    assert main(["train", write_config(tmp_path, model_dir), *overrides]) == 2
    line = error_line(capsys)
    assert f"{key}={response} + a prompt of up to {prompt} tokens (the longest prompt loaded has {prompt} tokens, " \
           f"data.max_prompt_tokens=256) = {prompt + response} tokens exceed the model's context of 512 positions " \
           "(max_position_embeddings of" in line
    assert line.endswith(f"lower {key} to at most {512 - prompt}, or data.max_prompt_tokens")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the run began


def test_a_default_max_prompt_tokens_beyond_the_context_is_no_reason_to_refuse(tmp_path, model_dir) -> None:
    """The shipped warm-start model has 256 positions and the default data.max_prompt_tokens is 256: what
    counts is the longest prompt actually loaded."""
    from rlite.run.loop import run_training

    run_training(tiny_config(model_dir, tmp_path / "run", "data.max_prompt_tokens=600", "rollout.max_new_tokens=8",
                             "training.steps=1"))


def test_absurd_batch_settings_are_refused_with_the_estimate_the_available_memory_and_the_keys(
    tmp_path, model_dir, capsys
) -> None:
    # 10^7 sequences of (longest prompt + 4) tokens: a KV cache of 10^7 x 2 layers x 2 x 2 heads x 16 x T x 4 bytes
    assert main(["train", write_config(tmp_path, model_dir), "rollout.prompts_per_step=5000000",
                 "rollout.samples_per_prompt=2"]) == 2
    line = error_line(capsys)
    assert line.startswith("rlite train: error: memory: the run needs about ")
    kv_cache = 10**7 * 2 * 2 * 2 * 16 * (longest_prompt(model_dir, tmp_path) + 4) * 4
    decode_step = 10**7 * 259 * 24  # sequences x vocabulary x (float32 logits, softmax, log-softmax, float64 CDF)
    assert f"engine KV cache {kv_cache / 2**30:.2f}, engine decode step {decode_step / 2**30:.2f} GiB" in line
    assert "are available (MemAvailable in /proc/meminfo)" in line
    assert "rollout.max_new_tokens, rollout.prompts_per_step x rollout.samples_per_prompt" in line
    assert "training.check_memory=false" in line


def test_the_check_compares_the_estimate_with_the_available_memory(tmp_path, model_dir, monkeypatch) -> None:
    from rlite.config import ConfigError

    cfg = tiny_config(model_dir, tmp_path / "run", "rollout.prompts_per_step=64", "rollout.samples_per_prompt=8")
    shape = limits.model_shape(__import__("transformers").AutoConfig.from_pretrained(model_dir))
    needed = limits.estimate_memory(cfg, shape).total
    monkeypatch.setattr(limits, "available_memory", lambda device: (needed, "test"))
    limits.check_run_fits(cfg, torch.device("cpu"))  # exactly enough
    monkeypatch.setattr(limits, "available_memory", lambda device: (needed - 1, "test"))
    with pytest.raises(ConfigError, match=r"^memory: the run needs about .* GiB are available \(test\)"):
        limits.check_run_fits(cfg, torch.device("cpu"))
    off = tiny_config(model_dir, tmp_path / "run", "rollout.prompts_per_step=64", "rollout.samples_per_prompt=8",
                      "training.check_memory=false")
    limits.check_run_fits(off, torch.device("cpu"))


def test_the_estimate_follows_its_documented_formula(tmp_path, model_dir) -> None:
    from transformers import AutoConfig

    shape = limits.model_shape(AutoConfig.from_pretrained(model_dir))
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.max_positions) == (2, 2, 16, 512)
    from transformers import AutoModelForCausalLM

    assert shape.parameters == AutoModelForCausalLM.from_pretrained(model_dir).num_parameters()
    cfg = tiny_config(model_dir, tmp_path / "run", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=4",
                      "data.max_prompt_tokens=100", "rollout.max_new_tokens=28", "training.eval_max_prompts=16",
                      "algorithm.kl.coef=0.1")
    parts = limits.estimate_memory(cfg, shape).parts
    p, t = shape.parameters, 128
    assert parts["weights"] == parts["gradients"] == parts["reference model"] == 4 * p
    assert parts["AdamW moments"] == 8 * p
    assert parts["engine KV cache"] == 2 * 2 * 2 * 16 * t * 4 * 32  # layers x 2 x kv heads x head dim x T x b x S
    assert parts["engine weights"] == 0  # the in-process engine shares the trainer's tensors
    assert parts["engine decode step"] == 32 * 259 * 24  # S x V x 24 bytes
    # an engine sampling in bfloat16 beside float32 master weights keeps its own bfloat16 copy and cache
    mixed = limits.estimate_memory(tiny_config(model_dir, tmp_path / "run", "rollout.prompts_per_step=8",
                                               "rollout.samples_per_prompt=4", "data.max_prompt_tokens=100",
                                               "rollout.max_new_tokens=28", "training.eval_max_prompts=16",
                                               "parallelism.param_dtype=bfloat16"), shape).parts
    assert mixed["engine weights"] == 2 * p and mixed["engine KV cache"] == parts["engine KV cache"] // 2
    # an engine left on the host beside a GPU trainer holds nothing on the GPU
    host = tiny_config(model_dir, tmp_path / "run", "rollout.engine.args.device=cpu")
    assert not any(name.startswith("engine") for name in limits.estimate_memory(host, shape, on_gpu=True).parts)
    assert parts["activations of a micro-batch"] == 8 * t * 64 * 2 * 34 * 4 // 2 + min(8 * t, 1024) * 259 * 4 * 3
    lora = tiny_config(model_dir, tmp_path / "run", "model.lora.enabled=true", "training.optimizer_offload=disk")
    lora_parts = limits.estimate_memory(lora, shape).parts
    assert lora_parts["gradients"] == lora_parts["AdamW moments"] == 0 and lora_parts["engine weights"] == 4 * p


def test_a_backends_registered_trainer_memory_replaces_the_sharded_formula(tmp_path, model_dir) -> None:
    """The estimate takes the trainer's parts from the backend's registered ``trainer_memory`` (one rank's
    bytes; on CPU every rank's share is in the host's memory, on a GPU one rank's is): fsdp2 registers none
    and is counted as shards, megatron (plugin module only; megatron-core is not needed) as a replica per
    data-parallel rank with masters, main gradients and ZeRO-1, by the formula in docs/memory.md."""
    from transformers import AutoConfig

    import rlite.plugins.megatron as megatron_plugin
    from rlite.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(autoload=False)
    pm.register(megatron_plugin, name="rlite.plugins.megatron")
    shape = limits.model_shape(AutoConfig.from_pretrained(model_dir))
    p = shape.parameters
    fsdp2 = tiny_config(model_dir, tmp_path / "run", pm=pm)
    for world_size, on_gpu in ((1, False), (2, False), (2, True)):
        with_pm = limits.estimate_memory(fsdp2, shape, world_size=world_size, on_gpu=on_gpu, pm=pm).parts
        assert with_pm == limits.estimate_memory(fsdp2, shape, world_size=world_size, on_gpu=on_gpu).parts
        assert with_pm["weights"] == (-(-4 * p // 2) if on_gpu else 4 * p)

    def megatron(*overrides, world_size, on_gpu=False, args=None):
        backend = "parallelism.backend=megatron" if args is None else f"parallelism.backend={{name: megatron, args: {args}}}"
        cfg = tiny_config(model_dir, tmp_path / "run", backend, *overrides, pm=pm)
        parts = limits.estimate_memory(cfg, shape, world_size=world_size, on_gpu=on_gpu, pm=pm).parts
        return {k: v for k, v in parts.items() if k in ("weights", "master weights", "gradients", "AdamW moments")}

    bf16 = "parallelism.param_dtype=bfloat16"
    # two data-parallel ranks on CPU: two whole replicas in the host's memory (FSDP2 would hold one)
    assert megatron(world_size=2) == {"weights": 8 * p, "master weights": 0, "gradients": 8 * p, "AdamW moments": 16 * p}
    # bf16 parameters, float32 masters and main gradients (reduce_dtype float32), a rank's own on a GPU
    assert megatron(bf16, world_size=2, on_gpu=True) == {
        "weights": 2 * p, "master weights": 4 * p, "gradients": 4 * p, "AdamW moments": 8 * p}  # fmt: skip
    assert megatron(bf16, "parallelism.reduce_dtype=bfloat16", world_size=1)["gradients"] == 2 * p
    # ZeRO-1 over two data-parallel ranks: half the masters and moments on each
    assert megatron(bf16, world_size=2, on_gpu=True, args="{distributed_optimizer: true}") == {
        "weights": 2 * p, "master weights": 2 * p, "gradients": 4 * p, "AdamW moments": 4 * p}  # fmt: skip
    # tensor parallel over both ranks: one replica, split in two
    split = -(-p // 2)
    assert megatron(world_size=2, on_gpu=True, args="{tensor_parallel: 2}") == {
        "weights": 4 * split, "master weights": 0, "gradients": 4 * split, "AdamW moments": 8 * split}  # fmt: skip
    assert megatron("training.optimizer_offload=disk", world_size=1)["AdamW moments"] == 0


def test_a_trainer_memory_that_returns_no_byte_counts_names_its_plugin(tmp_path, model_dir) -> None:
    from transformers import AutoConfig

    from rlite import hookimpl
    from rlite.plugin_manager import PluginError, build_plugin_manager

    class Sloppy:
        @hookimpl
        def register_training_backends(self, register):
            register("sloppy", lambda *args: None, trainer_memory=lambda config, cfg, parameters, world_size: {"weights": 1.5})

    pm = build_plugin_manager(autoload=False)
    pm.register(Sloppy(), name="sloppy-backends")
    cfg = tiny_config(model_dir, tmp_path / "run", "parallelism.backend=sloppy", pm=pm)
    shape = limits.model_shape(AutoConfig.from_pretrained(model_dir))
    with pytest.raises(PluginError, match=r"training backend 'sloppy' \(plugin 'sloppy-backends'\): trainer_memory must return"):
        limits.estimate_memory(cfg, shape, pm=pm)


def test_an_engines_registered_memory_is_what_the_estimate_counts_for_it(tmp_path, model_dir) -> None:
    """The engine's parts are its registration's ``memory=`` (the transformers engine's formula above is its
    own); an engine that registers none (SGLang, which sizes its pool itself) adds nothing, and one whose
    function returns no byte counts is named with its plugin."""
    from transformers import AutoConfig

    from rlite import hookimpl
    from rlite.plugin_manager import PluginError, build_plugin_manager

    calls = []

    def cache_only(config, cfg, shape, tokens, world_size, on_gpu):
        calls.append((tokens, world_size, on_gpu))
        return {"engine KV cache": shape.layers * tokens}

    class Engines:
        @hookimpl
        def register_rollout_engines(self, register):
            register("cache_only", lambda *args: None, memory=cache_only)
            register("sloppy", lambda *args: None, memory=lambda *args: {"engine weights": "a lot"})

    pm = build_plugin_manager(autoload=False)
    pm.register(Engines(), name="test-engines")
    shape = limits.model_shape(AutoConfig.from_pretrained(model_dir))
    base = ("rollout.max_new_tokens=28", "data.max_prompt_tokens=100")
    parts = limits.estimate_memory(tiny_config(model_dir, tmp_path / "run", "rollout.engine=cache_only", *base, pm=pm),
                                   shape, world_size=2, pm=pm).parts
    assert calls == [(128, 2, False)] and parts["engine KV cache"] == 2 * 128
    assert not {"engine weights", "engine decode step"} & set(parts)
    sglang = limits.estimate_memory(tiny_config(model_dir, tmp_path / "run", "rollout.engine=sglang", *base, pm=pm),
                                    shape, pm=pm).parts
    assert not any(name.startswith("engine") for name in sglang)
    sloppy = tiny_config(model_dir, tmp_path / "run", "rollout.engine=sloppy", pm=pm)
    with pytest.raises(PluginError, match=r"rollout engine 'sloppy' \(plugin 'test-engines'\): memory must return"):
        limits.estimate_memory(sloppy, shape, pm=pm)
