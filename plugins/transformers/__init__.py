"""The ``transformers`` rollout engine: transformers models with a KV cache, colocated with the trainer.

In-process by default, or in its own spawned process (``args.process: true``) receiving weights through
shared-memory buckets (:mod:`rlite.plugins.transformers.process`). Its model is built from the config with
no weights read (``rlite.api.skeleton_causal_lm``): the trainer's first sync, before any rollout, gives
every parameter. The engine itself is :mod:`rlite.plugins.transformers.engine`, its fixed-shape decodes
:mod:`~rlite.plugins.transformers.decode`, its speculative decoding :mod:`~rlite.plugins.transformers.speculative`.

A plugin package like any other: registered by :data:`rlite.plugin_manager.DEFAULT_PLUGINS` through
``pm.register`` (the default config names it, so it is there whatever ``plugins.autoload`` says), and it
imports only :mod:`rlite.api` and its own modules. Besides the run's engine, it builds the engine that
``rlite chat`` and ``rlite generate`` decode a loaded model with (``from_model``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

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
    """How the engine decodes (``rlite.plugins.transformers.decode``): ``loop`` (a KV cache that finished rows
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
        from rlite.plugins.transformers.process import ProcessEngine

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
    from rlite.api import skeleton_causal_lm
    from rlite.plugins.transformers.engine import TransformersEngine, load_draft_model

    # the trainer syncs every weight before the first rollout: the engine reads none from disk
    model = skeleton_causal_lm(model_config.path, dtype, cfg.attn_implementation, model_config.gguf_file,
                               model_config.trust_remote_code, device=device)  # fmt: skip
    return TransformersEngine(
        model,
        share_weights=shares_weights(cfg, rollout_config),
        draft_model=load_draft_model(draft, cfg.attn_implementation, weights_from_sync=True, device=device),
        **common,
    )


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


def engine_from_model(model, *, pad_token_id: int, eos_token_ids: Iterable[int]):
    """The engine around a Hugging Face model already loaded in this process, decoding with the loop (what
    ``rlite chat`` and ``rlite generate`` sample with: the rollouts' sampler, outside a run)."""
    from rlite.plugins.transformers.engine import TransformersEngine

    return TransformersEngine(model, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids)


@hookimpl
def register_rollout_engines(register):
    register("transformers", make_transformers_engine, TransformersEngineConfig, draft_methods=("model", "ngram"),
             memory=transformers_engine_memory, check_config=check_transformers_config,
             # in process unless spawned; an explicit share_weights binds the trainer's tensors (auto does not
             # when the rollouts overlap the update)
             samples_in_process=lambda cfg: () if cfg.process else ("process",),
             shares_weights=lambda cfg: ("share_weights",) if cfg.share_weights is True and not cfg.process else (),
             from_model=engine_from_model)
