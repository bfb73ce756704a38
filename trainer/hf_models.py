"""Loading Hugging Face causal LMs (and peft LoRA) for the trainer, the reference model and the
transformers engine."""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from torch import nn

from rlite.config import LoraConfig, ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextlib.contextmanager
def quiet_transformers_progress():
    """transformers draws no progress bars inside (its "Loading weights" and "Writing model shards"
    bars would break rlite's own progress line); the previous setting is restored after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def cache_kwarg(model: nn.Module) -> str:
    """The keyword under which ``model``'s forward (and ``generate``) takes a KV cache: ``cache`` in
    transformers 5.x, where ``past_key_values`` still works but warns (a FutureWarning per model class)
    on every run; ``past_key_values`` in the 4.x releases rlite also supports."""
    unwrapped = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # peft
    return _cache_kwarg_of(type(unwrapped))


@functools.cache
def _cache_kwarg_of(model_class: type) -> str:
    # a deprecation decorator keeps the wrapped signature (functools.wraps), which has the new name
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def load_causal_lm(cfg: ModelConfig) -> nn.Module:
    """Load the Hugging Face model named by ``model.path`` (offline folders work; GGUF optional)."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(
        dtype=DTYPES[cfg.dtype],
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code,
    )
    if cfg.gguf_file:
        kwargs["gguf_file"] = cfg.gguf_file
    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.path, **kwargs)
    except OSError as exc:
        from rlite.config import ConfigError

        raise ConfigError(
            f"model.path: cannot load a causal LM from {cfg.path!r} ({exc}). Give a folder with config.json "
            "and weights (or a hub name when a network is available)."
        ) from None
    if getattr(model, "hf_quantizer", None) is not None and cfg.gguf_file:
        model.hf_quantizer.remove_quantization_config(model)  # GGUF weights arrive dequantized
    return model


def empty_causal_lm(cfg: ModelConfig) -> nn.Module:
    """The model ``model.path`` names, built on the meta device: its structure (and ties), no storage,
    nothing read but the config. The ranks of a sharded model start from this and receive their shards."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    config = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code, **kwargs)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, dtype=DTYPES[cfg.dtype], attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
        )  # fmt: skip


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no storage, no initialisation
    work) and their buffers as usual: a parameter is moved to meta as it is registered. A parameter
    already on meta is kept as it is, so tied weights stay one object."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def skeleton_causal_lm(path: str, dtype: str = "float32", attn_implementation: str = "sdpa",
                       gguf_file: str | None = None, trust_remote_code: bool = False,
                       device: torch.device | str | None = None) -> nn.Module:
    """The model ``path`` names, built from its config only: parameters on the meta device, buffers
    (the rotary embedding's, which no state dict or weight sync carries) computed on the host as
    ``from_pretrained`` computes them, then moved to ``device`` (default: left on the host). For an
    engine whose first weight sync gives every parameter its storage: no second read of the checkpoint,
    and the parameters get their storage where the buffers are."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, dtype=DTYPES[dtype], attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
    if device is not None:
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
    return model


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg)


