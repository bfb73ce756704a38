"""``training.compile``: each decoder block through ``torch.compile``, the rest of the model eager.

What it buys on a GPU: the elementwise work around the matrix products (RMSNorm, the rotary embedding,
SiLU and the gate product, residual adds, casts) fused into a few Triton kernels per block instead of a
launch per op, and autograd's saved tensors chosen by the compiler's partitioner. The matrix products,
attention and the output layer run the same kernels either way.

Why blocks and not the whole model: a block is the unit FSDP2 shards and the unit that repeats, so one
compiled graph serves every block (the parameters are inputs of the graph, not constants), the FSDP2
hooks around each block run eagerly between graphs, and rlite's own code outside the blocks (the
shared-prompt forward's bookkeeping, the chunked output layer, routing replay) stays ordinary Python.
A new micro-batch shape recompiles once; after that the graph's batch and sequence sizes are symbolic.

Inside compiled blocks, rlite's hand-written activation savers (:mod:`rlite.plugins.fsdp2.lean_activations`)
and in-place gradient accumulation (:mod:`rlite.training.grad_accumulation`) are left out: the
compiler decides what to save and recompute itself, and a backward that writes ``.grad`` as a side
effect cannot be traced (it would cut the graph at every matrix product). Outside the blocks (the
embedding, the final norm, the output layer) they apply as usual.

Not with ``training.share_prompt_prefix``: the shared-prompt forward hands each block a KV cache that
the block indexes by its layer number, which specialises the graph per layer and per pass (prompt,
then responses) and runs past dynamo's recompile limit: the config refuses the pair
(:mod:`rlite.config.compat`). The reference model is not compiled (one no-grad forward per step).
"""

from __future__ import annotations

from torch import nn

COMPILE_BACKEND = "inductor"
"""``torch.compile``'s backend for the blocks (tests swap in ``aot_eager``, which compiles in a second on a CPU)."""


def decoder_blocks(lm: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a Hugging Face causal LM (plain or peft-wrapped)."""
    from rlite.api import causal_lm_of

    layers = getattr(causal_lm_of(lm).get_decoder(), "layers", None)
    if layers is None:
        raise ValueError("model: cannot find the decoder blocks (expected model.get_decoder().layers)")
    return list(layers)


def compile_decoder_blocks(blocks: list[nn.Module], backend: str | None = None) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile``: names, parameters and state dict stay
    as they are, so checkpoints, weight sync and FSDP2 see the same module)."""
    for block in blocks:
        block.compile(backend=backend or COMPILE_BACKEND)
