"""Built-in rollout engines.

* ``transformers``: transformers ``generate`` with a KV cache, colocated with the trainer; in-process
  by default, or in its own spawned process (``args.process: true``) receiving weights through
  shared-memory buckets (``rlite.engines.process_engine``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlite import hookimpl


@dataclass
class TransformersEngineConfig:
    process: bool = False
    """Run the engine in its own spawned process; weights arrive zero-copy through shared memory."""
    attn_implementation: str = "sdpa"
    """Attention implementation of the engine's model."""


def _eos_ids(tokenizer) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def make_transformers_engine(model_config, tokenizer, rollout_config, cfg: TransformersEngineConfig):
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    common = dict(pad_token_id=pad, eos_token_ids=_eos_ids(tokenizer), true_on_policy=rollout_config.true_on_policy)
    if cfg.process:
        from rlite.engines.process_engine import ProcessEngine

        return ProcessEngine(
            model_config.path,
            timeout_s=rollout_config.timeout_s,
            attn_implementation=cfg.attn_implementation,
            gguf_file=model_config.gguf_file,
            **common,
        )
    from rlite.actor import load_causal_lm
    from rlite.engines.hf_engine import TransformersEngine

    engine_model_cfg = type(model_config)(**{**model_config.__dict__, "attn_implementation": cfg.attn_implementation})
    return TransformersEngine(load_causal_lm(engine_model_cfg), **common)


@hookimpl
def register_rollout_engines(register):
    register("transformers", make_transformers_engine, TransformersEngineConfig)
