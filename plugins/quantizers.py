"""Built-in plugin: rollout-weight quantizers (``rollout.quantization``).

A quantizer runs on each weight at sync time, ``quantizer(name, tensor, cfg) -> tensor``, and
returns what the engine loads: the *dequantized* weight, so an engine without the quantized kernels
(the CPU transformers engine) samples with exactly the rounding a quantized engine would see. Only
2-D floating tensors (and the 3-D expert stacks of MoE layers, matrix by matrix) whose name matches one of ``cfg.include`` (fnmatch patterns, default
``*_proj.weight``: the q/k/v/o and gate/up/down projections of the decoder blocks, plus
``*experts.gate_up_proj`` and ``*experts.down_proj``) and none of
``cfg.exclude`` are touched; embeddings, norms, biases and ``lm_head`` pass through unchanged.
:func:`quantize_for_engine` produces the pre-quantized checkpoint layout instead, for engines
(SGLang) that load quantized weights themselves.

``fp8_blockwise`` — FP8 e4m3 (``torch.float8_e4m3fn``, max 448) with one scale per 128×128 block,
the layout of DeepSeek-V3 and SGLang's ``fp8`` block quantization. For a weight W [out, in] and
block (r, c):

    s[r, c] = max|W[block]| / 448           (``weight_scale_inv``, shape [⌈out/128⌉, ⌈in/128⌉], fp32)
    q       = fp8(clamp(W / s, −448, 448))  (round to nearest even)
    Ŵ       = q · s

The checkpoint name ``weight_scale_inv`` is what DeepSeek/SGLang call it although it *multiplies*
q (it is the inverse of the quantization scale 448/amax). An all-zero block has s = 0 and q = 0, so
Ŵ = 0 exactly (no NaN). Error: e4m3 has 3 mantissa bits, so for |W/s| ≥ 2⁻⁶ (normal range) the
rounding error is ≤ 2⁻⁴·|W|; below it the spacing is the subnormal step 2⁻⁹, so the error is
≤ 2⁻¹⁰·s. Together |W − Ŵ| ≤ 2⁻⁴·|W| + 2⁻¹⁰·s per element.

``int8_channel`` — INT8 symmetric per output channel (row):

    s[o] = max_i |W[o, i]| / 127,  q = clamp(round(W / s), −127, 127),  Ŵ = q · s

with |W − Ŵ| ≤ s[o] / 2. ``quantize_for_engine`` writes ``name`` (int8) and ``…weight_scale``
([out, 1], fp32), the layout of SGLang's ``w8a8_int8``. An all-zero row has s = 0 and Ŵ = 0.

Dequantized weights are returned in the input dtype (a bf16 master weight is dequantized in fp32
and rounded once more to bf16). Departures: SGLang/DeepSeek clamp the amax away from 0 (1e-12);
rlite stores s = 0 for zero blocks instead, which dequantizes to the same exact zeros.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlite.api import ConfigError, Register, hookimpl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
INT8_MAX = 127


# --------------------------------------------------------------------------------------------------
# Pure quantize / dequantize functions
# --------------------------------------------------------------------------------------------------


def _check_matrix(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight matrix, got shape {tuple(w.shape)}")


def _expand_blocks(scale: torch.Tensor, block: int, shape: torch.Size) -> torch.Tensor:
    """[⌈out/b⌉, ⌈in/b⌉] block scales -> [out, in] per element."""
    full = scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return full[: shape[0], : shape[1]]


def quantize_fp8_blockwise(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with one scale per ``block``×``block`` tile.

    :param w: [out, in] weight (any float dtype; computed in fp32).
    :param block: tile side; shapes that are not multiples of it get partial edge tiles.
    :returns: ``(q, scale_inv)``: q [out, in] ``float8_e4m3fn`` and scale_inv
        [⌈out/block⌉, ⌈in/block⌉] fp32 with W ≈ q · scale_inv (blockwise).
    """
    _check_matrix(w)
    out_features, in_features = w.shape
    rows, cols = -(-out_features // block), -(-in_features // block)
    w32 = w.detach().float()
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=w.device)
    padded[:out_features, :in_features] = w32
    amax = padded.abs().reshape(rows, block, cols, block).amax(dim=(1, 3))
    scale_inv = amax / FP8_MAX
    safe = torch.where(scale_inv > 0, scale_inv, torch.ones_like(scale_inv))
    scaled = w32 / _expand_blocks(safe, block, w.shape)
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # e4m3fn has no inf: never cast out of range
    return q, scale_inv


def dequantize_fp8_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """fp32 [out, in] = q · scale_inv, the inverse of :func:`quantize_fp8_blockwise`."""
    _check_matrix(q)
    return q.float() * _expand_blocks(scale_inv.float(), block, q.shape)


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 with one scale per output channel.

    :param w: [out, in] weight.
    :returns: ``(q, scale)``: q [out, in] int8 in [−127, 127] and scale [out, 1] fp32 with W ≈ q · scale.
    """
    _check_matrix(w)
    w32 = w.detach().float()
    scale = w32.abs().amax(dim=1, keepdim=True) / INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w32 / safe).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] = q · scale (scale [out, 1] or [out])."""
    _check_matrix(q)
    return q.float() * scale.float().reshape(-1, 1)


# --------------------------------------------------------------------------------------------------
# Configs and name filtering
# --------------------------------------------------------------------------------------------------


DEFAULT_TARGETS = ("*_proj.weight", "*experts.gate_up_proj", "*experts.down_proj")
"""The linear layers of the decoder blocks; ``experts.*`` are the ``[experts, out, in]`` stacks of
Hugging Face MoE layers (transformers 5), quantized expert by expert."""


def per_matrix(fn: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor) -> torch.Tensor:
    """``fn`` on a matrix, or on each matrix of a ``[experts, out, in]`` stack."""
    if tensor.dim() == 2:
        return fn(tensor)
    return torch.stack([fn(matrix) for matrix in tensor])


@dataclass
class QuantizationTargets:
    """Which weights a quantizer touches."""

    include: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """fnmatch patterns of weight names to quantize (default: the decoder blocks' linear layers and
    the stacked experts of MoE layers; routers, embeddings, norms and ``lm_head`` stay as they are)."""
    exclude: list[str] = field(default_factory=list)
    """fnmatch patterns of weight names to leave alone even if included."""

    def matches(self, name: str, tensor: torch.Tensor) -> bool:
        """True for a floating 2-D matrix or 3-D stack of matrices (one per expert) whose name is
        included and not excluded."""
        return (
            tensor.dim() in (2, 3)
            and tensor.is_floating_point()
            and any(fnmatch.fnmatchcase(name, p) for p in self.include)
            and not any(fnmatch.fnmatchcase(name, p) for p in self.exclude)
        )


@dataclass
class Fp8BlockwiseConfig(QuantizationTargets):
    """FP8 e4m3 with 128×128 block scales (DeepSeek / SGLang layout)."""

    block_size: int = 128
    """Side of the square tiles sharing one scale."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")


@dataclass
class Int8ChannelConfig(QuantizationTargets):
    """INT8 symmetric, one scale per output channel."""


def _scale_name(name: str, suffix: str) -> str:
    """``…proj.weight`` -> ``…proj.weight_<suffix>``: the scale sits next to its weight."""
    return f"{name}_{suffix}"


# --------------------------------------------------------------------------------------------------
# Quantizers (registered) and the engine layout
# --------------------------------------------------------------------------------------------------


def fp8_blockwise(name: str, tensor: torch.Tensor, cfg: Fp8BlockwiseConfig) -> torch.Tensor:
    """The FP8-rounded weight in ``tensor``'s dtype, or ``tensor`` itself if not targeted."""
    if not cfg.matches(name, tensor):
        return tensor

    def rounded(w: torch.Tensor) -> torch.Tensor:
        q, scale_inv = quantize_fp8_blockwise(w, cfg.block_size)
        return dequantize_fp8_blockwise(q, scale_inv, cfg.block_size).to(w.dtype)

    return per_matrix(rounded, tensor)


def int8_channel(name: str, tensor: torch.Tensor, cfg: Int8ChannelConfig) -> torch.Tensor:
    """The INT8-rounded weight in ``tensor``'s dtype, or ``tensor`` itself if not targeted."""
    if not cfg.matches(name, tensor):
        return tensor

    def rounded(w: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_int8_per_channel(w)
        return dequantize_int8_per_channel(q, scale).to(w.dtype)

    return per_matrix(rounded, tensor)


def _fp8_engine_layout(
    name: str, tensor: torch.Tensor, cfg: Fp8BlockwiseConfig
) -> list[tuple[str, torch.Tensor]]:
    parts = [quantize_fp8_blockwise(w, cfg.block_size) for w in _matrices(tensor)]
    return [(name, _restack(tensor, [q for q, _ in parts])),
            (_scale_name(name, "scale_inv"), _restack(tensor, [s for _, s in parts]))]


def _int8_engine_layout(
    name: str, tensor: torch.Tensor, cfg: Int8ChannelConfig
) -> list[tuple[str, torch.Tensor]]:
    parts = [quantize_int8_per_channel(w) for w in _matrices(tensor)]
    return [(name, _restack(tensor, [q for q, _ in parts])),
            (_scale_name(name, "scale"), _restack(tensor, [s for _, s in parts]))]


def _matrices(tensor: torch.Tensor) -> list[torch.Tensor]:
    return [tensor] if tensor.dim() == 2 else list(tensor)


def _restack(like: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """One matrix back as itself, an expert stack's per-expert results stacked on a leading axis."""
    return parts[0] if like.dim() == 2 else torch.stack(parts)


ENGINE_LAYOUTS: dict[type, Callable[..., list[tuple[str, torch.Tensor]]]] = {
    Fp8BlockwiseConfig: _fp8_engine_layout,
    Int8ChannelConfig: _int8_engine_layout,
}
"""Pre-quantized checkpoint layout per quantizer config class."""


def quantize_for_engine(
    name: str, tensor: torch.Tensor, cfg: QuantizationTargets
) -> list[tuple[str, torch.Tensor]]:
    """The tensors an engine that loads quantized checkpoints expects for one weight.

    ``fp8_blockwise``: ``[(name, q float8_e4m3fn), (name + "_scale_inv", scale_inv fp32)]``, i.e.
    ``…proj.weight`` and ``…proj.weight_scale_inv`` as in SGLang/DeepSeek FP8 checkpoints.
    ``int8_channel``: ``[(name, q int8), (name + "_scale", scale [out, 1] fp32)]``.
    A weight the config does not target comes back unchanged as ``[(name, tensor)]``.
    """
    if not cfg.matches(name, tensor):
        return [(name, tensor)]
    for cls in type(cfg).__mro__:  # a subclassed config keeps its parent's layout
        if cls in ENGINE_LAYOUTS:
            return ENGINE_LAYOUTS[cls](name, tensor, cfg)
    raise TypeError(f"no engine layout for quantizer config {type(cfg).__name__}")


def _fp8_checkpoint_config(cfg: Fp8BlockwiseConfig) -> dict:
    """The Hugging Face ``quantization_config`` of an FP8 checkpoint in :func:`_fp8_engine_layout`'s
    layout (DeepSeek-V3's; SGLang's ``Fp8Config`` reads it: block quantization, activations quantized on
    the fly per token group)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [cfg.block_size, cfg.block_size]}  # fmt: skip


def _int8_checkpoint_config(cfg: Int8ChannelConfig) -> dict:
    return {"quant_method": "w8a8_int8"}


# What an engine that loads quantized weights needs (see register_rollout_quantizers in rlite.hookspecs):
# the tensors it is sent for one weight, and the checkpoint config that declares their format.
fp8_blockwise.engine_layout = quantize_for_engine
fp8_blockwise.checkpoint_quantization_config = _fp8_checkpoint_config
int8_channel.engine_layout = quantize_for_engine
int8_channel.checkpoint_quantization_config = _int8_checkpoint_config


@hookimpl
def register_rollout_quantizers(register: Register) -> None:
    register("fp8_blockwise", fp8_blockwise, Fp8BlockwiseConfig)
    register("int8_channel", int8_channel, Int8ChannelConfig)
