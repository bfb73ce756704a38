"""Export the trained policy as a Hugging Face folder that plain transformers loads (LoRA merged)."""

from __future__ import annotations

from pathlib import Path

import torch

from rlite.training.backend import TrainingBackend


def export_hf(backend: TrainingBackend, tokenizer, out_dir: str | Path, *, is_main: bool) -> Path:
    """Gather the full weights (collective: every rank calls this) and ``save_pretrained`` on rank 0."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    state = {}
    for name, tensor in backend.full_weights():
        if is_main:
            state[name] = tensor.detach().to("cpu", copy=True)
    if is_main:
        hf_config = backend.hf_config()
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
