"""Loading Hugging Face causal LMs (and peft LoRA) for the trainer, the reference model and the
transformers engine."""

from __future__ import annotations

import torch
from torch import nn

from rlite.config import LoraConfig, ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


