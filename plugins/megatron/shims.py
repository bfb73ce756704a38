"""The patches megatron-core 0.16 needs without CUDA (CPU tests, gloo) or without Transformer Engine.

:func:`apply_cpu_shims` applies patch 2 (names Transformer Engine would define) wherever Transformer
Engine is missing, on a GPU too (a GPU check of 2026-11-26 hit ``NameError: te_general_gemm`` in the
MoE router on an H100 without TE), patch 6 (megatron-core imported without wandb and tensorboard) everywhere,
and patches 1, 3, 4 and 5 only when ``torch.cuda.is_available()`` is false. Each patch names the megatron-core code it works around (observed with 0.16.1 on CPU torch 2.13
and on CUDA torch 2.11; see ``../../docs/megatron.md``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

_applied = False


@contextlib.contextmanager
def megatron_jit_fuser_off() -> Iterator[None]:
    """5. Import megatron-core with its JIT fuser off (CPU only). megatron-core decorates about 40
    fusable functions with ``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on torch >= 2.2,
    when its modules are imported: each decoration imports torch's compiler stack (dynamo, inductor:
    66 of the 105 MiB that importing megatron-core adds to a trainer's RSS on CPU, issue #32), and each
    first call compiles. megatron-core's own switch, ``megatron.core.jit.disable_jit_fuser`` (its
    ``noop_decorator``), comes too late to use: ``megatron.core``'s ``__init__`` imports the decorated
    modules before ``megatron.core.jit`` can be reached. So the first import sees ``torch.compile`` as
    that no-op decorator, and ``disable_jit_fuser`` then covers modules imported later. The functions
    run eagerly, as they would without torch.compile; nothing else in megatron-core calls it."""
    if "megatron.core" in sys.modules:  # already imported (decorated) in this process: nothing to change
        yield
        return
    compile_ = torch.compile
    torch.compile = lambda model=None, **options: model if model is not None else (lambda fn: fn)
    try:
        yield
        from megatron.core import jit

        jit.disable_jit_fuser()
    finally:
        torch.compile = compile_


UNUSED_OPTIONAL_IMPORTS = ("wandb", "torch.utils.tensorboard")


@contextlib.contextmanager
def megatron_without_metric_writers() -> Iterator[None]:
    """6. Import megatron-core without wandb and tensorboard. Its timers (``megatron/core/timers.py``) and
    its dynamic inference engine and context import them where installed (each ``try: import ...
    except ImportError``), for metric writers rlite never hands megatron: 21 + 3 MiB of a CPU trainer's RSS
    when rlite's own extras installed them (issue #32). During megatron-core's first import they look
    not installed (``sys.modules[name] = None``); afterwards they import normally again, for rlite's own
    loggers. A module already imported is left alone."""
    hidden = [name for name in UNUSED_OPTIONAL_IMPORTS if name not in sys.modules]
    if "megatron.core" in sys.modules:
        hidden = []
    for name in hidden:
        sys.modules[name] = None
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def apply_cpu_shims() -> bool:
    """Patch megatron-core for CPU; returns whether the shims are active (idempotent)."""
    global _applied
    with megatron_without_metric_writers(), \
            megatron_jit_fuser_off() if not torch.cuda.is_available() else contextlib.nullcontext():
        import megatron.core  # noqa: F401
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
