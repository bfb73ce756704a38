"""Export the trained policy as a Hugging Face folder that plain transformers loads (LoRA merged)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from rlite.training.backend import TrainingBackend


def source_generation_config(model_path: str | None, hf_config):
    """The generation config of the model training started from (its ``generation_config.json``:
    sampling defaults, stop tokens), else the one transformers derives from the model config. Either
    way the KV cache stays on: training turns ``use_cache`` off in the model config, and an export
    that inherited that would decode without a cache, several times slower."""
    from transformers import GenerationConfig

    generation = None
    if model_path:
        try:
            generation = GenerationConfig.from_pretrained(model_path)
        except OSError:  # the source has no generation config (or is not a folder)
            generation = None
    if generation is None:
        generation = GenerationConfig.from_model_config(hf_config)
        generation.use_cache = True
    return generation


def export_hf(
    backend: TrainingBackend, tokenizer, out_dir: str | Path, *, is_main: bool, source_model: str | None = None
) -> Path:
    """Gather the full weights (collective: every rank calls this) and ``save_pretrained`` on rank 0,
    with the generation config of ``source_model`` (the ``model.path`` training started from).

    Rank 0 writes into ``<out_dir>.tmp`` and renames it to ``out_dir`` only when every file is written, so
    ``out_dir`` is complete or absent: an export stopped by a full disk leaves no partial folder behind
    (its temporary folder is removed to give the space back), and the next run of the same command,
    which resumes from the final checkpoint, exports again."""
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
        model.generation_config = source_generation_config(source_model, model.config)
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        if tmp.is_symlink():  # never written through: a link planted there would take the export elsewhere
            tmp.unlink()
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier export's leftovers
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        replace_folder(tmp, out_dir)
    return out_dir


def replace_folder(new: Path, target: Path) -> None:
    """Put the complete folder ``new`` at ``target``; an existing ``target`` is moved aside first and removed
    after, so ``target`` is never a mix of the two."""
    old = target.with_name(target.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)
