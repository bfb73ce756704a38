"""What a run will hold, checked before it allocates: the model's context and a memory estimate.

A run whose sequences outgrow the model's positions, or whose memory outgrows the machine, is refused
when it starts (``ConfigError``, exit status 2) with the numbers and the keys to change, instead of
being killed by the kernel minutes later. The estimate, part by part (``docs/memory.md``):

    trainer   = P * b_master * (1 weights + 1 gradients + 2 AdamW moments) / W     (LoRA: weights only;
                                                                                     moments on disk: 0)
              + P * b_master / W                              reference model, when algorithm.kl.coef != 0
              + 4 * P * b_master / W                           critic (weights, gradients, moments)
              (one rank's share of FSDP2's shards; a backend that holds its state otherwise registers
              ``trainer_memory=``, its own per-rank parts: megatron's replicas, masters and ZeRO-1)
              + m * T * h * L * 34 * b_param / 2                activations of one micro-batch
              + min(m * T, c) * V * 4 * 3                       a chunk of output-layer logits (fp32)
    engine    = P * b_engine                                    its weights (none when it shares the trainer's)
              + L * 2 * H_kv * d_head * T * b_engine * S        the KV cache of S concurrent sequences
              + S * V * 24                                      one decode step's logits, softmax, log-softmax
                                                                and float64 CDF
              (the engine's registered ``memory=``, here the built-in transformers engine's: on the
              trainer's device, its GPU when the trainer has one, unless ``rollout.engine.args.device=cpu``;
              b_engine: the engine's dtype, by default the trainer's compute dtype ``parallelism.param_dtype``)

with P parameters, L layers, h hidden size, V vocabulary, H_kv key/value heads of d_head each, W ranks,
m = ``training.micro_batch_size``, T = the longest prompt loaded (at most ``data.max_prompt_tokens``) +
``rollout.max_new_tokens`` (multi-turn: the larger of it and ``rollout.max_response_tokens``), c = ``training.logprob_chunk_size``, S = the larger of
``rollout.prompts_per_step`` x ``rollout.samples_per_prompt`` and ``training.eval_max_prompts``, b the bytes
of each dtype. An engine that registers no ``memory=`` adds nothing: SGLang sizes its own KV pool within
``mem_fraction_static``. The activation term is rough (Korthikanti et al. 2022's 34 bytes per token, hidden unit
and layer in 16-bit, without the attention scores that SDPA never stores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlite.config import ConfigError, RunConfig

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class ModelShape:
    """What the estimate needs of a Hugging Face model config."""

    parameters: int
    layers: int
    hidden: int
    vocab: int
    kv_heads: int
    head_dim: int
    max_positions: int | None


def model_shape(hf_config) -> ModelShape:
    """The shape of a causal LM from its config; the parameter count from a model built on the meta device."""
    from transformers import AutoModelForCausalLM

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // heads
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config).parameters())
    return ModelShape(
        parameters=parameters,
        layers=int(text.num_hidden_layers),
        hidden=int(text.hidden_size),
        vocab=int(text.vocab_size),
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        max_positions=getattr(text, "max_position_embeddings", None),
    )


def prompt_tokens(cfg: RunConfig, longest_prompt: int | None = None) -> int:
    """The longest prompt: the longest one loaded (prompts beyond ``data.max_prompt_tokens`` were dropped)."""
    return cfg.data.max_prompt_tokens if longest_prompt is None else min(longest_prompt, cfg.data.max_prompt_tokens)


def multi_turn(cfg: RunConfig, pm) -> bool:
    """The run's workflow samples turn by turn (its registration declares no ``single_turn``)."""
    return not pm.registry("rollout_workflow").get(cfg.rollout.workflow.name).metadata.get("single_turn")


def response_tokens(cfg: RunConfig, multi_turn: bool) -> tuple[int, str]:
    """The longest response and the key that bounds it (multi-turn: the whole response, observations too)."""
    rollout = cfg.rollout
    if multi_turn and rollout.max_response_tokens > rollout.max_new_tokens:
        return rollout.max_response_tokens, "rollout.max_response_tokens"
    return rollout.max_new_tokens, "rollout.max_new_tokens"


def sequence_tokens(cfg: RunConfig, multi_turn: bool, longest_prompt: int | None = None) -> int:
    """The longest sequence a sample can reach: its prompt, then what is sampled (and, multi-turn, observed)."""
    return prompt_tokens(cfg, longest_prompt) + response_tokens(cfg, multi_turn)[0]


def check_context(cfg: RunConfig, shape: ModelShape, multi_turn: bool, longest_prompt: int | None = None) -> None:
    """The longest prompt plus the longest response must fit the model's positions (``max_position_embeddings``)."""
    if shape.max_positions is None:
        return
    prompt = prompt_tokens(cfg, longest_prompt)
    response, response_key = response_tokens(cfg, multi_turn)
    if prompt + response > shape.max_positions:
        loaded = "" if longest_prompt is None else f"the longest prompt loaded has {prompt} tokens, "
        raise ConfigError(
            f"{response_key}={response} + a prompt of up to {prompt} tokens ({loaded}data.max_prompt_tokens="
            f"{cfg.data.max_prompt_tokens}) = {prompt + response} tokens exceed the model's context of "
            f"{shape.max_positions} positions (max_position_embeddings of {cfg.model.path}): lower "
            f"{response_key} to at most {shape.max_positions - prompt}, or data.max_prompt_tokens"
        )


@dataclass
class MemoryEstimate:
    """Bytes each part of a run holds at its peak (see the module docstring for the formulas)."""

    parts: dict[str, int]
    device: str

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{name} {size / GIB:.2f}" for name, size in self.parts.items() if size)


def sharded_trainer_memory(cfg: RunConfig, backend_cfg: object, parameters: int, world_size: int) -> dict[str, int]:
    """One rank's trainer state under FSDP2 (the estimate of a backend that registers no ``trainer_memory``):
    every tensor sharded over the ``world_size`` ranks, in ``model.dtype``."""
    master = DTYPE_BYTES[cfg.model.dtype]
    trains_all = not cfg.model.lora.enabled

    def share(nbytes: int) -> int:
        return -(-nbytes // world_size)  # rounded up: ranks x share >= the whole

    return {
        "weights": share(parameters * master),
        "gradients": share(parameters * master) if trains_all else 0,
        "AdamW moments": share(2 * parameters * master) if trains_all and cfg.training.optimizer_offload == "none" else 0,
        "reference model": share(parameters * master) if cfg.algorithm.kl.coef != 0 else 0,
        "critic": share(4 * parameters * master) if cfg.algorithm.critic.enabled else 0,
    }


def estimate_memory(cfg: RunConfig, shape: ModelShape, *, world_size: int = 1, on_gpu: bool = False,
                    longest_prompt: int | None = None, pm=None) -> MemoryEstimate:
    """What the run holds on one device (the host memory on CPU: every local rank and the engine share it).
    The trainer's parts come from the training backend's registered ``trainer_memory`` (one rank's bytes;
    FSDP2's shards without one), the engine's from the engine's registered ``memory`` (none without one).
    ``pm``: the run's plugin manager (None: the process-wide one)."""
    from rlite.plugin_manager import PluginError, get_plugin_manager, resolve_choice

    pm = get_plugin_manager() if pm is None else pm
    t = cfg.training
    compute = DTYPE_BYTES[cfg.parallelism.param_dtype]
    tokens = sequence_tokens(cfg, multi_turn(cfg, pm), longest_prompt)
    ranks_here = 1 if on_gpu else world_size  # on CPU all ranks' state is in the same memory
    backend = pm.registry("training_backend").get(cfg.parallelism.backend.name)
    _, backend_cfg = resolve_choice(pm.registry("training_backend"), cfg.parallelism.backend)
    per_rank = backend.metadata.get("trainer_memory", sharded_trainer_memory)
    trainer = per_rank(cfg, backend_cfg, shape.parameters, world_size)
    if not _byte_counts(trainer):
        raise PluginError(f"training backend {backend.name!r} (plugin {backend.plugin!r}): trainer_memory must return "
                          f"a dict of part name -> bytes (int), got {trainer!r}")
    parts = {name: size * ranks_here for name, size in trainer.items()}
    activations = t.micro_batch_size * tokens * shape.hidden * shape.layers * 34 * compute // 2
    logits = min(t.micro_batch_size * tokens, t.logprob_chunk_size) * shape.vocab * 4 * 3
    parts["activations of a micro-batch"] = (activations + logits) * ranks_here
    engine = pm.registry("rollout_engine").get(cfg.rollout.engine.name)
    engine_memory = engine.metadata.get("memory")
    if engine_memory is not None:
        _, engine_cfg = resolve_choice(pm.registry("rollout_engine"), cfg.rollout.engine)
        held = engine_memory(cfg, engine_cfg, shape, tokens, world_size, on_gpu)
        if not _byte_counts(held):
            raise PluginError(f"rollout engine {engine.name!r} (plugin {engine.plugin!r}): memory must return a dict "
                              f"of part name -> bytes (int), got {held!r}")
        parts.update(held)
    return MemoryEstimate(parts, "GPU" if on_gpu else "host")


def _byte_counts(parts: object) -> bool:
    return isinstance(parts, dict) and all(isinstance(k, str) and isinstance(v, int) for k, v in parts.items())


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """Bytes free for the run on ``device`` and where the number comes from; None when it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, "torch.cuda.mem_get_info"
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available), "psutil.virtual_memory().available"


def memory_keys(cfg: RunConfig, estimate: MemoryEstimate) -> str:
    """The keys that shrink the largest parts of ``estimate``, largest first."""
    keys = {
        "engine KV cache": "rollout.max_new_tokens, rollout.prompts_per_step x rollout.samples_per_prompt, "
                           "training.eval_max_prompts, data.max_prompt_tokens",
        "engine decode step": "rollout.prompts_per_step x rollout.samples_per_prompt, training.eval_max_prompts",
        "activations of a micro-batch": "training.micro_batch_size, parallelism.activation_checkpointing=true",
        "AdamW moments": "training.optimizer_offload=disk (megatron: or parallelism.backend.args.distributed_optimizer=true)",
        "gradients": "model.lora.enabled=true",
        "weights": "a smaller model, model.dtype=bfloat16",
        "master weights": "parallelism.param_dtype=float32, or ZeRO-1 (megatron: parallelism.backend.args.distributed_optimizer=true)",
        "engine weights": "rollout.engine.args.share_weights=true",
        "reference model": "algorithm.kl.coef=0",
        "critic": "algorithm.critic.enabled=false",
    }
    largest = sorted(estimate.parts, key=estimate.parts.get, reverse=True)
    return "; ".join(f"{name}: {keys[name]}" for name in largest[:3] if estimate.parts[name] and name in keys)


def check_memory(cfg: RunConfig, shape: ModelShape, device: torch.device, world_size: int = 1,
                 longest_prompt: int | None = None, pm=None) -> None:
    """Refuse a run whose estimate exceeds the memory available now."""
    estimate = estimate_memory(cfg, shape, world_size=world_size, on_gpu=device.type == "cuda",
                               longest_prompt=longest_prompt, pm=pm)
    available = available_memory(device)
    if available is None or estimate.total <= available[0]:
        return
    free, source = available
    raise ConfigError(
        f"memory: the run needs about {estimate.total / GIB:.2f} GiB of {estimate.device} memory ({estimate.describe()} "
        f"GiB; docs/memory.md) but {free / GIB:.2f} GiB are available ({source}). Lower the largest parts: "
        f"{memory_keys(cfg, estimate)}; or set training.check_memory=false to run anyway"
    )


def check_run_fits(cfg: RunConfig, device: torch.device, world_size: int = 1, longest_prompt: int | None = None,
                   pm=None) -> None:
    """The context and memory checks of a run, before its models are allocated; ``longest_prompt``: the longest
    prompt loaded, in tokens (None: ``data.max_prompt_tokens``). Model configs that transformers cannot read are
    left to the model loader, which names the problem."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
        shape = model_shape(hf_config)
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return
    from rlite.plugin_manager import get_plugin_manager

    pm = get_plugin_manager() if pm is None else pm
    check_context(cfg, shape, multi_turn(cfg, pm), longest_prompt)
    if cfg.training.check_memory:
        check_memory(cfg, shape, device, world_size, longest_prompt, pm)
