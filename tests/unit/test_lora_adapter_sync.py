"""Adapter-only LoRA sync: the adapter stream equals peft's own adapter state dict, and the SGLang
engine loads each version under a new name, drops the old one, and names it in every request."""

from __future__ import annotations

import pytest
import torch

from rlite.engines.base import EngineError, SamplingParams
from rlite.plugins.fsdp2.weights import iter_lora_adapter_tensors, lora_adapter_config
from rlite.plugins.sglang.engine import SGLangEngine
from rlite.testing import tiny_qwen2


def _peft_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_qwen2(96), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # peft starts B at zero; make the check meaningful
    return model


def test_adapter_stream_equals_peft_saved_adapter():
    from peft import get_peft_model_state_dict

    model = _peft_model()
    streamed = dict(iter_lora_adapter_tensors(model))
    saved = get_peft_model_state_dict(model)
    assert streamed.keys() == saved.keys()
    assert all(torch.equal(streamed[k], saved[k]) for k in saved)
    assert not any("base_layer" in k for k in streamed)
    config = lora_adapter_config(model)
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["target_modules"] == ["q_proj", "v_proj"]


class FakeLoRAServer:
    """SGLang's LoRA rules as far as rlite relies on them: a name loads once, generation may only name
    a loaded adapter, unloading an unknown name fails."""

    def __init__(self):
        self.adapters: dict[str, dict] = {}
        self.calls: list[tuple] = []
        self.version = "default"
        self.metadata_cls = None
        self.output_str = False

    def load_lora_adapter_from_tensors(self, *, lora_name, tensors, config_dict):
        assert lora_name not in self.adapters, f"adapter {lora_name} loaded twice"
        self.adapters[lora_name] = dict(tensors)
        self.calls.append(("load", lora_name, sorted(tensors)))
        return {"success": True}

    def unload_lora_adapter(self, *, lora_name):
        assert lora_name in self.adapters, f"unloading unknown adapter {lora_name}"
        del self.adapters[lora_name]
        self.calls.append(("unload", lora_name))
        return {"success": True}

    def update_weight_version(self, version):
        self.version = version
        return {"success": True}

    def resume_memory_occupation(self, tags=None):
        return {"success": True}

    def release_memory_occupation(self, tags=None):
        return {"success": True}

    def generate(self, *, input_ids, sampling_params, return_logprob, lora_path=None):
        assert lora_path is not None and len(lora_path) == len(input_ids)
        assert all(name in self.adapters for name in lora_path), "a request named an adapter that is not loaded"
        self.calls.append(("generate", lora_path[0]))
        meta = {"output_token_logprobs": [(-0.5, 5, None)], "finish_reason": {"type": "length"},
                "weight_version": self.version}
        return [{"text": None, "output_ids": [5], "meta_info": meta} for _ in input_ids]

    def shutdown(self):
        pass


def test_sglang_adapter_sync_versions_names_and_drops_the_old_adapter():
    fake = FakeLoRAServer()
    engine = SGLangEngine("unused", eos_token_ids=[1], fixed_base=True, backend=fake)
    model = _peft_model()
    for version in (1, 2):
        engine.update_lora_adapter(iter_lora_adapter_tensors(model), lora_adapter_config(model), version)
        out = engine.generate([[3, 4]], SamplingParams(n=2, max_new_tokens=1))
        assert [c.weight_version for c in out] == [version, version]
    assert [c[:2] for c in fake.calls] == [
        ("load", "rlite_v1"), ("generate", "rlite_v1"),
        ("load", "rlite_v2"), ("unload", "rlite_v1"), ("generate", "rlite_v2"),
    ]
    assert set(fake.adapters) == {"rlite_v2"}
    assert all(".lora_A." in k or ".lora_B." in k for k in fake.adapters["rlite_v2"])


def test_an_engine_without_a_fixed_base_refuses_adapters():
    """Its weights are released with the KV cache and only a full sync restores them: an adapter over
    released (lost) weights would sample garbage."""
    fake = FakeLoRAServer()
    engine = SGLangEngine("unused", eos_token_ids=[1], backend=fake)
    model = _peft_model()
    with pytest.raises(EngineError, match="fixed_base=True"):
        engine.update_lora_adapter(iter_lora_adapter_tensors(model), lora_adapter_config(model), 1)
    assert fake.calls == []


def test_adapter_sync_config_needs_an_engine_that_serves_adapters(tmp_path):
    from rlite.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout.lora_sync"):
        load_config(None, [f"model.path={tmp_path}", "data.task=addition", "rollout.lora_sync=adapter"], pm=False)


def test_adapter_sync_with_an_engine_that_cannot_serve_adapters_is_refused_when_the_config_loads(tmp_path):
    """The transformers engine's own check refuses it at load (naming the engine and its plugin)."""
    from rlite.config import ConfigError
    from rlite.testing import tiny_config

    with pytest.raises(ConfigError, match=r"^rollout.engine=transformers \(plugin 'rlite.plugins.transformers'\): "
                                          "rollout.lora_sync=adapter: the 'transformers' engine cannot serve adapters"):
        tiny_config(tmp_path / "m", tmp_path / "run", "model.lora.enabled=true", "rollout.lora_sync=adapter")


def test_an_engine_that_declares_nothing_is_still_refused_adapters_before_the_first_sync(tmp_path):
    """An engine whose plugin declares no check is held to its built capabilities (lora_adapters False)."""
    from rlite.config import ConfigError
    from rlite.engines.base import EngineCapabilities, IdleEngine
    from rlite.hookspecs import hookimpl
    from rlite.plugin_manager import build_plugin_manager
    from rlite.run.loop import run_training
    from rlite.testing import tiny_config
    from rlite.tokenizer import build_tiny_model_dir

    class Plain:
        @hookimpl
        def register_rollout_engines(self, register):
            class Engine(IdleEngine):
                capabilities = EngineCapabilities()

            register("plain", lambda *args, **kwargs: Engine())

    pm = build_plugin_manager(autoload=False)
    pm.register(Plain(), name="test-plain-engine")
    model_dir = build_tiny_model_dir(tmp_path / "m")
    cfg = tiny_config(model_dir, tmp_path / "run", "rollout.engine=plain", "model.lora.enabled=true",
                      "rollout.lora_sync=adapter", pm=pm)
    with pytest.raises(ConfigError, match="rollout.lora_sync=adapter: the 'plain' engine cannot serve adapters"):
        run_training(cfg, pm)
