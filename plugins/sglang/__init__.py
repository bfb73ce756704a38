"""The ``sglang`` rollout engine: SGLang >= 0.5.23 on GPUs (``pip install rlite[sglang]``).

Colocated with the trainer under SGLang's memory saver, fed its weights through flattened CUDA-IPC buckets
(:mod:`rlite.plugins.sglang.payloads`). Each engine runs on the GPUs of ``tp_size`` trainer ranks of a
machine, started by the first of them with ``base_gpu_id`` = its GPU and a ``mem_fraction_static`` that
leaves room for the trainer (:mod:`rlite.plugins.sglang.placement`); the other ranks of the group send
their prompts to it (:mod:`~rlite.plugins.sglang.group`). Not run on a GPU by us yet; on a CPU it is tested
against a stand-in that breaks where SGLang 0.5.23 breaks (``tests/workers/fake_sglang.py``).

A plugin package like any other: registered by :data:`rlite.plugin_manager.DEFAULT_PLUGINS` through
``pm.register``, it imports only :mod:`rlite.api` and its own modules, and nothing of SGLang until an engine
is built (``available`` says where it cannot start).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rlite.api import ConfigError, EngineCapabilities, hookimpl


def _eos_ids(tokenizer) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


@dataclass
class SGLangEngineConfig:
    launch: str = "engine"
    """``engine`` (in-process sglang.Engine) or ``server`` (an sglang.launch_server subprocess on 127.0.0.1)."""
    tp_size: int = 1
    """Tensor-parallel size of each engine: one engine runs on the GPUs of ``tp_size`` consecutive trainer
    ranks of a machine (it must divide their number), started by the first of them."""
    mem_fraction_static: Optional[float] = None
    """Fraction of the GPU memory free at the engine's start that SGLang takes for weights and KV cache.
    None: computed so that the trainer's optimizer states (created at its first step), the weight sync's
    buckets and SGLang's runtime (``runtime_reserve_gb``) fit beside it (``rlite.plugins.sglang.placement``)."""
    runtime_reserve_gb: Optional[float] = None
    """GPU memory left to SGLang's activations and CUDA graphs when ``mem_fraction_static`` is computed
    (None: an eighth of the GPU, at least 2 GiB)."""
    dtype: str = "auto"
    """SGLang's dtype (auto: the checkpoint's, float16 for a float32 one, as SGLang picks it); the trainer
    sends its weights in it."""
    verify_weights: bool = True
    """After every sync, compare SGLang's checksums of the 1-D weights it holds (norms, unfused biases)
    with the bytes the trainer sent; a difference stops the run."""
    start_timeout_s: float = 600.0
    """How long the engine may take to start before it is reported dead."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra SGLang ServerArgs, passed unchanged."""
    return_routed_experts: bool = True
    """For a Mixture-of-Experts model: start SGLang with ``enable_return_routed_experts`` so rollouts can
    report every token's experts (routing replay and its metrics; costs a host buffer of routing)."""

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.launch not in ("engine", "server"):
            raise ValueError(f"launch must be 'engine' or 'server', got {self.launch!r}")
        for key in ("tp_size", "mem_fraction_static", "dtype"):  # rlite needs to know these
            if key in self.engine_kwargs:
                raise ValueError(f"engine_kwargs.{key}: set it as rollout.engine.args.{key}")
        for key in ("base_gpu_id", "gpu_id_step"):
            if key in self.engine_kwargs:
                raise ValueError(f"engine_kwargs.{key}: rlite puts each engine on its trainer ranks' GPUs itself")


def sglang_available() -> str | None:
    """What SGLang needs to start on this machine (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None or not torch.cuda.is_available():
        return "needs its package and a GPU"
    return None


def check_sglang_config(config, cfg: SGLangEngineConfig) -> None:
    """Refused when the config loads. Left to the engine's start: the placement on the ranks' GPUs (tp_size
    against the ranks of each machine, ``mem_fraction_static`` against the free memory) and whether SGLang can
    reload the quantizer's weights (its checkpoint's quantization config, built with the engine)."""
    if config.rollout.draft.name != "none" and config.rollout.true_on_policy:
        raise ConfigError(
            "rollout.draft: SGLang's true on-policy mode (rollout.true_on_policy) is not verified with speculative "
            "decoding; set rollout.draft=none, or use rollout.engine=transformers, which keeps it bitwise with a draft"
        )
    if config.rollout.quantization.name != "none" and config.rollout.lora_sync == "adapter":
        raise ConfigError(
            "rollout.lora_sync=adapter: the 'sglang' engine runs rollout.quantization on weights it is sent, and an "
            "adapter sync sends none; use rollout.lora_sync=merged"
        )


def make_sglang_engine(model_config, tokenizer, rollout_config, cfg: SGLangEngineConfig, context):
    draft = context.draft
    try:
        import sglang  # noqa: F401
    except ImportError:
        raise ImportError(
            "rollout.engine: sglang is not installed; pip install 'rlite[sglang]' (GPU machines only)"
        ) from None
    from rlite.plugins.sglang.engine import SGLangEngine, read_model_config
    from rlite.plugins.sglang.group import EngineGroup, SGLangGroupMember
    from rlite.plugins.sglang.payloads import resolve_engine_dtype, sglang_metadata_cls
    from rlite.plugins.sglang.placement import engine_weight_bytes, plan_engines, plan_of

    weight_dtype = resolve_engine_dtype(cfg.dtype, read_model_config(model_config.path))
    quantization_config = None
    if context.quantizer is not None:  # SGLang runs FP8 kernels on the quantized weights it is sent
        quantize, quant_cfg = context.quantizer
        quantization_config = quantize.checkpoint_quantization_config(quant_cfg)
    measured = any(r.free_bytes is not None for r in context.engine_ranks)
    plans = plan_engines(
        context.engine_ranks, tp_size=cfg.tp_size, mem_fraction=cfg.mem_fraction_static,
        runtime_reserve_bytes=None if cfg.runtime_reserve_gb is None else int(cfg.runtime_reserve_gb * 2**30),
        bucket_bytes=rollout_config.bucket_bytes,
        weight_bytes=engine_weight_bytes(model_config.path, weight_dtype, quantized=quantization_config is not None)
        if measured and cfg.mem_fraction_static is None else 0,
    )  # fmt: skip
    plan = plan_of(plans, context.rank)
    group = EngineGroup(plan.ranks, context.rank) if len(plan.ranks) > 1 else None
    device = context.this.gpu_index
    device = None if device is None else torch.device("cuda", device)
    routed_experts = moe_routing_layout(model_config.path) if cfg.return_routed_experts else None
    if group is not None and not group.is_leader:  # another rank runs the engine on this rank's GPU too
        capabilities = EngineCapabilities(lora_adapters=True, routed_experts=routed_experts is not None,
                                          weight_dtype=weight_dtype, reacquires_device_memory=True,
                                          quantized_layout=quantization_config is not None,
                                          draft_methods=("model", "ngram", "eagle"))  # fmt: skip
        return SGLangGroupMember(group, capabilities, bucket_bytes=rollout_config.bucket_bytes, device=device,
                                 metadata_cls=sglang_metadata_cls(), draft=draft)  # fmt: skip
    engine_kwargs = dict(cfg.engine_kwargs)
    load_format = "dummy"  # weights arrive with the first sync
    if rollout_config.lora_sync == "adapter":  # the engine keeps the real base and serves adapters
        lora = model_config.lora
        engine_kwargs.setdefault("enable_lora", True)
        engine_kwargs.setdefault("max_lora_rank", lora.rank)
        engine_kwargs.setdefault("lora_target_modules", list(lora.target_modules))
        load_format = "auto"
    return SGLangEngine(
        model_config.path,
        eos_token_ids=_eos_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        timeout_s=rollout_config.timeout_s,
        start_timeout_s=cfg.start_timeout_s,
        true_on_policy=rollout_config.true_on_policy,
        bucket_bytes=rollout_config.bucket_bytes,
        tp_size=plan.tp_size,
        base_gpu_id=plan.base_gpu_id,
        launch=cfg.launch,
        mem_fraction_static=plan.mem_fraction_static,
        dtype=cfg.dtype,
        load_format=load_format,
        engine_kwargs=engine_kwargs,
        fixed_base=rollout_config.lora_sync == "adapter",
        routed_experts=routed_experts,
        quantization_config=quantization_config,
        verify_weights=cfg.verify_weights,
        group=group,
        draft=draft,
    )


def moe_routing_layout(model_path) -> tuple[int, int] | None:
    """``(num_hidden_layers, num_experts_per_tok)`` of a Mixture-of-Experts checkpoint, else ``None``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_path))
    config = getattr(config, "text_config", None) or config
    if not (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)):
        return None
    return int(config.num_hidden_layers), int(config.num_experts_per_tok)


@hookimpl
def register_rollout_engines(register):
    # SGLang sizes its own KV pool within mem_fraction_static: no memory= (the trainer's check leaves it out)
    register("sglang", make_sglang_engine, SGLangEngineConfig, draft_methods=("model", "ngram", "eagle"),
             available=sglang_available, check_config=check_sglang_config)
