"""The patches megatron-core 0.16 needs without CUDA (CPU tests, gloo) or without Transformer Engine.

:func:`apply_cpu_shims` applies patch 2 (names Transformer Engine would define) wherever Transformer
Engine is missing, on a GPU too (a GPU check of 2026-11-26 hit ``NameError: te_general_gemm`` in the
MoE router on an H100 without TE), and patches 1, 3 and 4 only when ``torch.cuda.is_available()`` is
false. Each patch names the megatron-core code it works around (observed with 0.16.1 on CPU torch 2.13
and on CUDA torch 2.11; see ``../../docs/megatron.md``).
"""

from __future__ import annotations

import torch

_applied = False


def apply_cpu_shims() -> bool:
    """Patch megatron-core for CPU; returns whether the shims are active (idempotent)."""
    global _applied
    # 2. MoE router gating: 0.16.1 references ``te_general_gemm`` (and friends) that are only defined
    #    when Transformer Engine imports; without TE they must exist and be None (0.19 fixed this).
    #    Needed on a GPU without TE as much as on a CPU.
    from megatron.core.transformer.moe import moe_utils

    for name in ("te_general_gemm", "fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss",
                 "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs", "fused_unpermute",
                 "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    # 1. megatron-core places buffers with ``torch.cuda.current_device()`` (rotary ``inv_freq``,
    #    GlobalMemoryBuffer for attention scores, the MoE router's weights), about 175 call sites;
    #    CPU torch asserts there. Answering "cpu" makes those tensors land on the CPU.
    torch.cuda.current_device = lambda: "cpu"
    # 4. Activation recompute (``recompute_granularity="full"``): ``tensor_parallel.random.CheckpointFunction``
    #    saves and restores the CUDA RNG state around each recomputed layer (``_get_all_rng_states``),
    #    which asserts on CPU torch. The CPU generator is still saved and restored by the same code; on a
    #    CPU there is no CUDA state to keep.
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    megatron_random._set_cuda_rng_state = lambda *args, **kwargs: None
    _applied = True
    return True


def seed_model_parallel_rng(seed: int) -> None:
    """Megatron's model-parallel RNG tracker. 3. On CPU ``model_parallel_cuda_manual_seed`` would read
    CUDA RNG states; its no-op inference tracker is enough because rlite runs with dropout 0."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not torch.cuda.is_available())
