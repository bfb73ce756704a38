"""Model FLOPs and MFU: how much of the device's peak the trainer's passes use (``perf/*`` metrics).

**FLOPs of one pass.** Only matrix products count, 2 FLOPs per multiply-add (norms, rotary, softmax,
activations, biases and the input embedding lookup are left out, as torchtitan and verl leave them out).
For a sequence of ``s`` real tokens (prompt + response; padding is not model work) in a model of ``L``
layers, a forward pass costs::

    F_fwd(s) = 2 * N * s  +  4 * L * d_attn * s * (s + 1) / 2

* ``N``: the matrix weights one token multiplies, per layer
  ``hidden * d_attn`` (q) + ``2 * hidden * kv_heads * head_dim`` (k, v) + ``d_attn * hidden`` (o)
  + the MLP's ``3 * hidden * intermediate`` (SwiGLU's gate, up and down); a Mixture-of-Experts layer counts
  the router ``hidden * experts``, the ``top_k`` experts a token is routed to (``3 * hidden * expert_intermediate``
  each) and a shared expert if any (``3 * hidden * shared_intermediate + hidden`` with its gate); plus the
  output head ``hidden * vocab`` once (tied to the embedding or not: the head is a product, the lookup is not;
  a critic's value head is ``hidden * 1``).
* ``d_attn = heads * head_dim``. Attention is ``q k^T`` and ``p v``, ``2 * d_attn`` FLOPs each per
  (query, key) pair and layer, over the ``s (s + 1) / 2`` pairs a **causal** mask leaves (from each
  sequence's real length). torchtitan and verl count ``s^2`` pairs (``12 * L * d_attn * s`` per token for
  forward + backward); this module counts the causal half, the work a causal kernel does.

As in PaLM's and torchtitan's MFU, the count is the model's, not the implementation's: every real token of
every sequence goes through the whole model, output head included, whatever a trainer skips (the logits of
prompt positions, which no loss needs and neither rlite nor TRL computes; rlite's shared prompt prefix,
``training.share_prompt_prefix``, which runs a GRPO group's prompt once). MFU is then throughput x FLOPs
per token / peak, comparable between two implementations of the same job; work a trainer skips shows as
a higher MFU.

Backward costs twice the forward (gradients of the inputs and of the weights), so forward + backward is
``3 * F_fwd(s) = 6 N s + 6 L d_attn s (s + 1)``: torchtitan's ``6 N`` per token with the causal attention
term. With LoRA (``model.lora.enabled``) the frozen base weights get no weight gradients: forward + backward
is ``4 N s + 6 L d_attn s (s + 1)`` (the adapters' rank-r products are not counted). Recomputation
(``parallelism.activation_checkpointing``, lean activations) is not counted either: MFU counts the model's
FLOPs, not the hardware's.

**FLOPs of a step** (:meth:`PerfMeter.step_metrics`), over the global batch, with ``S1 = sum(s)`` and
``S2 = sum(s (s + 1) / 2)`` over its sequences::

    policy update: epochs_per_step x forward + backward
    pi_old:        one forward, when the trainer recomputes it (PreparedTargets.mismatch_measured)
    pi_ref:        one forward, when a reference model runs (algorithm.kl.coef > 0)
    MoE routing:   two forwards, when the routing metrics run (algorithm.routing_metrics)
    critic:        one forward (values) + one forward + backward (its update), with its own N (value head)

Evaluation, generation and a speculative draft's update are not trainer work and are not counted.

**MFU** = the step's model FLOPs / (trainer seconds x GPUs x the peak FLOP/s of one GPU), where the trainer
seconds are ``time/logprobs + time/train`` (scoring, advantages, forward, backward, optimizer) on rank 0 and
GPUs are all ranks (``WORLD_SIZE``). The peak is ``logging.peak_tflops`` when set, else the dense spec
number of :data:`PEAK_TFLOPS` for the CUDA device's name in the trainer's matmul precision (bf16 when
``model.dtype`` or ``parallelism.param_dtype`` is bfloat16; else tf32 when torch allows TF32 matmuls,
else fp32). On CPU, or on a GPU not in the table, there is no peak and ``perf/mfu`` is not reported.

Metrics (rank 0's clock, global FLOPs and tokens):

============================== ========================================================================
``perf/model_flops``           the step's trainer model FLOPs (formula above), all ranks together
``perf/model_tflops``          ``perf/model_flops / (time/logprobs + time/train) / GPUs / 1e12``: achieved
                               model TFLOP/s per GPU
``perf/mfu``                   ``perf/model_tflops / perf/peak_tflops`` (only with a peak)
``perf/peak_tflops``           the peak it is measured against (only with a peak)
``perf/train_tokens``          tokens (prompt + response, real) of one pass over the step's batch
``perf/train_tokens_per_s``    ``epochs_per_step * perf/train_tokens / (time/train/forward + time/train/backward)``:
                               the policy update's forward + backward throughput, all ranks
============================== ========================================================================
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------
# the model's shape and the FLOPs of a pass
# --------------------------------------------------------------------------------------------------


class UnsupportedModel(ValueError):
    """A model whose config does not say what :func:`model_shape` needs (its FLOPs are not counted)."""


@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a decoder-only transformer."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_weights: tuple[int, ...]
    """Per layer: the MLP's matrix weights one token multiplies (a MoE layer: router + its top-k experts + shared)."""
    head_outputs: int
    """Width of the output head: the vocabulary (a language model) or 1 (a critic's value head)."""

    @property
    def attention_width(self) -> int:
        """``d_attn = heads * head_dim``."""
        return self.heads * self.head_dim

    @property
    def matmul_weights(self) -> int:
        """``N``: the matrix weights one token multiplies in a forward pass (module docstring)."""
        attention = self.hidden * self.attention_width * 2 + 2 * self.hidden * self.kv_heads * self.head_dim
        return self.layers * attention + sum(self.mlp_weights) + self.hidden * self.head_outputs

    def with_head(self, outputs: int) -> ModelShape:
        """The same backbone with another output head (a critic's value head: 1)."""
        return ModelShape(self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, self.mlp_weights, outputs)


def _field(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def model_shape(hf_config: Any) -> ModelShape:
    """The :class:`ModelShape` of a Hugging Face decoder config: Llama/Qwen2/Qwen3/Mistral-style dense models,
    Qwen2-MoE/Qwen3-MoE (``num_experts``, ``moe_intermediate_size``, ``decoder_sparse_step``,
    ``mlp_only_layers``, a shared expert) and Mixtral (``num_local_experts``). Raises :class:`UnsupportedModel`
    naming what is missing (multi-head latent attention, for one, has other projections)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    if _field(text, "kv_lora_rank", "q_lora_rank") is not None:
        raise UnsupportedModel(f"{type(text).__name__}: multi-head latent attention (kv_lora_rank) is not counted")
    hidden = _field(text, "hidden_size")
    layers = _field(text, "num_hidden_layers")
    heads = _field(text, "num_attention_heads")
    vocab = _field(text, "vocab_size")
    missing = [name for name, value in (("hidden_size", hidden), ("num_hidden_layers", layers),
                                        ("num_attention_heads", heads), ("vocab_size", vocab)) if value is None]  # fmt: skip
    if missing:
        raise UnsupportedModel(f"{type(text).__name__} has no {', '.join(missing)}")
    kv_heads = _field(text, "num_key_value_heads") or heads
    head_dim = _field(text, "head_dim") or hidden // heads
    intermediate = _field(text, "intermediate_size")
    experts = int(_field(text, "num_experts", "num_local_experts") or 0)
    mlp = []
    for layer in range(layers):
        if experts and _sparse_layer(text, layer):
            top_k = int(_field(text, "num_experts_per_tok") or 0)
            expert = _field(text, "moe_intermediate_size") or intermediate
            shared = _field(text, "shared_expert_intermediate_size") or 0
            if not top_k or expert is None:
                raise UnsupportedModel(f"{type(text).__name__}: a MoE config without num_experts_per_tok or an expert size")
            mlp.append(hidden * experts + top_k * 3 * hidden * expert + (3 * hidden * shared + hidden if shared else 0))
        else:
            if intermediate is None:
                raise UnsupportedModel(f"{type(text).__name__} has no intermediate_size")
            mlp.append(3 * hidden * intermediate)
    return ModelShape(int(layers), int(hidden), int(heads), int(kv_heads), int(head_dim), tuple(mlp), int(vocab))


def _sparse_layer(text: Any, layer: int) -> bool:
    """Qwen-MoE's rule for which layers route to experts (Mixtral: every layer)."""
    if layer in (getattr(text, "mlp_only_layers", None) or []):
        return False
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    return (layer + 1) % step == 0


class SequenceSums(NamedTuple):
    """What the FLOPs of a pass over a batch need of its sequences' real lengths ``s``."""

    tokens: float
    """``S1 = sum(s)``."""
    causal_pairs: float
    """``S2 = sum(s (s + 1) / 2)``: the (query, key) pairs a causal mask leaves."""


def sequence_sums(lengths: torch.Tensor) -> SequenceSums:
    """:class:`SequenceSums` of the real lengths ``[B]`` (float64: sums of squares of long batches stay exact)."""
    s = lengths.to(torch.float64)
    return SequenceSums(float(s.sum()), float((s * (s + 1) / 2).sum()))


def forward_flops(shape: ModelShape, sums: SequenceSums) -> float:
    """``sum(F_fwd(s)) = 2 N S1 + 4 L d_attn S2`` (module docstring)."""
    return 2.0 * shape.matmul_weights * sums.tokens + 4.0 * shape.layers * shape.attention_width * sums.causal_pairs


def forward_backward_flops(shape: ModelShape, sums: SequenceSums, *, weight_gradients: bool = True) -> float:
    """``6 N S1 + 12 L d_attn S2``; without weight gradients (LoRA's frozen base) ``4 N S1 + 12 L d_attn S2``."""
    attention = 4.0 * shape.layers * shape.attention_width * sums.causal_pairs
    weights = 2.0 * shape.matmul_weights * sums.tokens
    return 3 * attention + (3 if weight_gradients else 2) * weights


@dataclass(frozen=True)
class TrainerPasses:
    """Which passes the trainer makes over a step's batch (module docstring, "FLOPs of a step")."""

    update_epochs: int = 1
    lora: bool = False
    pi_old: bool = False
    reference: bool = False
    routing_forwards: int = 0
    critic: ModelShape | None = None


def step_flops(shape: ModelShape, sums: SequenceSums, passes: TrainerPasses) -> float:
    """The trainer's model FLOPs of one step over a batch of :class:`SequenceSums` ``sums``."""
    flops = passes.update_epochs * forward_backward_flops(shape, sums, weight_gradients=not passes.lora)
    forwards = int(passes.pi_old) + int(passes.reference) + passes.routing_forwards
    flops += forwards * forward_flops(shape, sums)
    if passes.critic is not None:
        flops += forward_flops(passes.critic, sums) + forward_backward_flops(passes.critic, sums)
    return flops


# --------------------------------------------------------------------------------------------------
# the device's peak
# --------------------------------------------------------------------------------------------------


class Peak(NamedTuple):
    """Dense (no 2:4 sparsity) peak TFLOP/s of one GPU, by matmul precision, with where it comes from."""

    bf16: float
    tf32: float
    fp32: float
    source: str


_H100 = "NVIDIA H100 datasheet, https://www.nvidia.com/en-us/data-center/h100/ (sparsity figures halved)"
_H200 = "NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/ (sparsity figures halved)"
_A100 = "NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/ (sparsity figures halved)"
PEAK_TFLOPS: tuple[tuple[str, Peak], ...] = (
    (r"\bH100\b.*\bNVL\b", Peak(835.0, 418.0, 60.0, _H100 + ", H100 NVL")),
    (r"\bH100\b.*\bPCIe\b", Peak(756.0, 378.0, 51.0, _H100 + ", H100 PCIe")),
    (r"\bH100\b", Peak(989.0, 495.0, 67.0, _H100 + ", H100 SXM")),
    (r"\bH200\b.*\bNVL\b", Peak(835.0, 418.0, 60.0, _H200 + ", H200 NVL")),
    (r"\bH200\b", Peak(989.0, 495.0, 67.0, _H200 + ", H200 SXM")),
    (r"\bGH200\b", Peak(989.0, 495.0, 67.0, "NVIDIA GH200 datasheet (the H100 SXM's tensor cores), sparsity halved")),
    (r"\bB200\b", Peak(2250.0, 1125.0, 75.0, "NVIDIA HGX B200 datasheet, one GPU = 1/8 of the 8-GPU figures, "
                                               "sparsity halved")),
    (r"\bA100\b", Peak(312.0, 156.0, 19.5, _A100 + ", SXM and PCIe, 40 and 80 GB")),
    (r"\bL40S\b", Peak(362.0, 183.0, 91.6, "NVIDIA L40S datasheet, sparsity halved")),
    (r"\bL4\b", Peak(121.0, 60.0, 30.3, "NVIDIA L4 datasheet, sparsity halved")),
    (r"\bA10\b", Peak(125.0, 62.5, 31.2, "NVIDIA A10 datasheet, sparsity halved")),
)
"""Device peaks by the CUDA device name (``torch.cuda.get_device_name``: "NVIDIA H200", "NVIDIA H100 80GB HBM3",
"NVIDIA A100-SXM4-80GB", ...), first match wins. Spec numbers are what MFU is conventionally measured against
(torchtitan's and verl's tables hold the same bf16 figures); a device reaches less: on the lent H200 a large
bf16 matrix product ran at 769-798 TFLOP/s, about 80% of 989. ``logging.peak_tflops`` overrides the table."""


def device_peak(device_name: str) -> Peak | None:
    """The :data:`PEAK_TFLOPS` entry of a CUDA device name, or None for a device not in the table."""
    for pattern, peak in PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peak
    return None


def matmul_precision(model_dtype: str, param_dtype: str) -> str:
    """``bf16``, ``tf32`` or ``fp32``: the precision the trainer's matrix products run in (module docstring)."""
    if "bfloat16" in (model_dtype, param_dtype):
        return "bf16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def resolve_peak(override_tflops: float | None, device: torch.device, precision: str) -> tuple[float, str] | None:
    """``(TFLOP/s, where it comes from)`` of one device, or None when unknown (CPU, a GPU not in the table)."""
    if override_tflops is not None:
        return float(override_tflops), "logging.peak_tflops"
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = device_peak(name)
    if peak is None:
        log.warning("perf/mfu not reported: %r is not in rlite.perf.PEAK_TFLOPS; set logging.peak_tflops to its "
                    "dense %s TFLOP/s to report MFU", name, precision)  # fmt: skip
        return None
    return getattr(peak, precision), f"{name} {precision} dense spec ({peak.source})"


# --------------------------------------------------------------------------------------------------
# per step
# --------------------------------------------------------------------------------------------------


def perf_metrics(flops: float, sums: SequenceSums, times: dict[str, float], *, gpus: int, update_epochs: int,
                 peak_tflops: float | None) -> dict[str, float]:
    """The ``perf/*`` metrics of the module docstring from the step's FLOPs, its batch and its ``time/*``."""
    trainer_s = times.get("time/logprobs", 0.0) + times.get("time/train", 0.0)
    update_s = times.get("time/train/forward", 0.0) + times.get("time/train/backward", 0.0)
    out = {"perf/model_flops": flops, "perf/train_tokens": sums.tokens}
    if trainer_s > 0:
        out["perf/model_tflops"] = flops / trainer_s / max(gpus, 1) / 1e12
        if peak_tflops is not None:
            out["perf/peak_tflops"] = peak_tflops
            out["perf/mfu"] = out["perf/model_tflops"] / peak_tflops
    if update_s > 0:
        out["perf/train_tokens_per_s"] = update_epochs * sums.tokens / update_s
    return out


class PerfMeter:
    """The ``perf/*`` metrics of each step of a run (built once by :meth:`for_run`)."""

    def __init__(self, shape: ModelShape | None, passes: TrainerPasses, *, gpus: int,
                 peak: tuple[float, str] | None) -> None:
        self.shape, self.passes, self.gpus = shape, passes, gpus
        self.peak_tflops, self.peak_source = (peak if peak is not None else (None, None))

    @classmethod
    def for_run(cls, cfg: Any, hf_config: Any, ctx: Any, *, critic: bool, reference: bool,
                routing_metrics: bool) -> PerfMeter:
        """From the run's config and the policy's Hugging Face config: the policy's shape, the passes the config
        makes (``critic``, ``reference``: whether the run trains a critic and scores a reference;
        ``routing_metrics``: two more forwards a step), the GPUs (``ctx``, the run's
        :class:`~rlite.distributed.DistContext`) and the peak."""
        try:
            shape = model_shape(hf_config)
        except UnsupportedModel as exc:
            log.warning("perf/model_flops, perf/model_tflops and perf/mfu not reported: %s", exc)
            shape = None
        critic_shape = None
        if critic and shape is not None:
            critic_shape = shape.with_head(1)
            if cfg.algorithm.critic.path and cfg.algorithm.critic.path != cfg.model.path:
                from transformers import AutoConfig

                critic_shape = model_shape(AutoConfig.from_pretrained(cfg.algorithm.critic.path)).with_head(1)
        passes = TrainerPasses(
            update_epochs=cfg.algorithm.epochs_per_step, lora=cfg.model.lora.enabled, reference=reference,
            routing_forwards=2 if routing_metrics else 0, critic=critic_shape,
        )  # fmt: skip
        precision = matmul_precision(cfg.model.dtype, cfg.parallelism.param_dtype)
        peak = resolve_peak(cfg.logging.peak_tflops, ctx.device, precision)
        if peak is not None and shape is not None and ctx.is_main:
            log.info("perf/mfu: against %.1f TFLOP/s per GPU (%s)", *peak)
        return cls(shape, passes, gpus=ctx.world_size, peak=peak)

    def step_metrics(self, sums: SequenceSums, times: dict[str, float], *, pi_old_recomputed: bool) -> dict[str, float]:
        """This step's ``perf/*`` metrics: ``sums`` of the global batch, ``times`` its ``time/*`` metrics."""
        if self.shape is None:
            return {"perf/train_tokens": sums.tokens}
        passes = replace(self.passes, pi_old=pi_old_recomputed)
        flops = step_flops(self.shape, sums, passes)
        return perf_metrics(flops, sums, times, gpus=self.gpus, update_epochs=passes.update_epochs,
                            peak_tflops=self.peak_tflops)


def perf_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The end-of-run summary's lines about speed: the mean of ``perf/mfu``, ``perf/model_tflops`` and
    ``perf/train_tokens_per_s`` over the steps after the first (its warm-up: allocations, kernel choices,
    compilation), or over the one step of a one-step run."""
    steady = [r for r in rows if "perf/model_tflops" in r]
    steady = steady[1:] or steady
    if not steady:
        return {}
    label = f"steps {steady[0]['step']}-{steady[-1]['step']}" if "step" in steady[0] else "last step"
    out: dict[str, Any] = {}
    for key, name in (("perf/mfu", "mfu"), ("perf/model_tflops", "model_tflops_per_gpu"),
                      ("perf/train_tokens_per_s", "train_tokens_per_s")):  # fmt: skip
        values = [r[key] for r in steady if r.get(key) is not None]
        if values:
            out[f"{name} (mean of {label})"] = sum(values) / len(values)
    if "perf/peak_tflops" in steady[-1]:
        out["mfu_peak_tflops"] = steady[-1]["perf/peak_tflops"]
    return out
