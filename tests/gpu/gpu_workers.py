"""Functions that the GPU checks' spawned engine processes import by name (a test module cannot be
imported by name under pytest's importlib mode; tests/gpu/conftest.py puts this folder on sys.path,
which spawn hands to the child)."""

from __future__ import annotations

import torch


def build_cuda_engine(*, model_dir: str, pad_token_id: int, eos_token_ids: list[int], true_on_policy: bool):
    """A transformers engine whose float32 model lives on this process's GPU: the weights a sync hands
    over as CUDA-IPC buckets are bound zero-copy into it (same dtype and device)."""
    from transformers import AutoModelForCausalLM

    from rlite.plugins.transformers.engine import TransformersEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda")
    return TransformersEngine(model, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids,
                              true_on_policy=true_on_policy)
