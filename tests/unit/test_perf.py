"""``rlite.perf``: the model FLOP count of every pass against hand computation and against torch's own
FLOP counter on a real transformers model, MFU = FLOPs / time / peak, the device-peak table and the key
that overrides it, and where MFU shows (progress line, summary)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

from rlite.config import ConfigError
from rlite.metrics import plain_progress_line
from rlite.perf import (
    SequenceSums,
    TrainerPasses,
    UnsupportedModel,
    device_peak,
    forward_backward_flops,
    forward_flops,
    matmul_precision,
    model_shape,
    perf_metrics,
    perf_summary,
    resolve_peak,
    sequence_sums,
    step_flops,
)

# hidden 8, 2 layers, 2 heads of 4 (d_attn 8), 1 KV head, intermediate 12, vocabulary 20
TINY = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=12,
            vocab_size=20, max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip
# per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192, MLP 3*8*12 = 288; output head 8*20 = 160
N_TINY = 2 * (192 + 288) + 160
LENGTHS = torch.tensor([3, 5])
S1, S2 = 8, 3 * 4 / 2 + 5 * 6 / 2  # sum s, sum s(s+1)/2 = 6 + 15


def test_the_matmul_weights_of_a_dense_model_by_hand_and_as_its_linear_layers_hold_them():
    shape = model_shape(Qwen2Config(**TINY))
    assert shape.attention_width == 8 and shape.kv_heads == 1 and shape.head_dim == 4
    assert shape.matmul_weights == N_TINY == 1120
    model = Qwen2ForCausalLM(Qwen2Config(**TINY))  # tied: lm_head is the embedding, and still a product
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear == N_TINY


def test_sequence_sums_count_the_pairs_a_causal_mask_leaves():
    sums = sequence_sums(LENGTHS)
    assert sums == SequenceSums(S1, S2) == SequenceSums(8.0, 21.0)
    assert sums.causal_pairs == sum(torch.ones(s, s).tril().sum().item() for s in LENGTHS.tolist())


def test_forward_and_backward_flops_by_hand():
    shape = model_shape(Qwen2Config(**TINY))
    sums = SequenceSums(S1, S2)
    matmuls, attention = 2 * 1120 * 8, 4 * 2 * 8 * 21  # 2 N S1, 4 L d_attn S2
    assert forward_flops(shape, sums) == matmuls + attention == 19264
    assert forward_backward_flops(shape, sums) == 3 * (matmuls + attention) == 57792
    # LoRA: the frozen base gets input gradients only (no weight gradients); attention's backward is whole
    assert forward_backward_flops(shape, sums, weight_gradients=False) == 2 * matmuls + 3 * attention == 39872


def model_flops(counter) -> int:
    """What a FlopCounterMode counted, less the rotary embedding's angles (positions x inverse frequencies:
    no weights, and a product only in some transformers releases, 5.17 for one, a broadcast in others)."""
    rotary = sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items() if name.endswith("rotary_emb"))
    return counter.get_total_flops() - rotary


def test_the_count_equals_torchs_flop_counter_on_the_real_model_less_the_masked_half():
    """torch counts every product the model runs; eager attention computes the masked half of q k^T and p v
    too (s^2 pairs), which the causal count leaves out: the rest must be equal, forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    config = Qwen2Config(**TINY, attn_implementation="eager")
    model = Qwen2ForCausalLM(config)
    shape = model_shape(config)
    s = 7
    ids = torch.randint(0, 20, (1, s))
    with FlopCounterMode(display=False) as forward_only:
        logits = model(ids).logits
    full_attention = 4 * shape.layers * shape.attention_width * s * s  # the s^2 pairs eager computes
    masked = full_attention - 4 * shape.layers * shape.attention_width * s * (s + 1) / 2
    assert model_flops(forward_only) == forward_flops(shape, sequence_sums(torch.tensor([s]))) + masked
    with FlopCounterMode(display=False) as both:
        model(ids).logits.sum().backward()
    assert model_flops(both) == forward_backward_flops(shape, sequence_sums(torch.tensor([s]))) + 3 * masked
    assert logits.shape == (1, s, 20)


def test_moe_layers_count_the_router_the_routed_experts_and_a_shared_expert():
    moe = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6)
    shape = model_shape(Qwen3MoeConfig(**moe, head_dim=4))
    router, experts = 8 * 4, 2 * 3 * 8 * 6  # hidden x experts, top-k x SwiGLU of the expert size
    assert shape.mlp_weights == (router + experts, router + experts)
    assert shape.matmul_weights == 2 * 192 + 2 * (router + experts) + 160
    dense_first = model_shape(Qwen3MoeConfig(**moe, head_dim=4, mlp_only_layers=[0]))
    assert dense_first.mlp_weights == (3 * 8 * 12, router + experts)
    every_other = model_shape(Qwen3MoeConfig(**moe, head_dim=4, decoder_sparse_step=2))
    assert every_other.mlp_weights == (3 * 8 * 12, router + experts)  # layer i routes when (i + 1) % 2 == 0
    shared = model_shape(Qwen2MoeConfig(**moe, shared_expert_intermediate_size=10))
    assert shared.mlp_weights[0] == router + experts + 3 * 8 * 10 + 8  # the shared expert and its gate


def test_a_model_without_what_the_count_needs_is_refused_by_name():
    from transformers import DeepseekV3Config

    with pytest.raises(UnsupportedModel, match="latent attention"):
        model_shape(DeepseekV3Config())
    from types import SimpleNamespace

    without_mlp = SimpleNamespace(**{k: v for k, v in TINY.items() if k != "intermediate_size"})
    with pytest.raises(UnsupportedModel, match="has no intermediate_size"):
        model_shape(without_mlp)
    with pytest.raises(UnsupportedModel, match="has no vocab_size"):
        model_shape(SimpleNamespace(**{k: v for k, v in TINY.items() if k != "vocab_size"}))


def test_step_flops_add_each_pass_the_config_makes():
    shape = model_shape(Qwen2Config(**TINY))
    sums = SequenceSums(S1, S2)
    fwd, both = 19264, 57792
    assert step_flops(shape, sums, TrainerPasses()) == both
    assert step_flops(shape, sums, TrainerPasses(update_epochs=2)) == 2 * both
    assert step_flops(shape, sums, TrainerPasses(pi_old=True, reference=True)) == both + 2 * fwd
    assert step_flops(shape, sums, TrainerPasses(routing_forwards=2)) == both + 2 * fwd
    critic = shape.with_head(1)  # the same backbone with a value head: N = 960 + 8
    critic_fwd = 2 * (960 + 8) * 8 + 4 * 2 * 8 * 21
    assert step_flops(shape, sums, TrainerPasses(critic=critic)) == both + critic_fwd + 3 * critic_fwd
    assert step_flops(shape, sums, TrainerPasses(lora=True)) == 39872


def test_mfu_is_model_flops_over_trainer_time_gpus_and_peak():
    sums = SequenceSums(1000.0, 0.0)
    times = {"time/logprobs": 0.5, "time/train": 1.5, "time/train/forward": 0.4, "time/train/backward": 0.6,
             "time/generation": 9.0}  # fmt: skip
    out = perf_metrics(8e12, sums, times, gpus=2, update_epochs=3, peak_tflops=4.0)
    assert out["perf/model_flops"] == 8e12
    assert out["perf/model_tflops"] == pytest.approx(8e12 / (0.5 + 1.5) / 2 / 1e12) == 2.0  # generation not counted
    assert out["perf/mfu"] == pytest.approx(2.0 / 4.0)
    assert out["perf/peak_tflops"] == 4.0
    assert out["perf/train_tokens"] == 1000.0
    assert out["perf/train_tokens_per_s"] == pytest.approx(3 * 1000.0 / (0.4 + 0.6))
    no_peak = perf_metrics(8e12, sums, times, gpus=2, update_epochs=1, peak_tflops=None)
    assert "perf/mfu" not in no_peak and "perf/peak_tflops" not in no_peak
    assert no_peak["perf/model_tflops"] == out["perf/model_tflops"]


@pytest.mark.parametrize(("name", "bf16"), [
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
    ("NVIDIA H100 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA L4", 121.0), ("NVIDIA A10", 125.0), ("NVIDIA B200", 2250.0),
    ("NVIDIA A10G", None), ("NVIDIA GeForce RTX 3090", None),
])  # fmt: skip
def test_device_peaks_by_cuda_name(name, bf16):
    peak = device_peak(name)
    assert (peak.bf16 if peak else None) == bf16
    if peak:
        assert peak.bf16 > peak.tf32 > peak.fp32 > 0 and "datasheet" in peak.source


def test_the_peak_comes_from_the_key_else_the_table_on_cuda_else_none(monkeypatch):
    assert resolve_peak(None, torch.device("cpu"), "bf16") is None
    assert resolve_peak(12.5, torch.device("cpu"), "fp32") == (12.5, "logging.peak_tflops")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    tflops, source = resolve_peak(None, torch.device("cuda", 0), "tf32")
    assert tflops == 495.0 and "H100 80GB HBM3 tf32" in source
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert resolve_peak(None, torch.device("cuda", 0), "bf16") is None


def test_matmul_precision_follows_the_dtypes_and_torchs_tf32_setting():
    assert matmul_precision("bfloat16", "bfloat16") == "bf16"
    assert matmul_precision("float32", "bfloat16") == "bf16"  # float32 masters, bf16 compute
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert matmul_precision("float32", "float32") == "fp32"
        torch.set_float32_matmul_precision("high")
        assert matmul_precision("float32", "float32") == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_peak_tflops_key_refuses_a_non_positive_value(tmp_path):
    from rlite.testing import tiny_config

    with pytest.raises(ConfigError, match="logging.peak_tflops must be > 0"):
        tiny_config(tmp_path / "model", tmp_path / "run", "logging.peak_tflops=0")


def test_progress_line_shows_mfu_only_when_reported():
    metrics = {"reward/mean": 0.5, "perf/tokens_per_s": 100.0}
    assert "MFU" not in plain_progress_line(1, 10, 0, 1.0, metrics, None)
    line = plain_progress_line(1, 10, 0, 1.0, dict(metrics, **{"perf/mfu": 0.3124}), None)
    assert "| 100 tok/s | MFU 31.2% |" in line


def test_summary_averages_the_steps_after_the_first():
    rows = [{"step": 1, "perf/model_tflops": 1.0, "perf/mfu": 0.1, "perf/train_tokens_per_s": 10.0, "perf/peak_tflops": 10.0},
            {"step": 2, "perf/model_tflops": 2.0, "perf/mfu": 0.2, "perf/train_tokens_per_s": 20.0, "perf/peak_tflops": 10.0},
            {"step": 3, "perf/model_tflops": 4.0, "perf/mfu": 0.4, "perf/train_tokens_per_s": 40.0, "perf/peak_tflops": 10.0}]  # fmt: skip
    out = perf_summary(rows)
    assert out["mfu (mean of steps 2-3)"] == pytest.approx(0.3)
    assert out["model_tflops_per_gpu (mean of steps 2-3)"] == pytest.approx(3.0)
    assert out["train_tokens_per_s (mean of steps 2-3)"] == pytest.approx(30.0)
    assert out["mfu_peak_tflops"] == 10.0
    assert perf_summary(rows[:1]) == {"mfu (mean of steps 1-1)": 0.1, "model_tflops_per_gpu (mean of steps 1-1)": 1.0,
                                      "train_tokens_per_s (mean of steps 1-1)": 10.0, "mfu_peak_tflops": 10.0}  # fmt: skip
    no_peak = perf_summary([{k: v for k, v in r.items() if k not in ("perf/mfu", "perf/peak_tflops")} for r in rows])
    assert not any(k.startswith("mfu") for k in no_peak)
