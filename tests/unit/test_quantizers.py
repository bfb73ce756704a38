"""Rollout-weight quantizers: error bounds of the formats, block layout, zero blocks, name filtering.

Bounds used (per element, s the element's block or channel scale):

* FP8 e4m3 stores x = W/s in [−448, 448] with 3 mantissa bits. Round-to-nearest in the normal
  range (|x| ≥ 2⁻⁶) errs by at most half an ulp, 2⁻⁴·|x|; below it the grid is the subnormal step
  2⁻⁹, so the error is at most 2⁻¹⁰. Scaling back: |W − Ŵ| ≤ 2⁻⁴·|W| + 2⁻¹⁰·s.
* INT8 symmetric rounds W/s to an integer: |W − Ŵ| ≤ s/2.

A small slack covers the fp32 division and multiplication around the rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlite.plugin_manager import RlitePluginManager
from rlite.plugins import quantizers as Q

torch.set_num_threads(1)

SLACK = 1e-6  # relative, for the fp32 arithmetic around the rounding


def _weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Values spread over five decades so blocks hold normal and subnormal fp8 values."""
    g = torch.Generator().manual_seed(seed)
    magnitude = 10 ** (torch.rand(out_features, in_features, generator=g) * 5 - 4)
    return torch.randn(out_features, in_features, generator=g) * magnitude


def test_fp8_layout_and_scales_match_block_amax():
    w = _weight(300, 200)
    q, scale_inv = Q.quantize_fp8_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (3, 2)  # ceil(300/128), ceil(200/128)
    for r in range(3):
        for c in range(2):
            block = w[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128]
            assert scale_inv[r, c].item() == pytest.approx(block.abs().max().item() / 448.0, rel=1e-7)
            # the block's largest magnitude lands on the top of the fp8 range
            assert q[r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128].float().abs().max().item() == 448.0


@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (1, 5), (129, 257)])
def test_fp8_round_trip_error_within_format_bound(shape):
    w = _weight(*shape, seed=sum(shape))
    q, scale_inv = Q.quantize_fp8_blockwise(w)
    deq = Q.dequantize_fp8_blockwise(q, scale_inv, 128)
    s = Q._expand_blocks(scale_inv, 128, w.shape)
    err = (w - deq).abs()
    bound = 2**-4 * w.abs() * (1 + SLACK) + 2**-10 * s * (1 + SLACK)
    assert torch.isfinite(deq).all()
    assert (err <= bound).all(), (err - bound).max()
    x = (w / s).abs()
    normal = x >= 2**-6
    assert (err[normal] <= 2**-4 * w.abs()[normal] * (1 + SLACK)).all()
    if w.numel() > 100:  # the rounding is real: relative errors reach the bound's order
        assert (err[normal] / w.abs()[normal]).max() > 2**-6


def test_fp8_small_block_by_hand():
    w = torch.tensor([[1.0, -2.0, 0.1], [0.5, 4.0, 0.0], [3.0, 0.0, -0.3]])
    q, scale_inv = Q.quantize_fp8_blockwise(w, block=2)
    expected_scales = torch.tensor([[4.0 / 448, 0.1 / 448], [3.0 / 448, 0.3 / 448]])
    assert torch.allclose(scale_inv, expected_scales, rtol=1e-7, atol=0)
    deq = Q.dequantize_fp8_blockwise(q, scale_inv, block=2)
    # 4.0 and 0.1, 3.0, -0.3 are their blocks' maxima: exactly representable after scaling (448)
    for i, j in [(1, 1), (0, 2), (2, 0), (2, 2)]:
        assert deq[i, j].item() == pytest.approx(w[i, j].item(), rel=1e-6)
    assert deq[1, 2] == 0.0 and deq[2, 1] == 0.0


def test_fp8_zero_blocks_and_zero_matrix():
    w = _weight(256, 256)
    w[:128, 128:] = 0.0
    q, scale_inv = Q.quantize_fp8_blockwise(w)
    deq = Q.dequantize_fp8_blockwise(q, scale_inv)
    assert scale_inv[0, 1] == 0.0
    assert torch.isfinite(q.float()).all() and torch.isfinite(deq).all()
    assert torch.equal(deq[:128, 128:], torch.zeros(128, 128))
    zq, zs = Q.quantize_fp8_blockwise(torch.zeros(10, 300))
    assert torch.equal(Q.dequantize_fp8_blockwise(zq, zs), torch.zeros(10, 300))


def test_fp8_rejects_non_matrices():
    with pytest.raises(ValueError, match="2-D"):
        Q.quantize_fp8_blockwise(torch.ones(4))


@pytest.mark.parametrize("shape", [(7, 300), (130, 1)])
def test_int8_round_trip_error_within_half_step(shape):
    w = _weight(*shape, seed=3)
    w[2] = 0.0  # an all-zero channel
    q, scale = Q.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (shape[0], 1) and scale.dtype == torch.float32
    assert q.min() >= -127 and q.max() <= 127
    assert torch.allclose(scale.squeeze(1), w.abs().amax(1) / 127, rtol=1e-7, atol=0)
    deq = Q.dequantize_int8_per_channel(q, scale)
    assert torch.isfinite(deq).all() and torch.equal(deq[2], torch.zeros(shape[1]))
    assert ((w - deq).abs() <= scale / 2 * (1 + SLACK) + 1e-30).all()
    assert (q.abs().amax(1)[scale.squeeze(1) > 0] == 127).all()  # the channel max uses the full range


# --------------------------------------------------------------------------------------------------
# registered quantizers: name filtering and dtypes
# --------------------------------------------------------------------------------------------------

TARGETED = ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight"]
UNTOUCHED = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.bias"]


def test_registered_names():
    pm = RlitePluginManager()
    pm.register(Q)
    registry = pm.registry("rollout_quantizer")
    assert registry.names() == ["fp8_blockwise", "int8_channel"]
    assert registry.get("fp8_blockwise").config_cls is Q.Fp8BlockwiseConfig


@pytest.mark.parametrize(
    "quantizer, cfg", [(Q.fp8_blockwise, Q.Fp8BlockwiseConfig()), (Q.int8_channel, Q.Int8ChannelConfig())]
)
def test_default_targets_only_decoder_linear_weights(quantizer, cfg):
    w = _weight(64, 96)
    for name in TARGETED:
        out = quantizer(name, w, cfg)
        assert out.shape == w.shape and out.dtype == w.dtype and not torch.equal(out, w)
    for name in UNTOUCHED:
        assert quantizer(name, w, cfg) is w
    norm = torch.ones(96)
    assert quantizer("model.layers.0.input_layernorm.weight", norm, cfg) is norm
    assert quantizer("model.layers.0.self_attn.q_proj.weight", norm, cfg) is norm  # not 2-D


def test_include_and_exclude_patterns():
    w = _weight(16, 16)
    cfg = Q.Fp8BlockwiseConfig(include=["lm_head.weight", "*_proj.weight"], exclude=["*.mlp.*"])
    assert not torch.equal(Q.fp8_blockwise("lm_head.weight", w, cfg), w)
    assert not torch.equal(Q.fp8_blockwise("model.layers.0.self_attn.o_proj.weight", w, cfg), w)
    assert Q.fp8_blockwise("model.layers.0.mlp.up_proj.weight", w, cfg) is w


def test_quantizer_keeps_bf16_and_matches_pure_functions():
    w = _weight(130, 70).to(torch.bfloat16)
    out = Q.fp8_blockwise(TARGETED[0], w, Q.Fp8BlockwiseConfig())
    assert out.dtype == torch.bfloat16
    q, s = Q.quantize_fp8_blockwise(w)
    assert torch.equal(out, Q.dequantize_fp8_blockwise(q, s).to(torch.bfloat16))


def test_quantize_for_engine_layouts():
    w = _weight(300, 200)
    name = TARGETED[0]
    fp8 = Q.quantize_for_engine(name, w, Q.Fp8BlockwiseConfig())
    assert [n for n, _ in fp8] == [name, "model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert fp8[0][1].dtype == torch.float8_e4m3fn and fp8[1][1].shape == (3, 2)
    deq = Q.dequantize_fp8_blockwise(fp8[0][1], fp8[1][1])
    assert torch.equal(deq, Q.fp8_blockwise(name, w, Q.Fp8BlockwiseConfig()))
    int8 = Q.quantize_for_engine(name, w, Q.Int8ChannelConfig())
    assert [n for n, _ in int8] == [name, "model.layers.0.self_attn.q_proj.weight_scale"]
    assert int8[0][1].dtype == torch.int8 and int8[1][1].shape == (300, 1)
    assert Q.quantize_for_engine("lm_head.weight", w, Q.Fp8BlockwiseConfig()) == [("lm_head.weight", w)]


def test_fp8_error_is_small_relative_to_the_weight_norm():
    """A sanity number on a Gaussian matrix: the relative Frobenius error is a few percent at most."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(256, 256, generator=g)
    deq = Q.fp8_blockwise(TARGETED[0], w, Q.Fp8BlockwiseConfig())
    rel = (torch.linalg.norm(w - deq) / torch.linalg.norm(w)).item()
    assert 0 < rel < 2**-4 and math.isfinite(rel)
