"""Built-in rollout engines.

* ``transformers``: transformers ``generate`` with a KV cache, colocated with the trainer; in-process
  by default, or in its own spawned process (``args.process: true``) receiving weights through
  shared-memory buckets (``rlite.engines.transformers.process``). Its model is built from the
  config with no weights read (``rlite.hf_models.skeleton_causal_lm``): the trainer's first sync,
  before any rollout, gives every parameter.
* ``sglang``: SGLang >= 0.5.23 on GPUs (``pip install rlite[sglang]``), colocated with the memory
  saver, weights through flattened CUDA-IPC buckets (``rlite.engines.sglang``). Each engine runs on
  the GPUs of ``tp_size`` trainer ranks of a machine, started by the first of them with
  ``base_gpu_id`` = its GPU and a ``mem_fraction_static`` that leaves room for the trainer
  (``rlite.engines.sglang.placement``). Not run on a GPU by us yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rlite.api import ConfigError, hookimpl

ENGINE_DEVICES = ("auto", "cpu")
ENGINE_DTYPES = ("auto", "float32", "bfloat16", "float16")
ENGINE_DECODES = ("auto", "loop", "static", "graph", "generate")
ENGINE_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

log = logging.getLogger("rlite")


@dataclass
class TransformersEngineConfig:
    process: bool = False
    """Run the engine in its own spawned process, fed the weights zero-copy through flattened buckets: shared
    memory on a CPU, CUDA-IPC handles to GPU memory on a GPU (the ``rlite.sync`` protocol, checksummed)."""
    attn_implementation: str = "sdpa"
    """Attention implementation of the engine's model (sdpa, eager, flash_attention_2, flash_attention_3,
    flex_attention)."""
    share_weights: Optional[bool] = None
    """A sync binds the engine's parameters to the synced tensors instead of copying them (same shape, dtype,
    device): on one rank, without LoRA or rollout quantization, those are the trainer's own tensors (no second
    copy of the model; a sync moves no bytes). None (auto): on, except with ``rollout.mode=one_step_off`` or
    ``async``, where the engine samples while the trainer updates and keeps its own copy. Off: every sync copies."""
    device: str = "auto"
    """Where the engine samples: ``auto`` on the trainer's device (each rank's own GPU on a GPU, the CPU on a
    CPU), ``cpu`` on the host whatever the trainer's device."""
    dtype: str = "auto"
    """The dtype the engine samples in: ``auto`` the one the trainer computes in (``parallelism.param_dtype``:
    with float32 master weights and bfloat16 compute, bfloat16), or float32, bfloat16, float16."""
    decode: str = "auto"
    """How the engine decodes (``rlite.engines.transformers.decode``): ``loop`` (a KV cache that finished rows
    leave, the CPU's fastest), ``static`` (every row kept, no host synchronisation per token), ``graph``
    (``static`` with each token's step replayed from a CUDA graph, a GPU's fastest) or ``generate``
    (transformers' own). ``auto``: ``graph`` on a GPU (``static`` if the model's step cannot be captured,
    said once), ``loop`` on a CPU and wherever a setting needs the loop (routing replay, a draft, true
    on-policy mode, which samples with its own fixed-shape forward)."""

    def __post_init__(self) -> None:
        for key, value, allowed in (("device", self.device, ENGINE_DEVICES), ("dtype", self.dtype, ENGINE_DTYPES),
                                    ("decode", self.decode, ENGINE_DECODES),
                                    ("attn_implementation", self.attn_implementation, ENGINE_ATTENTION)):
            if value not in allowed:
                raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")


def engine_device(cfg: TransformersEngineConfig, context) -> torch.device:
    """The device the engine samples on: this rank's GPU (``auto`` on a GPU rank), else the CPU."""
    index = context.this.gpu_index
    if cfg.device == "cpu" or index is None:
        return torch.device("cpu")
    return torch.device("cuda", index)


def engine_dtype(cfg: TransformersEngineConfig, model_config, context) -> str:
    """The dtype the engine samples in (``auto``: the trainer's compute dtype, else ``model.dtype``)."""
    if cfg.dtype != "auto":
        return cfg.dtype
    return context.compute_dtype or model_config.dtype


def engine_decode(cfg: TransformersEngineConfig, rollout_config, context, device: torch.device) -> tuple[str, bool]:
    """The decode the engine runs, and whether ``auto`` chose it (the engine may then decode otherwise where a
    call needs it: the loop for a call that records MoE routing, ``static`` when the step cannot be captured)."""
    if cfg.decode != "auto":
        return cfg.decode, False
    loop_only = rollout_config.true_on_policy or context.draft is not None
    if device.type == "cuda" and not loop_only:
        return "graph", True
    return "loop", False


def shares_weights(cfg: TransformersEngineConfig, rollout_config) -> bool:
    """``share_weights`` resolved: ``auto`` shares unless the engine samples while the trainer updates."""
    overlaps = rollout_config.mode == "one_step_off" or (rollout_config.mode == "async" and rollout_config.max_staleness > 0)
    if cfg.share_weights is not None:
        return cfg.share_weights
    if overlaps and not cfg.process:
        log.info("rollout.mode=%s: the in-process engine samples while the trainer updates, so it keeps its own copy "
                 "of the weights (rollout.engine.args.share_weights=auto)", rollout_config.mode)
    return not overlaps


def check_transformers_config(config, cfg: TransformersEngineConfig) -> None:
    """Refused when the config loads: what this engine cannot serve. (What needs the device, such as
    ``decode: graph`` on a CPU, is decided when the engine is built.)"""
    if config.rollout.lora_sync == "adapter":
        raise ConfigError(
            "rollout.lora_sync=adapter: the 'transformers' engine cannot serve adapters; use rollout.lora_sync=merged "
            "or an engine that can (sglang)"
        )


def _eos_ids(tokenizer) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def make_transformers_engine(model_config, tokenizer, rollout_config, cfg: TransformersEngineConfig, context):
    draft = context.draft
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = engine_device(cfg, context)
    dtype = engine_dtype(cfg, model_config, context)
    decode, auto_decode = engine_decode(cfg, rollout_config, context, device)
    common = dict(
        pad_token_id=pad, eos_token_ids=_eos_ids(tokenizer), true_on_policy=rollout_config.true_on_policy, draft=draft,
        decode=decode, auto_decode=auto_decode,
    )
    if cfg.process:
        from rlite.api import ProcessEngine

        return ProcessEngine(
            model_config.path,
            timeout_s=rollout_config.timeout_s,
            dtype=DTYPES[dtype],
            attn_implementation=cfg.attn_implementation,
            gguf_file=model_config.gguf_file,
            bucket_bytes=rollout_config.bucket_bytes,
            weights_from_sync=True,
            device=device,
            **common,
        )
    from rlite.api import TransformersEngine, skeleton_causal_lm

    # wiring rlite's own engine: not public API
    from rlite.engines.transformers.engine import load_draft_model

    # the trainer syncs every weight before the first rollout: the engine reads none from disk
    model = skeleton_causal_lm(model_config.path, dtype, cfg.attn_implementation, model_config.gguf_file,
                               model_config.trust_remote_code, device=device)  # fmt: skip
    return TransformersEngine(
        model,
        share_weights=shares_weights(cfg, rollout_config),
        draft_model=load_draft_model(draft, cfg.attn_implementation, weights_from_sync=True, device=device),
        **common,
    )


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
    buckets and SGLang's runtime (``runtime_reserve_gb``) fit beside it (``rlite.engines.sglang.placement``)."""
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
    from rlite.api import EngineCapabilities, SGLangEngine

    # wiring rlite's own engine: not public API
    from rlite.engines.sglang.engine import read_model_config
    from rlite.engines.sglang.group import EngineGroup, SGLangGroupMember
    from rlite.engines.sglang.payloads import resolve_engine_dtype, sglang_metadata_cls
    from rlite.engines.sglang.placement import engine_weight_bytes, plan_engines, plan_of

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


def transformers_engine_memory(config, cfg: TransformersEngineConfig, shape, tokens: int, world_size: int,
                               on_gpu: bool) -> dict[str, int]:
    """What the engine holds where the trainer is (nothing when it samples on the host beside a GPU trainer):
    its weights unless it shares the trainer's, the KV cache of every sequence of a call, and one decode step's
    work on the output layer (float32 logits, their softmax and log-softmax, and the float64 CDF the sampler
    inverts: 24 bytes per row and vocabulary entry). ``shape``: the model's ``rlite.run.limits.ModelShape``;
    ``tokens``: the longest sequence (docs/memory.md)."""
    if on_gpu and cfg.device == "cpu":
        return {}
    rollout = config.rollout
    overlaps = rollout.mode == "one_step_off" or (rollout.mode == "async" and rollout.max_staleness > 0)
    dtype = config.parallelism.param_dtype if cfg.dtype == "auto" else cfg.dtype
    shares = ((cfg.share_weights is True or (cfg.share_weights is None and not overlaps)) and not cfg.process
              and world_size == 1 and dtype == config.model.dtype)
    own_weights = not shares or config.model.lora.enabled or rollout.quantization.name != "none"
    engine_bytes = DTYPES[dtype].itemsize
    sequences = max(rollout.prompts_per_step * rollout.samples_per_prompt, config.training.eval_max_prompts)
    return {
        "engine weights": shape.parameters * engine_bytes if own_weights else 0,
        "engine KV cache": shape.layers * 2 * shape.kv_heads * shape.head_dim * tokens * engine_bytes * sequences,
        "engine decode step": sequences * shape.vocab * 24,
    }


@hookimpl
def register_rollout_engines(register):
    register("transformers", make_transformers_engine, TransformersEngineConfig, draft_methods=("model", "ngram"),
             memory=transformers_engine_memory, check_config=check_transformers_config,
             # in process unless spawned; an explicit share_weights binds the trainer's tensors (auto does not
             # when the rollouts overlap the update)
             samples_in_process=lambda cfg: () if cfg.process else ("process",),
             shares_weights=lambda cfg: ("share_weights",) if cfg.share_weights is True and not cfg.process else ())
    # SGLang sizes its own KV pool within mem_fraction_static: no memory= (the trainer's check leaves it out)
    register("sglang", make_sglang_engine, SGLangEngineConfig, draft_methods=("model", "ngram", "eagle"),
             available=sglang_available, check_config=check_sglang_config)
