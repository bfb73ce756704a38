"""The megatron-core training backend: a ``GPTModel`` built from a Hugging Face config, with tensor and
expert parallelism, behind rlite's :class:`~rlite.api.TrainingBackend` contract.

The model runs megatron-core's *local* layer spec (no Transformer Engine): RMSNorm, SwiGLU MLPs or
MoE layers with the ``allgather`` token dispatcher, rotary attention; its experts as grouped matrix
products and its core attention through ``scaled_dot_product_attention`` (:func:`build_gpt_model`).
Weights come from the Hugging Face checkpoint through :mod:`rlite.plugins.megatron.convert` and go back
the same way for weight sync and export.

Log-probs: the decoder's hidden states at the response positions go through the output layer in
chunks (rlite's chunked output layer, as fsdp2's; at TP>1 with a ``score`` that takes each chunk's
log-softmax across the ranks' vocabulary slices, max and sum all-reduced, the gradient of the sum the
identity on each rank as in megatron's own cross entropy, padded vocabulary rows masked out), so no
``[tokens, vocab]`` logits are kept for backward. With ``spec.share_prompts`` each distinct prompt of a
micro-batch runs once (:func:`shared_prompt_hidden`). Padding: each row is rotated past its left padding,
so its tokens get Hugging Face's positions and one causal ``[S, S]`` mask is exact.

Gradients: the loss of each rank is already scaled for averaging over data-parallel ranks (rlite's
global normalisation), so dense gradients are summed over the data-parallel group and divided by its
size, and an expert's gradients are summed over the expert-data-parallel group and divided by the
same data-parallel size (its copies together saw every rank's tokens once). The gradient norm counts
tensor-parallel duplicates once and sums expert norms over the expert-parallel group.

Memory settings (``parallelism.param_dtype``/``reduce_dtype``, ``model.dtype``, ``training.optimizer_offload``,
ZeRO-1): the model is built in ``param_dtype``; master weights, main gradients and the optimizer's sharding
are :mod:`rlite.plugins.megatron.optimizer`'s.

Data: the ranks of a tensor-parallel group see the same batch (:meth:`MegatronBackend.data_layout`:
the loop shards prompts by data-parallel rank, and the group's rank 0 generates and broadcasts);
expert-parallel ranks see different batches, as data-parallel ranks do. Tensor parallelism > 1 is
for dense models (MoE with TP needs sequence parallelism, which needs Transformer Engine's norms).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlite.api import (
    BackendBase,
    BackendCapabilities,
    ConfigError,
    DataLayout,
    ForwardSpec,
    RolloutBatch,
    build_lr_scheduler,
    load_causal_lm,
    model_inputs,
    pad_to_width,
    skeleton_causal_lm,
    to_device,
)
from rlite.plugins.megatron.checkpoint_state import open_checkpoint_state
from rlite.plugins.megatron.convert import (
    ModelShape,
    expert_index,
    hf_to_megatron_full,
    hf_to_megatron_local,
    local_expert_range,
    megatron_to_hf,
    model_shape,
    padded_vocab_size,
    tp_layout,
    tp_merge,
)
from rlite.plugins.megatron.optimizer import MainParam, MainParams
from rlite.plugins.megatron.routing import routing_context
from rlite.plugins.megatron.shims import apply_cpu_shims, seed_model_parallel_rng


def init_model_parallel(tp: int, ep: int) -> None:
    from megatron.core import parallel_state

    world = dist.get_world_size() if dist.is_initialized() else 1
    for key, size in (("tensor_parallel", tp), ("expert_parallel", ep)):
        if world % size:
            raise ConfigError(f"parallelism.backend.args.{key}={size} must divide the world size {world}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )


def transformer_config(shape: ModelShape, *, tp: int, ep: int, params_dtype: torch.dtype, recompute: bool = False):
    """megatron-core's config for ``shape``. ``params_dtype`` bf16 (fp16) also sets megatron's ``bf16`` (``fp16``)
    flag, with which its attention takes the softmax of bf16 scores in float32 (``attention_softmax_in_fp32``)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe: dict[str, Any] = {}
    if shape.is_moe:
        moe = dict(
            num_moe_experts=shape.num_experts,
            moe_router_topk=shape.moe_top_k,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            # Hugging Face: softmax over all experts, top-k, renormalised when norm_topk_prob; megatron's
            # default (top-k of the logits, softmax over those k) is the same distribution
            moe_router_pre_softmax=not shape.norm_topk_prob,
            moe_shared_expert_intermediate_size=shape.shared_expert_ffn,
            moe_shared_expert_gate=bool(shape.shared_expert_ffn),
            moe_enable_routing_replay=True,  # every router gets a RouterReplay (idle unless rlite drives it)
        )
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        # parallelism.activation_checkpointing: every transformer layer keeps only its input for backward
        # and runs again there (megatron's "full" recompute, one layer per checkpoint)
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}),
        **moe,
    )


def build_gpt_model(shape: ModelShape, tcfg, tp: int, *, grouped_experts: bool = True, sdpa_attention: bool = True):
    """The ``GPTModel`` of megatron-core's local layer spec, with two of its modules replaced by rlite's
    (same parameters, same formula): with ``grouped_experts`` the MoE layers' experts run as two grouped
    matrix products (:class:`~rlite.plugins.megatron.experts.GroupedExperts`, bitwise megatron's loop over
    experts), with ``sdpa_attention`` the core attention is one ``scaled_dot_product_attention``
    (:class:`~rlite.plugins.megatron.attention.SDPAttention`, equal to float rounding)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=shape.num_experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm, normalization="RMSNorm"
    )
    if shape.is_moe and grouped_experts:
        from rlite.plugins.megatron.experts import GroupedExperts

        spec.submodules.mlp.submodules.experts.module = GroupedExperts
    if sdpa_attention:
        from rlite.plugins.megatron.attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return GPTModel(
        tcfg,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(shape.vocab_size, tp),
        max_sequence_length=shape.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=shape.rope_theta,
        share_embeddings_and_output_weights=shape.tied_embeddings,
    )


def load_weights(model: torch.nn.Module, local: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(local, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"megatron weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


# --------------------------------------------------------------------------------------------------
# log-probs over a vocabulary split across tensor-parallel ranks
# --------------------------------------------------------------------------------------------------


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, *, with_entropy: bool, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits)[target]`` (and the entropy) when each TP rank holds a slice of the vocabulary."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    width = logits.shape[-1]
    first = tp_rank * width
    padded = torch.arange(first, first + width, device=logits.device) >= vocab_size
    logits = logits.masked_fill(padded, float("-inf"))
    top = logits.detach().max(-1).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    shifted = logits - top.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(-1))
    log_z = sum_exp.log()
    local = targets - first
    mine = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1) * mine
    logprobs = reduce_from_tensor_model_parallel_region(picked) - log_z
    entropy = None
    if with_entropy:
        # H = log Z - sum_j e^{s_j} s_j / Z: only sums of local terms cross the ranks, so each rank's
        # share of the gradient is exact (a per-rank -sum p log p would miss the other ranks' log Z terms)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            weighted = reduce_from_tensor_model_parallel_region(torch.where(padded, 0.0, exp * shifted).sum(-1))
            entropy = log_z - weighted / sum_exp
    return logprobs, entropy


def same_shape_across_expert_ranks(ids: torch.Tensor, attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad a micro-batch (rows at the bottom, columns at the right, all masked) to the largest shape in
    the expert-parallel group: megatron's allgather token dispatcher gathers equal-sized token blocks.
    Padded tokens are routed like any token; being after every real token (or in rows of their own)
    they are never attended by one under causal attention, and they are cut from the output."""
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_world_size() == 1:
        return ids, attention
    shape = torch.tensor(ids.shape, dtype=torch.long)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=parallel_state.get_expert_model_parallel_group())
    rows, cols = shape.tolist()
    pad = (0, cols - ids.shape[1], 0, rows - ids.shape[0])
    return torch.nn.functional.pad(ids, pad), torch.nn.functional.pad(attention, pad)


def left_aligned_columns(attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(columns, shift)``: each row's columns rotated left past its leading padding, so that
    ``x.gather(1, columns)`` starts every row with its first real token and puts all padding at the end;
    ``shift`` ``[B]`` is each row's number of leading padding columns. ``None`` when some row has
    padding between real tokens (then it cannot be right-aligned away)."""
    seq = attention.shape[1]
    shift = (attention.cumsum(1) == 0).sum(1)
    columns = (torch.arange(seq, device=attention.device) + shift[:, None]) % seq
    aligned = attention.gather(1, columns)
    if not bool((aligned[:, 1:] <= aligned[:, :-1]).all()):
        return None
    return columns, shift


def attention_mask(attention: torch.Tensor, *, right_padded: bool) -> torch.Tensor:
    """True where masked. Right-padded rows need the causal mask alone, ``[1, 1, S, S]`` broadcast over
    the batch (what megatron's causal mask type builds itself when given none, but on ``"cuda"``
    whatever the device, in ``transformer/utils.py::get_default_causal_mask``); rows with padding
    between real tokens get the dense ``[B, 1, S, S]`` causal-and-padding mask."""
    seq = attention.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention.device).triu(1)[None, None]
    return causal if right_padded else causal | (attention == 0)[:, None, None, :]


@contextlib.contextmanager
def returning_hidden_states(model: torch.nn.Module) -> Iterator[None]:
    """Inside, ``GPTModel.forward`` returns the decoder's output ``[S, B, H]`` (final norm applied) and
    skips the output layer: megatron-core's ``_postprocess`` returns the hidden states when the model
    is not the last pipeline stage (``post_process=False``), before it computes logits."""
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = True


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """This TP rank's ``[vocab / TP, H]`` rows of the output layer (the embedding when tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def response_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, vocab_size: int, spec: ForwardSpec,
    *, with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[N]`` of ``targets`` ``[N]`` from the hidden states ``[N, H]`` that
    predict them, never holding more than one chunk's logits: rlite's chunked output layer (the one
    fsdp2 uses; logits kept for backward only under ``spec.recompute_above_bytes``). At TP=1 it is the
    hand-written-backward path; at TP>1 each chunk's ``[tokens, vocab / TP]`` logits are scored by
    :func:`vocab_parallel_logprobs` (sums combined across the ranks), and the hidden states enter as
    megatron's column-parallel output layer takes them (identity forward, gradients summed over the TP
    group)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from rlite.api import chunked_logprobs

    weight = output_weight(model)
    score = None
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        hidden = copy_to_tensor_model_parallel_region(hidden)
        score = functools.partial(vocab_parallel_logprobs, vocab_size=vocab_size)
    elif weight.shape[0] > vocab_size:
        weight = weight[:vocab_size]
    recompute = hidden.shape[0] * weight.shape[0] * 4 > spec.recompute_above_bytes
    return chunked_logprobs(
        hidden, weight, targets, temperature=spec.temperature, chunk_size=spec.chunk_size, with_entropy=with_entropy,
        entropy_grad=spec.entropy_grad, recompute=recompute, score=score,
    )


@contextlib.contextmanager
def attention_prefix(model: torch.nn.Module, *, record: list | None = None, prefix: list | None = None,
                     source: torch.Tensor | None = None) -> Iterator[None]:
    """Inside, each decoder layer's core attention (megatron's ``DotProductAttention``, which takes the
    keys and values after rotary embedding, ``[s, b, groups, head_dim]``) either appends its keys and
    values to ``record``, or attends to ``prefix[layer]`` gathered to its rows (``[:, source]``) ahead
    of its own: the prompt pass and the response pass of :func:`shared_prompt_hidden`. A forward
    pre-hook on megatron's module, so the model's structure and state dict stay as they are."""

    def hook(layer, module, args, kwargs):
        query, key, value, *rest = args
        if record is not None:
            record.append((key, value))
            return None
        prompt_key, prompt_value = prefix[layer]
        key = torch.cat([prompt_key[:, source], key])
        value = torch.cat([prompt_value[:, source], value])
        return (query, key, value, *rest), kwargs

    handles = [
        layer.self_attention.core_attention.register_forward_pre_hook(
            functools.partial(hook, index), with_kwargs=True
        )
        for index, layer in enumerate(model.decoder.layers)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def can_share_prompts(model: torch.nn.Module, spec: ForwardSpec) -> bool:
    """Whether :func:`shared_prompt_hidden` may run this forward: not with megatron's recompute (build
    turns sharing off with activation checkpointing anyway), and not with expert parallelism (the ranks'
    token blocks must match call for call, and each rank's prompts and lengths differ)."""
    from megatron.core import parallel_state

    return (
        spec.share_prompts and not spec.exact_layout and model.config.recompute_granularity is None
        and parallel_state.get_expert_model_parallel_world_size() == 1
    )


def shared_prompt_hidden(
    model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, start: int, response_mask: torch.Tensor,
    unique_rows: torch.Tensor, inverse: torch.Tensor, routing: torch.Tensor | None, spec: ForwardSpec,
) -> torch.Tensor | None:
    """The final hidden states ``[B, T, H]`` that predict each row's ``T`` response tokens, running each
    distinct prompt once (a GRPO group's samples share it): fsdp2's shared-prompt forward in megatron.

    Prompt pass: the distinct prompts, rotated past their left padding (positions ``0..L-1``, one causal
    mask), their per-layer keys and values recorded (:func:`attention_prefix`). Response pass, in
    groups of similar length (:func:`rlite.api.length_buckets`): each row's response tokens at rotary
    positions ``L..``, through megatron's embedding and ``TransformerBlock`` (rotary embeddings given per
    row), attending to its prompt's keys and values and causally to its own tokens. The prompt's keys
    and values reach every sample through a gather, so their gradients sum over the samples. Same
    maths as the full forward. Under a routing plan (``spec.routing``) the prompt pass routes as the
    group's first sample did (``routing`` ``[B, S, L, K]``), as fsdp2's shared forward does. ``None`` when
    a prompt has padding between real tokens."""
    from rlite.api import length_buckets

    device = ids.device
    prompt_ids, prompt_attention = ids[unique_rows, :start], attention[unique_rows, :start]
    aligned = left_aligned_columns(prompt_attention)
    if aligned is None:
        return None
    columns, _ = aligned
    lengths = prompt_attention.sum(1)  # [U] real prompt tokens
    prompt_ids = prompt_ids.gather(1, columns)
    prompt_routing = None
    if routing is not None:
        prompt_routing = routing[unique_rows, :start]
        prompt_routing = prompt_routing.gather(1, columns[:, :, None, None].expand_as(prompt_routing))
    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
    with attention_prefix(model, record=recorded), returning_hidden_states(model), \
            routing_context(model, spec.routing, prompt_routing):
        prompt_hidden = model(
            prompt_ids, torch.arange(start, device=device).expand_as(prompt_ids),
            attention_mask(prompt_attention, right_padded=True),
        )  # [P, U, H]
    batch, width = ids.shape[0], ids.shape[1] - start
    last = prompt_hidden[lengths - 1, torch.arange(len(lengths), device=device)][inverse, None]  # predicts token 0
    if width == 1:
        return last
    # response token t is predicted from response token t - 1: a row of length n runs n - 1 tokens
    # (read from the host copy of the mask: on a GPU, reading the device's would wait for it)
    steps = torch.arange(1, width + 1, device=response_mask.device)
    needs = ((response_mask.bool() * steps).amax(-1) - 1).clamp(min=0).tolist()
    rotary = model.rotary_pos_emb(start + width)[:, 0, 0]  # [positions, rotary dim]
    hidden = last.new_zeros(batch, width - 1, last.shape[-1])
    for rows, run in length_buckets(needs):
        if run == 0:
            continue
        index = torch.tensor(rows, dtype=torch.long, device=device)
        source = inverse[index]
        positions = lengths[source][:, None] + torch.arange(run, device=device)  # [b, run]
        prompt_masked = torch.arange(start, device=device)[None] >= lengths[source][:, None]  # [b, P]
        causal = torch.ones(run, run, dtype=torch.bool, device=device).triu(1)
        mask = torch.cat([prompt_masked[:, None].expand(-1, run, -1), causal.expand(len(rows), -1, -1)], dim=-1)
        tokens = ids[index, start : start + run]
        bucket_routing = None if routing is None else routing[index, start : start + run]
        with attention_prefix(model, prefix=recorded, source=source), \
                routing_context(model, spec.routing, bucket_routing):
            out = model.decoder(
                hidden_states=model.embedding(input_ids=tokens, position_ids=positions),
                attention_mask=mask[:, None],
                rotary_pos_emb=rotary[positions].transpose(0, 1)[:, :, None],  # [run, b, 1, rotary dim]
            )  # [run, b, H]
        hidden = hidden.index_copy(0, index, torch.nn.functional.pad(out.transpose(0, 1), (0, 0, 0, width - 1 - run)))
    return torch.cat([last, hidden], dim=1)


def full_forward_hidden(
    model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, start: int, width: int,
    routing: torch.Tensor | None, spec: ForwardSpec,
) -> torch.Tensor:
    """The final hidden states ``[B, T, H]`` that predict each row's ``T`` response tokens, from one
    forward over whole rows. Each row is rotated left past its prompt's left padding
    (:func:`left_aligned_columns`), so its real tokens sit at positions ``0..L-1`` (the positions
    Hugging Face gives them) and all its padding comes after them: a plain causal mask is then exact for
    every real token and no ``[B, 1, S, S]`` mask is built."""
    device = ids.device
    rows, cols = ids.shape
    aligned = left_aligned_columns(attention)
    shift = torch.zeros(rows, dtype=torch.long, device=device)
    if aligned is not None:
        columns, shift = aligned
        ids, attention = ids.gather(1, columns), attention.gather(1, columns)
        if routing is not None:
            routing = routing.gather(1, columns[:, :, None, None].expand_as(routing))
    ids, attention = same_shape_across_expert_ranks(ids, attention)
    mask = attention_mask(attention, right_padded=aligned is not None)
    position_ids = torch.arange(ids.shape[1], device=device).expand_as(ids)
    if routing is not None:  # padded like the tokens (-1: no recorded choice)
        routing = torch.nn.functional.pad(
            routing, (0, 0, 0, 0, 0, ids.shape[1] - cols, 0, ids.shape[0] - rows), value=-1
        )
    with routing_context(model, spec.routing, routing), returning_hidden_states(model):
        hidden = model(ids, position_ids, mask)  # [S, B, H]
    # the hidden state predicting response token t of row b: original column start - 1 + t, shifted
    predicting = torch.arange(start - 1, start - 1 + width, device=device)[None] - shift[:, None]
    hidden = hidden.transpose(0, 1)[:rows]
    return hidden.gather(1, predicting[:, :, None].expand(-1, -1, hidden.shape[-1]))


def gpt_logprobs(
    model: torch.nn.Module, batch: RolloutBatch, spec: ForwardSpec, vocab_size: int, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, T]`` log-probs (and entropies) of a batch's responses: the hidden states predicting them
    from the shared-prompt forward (:func:`shared_prompt_hidden`, with ``spec.share_prompts`` where a
    prompt repeats) or one forward over whole rows (:func:`full_forward_hidden`); then only the
    response positions' hidden states go through the output layer, in chunks (:func:`response_logprobs`)."""
    from rlite.api import unique_prompt_rows

    inputs = model_inputs(batch, exact_layout=spec.exact_layout)
    if spec.routing is not None and spec.routing.replay and inputs.routed_experts is None:
        raise ValueError("routing replay: the batch carries no routed experts (the engine was not asked for them)")
    # the batch lives on the host (rollouts); the model may be on a GPU: the inputs go to the model's device
    # (asynchronously from pinned memory) and the log-probs stay there, where the loss is computed
    device = next(model.parameters()).device
    host_response_mask = inputs.response_mask
    inputs = to_device(inputs, device)
    ids, attention, routing = inputs.input_ids, inputs.attention_mask, inputs.routed_experts
    rows = ids.shape[0]
    start, width = inputs.response_start, inputs.response_mask.shape[1]
    hidden = None
    if can_share_prompts(model, spec):
        unique_rows, inverse = unique_prompt_rows(ids[:, :start], attention[:, :start])
        if len(unique_rows) < rows:
            hidden = shared_prompt_hidden(
                model, ids, attention, start, host_response_mask, unique_rows, inverse, routing, spec
            )
    if hidden is None:
        hidden = full_forward_hidden(model, ids, attention, start, width, routing, spec)
    # the scored tokens by index, found on the host copy of the mask (a boolean mask's indexing waits for a GPU)
    selected = to_device(host_response_mask.bool().nonzero(as_tuple=True), device)
    targets = ids[:, start : start + width]
    logprobs_flat, entropy_flat = response_logprobs(
        model, hidden[selected], targets[selected], vocab_size, spec, with_entropy=with_entropy
    )
    logprobs = torch.zeros(rows, width, dtype=torch.float32, device=device).index_put(selected, logprobs_flat)
    full = batch.response_ids.shape[1]
    logprobs = pad_to_width(logprobs, full)
    if not with_entropy:
        return logprobs, None
    entropy = torch.zeros(rows, width, dtype=torch.float32, device=device).index_put(selected, entropy_flat)
    return logprobs, pad_to_width(entropy, full)


# --------------------------------------------------------------------------------------------------
# the backend
# --------------------------------------------------------------------------------------------------


@dataclass
class MegatronReference:
    """The frozen initial policy, for pi_ref."""

    model: torch.nn.Module
    vocab_size: int

    def logprobs(self, batch: RolloutBatch, spec: ForwardSpec, *, with_entropy: bool = False):
        return gpt_logprobs(self.model, batch, spec, self.vocab_size, with_entropy=with_entropy)


def hf_weights(model_cfg) -> tuple[Any, Mapping[str, Any], Mapping[str, torch.Tensor]]:
    """``(Hugging Face config, weights, the model's parameter names and shapes)`` of ``model.path``.

    A safetensors folder is read lazily (:mod:`.checkpoint_state`): each rank reads only the tensors of
    its own shard, one at a time; names, shapes and the config come from the transformers model built
    on the meta device (nothing read but config.json). Other checkpoints (GGUF, ``.bin``), or one whose
    tensors do not answer to the model's parameter names, are loaded whole through transformers.
    """
    import logging

    lazy = open_checkpoint_state(model_cfg.path, getattr(torch, model_cfg.dtype), model_cfg.gguf_file)
    if lazy is not None:
        skeleton = skeleton_causal_lm(model_cfg.path, model_cfg.dtype, trust_remote_code=model_cfg.trust_remote_code)
        names = dict(skeleton.state_dict())
        tied = getattr(skeleton.config, "tie_word_embeddings", False)
        missing = [name for name in names if not lazy.resolves(name) and not (tied and name == "lm_head.weight")]
        if not missing:
            return skeleton.config, lazy, names
        logging.getLogger(__name__).info(
            "%s: its safetensors files have no tensor %s under the model's names; loading the whole model "
            "through transformers", model_cfg.path, missing[0],
        )  # fmt: skip
    hf = load_causal_lm(model_cfg)
    state = {name: t.detach() for name, t in hf.state_dict().items()}
    return hf.config, state, state


class MegatronBackend(BackendBase):
    """A megatron-core ``GPTModel`` with AdamW (master weights, main gradients and ZeRO-1 as
    :mod:`rlite.plugins.megatron.optimizer` says) and rlite's LR schedule. Its own: clipping and the
    optimizer step over the main parameters, the checkpoint's keys, the data layout; the step, the LR
    scheduler's state, ``train_mode``, ``backward`` and ``after_checkpoint`` are :class:`BackendBase`'s."""

    @property
    def capabilities(self) -> BackendCapabilities:
        # one rank holding every weight whole: Hugging Face tensors can be views of the weights served
        # (the parameters, or the master weights that AdamW updates in place)
        whole = self.cfg.tensor_parallel == 1 and self.cfg.expert_parallel == 1
        return BackendCapabilities(lora=False, critic=False, weight_views=whole, routing_replay=True)

    def __init__(self, config, cfg, device: torch.device, total_optimizer_steps: int) -> None:
        self.config, self.cfg, self.device = config, cfg, device
        self.cpu_shims = apply_cpu_shims()  # before megatron-core's first import (its JIT fuser, on a CPU)
        from megatron.core import parallel_state

        init_model_parallel(cfg.tensor_parallel, cfg.expert_parallel)
        seed_model_parallel_rng(config.training.seed)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self._hf_config, hf_state, names = hf_weights(config.model)
        fused = any(name.endswith("experts.gate_up_proj") for name in names)
        self.shape = model_shape(self._hf_config, fused_experts=fused)
        if self.shape.is_moe and cfg.tensor_parallel > 1:
            raise ConfigError(
                "parallelism.backend.args.tensor_parallel > 1 with a Mixture-of-Experts model needs sequence "
                "parallelism, which needs Transformer Engine's norms: use expert_parallel instead"
            )
        if self.shape.is_moe and self.shape.num_experts % cfg.expert_parallel:
            raise ConfigError(
                f"parallelism.backend.args.expert_parallel={cfg.expert_parallel} must divide the "
                f"{self.shape.num_experts} experts"
            )
        self.full_names = [name for name, _ in hf_to_megatron_full(names, self.shape, tp_size=cfg.tensor_parallel)]
        self.model, local = self._build_model(hf_state)
        self.weight_plan: list[tuple[str, MainParam, int | None, bool]] | None = None  # on the first sync
        del hf_state, names  # the megatron model (and the master weights) hold this rank's part
        par = config.parallelism
        master_dtype = getattr(torch, config.model.dtype)
        self.main_params = MainParams(
            [(n, p) for n, p in self.model.named_parameters() if p.requires_grad],
            local if master_dtype != getattr(torch, par.param_dtype) else None,
            master_dtype=master_dtype, reduce_dtype=getattr(torch, par.reduce_dtype), group_of=self._replica_group,
            zero1=cfg.distributed_optimizer,
        )
        del local
        self.optimizer = self._build_optimizer(config, device)
        self.scheduler = build_lr_scheduler(self.optimizer, config.training, total_optimizer_steps)
        self.grad_clip = config.training.grad_clip

    def _build_optimizer(self, config, device: torch.device) -> torch.optim.Optimizer:
        """AdamW over what :class:`MainParams` optimizes: torch's fused one, or with its moments in files
        (``training.optimizer_offload=disk``, rlite's ``DiskOffloadAdamW``, which steps fp32 tensors in CPU memory)."""
        train = config.training
        adamw = dict(lr=train.lr, betas=tuple(train.betas), eps=train.eps, weight_decay=train.weight_decay)
        if train.optimizer_offload != "disk":
            return torch.optim.AdamW(self.main_params.optimized(), **adamw, fused=True)
        from rlite.api import DiskOffloadAdamW, optimizer_offload_dir

        if device.type != "cpu":
            raise ConfigError(
                "training.optimizer_offload=disk with parallelism.backend=megatron on a GPU: the disk-offloaded AdamW "
                "steps weights held in CPU memory, and the megatron backend keeps its weights on the GPU; set "
                "training.optimizer_offload=none, or use parallelism.backend=fsdp2 with parallelism.cpu_offload=true"
            )
        rank = dist.get_rank() if dist.is_initialized() else 0
        folder = optimizer_offload_dir(train.optimizer_offload_dir, config.logging.run_dir, rank)
        return DiskOffloadAdamW(self.main_params.optimized(), folder, **adamw)

    def _replica_group(self, name: str):
        """The ranks that hold copies of parameter ``name`` (None: none but this one): the data-parallel group
        for dense parameters, the expert-data-parallel group for experts."""
        from megatron.core import parallel_state as ps

        if self._is_expert(name):
            group = ps.get_expert_data_parallel_group()
        else:
            group = ps.get_data_parallel_group()
        return group if dist.is_initialized() and dist.get_world_size(group) > 1 else None

    def _build_model(self, hf_state: Mapping[str, Any]) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        """A ``GPTModel`` holding this rank's part of the Hugging Face weights in ``parallelism.param_dtype``,
        and that part by megatron name as read (in ``model.dtype``: the master weights' initial values).

        The model is built with megatron's own ``bf16``/``params_dtype`` settings and cast to ``param_dtype``,
        rather than wrapped in megatron's ``Float16Module``: that wrapper casts the module too, but also upcasts
        the output, which here is the hidden states that enter rlite's chunked output layer in the compute dtype
        (logits in float32 after the matmul, as fsdp2's); and the backend calls the ``GPTModel``'s embedding and
        decoder directly (shared prompts), past any wrapper."""
        cfg = self.cfg
        tcfg = transformer_config(
            self.shape, tp=cfg.tensor_parallel, ep=cfg.expert_parallel,
            params_dtype=getattr(torch, self.config.parallelism.param_dtype),
            recompute=self.config.parallelism.activation_checkpointing,
        )
        model = build_gpt_model(self.shape, tcfg, cfg.tensor_parallel)
        local = hf_to_megatron_local(
            hf_state, self.shape, tp_rank=self.tp_rank, tp_size=cfg.tensor_parallel, ep_rank=self.ep_rank,
            ep_size=cfg.expert_parallel,
        )
        # megatron's torch-norm fallback (no Apex, no Transformer Engine) makes float32 norm weights whatever
        # params_dtype says: cast the whole module, as Float16Module does
        model = model.to(device=self.device, dtype=tcfg.params_dtype)
        load_weights(model, local)  # cast into param_dtype
        return model, local

    # -- training ---------------------------------------------------------------------------------
    def logprobs(self, batch: RolloutBatch, spec: ForwardSpec, *, with_entropy: bool = False):
        return gpt_logprobs(self.model, batch, spec, self.shape.vocab_size, with_entropy=with_entropy)

    def _is_expert(self, name: str) -> bool:
        return ".mlp.experts." in name

    def _grad_norm(self) -> torch.Tensor:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        dense = torch.zeros((), dtype=torch.float64, device=self.device)
        expert = torch.zeros((), dtype=torch.float64, device=self.device)
        for mp, sq in self.main_params.squared_norms():
            if self._is_expert(mp.name):
                expert += sq
            elif param_is_not_tensor_parallel_duplicate(mp.param):
                dense += sq
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(dense, group=parallel_state.get_tensor_model_parallel_group())
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            dist.all_reduce(expert, group=parallel_state.get_expert_model_parallel_group())
        return (dense + expert).sqrt()

    def clip_gradients(self) -> float:
        from megatron.core import parallel_state

        self.main_params.reduce_gradients(parallel_state.get_data_parallel_world_size())
        norm = float(self._grad_norm())
        scale = None
        if math.isfinite(norm) and self.grad_clip > 0 and norm > self.grad_clip:
            scale = self.grad_clip / (norm + 1e-6)  # torch's clip_grad_norm_ rule
        self.main_params.hand_gradients_to_optimizer(scale)
        return norm

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.main_params.copy_to_model()  # masters into the model's dtype; ZeRO-1 slices gathered
        self.scheduler.step()

    def zero_grad(self) -> None:
        self.main_params.zero_grad()

    def data_layout(self) -> DataLayout:
        """Data-parallel ranks hold different shards; the ranks of a tensor-parallel group share one
        (its rank 0 generates and broadcasts the batch)."""
        from megatron.core import parallel_state as ps

        tp_group = ps.get_tensor_model_parallel_group()
        return DataLayout(
            rank=ps.get_data_parallel_rank(),
            size=ps.get_data_parallel_world_size(),
            group=ps.get_data_parallel_group(),
            replica_rank=ps.get_tensor_model_parallel_rank(),
            replica_size=ps.get_tensor_model_parallel_world_size(),
            replica_group=tp_group,
            replica_leader=dist.get_global_rank(tp_group, 0) if dist.is_initialized() else 0,
        )

    # -- weights out ------------------------------------------------------------------------------
    def _weight_plan(self) -> list[tuple[str, MainParam, int | None, bool]]:
        """Per full megatron weight, in :func:`~rlite.plugins.megatron.convert.hf_to_megatron_full`'s order:
        ``(name, this rank's parameter, the expert's owning EP rank or None, whether it is TP-split)``.
        Worked out once: parameters and master weights are updated in place, never replaced."""
        params = {mp.name: mp for mp in self.main_params.params}
        ep_size, tp_size = self.cfg.expert_parallel, self.cfg.tensor_parallel
        per_rank = self.shape.num_experts // ep_size if self.shape.is_moe else 0
        plan = []
        for name in self.full_names:
            parts = expert_index(name)
            if parts is not None:
                prefix, expert, suffix = parts
                owner = expert // per_rank
                plan.append((name, params[f"{prefix}{expert - owner * per_rank}{suffix}"], owner, False))
            else:
                plan.append((name, params[name], None, tp_size > 1 and tp_layout(name) != "replicated"))
        return plan

    def _served(self, mp: MainParam) -> torch.Tensor:
        """This rank's weight as the engine samples from it: the master weight where AdamW steps one (as
        fsdp2 serves its float32 sharded parameters under ``param_dtype=bfloat16``; ZeRO-1 slices gathered,
        a collective over the parameter's replicas), else the parameter. Not a copy where it need not be."""
        return self.main_params.full_master(mp).detach() if mp.is_copy else mp.param.detach()

    def _full_megatron(self, views: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight, full (TP shards gathered, experts broadcast by their owner), in the order of
        :func:`~rlite.plugins.megatron.convert.hf_to_megatron_full`. A collective. ``views``: a weight
        this rank holds whole is its parameter or master weight itself (detached), not a copy."""
        from megatron.core import parallel_state

        if self.weight_plan is None:
            self.weight_plan = self._weight_plan()
        ep_size = self.cfg.expert_parallel
        for name, mp, owner, tp_split in self.weight_plan:
            if owner is not None and ep_size > 1:
                group = parallel_state.get_expert_model_parallel_group()
                if owner == self.ep_rank:  # (every rank of an expert-data-parallel group owns the same experts)
                    tensor = self._served(mp).clone()
                else:
                    dtype = mp.main.dtype if mp.is_copy else mp.param.dtype
                    tensor = torch.empty(mp.param.shape, dtype=dtype, device=mp.param.device)
                dist.broadcast(tensor, src=dist.get_global_rank(group, owner), group=group)
                yield name, tensor
                continue
            local = self._served(mp)
            if tp_split:
                shards = [torch.empty_like(local) for _ in range(self.cfg.tensor_parallel)]
                dist.all_gather(shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
                yield name, tp_merge(name, shards)
            else:
                yield name, local if views else local.clone()

    def full_weights(self, *, views: bool = False):
        """Hugging Face tensors streamed as each megatron weight is gathered. With ``views`` (one rank,
        TP=EP=1) the conversion's slices and row splits (embedding, norms, projections, ``gate || up``
        halves, experts) are views of the parameters, so an engine sharing the trainer's weights binds
        them once and later syncs move no bytes for them; the grouped QKV split is a fresh tensor."""
        return megatron_to_hf(self._full_megatron(views), self.shape)

    def lora_adapter(self):
        return None

    def hf_config(self) -> Any:
        return self._hf_config

    # -- checkpoints ------------------------------------------------------------------------------
    def _checkpoint_key(self, name: str) -> str:
        """A name unique to the weights this rank holds: TP shards by rank, experts by global index."""
        parts = expert_index(name)
        if parts is not None:
            prefix, local, suffix = parts
            start = local_expert_range(self.shape, self.ep_rank, self.cfg.expert_parallel).start
            name = f"{prefix}{start + local}{suffix}"
        elif tp_layout(name) != "replicated" and self.cfg.tensor_parallel > 1:
            name = f"{name}.tp{self.tp_rank}"
        return name

    def _optimizer_key(self, mp: MainParam) -> str:
        """:meth:`_checkpoint_key`, and under ZeRO-1 the rank's place among the parameter's replicas (each
        holds its own slice of the optimizer state)."""
        key = self._checkpoint_key(mp.name)
        return key if mp.shard is None else f"{key}.zero{dist.get_rank(mp.group)}"

    def _optimizer_state(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """AdamW's state of ``tensor``; before the first step, zeros to load into."""
        state = self.optimizer.state.get(tensor)
        if state:
            return state
        if hasattr(self.optimizer, "init_state"):  # DiskOffloadAdamW: the moments' files
            self.optimizer.init_state()
            return self.optimizer.state[tensor]
        state = self.optimizer.state[tensor] = {
            "step": torch.zeros((), dtype=torch.float32, device=tensor.device),
            "exp_avg": torch.zeros_like(tensor),
            "exp_avg_sq": torch.zeros_like(tensor),
        }
        return state

    def checkpoint_state(self) -> dict[str, Any]:
        """The model's parameters (``param_dtype``) by :meth:`_checkpoint_key`, and per parameter AdamW's step
        and moments with the master weight where there is one (``master``; under ZeRO-1 this rank's slice)."""
        model, optim = {}, {}
        for mp in self.main_params.params:
            model[self._checkpoint_key(mp.name)] = mp.param.detach()
            if not mp.main.numel():  # a rank's empty ZeRO-1 slice
                continue
            entry = dict(self._optimizer_state(mp.main))
            if mp.is_copy:
                entry["master"] = mp.main.detach()
            optim[self._optimizer_key(mp)] = entry
        return {"model": model, "optim": optim}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for mp in self.main_params.params:
                mp.param.copy_(state["model"][self._checkpoint_key(mp.name)])
                if not mp.main.numel():
                    continue
                target = self._optimizer_state(mp.main)
                for slot, value in state["optim"][self._optimizer_key(mp)].items():
                    (mp.main if slot == "master" else target[slot]).copy_(value)
        self.after_checkpoint()  # DiskOffloadAdamW: the load wrote the moments through its mappings

    # -- other models -----------------------------------------------------------------------------
    def build_reference(self) -> MegatronReference:
        """The initial policy, loaded again from its Hugging Face folder."""
        model, _ = self._build_model(hf_weights(self.config.model)[1])
        model.requires_grad_(False)
        return MegatronReference(model, self.shape.vocab_size)

    def build_critic(self, cfg):
        raise ConfigError("algorithm.critic.enabled: the megatron backend has no critic yet; use parallelism.backend=fsdp2")

    def device_bytes_to_come(self) -> int:
        """AdamW's two moments of every tensor it steps, until its first step (the master weights, which
        ``optimizer_state_bytes_to_come`` would not count as they need no gradient, exist already);
        ``DiskOffloadAdamW`` keeps its moments in files."""
        if not isinstance(self.optimizer, torch.optim.AdamW) or self.optimizer.state:
            return 0
        optimized = self.main_params.optimized()
        return sum(2 * t.numel() * t.element_size() for t in optimized if t.device == self.device)

    def close(self) -> None:
        super().close()  # the optimizer's files (DiskOffloadAdamW)
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()  # the process-wide list megatron keeps
