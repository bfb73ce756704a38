"""Hugging Face <-> megatron-core weights, written in rlite (megatron-bridge needs Transformer Engine).

Supported families: dense Qwen2 / Qwen3 / Llama / Mistral, and MoE Qwen3-MoE / Qwen2-MoE (shared expert
with its sigmoid gate), tied or untied output layer. Megatron-core's *local* layer spec names:

    embedding.word_embeddings.weight                       <- model.embed_tokens.weight (vocab rows)
    decoder.layers.L.input_layernorm.weight                <- model.layers.L.input_layernorm.weight
    decoder.layers.L.self_attention.linear_qkv.{weight,bias}  <- q/k/v_proj, interleaved per query group:
        [q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]
    decoder.layers.L.self_attention.{q,k}_layernorm.weight <- self_attn.{q,k}_norm.weight (Qwen3)
    decoder.layers.L.self_attention.linear_proj.weight     <- self_attn.o_proj.weight
    decoder.layers.L.pre_mlp_layernorm.weight              <- post_attention_layernorm.weight
    decoder.layers.L.mlp.linear_fc1.weight                 <- [gate_proj; up_proj]
    decoder.layers.L.mlp.linear_fc2.weight                 <- down_proj
    decoder.layers.L.mlp.router.weight                     <- mlp.gate.weight (MoE)
    decoder.layers.L.mlp.experts.local_experts.E.linear_fc{1,2}.weight <- expert E (fused 3-D
        ``experts.gate_up_proj`` / ``experts.down_proj`` in transformers 5, per-expert modules before)
    decoder.layers.L.mlp.shared_experts.linear_fc{1,2}.weight, .gate_weight <- shared_expert(_gate)
    decoder.final_layernorm.weight                         <- model.norm.weight
    output_layer.weight                                    <- lm_head.weight (absent when tied)

Tensor parallelism splits column-parallel weights (``linear_qkv``, ``linear_fc1``, the vocabulary)
along dim 0 and row-parallel ones (``linear_proj``, ``linear_fc2``) along dim 1; a gated ``linear_fc1``
is split as ``[gate_r; up_r]`` (megatron's GLU chunks each rank's output in two). The vocabulary is
padded with zero rows to a multiple of the TP size; those logits are masked out of every softmax.
Expert parallelism gives EP rank ``r`` the experts ``[r * E / ep, (r + 1) * E / ep)``; experts are not
tensor-split (expert TP size 1). In the *full* megatron names used between gathering and
conversion, experts carry their global index.

Everything here is pure tensor bookkeeping (no process group): the round trip
``hf -> shards -> gather -> hf`` is tested bitwise for every TP/EP layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from rlite.api import ConfigError

DENSE = {"qwen2", "qwen3", "llama", "mistral"}
MOE = {"qwen3_moe", "qwen2_moe"}


@dataclass(frozen=True)
class ModelShape:
    """What the conversion and megatron's TransformerConfig need from a Hugging Face config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int | None = None
    moe_top_k: int = 0
    moe_ffn_hidden_size: int | None = None
    norm_topk_prob: bool = True
    shared_expert_ffn: int | None = None
    fused_experts: bool = True
    """transformers >= 5 stores experts as 3-D ``gate_up_proj`` / ``down_proj`` parameters."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None


def model_shape(hf_config, *, fused_experts: bool = True) -> ModelShape:
    """Read a Hugging Face config; unsupported architectures and options fail with what to use instead."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in DENSE | MOE:
        raise ConfigError(
            f"parallelism.backend=megatron: model type {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(DENSE | MOE))} (use parallelism.backend=fsdp2 for others)"
        )
    rope_scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default")) if rope_scaling else "default"
    if rope_type not in (None, "default"):
        raise ConfigError(f"parallelism.backend=megatron: rope scaling {rope_type!r} is not supported yet")
    rope_theta = getattr(hf_config, "rope_theta", None)
    if rope_theta is None:
        rope_theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    heads = hf_config.num_attention_heads
    moe = model_type in MOE
    if moe:
        sparse_step = getattr(hf_config, "decoder_sparse_step", 1)
        dense_layers = list(getattr(hf_config, "mlp_only_layers", []) or [])
        if sparse_step != 1 or dense_layers:
            raise ConfigError("parallelism.backend=megatron: MoE models with dense layers in between are not supported yet")
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) if model_type == "qwen2_moe" else None
    return ModelShape(
        model_type=model_type,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        norm_eps=hf_config.rms_norm_eps,
        rope_theta=float(rope_theta),
        max_position_embeddings=hf_config.max_position_embeddings,
        num_experts=hf_config.num_experts if moe else None,
        moe_top_k=hf_config.num_experts_per_tok if moe else 0,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size if moe else None,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", True)),
        shared_expert_ffn=shared,
        fused_experts=fused_experts,
    )


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


# --------------------------------------------------------------------------------------------------
# how each megatron weight is split over tensor-parallel ranks
# --------------------------------------------------------------------------------------------------

VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_COLUMN = re.compile(r"(linear_qkv\.(weight|bias))$")
_GLU = re.compile(r"(mlp|shared_experts)\.linear_fc1\.weight$")
_ROW = re.compile(r"(linear_proj|linear_fc2)\.weight$")
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def tp_layout(name: str) -> str:
    """``vocab``, ``column``, ``glu``, ``row`` or ``replicated`` (experts: always replicated in TP)."""
    if _EXPERT.match(name):
        return "replicated"
    if name in VOCAB:
        return "vocab"
    if _COLUMN.search(name):
        return "column"
    if _GLU.search(name):
        return "glu"
    if _ROW.search(name):
        return "row"
    return "replicated"


def tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of a full megatron tensor."""
    layout = tp_layout(name)
    if tp_size == 1 or layout == "replicated":
        return full
    if layout in ("vocab", "column"):
        return full.chunk(tp_size, dim=0)[tp_rank]
    if layout == "row":
        return full.chunk(tp_size, dim=1)[tp_rank]
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])


def tp_merge(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every TP rank's shard, in rank order (inverse of :func:`tp_shard`)."""
    layout = tp_layout(name)
    if len(shards) == 1 or layout == "replicated":
        return shards[0]
    if layout in ("vocab", "column"):
        return torch.cat(shards, dim=0)
    if layout == "row":
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])


def expert_index(name: str) -> tuple[str, int, str] | None:
    """``(prefix, expert index, suffix)`` of an expert weight's name, else None."""
    match = _EXPERT.match(name)
    return None if match is None else (match.group(1), int(match.group(2)), match.group(3))


def local_expert_range(shape: ModelShape, ep_rank: int, ep_size: int) -> range:
    per_rank = shape.num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


# --------------------------------------------------------------------------------------------------
# Hugging Face -> megatron
# --------------------------------------------------------------------------------------------------


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """Interleave per query group: ``[q_g (heads/groups heads), k_g, v_g]`` for each group g."""
    groups, per_group, hd = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * hd, *rest)
    k = k.reshape(groups, hd, *rest)
    v = v.reshape(groups, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per_group, hd = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * hd, *rest)
    q, k, v = grouped.split([per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    if weight.shape[0] == padded:
        return weight
    return torch.cat([weight, weight.new_zeros(padded - weight.shape[0], *weight.shape[1:])])


def hf_to_megatron_full(
    hf: Mapping[str, torch.Tensor], shape: ModelShape, *, tp_size: int = 1, experts: range | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (unsplit) megatron tensors, experts under their global index, from a Hugging Face state;
    ``experts``: only these experts' tensors (the others are never read from ``hf``)."""
    padded = padded_vocab_size(shape.vocab_size, tp_size)
    yield "embedding.word_embeddings.weight", _pad_vocab(hf["model.embed_tokens.weight"], padded)
    for layer in range(shape.num_layers):
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        attn = h + "self_attn."
        yield m + "input_layernorm.weight", hf[h + "input_layernorm.weight"]
        yield m + "self_attention.linear_qkv.weight", _qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], shape
        )
        if shape.qkv_bias:
            yield m + "self_attention.linear_qkv.bias", _qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], shape
            )
        if shape.qk_norm:
            yield m + "self_attention.q_layernorm.weight", hf[attn + "q_norm.weight"]
            yield m + "self_attention.k_layernorm.weight", hf[attn + "k_norm.weight"]
        yield m + "self_attention.linear_proj.weight", hf[attn + "o_proj.weight"]
        yield m + "pre_mlp_layernorm.weight", hf[h + "post_attention_layernorm.weight"]
        mlp = h + "mlp."
        if not shape.is_moe:
            yield m + "mlp.linear_fc1.weight", torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
            yield m + "mlp.linear_fc2.weight", hf[mlp + "down_proj.weight"]
            continue
        yield m + "mlp.router.weight", hf[mlp + "gate.weight"]
        for expert in range(shape.num_experts) if experts is None else experts:
            e = f"{m}mlp.experts.local_experts.{expert}."
            if shape.fused_experts:
                yield e + "linear_fc1.weight", hf[mlp + "experts.gate_up_proj"][expert]
                yield e + "linear_fc2.weight", hf[mlp + "experts.down_proj"][expert]
            else:
                x = f"{mlp}experts.{expert}."
                yield e + "linear_fc1.weight", torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]])
                yield e + "linear_fc2.weight", hf[x + "down_proj.weight"]
        if shape.shared_expert_ffn:
            s = mlp + "shared_expert."
            yield m + "mlp.shared_experts.linear_fc1.weight", torch.cat([hf[s + "gate_proj.weight"], hf[s + "up_proj.weight"]])
            yield m + "mlp.shared_experts.linear_fc2.weight", hf[s + "down_proj.weight"]
            yield m + "mlp.shared_experts.gate_weight", hf[mlp + "shared_expert_gate.weight"]
    yield "decoder.final_layernorm.weight", hf["model.norm.weight"]
    if not shape.tied_embeddings:
        yield "output_layer.weight", _pad_vocab(hf["lm_head.weight"], padded)


def hf_to_megatron_local(
    hf: Mapping[str, torch.Tensor], shape: ModelShape, *, tp_rank: int, tp_size: int, ep_rank: int, ep_size: int
) -> dict[str, torch.Tensor]:
    """This rank's megatron state (local expert indices, TP shards), ready for ``load_state_dict``."""
    mine = local_expert_range(shape, ep_rank, ep_size) if shape.is_moe else range(0)
    local = {}
    for name, full in hf_to_megatron_full(hf, shape, tp_size=tp_size, experts=mine if shape.is_moe else None):
        parts = expert_index(name)
        if parts is not None:
            prefix, expert, suffix = parts
            if expert not in mine:
                continue
            name = f"{prefix}{expert - mine.start}{suffix}"
        local[name] = tp_shard(name, full, tp_rank, tp_size).contiguous()
    return local


# --------------------------------------------------------------------------------------------------
# megatron -> Hugging Face
# --------------------------------------------------------------------------------------------------


def megatron_to_hf(full: Iterable[tuple[str, torch.Tensor]], shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face ``(name, tensor)`` pairs from full megatron tensors (global expert indices) in the
    order :func:`hf_to_megatron_full` yields them. Streams: a layer's tensors are held only until the
    Hugging Face tensors that need them are complete (all experts of a layer, in the fused format)."""
    experts: dict[int, dict[int, torch.Tensor]] = {}
    for name, tensor in full:
        if name == "embedding.word_embeddings.weight":
            yield "model.embed_tokens.weight", tensor[: shape.vocab_size]
            continue
        if name == "output_layer.weight":
            yield "lm_head.weight", tensor[: shape.vocab_size]
            continue
        if name == "decoder.final_layernorm.weight":
            yield "model.norm.weight", tensor
            continue
        match = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
        if match is None:
            raise ValueError(f"megatron weight {name!r} has no Hugging Face name")
        layer, rest = int(match.group(1)), match.group(2)
        h = f"model.layers.{layer}."
        if rest == "input_layernorm.weight":
            yield h + "input_layernorm.weight", tensor
        elif rest == "pre_mlp_layernorm.weight":
            yield h + "post_attention_layernorm.weight", tensor
        elif rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = _split_qkv(tensor, shape)
            yield h + f"self_attn.q_proj.{kind}", q
            yield h + f"self_attn.k_proj.{kind}", k
            yield h + f"self_attn.v_proj.{kind}", v
        elif rest == "self_attention.q_layernorm.weight":
            yield h + "self_attn.q_norm.weight", tensor
        elif rest == "self_attention.k_layernorm.weight":
            yield h + "self_attn.k_norm.weight", tensor
        elif rest == "self_attention.linear_proj.weight":
            yield h + "self_attn.o_proj.weight", tensor
        elif rest == "mlp.linear_fc1.weight":
            gate, up = tensor.chunk(2, dim=0)
            yield h + "mlp.gate_proj.weight", gate
            yield h + "mlp.up_proj.weight", up
        elif rest == "mlp.linear_fc2.weight":
            yield h + "mlp.down_proj.weight", tensor
        elif rest == "mlp.router.weight":
            yield h + "mlp.gate.weight", tensor
        elif rest == "mlp.shared_experts.linear_fc1.weight":
            gate, up = tensor.chunk(2, dim=0)
            yield h + "mlp.shared_expert.gate_proj.weight", gate
            yield h + "mlp.shared_expert.up_proj.weight", up
        elif rest == "mlp.shared_experts.linear_fc2.weight":
            yield h + "mlp.shared_expert.down_proj.weight", tensor
        elif rest == "mlp.shared_experts.gate_weight":
            yield h + "mlp.shared_expert_gate.weight", tensor
        elif rest.startswith("mlp.experts.local_experts."):
            expert, which = rest[len("mlp.experts.local_experts.") :].split(".", 1)
            expert = int(expert)
            if not shape.fused_experts:
                if which == "linear_fc1.weight":
                    gate, up = tensor.chunk(2, dim=0)
                    yield h + f"mlp.experts.{expert}.gate_proj.weight", gate
                    yield h + f"mlp.experts.{expert}.up_proj.weight", up
                else:
                    yield h + f"mlp.experts.{expert}.down_proj.weight", tensor
                continue
            slot = 1 if which == "linear_fc1.weight" else 2
            experts.setdefault(layer * 2 + slot, {})[expert] = tensor
            done = experts[layer * 2 + slot]
            if len(done) == shape.num_experts:
                stacked = torch.stack([done[i] for i in range(shape.num_experts)])
                del experts[layer * 2 + slot]
                yield h + ("mlp.experts.gate_up_proj" if slot == 1 else "mlp.experts.down_proj"), stacked
        else:
            raise ValueError(f"megatron weight {name!r} has no Hugging Face name")
    if experts:
        raise ValueError(f"experts missing from the megatron weights (layers {sorted(k // 2 for k in experts)})")
