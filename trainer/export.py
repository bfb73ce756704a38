"""Export the trained policy as a Hugging Face folder that plain transformers loads (LoRA merged)."""

from __future__ import annotations

from pathlib import Path

import torch


def export_hf(backend, tokenizer, out_dir: str | Path, *, is_main: bool) -> Path:
    """Gather the full weights (collective: every rank calls this) and ``save_pretrained`` on rank 0."""
    from transformers import AutoModelForCausalLM

    from rlite.engines.weight_sync import iter_full_tensors
    from rlite.logprobs import causal_lm_of

    out_dir = Path(out_dir)
    state = {}
    for name, tensor in iter_full_tensors(backend.model.lm, lora_merge=backend.lora):
        if is_main:
            state[name] = tensor.detach().to("cpu", copy=True)
    if is_main:
        hf_config = causal_lm_of(backend.model.lm).config
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        model.load_state_dict(state, strict=False, assign=True)
        model.tie_weights()  # a tied output layer shares the (now loaded) input embedding
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise RuntimeError(f"export: no weights for {missing[:5]}")
        model.config.use_cache = True
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    return out_dir
