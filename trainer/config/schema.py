"""Typed run configuration: dataclasses merged with YAML and ``key=value`` overrides by omegaconf.

Every field carries a docstring right under it (a test checks this). Unknown keys, wrong types and
unknown plugin names fail in :func:`load_config` with the full key path, the bad value and the valid
choices. Rules that link fields live in ``__post_init__`` next to the fields.

A *named choice* (:class:`Choice`) selects an implementation registered by a plugin, with optional
``args`` validated against that implementation's own config dataclass. In YAML it is written either
as a bare name (``advantage: grpo``) or as ``{name: grpo, args: {norm_by_std: false}}``.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from rlite.errors import ConfigError  # noqa: F401  (re-exported: rlite.config.ConfigError)

DTYPES = ("float32", "bfloat16", "float16")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LR_SCHEDULES = ("constant", "cosine", "linear")
OPTIMIZER_OFFLOADS = ("none", "disk")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


class UnknownChoiceError(KeyError):
    """A name that no plugin registered."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


# omegaconf builds the schema from default instances; linked-field rules only make sense on the
# final merged values, so they are skipped while the schema and layers are being merged.
_SKIP_CHECKS: contextvars.ContextVar[bool] = contextvars.ContextVar("rlite_skip_config_checks", default=False)


_DEFER_DEPENDENCIES: contextvars.ContextVar[bool] = contextvars.ContextVar("rlite_defer_dependencies", default=False)
"""Set while a config is only shown (``rlite config``): optional packages are checked when a run starts."""


@contextlib.contextmanager
def optional_dependencies_deferred() -> typing.Iterator[None]:
    """Within this block, :func:`require_optional_package` checks nothing: a config that names an optional
    package's feature can be loaded and printed without the package, which the run still requires."""
    token = _DEFER_DEPENDENCIES.set(True)
    try:
        yield
    finally:
        _DEFER_DEPENDENCIES.reset(token)


def require_optional_package(module: str, message: str) -> None:
    """Raise ConfigError(``message``) when ``module`` cannot be imported, unless the check is deferred
    (:func:`optional_dependencies_deferred`). For a plugin option's ``__post_init__``: a config that needs the
    package fails when a run loads it, and still prints with ``rlite config``."""
    import importlib.util

    if _DEFER_DEPENDENCIES.get() or _SKIP_CHECKS.get():
        return
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None in sys.modules
        found = False
    if not found:
        raise ConfigError(message)


def _check_trained_dtype(key: str, value: str) -> None:
    """float16 is refused for what the trainer holds and differentiates: rlite has no loss scaling."""
    if _SKIP_CHECKS.get() or value != "float16":
        return
    raise ConfigError(
        f"{key}=float16: rlite trains without loss scaling, and float16 gradients below 6e-8 become zero (below 6e-5 "
        "they lose precision) with no error, so the run would follow part of its gradient; use bfloat16 (float32's "
        "range in the same memory) or float32. An SGLang engine can still sample in float16: rollout.engine.args.dtype"
    )


def _check_choice(key: str, value: Any, choices: typing.Sequence[Any]) -> None:
    if _SKIP_CHECKS.get():
        return
    if value not in choices:
        msg = f"{key}: invalid value {value!r}. Valid choices: {', '.join(map(str, choices))}."
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        if close:
            msg += f" Did you mean {close[0]!r}?"
        raise ConfigError(msg)


def _check(condition: bool, message: str) -> None:
    if not condition and not _SKIP_CHECKS.get():
        raise ConfigError(message)


def _check_range(key: str, value: float, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False, meaning: str = "") -> None:
    """``key``'s value lies in the interval [low, high] (``low_open``/``high_open``: that end excluded; None:
    unbounded); the error names the key, the value and the valid range, plus what the range means."""
    if _SKIP_CHECKS.get():
        return
    above = low is None or (value > low if low_open else value >= low)
    below = high is None or (value < high if high_open else value <= high)
    if above and below:
        return
    if high is None:
        valid = f"{'>' if low_open else '>='} {low}"
    elif low is None:
        valid = f"{'<' if high_open else '<='} {high}"
    else:
        valid = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    raise ConfigError(f"{key}: invalid value {value!r}. Valid range: {valid}" + (f" ({meaning})" if meaning else ""))


@dataclass
class Choice:
    """A named implementation from a plugin registry plus its options."""

    name: str = "none"
    """Registered name of the implementation (see ``rlite plugins`` for what is available)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Options of the implementation, validated against the config dataclass it registered."""


# --------------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------------


@dataclass
class LoraConfig:
    """LoRA adapters through peft."""

    enabled: bool = False
    """Train LoRA adapters instead of the full weights; the engine receives merged weights."""
    rank: int = 8
    """LoRA rank r."""
    alpha: float = 16.0
    """LoRA scaling numerator: the update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on the LoRA input (keep 0.0 for exact on-policy log-probs)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names (suffixes) that get adapters."""

    def __post_init__(self) -> None:
        _check_range("model.lora.dropout", self.dropout, 0, 1, high_open=True)
        if self.enabled:
            _check(self.rank > 0, f"model.lora.rank must be positive, got {self.rank}")
            _check(bool(self.target_modules), "model.lora.target_modules must name at least one module")


@dataclass
class ModelConfig:
    """The policy model."""

    path: str = "???"
    """Hugging Face model folder (or hub name when a network is available) holding config, weights and tokenizer;
    checked before anything loads (a missing folder is named)."""
    tokenizer: Optional[str] = None
    """Tokenizer folder; defaults to ``path``."""
    dtype: str = "float32"
    """Dtype of the master weights kept by the trainer: float32 or bfloat16 (float16 is refused: rlite has no loss
    scaling, and float16 gradients underflow silently)."""
    attn_implementation: str = "sdpa"
    """Attention implementation passed to transformers (sdpa, eager, flash_attention_2, flash_attention_3, flex_attention)."""
    gguf_file: Optional[str] = None
    """GGUF file inside ``path`` to load (dequantized) instead of safetensors weights."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the model folder."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA settings."""

    def __post_init__(self) -> None:
        _check_choice("model.dtype", self.dtype, DTYPES)
        _check_trained_dtype("model.dtype", self.dtype)
        _check_choice("model.attn_implementation", self.attn_implementation, ATTN_IMPLEMENTATIONS)


# --------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    """Prompts: a built-in synthetic task, or files."""

    task: Optional[str] = None
    """Built-in synthetic task (addition, reversal, sorting, word_problems, spell_digits); ignored when ``train_files`` is set."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Options of the synthetic task (for example ``digits: 2``)."""
    train_files: Union[str, list[str], None] = None
    """Training prompts: a .jsonl/.json/.parquet file, a glob (``data/train-*.parquet``), a folder of such files
    (read recursively), a folder saved by ``datasets.save_to_disk``, or a list of any of these (read in order)."""
    eval_files: Union[str, list[str], None] = None
    """Held-out prompts in the same forms; a synthetic task makes its own held-out split."""
    prompt_key: str = "prompt"
    """Column holding the prompt (a string, or a list of chat messages); a dotted path reads a nested column.
    Rows with an empty prompt are dropped and counted."""
    answer_key: str = "answer"
    """Column holding the reference answer given to the reward functions; a dotted path reads a nested column
    (``reward_model.ground_truth``)."""
    num_train: int = 2000
    """Number of synthetic training prompts."""
    num_eval: int = 64
    """Number of held-out prompts (synthetic tasks) or the cap on the eval file's rows (0 = all)."""
    seed: int = 0
    """Seed of the synthetic task generator and of the prompt shuffling."""
    chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template (needs one). The trained model then answers templated
    prompts only: talk to it with ``rlite chat`` / ``rlite generate``, which template prompts the same way."""
    system_prompt: Optional[str] = None
    """System message prepended when the chat template is used."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are dropped when the data loads (with a logged count)."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch (deterministically from ``seed``)."""

    def __post_init__(self) -> None:
        _check(
            self.task is not None or self.train_files is not None,
            "data: set data.task (a built-in synthetic task) or data.train_files (a .jsonl/.parquet file or dataset folder)",
        )
        _check(self.max_prompt_tokens > 0, "data.max_prompt_tokens must be positive")


# --------------------------------------------------------------------------------------------------
# rollout
# --------------------------------------------------------------------------------------------------


@dataclass
class RolloutConfig:
    """Generation of samples by the rollout engine."""

    engine: Choice = field(default_factory=lambda: Choice("transformers"))
    """Rollout engine (transformers on CPU, sglang on GPU)."""
    prompts_per_step: int = 8
    """Prompts per training step, over all ranks."""
    samples_per_prompt: int = 8
    """Completions sampled per prompt (the group size of GRPO)."""
    max_new_tokens: int = 16
    """Maximum completion length in tokens."""
    temperature: float = 1.0
    """Sampling temperature; the trainer divides its logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    quantization: Choice = field(default_factory=lambda: Choice("none"))
    """Quantization applied to the weights the engine samples with."""
    draft: Choice = field(default_factory=lambda: Choice("none"))
    """Speculative-decoding draft for the engine (``draft_model``: a small LM trained online; ``ngram``: prompt
    lookup); the samples keep the policy's distribution exactly (``docs/speculative.md``)."""
    sync_bucket_mb: int = 512
    """Size of the flattened weight buckets sent to the engine, in MB (code reads :attr:`bucket_bytes`)."""
    timeout_s: float = 600.0
    """Timeout of any single engine call (generate, weight update); a hung engine fails loudly."""
    engine_restarts: int = 2
    """How many times a rollout engine whose process died (or hung past ``timeout_s`` and was killed) is restarted
    with the trainer's current weights, the failed call made again; one more death stops the run with a checkpoint
    to resume from (exit status 4). Restarts need a single trainer process; with several, a death stops the run."""
    lora_sync: str = "merged"
    """With LoRA: ``merged`` sends W + scale * B @ A to the engine; ``adapter`` sends only the adapter (engines that serve adapters, e.g. sglang)."""
    ignore_eos: bool = False
    """Training samples do not stop at the tokenizer's end-of-sequence token: every completion runs to
    ``max_new_tokens`` (benchmarks of a fixed length, as TRL's ``min_new_tokens`` and SGLang's ``ignore_eos``);
    evaluation still stops there."""
    true_on_policy: bool = False
    """Sample with the trainer's own fixed-shape forward so rollout log-probs equal the trainer's bitwise (slow; transformers engine)."""
    workflow: Choice = field(default_factory=lambda: Choice("single_turn"))
    """Rollout workflow: ``single_turn`` (one completion per sample) or an environment that answers every
    sampled turn over several turns (``calculator``, ``arithmetic_chain``, plugins; ``docs/multiturn.md``)."""
    max_turns: int = 4
    """Multi-turn workflows: the most sampled turns per trajectory (each up to ``max_new_tokens``)."""
    max_response_tokens: int = 256
    """Multi-turn workflows: the token budget of a whole response, sampled and observation tokens together."""
    observation_role: str = "user"
    """Multi-turn workflows: the chat-template role of the environment's messages (``user``, ``tool``, ...)."""
    mode: str = "sync"
    """``sync``: each step samples from the weights it trains; ``one_step_off``: the next batch is sampled
    while the trainer trains, one weight version behind; ``async``: sampled ahead, at most ``max_staleness``
    versions behind (``docs/multiturn.md``)."""
    max_staleness: int = 1
    """``rollout.mode=async``: the most weight versions a sample may lag the weights it trains (0: none)."""
    partial_segment_tokens: int = 0
    """``rollout.mode=async``: sample each generation in segments of at most this many new tokens per sequence,
    and let a waiting weight sync in between two segments; the rest of an unfinished sequence then samples with
    the new weights from its exact tokens, each token recording its version (a partial rollout within a turn).
    0: an engine call is never interrupted (a multi-turn rollout still lets a sync in between turns)."""

    @property
    def bucket_bytes(self) -> int:
        """``sync_bucket_mb`` in bytes: the one conversion, what every ``bucket_bytes`` argument takes (engines,
        :class:`rlite.sync.SharedBucketSender`, :func:`rlite.sync.iter_buckets`)."""
        return int(self.sync_bucket_mb) << 20

    def __post_init__(self) -> None:
        for key in ("prompts_per_step", "samples_per_prompt", "max_new_tokens", "sync_bucket_mb", "max_turns",
                    "max_response_tokens"):
            _check(getattr(self, key) > 0, f"rollout.{key} must be positive, got {getattr(self, key)}")
        _check(self.temperature > 0, f"rollout.temperature must be > 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, f"rollout.top_p must be in (0, 1], got {self.top_p}")
        _check_range("rollout.top_k", self.top_k, 0, meaning="0 = off")
        _check_range("rollout.timeout_s", self.timeout_s, 0, low_open=True, meaning="seconds a single engine call may take")
        _check_choice("rollout.lora_sync", self.lora_sync, ("merged", "adapter"))
        _check(self.engine_restarts >= 0, f"rollout.engine_restarts must be >= 0, got {self.engine_restarts}")
        _check_choice("rollout.mode", self.mode, ("sync", "one_step_off", "async"))
        _check(self.max_staleness >= 0, f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        _check(self.partial_segment_tokens >= 0,
               f"rollout.partial_segment_tokens must be >= 0, got {self.partial_segment_tokens}")
        if self.partial_segment_tokens:
            _check(self.mode == "async" and self.max_staleness > 0,
                   "rollout.partial_segment_tokens: segments let a weight sync into a generation, which only "
                   "rollout.mode=async with rollout.max_staleness > 0 does; set rollout.partial_segment_tokens=0")


# --------------------------------------------------------------------------------------------------
# algorithm
# --------------------------------------------------------------------------------------------------


@dataclass
class KLConfig:
    """KL to the reference model."""

    coef: float = 0.0
    """KL coefficient beta; the reference model is built only when it is non-zero."""
    estimator: str = "k3"
    """KL estimator: k1, k2, k3, abs, low_var_kl, or a straight-through variant (k1+, k3+, abs+, low_var_kl+: value of the named one, gradient of k2)."""
    in_reward: bool = False
    """Apply KL as a per-token reward penalty (PPO style) instead of a loss term (GRPO style)."""
    adaptive_target: Optional[float] = None
    """Target KL of the adaptive controller (reward penalty only); None keeps beta fixed."""
    adaptive_horizon: int = 10000
    """Horizon of the adaptive KL controller, in samples."""


@dataclass
class CriticConfig:
    """The value model of PPO with GAE (same architecture as the policy plus a scalar head)."""

    enabled: bool = False
    """Build and train a critic; required by ``algorithm.advantage: gae``."""
    path: Optional[str] = None
    """Model folder to initialise the critic's backbone from; defaults to ``model.path``."""
    lr: float = 1e-5
    """AdamW learning rate of the critic (its own optimizer)."""
    value_clip: float = 0.2
    """Clip of the value prediction around the old value: v_old +- value_clip (verl cliprange_value)."""
    grad_clip: float = 1.0
    """Gradient-norm clip of the critic (0 = none)."""

    def __post_init__(self) -> None:
        _check(self.lr >= 0, "algorithm.critic.lr must be >= 0")
        _check_range("algorithm.critic.grad_clip", self.grad_clip, 0, meaning="0 = no clipping")
        _check(self.value_clip > 0, "algorithm.critic.value_clip must be > 0")


@dataclass
class AlgorithmConfig:
    """Advantages, losses and their aggregation."""

    advantage: Choice = field(default_factory=lambda: Choice("grpo"))
    """Advantage estimator."""
    policy_loss: Choice = field(default_factory=lambda: Choice("ppo_clip"))
    """Policy loss."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses are averaged over the global batch (token-mean, token-sum, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm; token-sum is unnormalised: N_tok times token-mean)."""
    loss_agg_horizon: Optional[int] = None
    """Constant H of seq-mean-token-sum-norm (Dr.GRPO); defaults to ``rollout.max_new_tokens``."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL regularisation."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (subtracted from the loss)."""
    corrections: list[Choice] = field(default_factory=list)
    """Train/inference mismatch corrections, applied in this order."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model for GAE."""
    old_logprob_mode: str = "decoupled"
    """pi_old of the PPO ratio: ``decoupled`` recomputes it with the trainer, ``bypass`` uses the engine's log-probs."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and draw more prompts until the batch is full."""
    dynamic_sampling_max_rounds: int = 4
    """Cap on generation rounds per step with dynamic sampling; a batch still short after it is topped up with dropped groups."""
    mask_truncated: bool = False
    """Exclude completions that hit ``rollout.max_new_tokens`` from the loss (DAPO overlong filtering)."""
    minibatches_per_step: int = 1
    """Optimizer steps per rollout batch (the batch is split into this many mini-batches)."""
    epochs_per_step: int = 1
    """Passes over the rollout batch per training step (PPO epochs)."""
    routing_replay: str = "none"
    """Mixture-of-Experts models: ``rollout`` routes every token in the trainer's forwards (pi_old, pi_ref, training) to the experts the engine used (R3); ``none`` lets the trainer's routers choose."""
    routing_metrics: bool = True
    """Mixture-of-Experts models: every step, routing agreement and the mismatch KL with and without replay (two extra no-grad forwards)."""

    def __post_init__(self) -> None:
        _check_range("algorithm.kl.coef", self.kl.coef, 0, meaning="0 = no KL term")
        _check_range("algorithm.kl.adaptive_horizon", self.kl.adaptive_horizon, 0, low_open=True)
        _check_choice("algorithm.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        _check_choice("algorithm.routing_replay", self.routing_replay, ("none", "rollout"))
        _check_choice("algorithm.old_logprob_mode", self.old_logprob_mode, ("decoupled", "bypass"))
        _check(self.dynamic_sampling_max_rounds >= 1, "algorithm.dynamic_sampling_max_rounds must be >= 1")
        _check(
            self.kl.adaptive_target is None or self.kl.in_reward,
            "algorithm.kl.adaptive_target needs algorithm.kl.in_reward=true (the adaptive controller shapes rewards)",
        )
        _check(self.minibatches_per_step >= 1, "algorithm.minibatches_per_step must be >= 1")
        _check(self.epochs_per_step >= 1, "algorithm.epochs_per_step must be >= 1")


# --------------------------------------------------------------------------------------------------
# training and optimizer
# --------------------------------------------------------------------------------------------------


@dataclass
class TrainingConfig:
    """The optimisation schedule."""

    steps: int = 100
    """Number of training steps (one rollout batch each)."""
    seed: int = 0
    """Seed of sampling, dropout and initialisation."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass on each rank; gradients accumulate over micro-batches."""
    pack_sequences: bool = False
    """Padding-free forward and backward (fsdp2 backend): each micro-batch's sequences are laid end to end
    with their own position ids and attention that never crosses a sequence boundary, so no padding is
    computed (the policy, the reference model and the critic; the same log-probs to float rounding).
    Not with ``rollout.true_on_policy`` (which scores the engine's padded layout on purpose)."""
    max_tokens_per_micro_batch: int = 0
    """A token budget per micro-batch (0: off): sequences sorted by length are grouped so that each
    micro-batch's padded size (sequences x (longest prompt + longest response)) stays within it, with at
    most ``micro_batch_size`` sequences; every data-parallel rank runs the same number of micro-batches.
    Applies to pi_old, pi_ref, the critic and the update alike. Bounds a micro-batch's activation memory
    when lengths vary, and cuts padding (``batching/padding_fraction``). Off on a GPU too: sorting rows by length
    splits a GRPO group's samples over micro-batches, so each of its prompts runs in several of them and prompt
    sharing (``share_prompt_prefix``) saves less, while shared prompts and their response length buckets already
    compute little padding; a budget pays when lengths vary widely and memory, not padding, is the limit."""
    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = no clipping, the norm is still logged)."""
    lr_schedule: str = "constant"
    """LR schedule after warm-up: constant, cosine or linear (decay to ``min_lr_ratio`` x lr)."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to the peak learning rate."""
    min_lr_ratio: float = 0.0
    """Final learning rate of the cosine and linear schedules, as a fraction of ``lr``."""
    liger_fused_logprobs: Union[bool, str] = "auto"
    """Compute response log-probs with liger-kernel's fused linear cross-entropy (``pip install rlite[liger]``; its
    Triton kernels need CUDA). ``auto`` (default): on a CUDA device, with liger-kernel >= 0.8.2 installed, a backend
    that takes it (fsdp2) and no entropy term in the loss (``algorithm.entropy_coef=0``); otherwise rlite's chunked
    output layer. Why: the output layer is the model's largest matrix (a 152k-word vocabulary is a quarter of a 0.5B
    model's FLOPs) and rlite's chunked path writes and reads its float32 ``[tokens, vocabulary]`` logits several times
    per chunk, forward and backward; liger's kernels fuse that, and installing the extra is the opt-in. The entropy
    metric is then computed without gradient by the chunked path (one more output-layer forward); an entropy term in
    the loss needs the chunked path's gradient. ``true`` requires it (an error where it cannot run), ``false`` never."""
    compile: bool = False
    """``torch.compile`` each decoder block of the policy (fsdp2 backend; ``rlite.plugins.fsdp2.compile``): the
    elementwise work around the matrix products fused per block, the same log-probs and gradients to float rounding.
    Off by default: compiling takes time at the start and at each new micro-batch shape (seconds to minutes), it pays
    only on a GPU where the elementwise ops cost a noticeable share of the step, and it cannot run the shared-prompt
    forward (set ``training.share_prompt_prefix=false`` with it: each distinct prompt then runs once per sample).
    Inside compiled blocks, ``parallelism.lean_activations`` and ``fused_grad_accumulation`` do not apply (the
    compiler picks what to save). Not measured on a GPU yet."""
    share_prompt_prefix: bool = True
    """Run each prompt once per micro-batch and share its KV cache with its n samples (off with activation checkpointing or true on-policy)."""
    logprob_recompute_mb: float = 256.0
    """Recompute output-layer chunks in backward only when a micro-batch's response logits would exceed this many MB (else keep them)."""
    optimizer_offload: str = "none"
    """Where AdamW's two moments live between steps: ``none`` (in memory) or ``disk`` (files, streamed through small
    staging buffers during each step with direct I/O; the same numbers in half the memory of weights + gradients +
    moments, for about 1 s per step per 135M parameters on a fast local disk; ``rlite.training.optim_offload``)."""
    optimizer_offload_dir: str = ""
    """Folder for the ``disk`` moments ("" = ``<run_dir>/optimizer_offload``); a local disk, scratch space."""
    keep_freed_memory: bool = True
    """glibc only: keep freed host memory in the process for the next step instead of returning it to the OS (no fresh page faults for every step's large tensors; ``rlite.run.allocator``)."""
    num_threads: Optional[int] = None
    """torch intra-op threads per process (None = torch's default; torchrun sets 1 unless OMP_NUM_THREADS is given)."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk of the output-layer log-prob computation (bounds the [tokens, vocab] memory)."""
    eval_every: int = 10
    """Evaluate on the held-out split every this many steps (0 = only at the end)."""
    eval_max_prompts: int = 64
    """Cap on held-out prompts per evaluation."""
    accuracy_threshold: float = 1.0
    """``eval/*_accuracy`` and ``reward/accuracy`` count a sample correct by its built-in task's answer check
    (``rlite.tasks.TASK_CHECKS``); rows of data files, which have none, when their total reward is >= this."""
    check_memory: bool = True
    """Before anything is allocated, estimate the memory the run holds (weights, gradients, AdamW moments,
    activations of a micro-batch, the transformers engine's KV cache; ``docs/memory.md``) and refuse a run whose
    estimate exceeds the memory available (exit status 2, naming the keys to change). False skips the check."""
    max_nonfinite_in_a_row: int = 3
    """An optimizer update whose loss or gradient norm is NaN/inf is skipped (counted in ``train/skipped_nonfinite``,
    the critic's in ``critic/skipped_nonfinite``); after this many skipped in a row (each model counted on its own) the
    run stops with a message naming the step and the likely cause (exit status 4)."""

    def __post_init__(self) -> None:
        _check(self.steps >= 0, "training.steps must be >= 0")
        _check(self.micro_batch_size >= 1, "training.micro_batch_size must be >= 1")
        _check(self.max_tokens_per_micro_batch >= 0,
               "training.max_tokens_per_micro_batch must be >= 0 (0: no token budget)")
        _check(self.lr >= 0, "training.lr must be >= 0")
        _check(len(self.betas) == 2, f"training.betas must have two values, got {list(self.betas)}")
        for index, beta in enumerate(self.betas):
            _check_range(f"training.betas[{index}]", beta, 0, 1, high_open=True, meaning="AdamW's moment decay rates")
        _check_range("training.eps", self.eps, 0, low_open=True, meaning="AdamW's denominator term")
        _check_range("training.weight_decay", self.weight_decay, 0)
        _check_range("training.grad_clip", self.grad_clip, 0, meaning="0 = no clipping")
        _check_range("training.warmup_steps", self.warmup_steps, 0)
        _check_range("training.eval_every", self.eval_every, 0, meaning="0 = only at the end")
        _check_range("training.eval_max_prompts", self.eval_max_prompts, 0)
        _check_range("training.min_lr_ratio", self.min_lr_ratio, 0, 1, meaning="a fraction of training.lr")
        _check_range("training.logprob_recompute_mb", self.logprob_recompute_mb, 0)
        if self.num_threads is not None:
            _check_range("training.num_threads", self.num_threads, 1, meaning="or null for torch's default")
        _check_choice("training.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _check(self.logprob_chunk_size >= 1, "training.logprob_chunk_size must be >= 1")
        _check(self.max_nonfinite_in_a_row >= 1, "training.max_nonfinite_in_a_row must be >= 1")
        _check_choice("training.optimizer_offload", self.optimizer_offload, OPTIMIZER_OFFLOADS)
        _check(self.liger_fused_logprobs in ("auto", True, False),
               f"training.liger_fused_logprobs: invalid value {self.liger_fused_logprobs!r}. Valid choices: auto "
               "(on CUDA when liger-kernel is installed), true, false")


# --------------------------------------------------------------------------------------------------
# parallelism
# --------------------------------------------------------------------------------------------------


@dataclass
class ParallelismConfig:
    """Sharding and precision of the training backend."""

    backend: Choice = field(default_factory=lambda: Choice("fsdp2"))
    """Training backend (fsdp2 built in)."""
    param_dtype: str = "float32"
    """Dtype of parameters during forward/backward (FSDP2 MixedPrecisionPolicy.param_dtype; megatron: the model is
    built in it, AdamW steps master weights in ``model.dtype``)."""
    reduce_dtype: str = "float32"
    """Dtype of gradient reduction (FSDP2 MixedPrecisionPolicy.reduce_dtype; megatron: the dtype gradients
    accumulate over micro-batches and are all-reduced in, megatron's ``main_grad``)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state on the CPU (FSDP2 CPUOffloadPolicy; fsdp2 only)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward instead of storing them."""
    lean_activations: bool = True
    """Save fewer activations in recognised SwiGLU MLPs and RMSNorms (Llama, Qwen2/3, Mistral) and recompute two
    elementwise ops in backward instead: the same forward values, less memory (``rlite.plugins.fsdp2.lean_activations``)."""
    reshard_after_forward: bool = True
    """Free gathered parameters after forward (ZeRO-3 style); False keeps them until backward."""
    shard_single_process: Union[bool, str] = "auto"
    """Apply ``fully_shard`` at world size 1 too. ``auto`` (default): on a CPU, yes (the code path N ranks run, as
    before); on one CUDA GPU, only when FSDP2 implements what the run asks for, ``cpu_offload`` or compute in another
    dtype than the master weights (``param_dtype`` != ``model.dtype``: FSDP2's mixed precision, which computes exactly
    as a bf16 model does and holds one block's bf16 copy at a time); otherwise (pure bf16, fp32) the model stays plain:
    none of FSDP2's per-micro-batch copies of each block's weights and gradients, which it makes even at world size 1,
    and gradients added into ``.grad`` in place (``rlite.plugins.fsdp2.sharding.shards_single_process`` argues each
    case). ``true`` / ``false`` force it; a plain model needs ``param_dtype`` equal to ``model.dtype`` and no
    ``cpu_offload``. Several ranks always shard."""
    fused_grad_accumulation: bool = True
    """For a model without FSDP2 (a single process whose ``shard_single_process`` resolves to plain): matrix products and embeddings add
    their weight gradients straight into ``.grad`` (``addmm_``, ``index_add_``) instead of autograd allocating,
    buffering and summing a fresh gradient per use of each weight (``rlite.training.grad_accumulation``). The same gradients to
    float rounding, less memory and time per micro-batch. No effect under FSDP2."""

    def __post_init__(self) -> None:
        _check_choice("parallelism.param_dtype", self.param_dtype, DTYPES)
        _check_choice("parallelism.reduce_dtype", self.reduce_dtype, DTYPES)
        _check_trained_dtype("parallelism.param_dtype", self.param_dtype)
        _check_trained_dtype("parallelism.reduce_dtype", self.reduce_dtype)
        _check(self.shard_single_process in ("auto", True, False),
               f"parallelism.shard_single_process: invalid value {self.shard_single_process!r}. Valid choices: auto "
               "(FSDP2 on a CPU, plain on one GPU where the precision allows), true, false")
        _check(
            self.shard_single_process is not False or not self.cpu_offload,
            "parallelism.shard_single_process=false leaves the model without FSDP2 at world size 1, so it cannot "
            "apply parallelism.cpu_offload (FSDP2's CPUOffloadPolicy): set cpu_offload=false, or "
            "shard_single_process=auto",
        )


# --------------------------------------------------------------------------------------------------
# checkpoint, logging, plugins
# --------------------------------------------------------------------------------------------------


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    every: int = 0
    """Save a checkpoint every this many steps (0 = only at the end)."""
    keep_last: int = 2
    """Keep this many most recent checkpoints (older ones are deleted after a newer one is complete)."""
    resume: str = "auto"
    """``auto`` resumes from the latest complete checkpoint in the run folder, ``never`` starts fresh, or a checkpoint path."""
    resume_mismatch: str = "refuse"
    """A checkpoint whose run (its folder's ``config.yaml``) had another ``model.*`` or ``algorithm.*``: ``refuse`` to
    resume it, naming the keys that differ, or ``allow`` resuming anyway (the differences are logged)."""
    verify: bool = True
    """Before resuming, check every file of the checkpoint against the size and SHA-256 its ``MANIFEST.json`` gives
    (``resume: auto`` falls back to the newest intact one), and refuse a checkpoint without a manifest. ``false``: skip
    the checksums and accept a checkpoint without a manifest (one written before rlite wrote manifests), checking only
    what needs none (the DCP metadata reads, no shard is missing or short, every trainer state opens). Either way a
    checkpoint's pickles are read without running code, and one holding anything rlite never writes is refused."""
    save_final: bool = True
    """Save a checkpoint after the last step."""
    export_hf: bool = True
    """Export the final model as a Hugging Face folder (LoRA merged) loadable by plain transformers."""
    preempt_timeout_s: float = 600.0
    """After SIGTERM or Ctrl-C the run saves a checkpoint at the next step boundary and exits with status 75; if it
    has not within this many seconds it exits anyway (the previous checkpoint resumes). Keep it under the scheduler's
    grace period; 0 = no limit."""

    def __post_init__(self) -> None:
        _check(self.every >= 0, "checkpoint.every must be >= 0")
        _check(self.keep_last >= 1, "checkpoint.keep_last must be >= 1")
        _check_choice("checkpoint.resume_mismatch", self.resume_mismatch, ("refuse", "allow"))
        _check(self.preempt_timeout_s >= 0, "checkpoint.preempt_timeout_s must be >= 0")


@dataclass
class LoggingConfig:
    """Metrics and output."""

    run_dir: str = ""
    """Output folder: config.yaml, metrics.jsonl, checkpoints, the exported model and the final plot; empty means
    ``runs/<the config file's name without .yaml>`` (``runs/rlite`` without a config file), so each config has its own."""
    loggers: list[Choice] = field(default_factory=lambda: [Choice("jsonl"), Choice("tensorboard")])
    """Metric loggers (jsonl, tensorboard when installed, wandb)."""
    progress_bar: bool = True
    """Show a live progress bar on rank 0; when stdout is not a terminal (pipes, nohup, schedulers' log files), plain
    one-line summaries every ``log_every`` steps instead."""
    log_every: int = 10
    """Without a terminal: print a one-line summary (step, reward, held-out accuracy, tokens/s, s/step, elapsed, ETA)
    every this many steps, and at the run's first and last steps."""
    plot: bool = True
    """Write plot.png at the end: reward (and its smoothed curve) with eval accuracy, response length, entropy and KL
    against step (``rlite.metrics.plot_run``)."""
    profile: bool = False
    """Record a torch profiler trace of the run's 2nd and 3rd steps into ``<run_dir>/profile/`` (Chrome trace + top-ops table)."""
    samples_every: int = 10
    """Write rollouts (prompt, completion, reward, each reward function's value, advantage) to ``<run_dir>/samples.jsonl``
    and to the loggers that show samples (TensorBoard text, wandb tables) every this many steps and at the last step,
    and every evaluation's generations (0 = never; ``rlite.samples``)."""
    samples_per_step: int = 4
    """Rollouts written each time: rank 0's first ones (whole groups first); an evaluation writes this many per mode."""
    peak_tflops: Optional[float] = None
    """Peak TFLOP/s of one device that ``perf/mfu`` is measured against. None: the dense spec number of the CUDA
    device (``rlite.perf.PEAK_TFLOPS``, by its name, in the trainer's matmul precision); on CPU or an unlisted GPU
    there is none and ``perf/mfu`` is not reported (``perf/model_tflops`` always is)."""

    def __post_init__(self) -> None:
        _check(self.log_every >= 1, "logging.log_every must be >= 1")
        _check(self.samples_every >= 0, "logging.samples_every must be >= 0 (0 = never)")
        _check(self.samples_per_step >= 1, "logging.samples_per_step must be >= 1")
        _check(self.peak_tflops is None or self.peak_tflops > 0,
               f"logging.peak_tflops must be > 0 (TFLOP/s of one device) or null (from the device's name), got {self.peak_tflops}")
        if not self.run_dir and not _SKIP_CHECKS.get():  # built in code, without a config file to name it
            self.run_dir = "runs/rlite"
        if self.run_dir and not _SKIP_CHECKS.get():
            blocker = _existing_non_folder(self.run_dir)
            _check(blocker is None, f"logging.run_dir: {self.run_dir!r} cannot be a folder: {blocker!r} exists and "
                                    "is not a folder. Valid: a folder, or a path that does not exist yet")


def _existing_non_folder(path: str) -> str | None:
    """The nearest existing part of ``path`` (itself or an ancestor) when it is not a folder, else None."""
    current = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent
    return None if os.path.isdir(current) else current


@dataclass
class PluginsConfig:
    """Third-party plugin discovery."""

    autoload: bool = True
    """Load plugins from the ``rlite`` entry-point group (also off if RLITE_DISABLE_PLUGIN_AUTOLOAD is set)."""
    enable: Optional[list[str]] = None
    """Load only these entry-point plugins (None = all)."""


@dataclass
class RunConfig:
    """A complete training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and answers."""
    rewards: list[Choice] = field(default_factory=lambda: [Choice("exact_match")])
    """Reward functions; a sample's reward is the weighted sum (weight in ``args.weight``, default 1)."""
    reward_timeout_s: float = 60.0
    """Deadline of one batch of reward calls (a step's rollouts, one evaluation pass), counted from the
    batch's start: the calls run concurrently on the reward workers, and those unfinished then (their
    worker processes killed and replaced) score 0 and count in ``reward/timeouts``."""
    reward_workers: int = 4
    """Worker processes per reward function that runs in processes (``python``, ``math_verify``) and
    worker threads for rewards registered without isolation; built-in pure rewards run inline."""
    reward_max_failure_fraction: float = 0.01
    """Stop the run, with the first failure's traceback, when a reward function's failed calls (it
    raised, or returned NaN, inf or something that is not a number) pass this fraction of its calls
    so far, or when all its calls of one batch fail. 1 never stops: failures score 0 and are counted."""
    reward_max_timeout_fraction: float = 0.01
    """The same bound for timed-out calls (counted apart from failures): stop when they pass this
    fraction of a function's calls, or when all its calls of one batch time out; 1 never stops."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages and losses."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Optimisation."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """Sharding and precision."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics."""
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    """Plugin discovery."""

    def __post_init__(self) -> None:
        _check(bool(self.rewards), "rewards: list at least one reward function")
        _check(
            self.parallelism.shard_single_process is not False or self.parallelism.param_dtype == self.model.dtype,
            f"parallelism.shard_single_process=false leaves the model without FSDP2 at world size 1, in "
            f"model.dtype={self.model.dtype}, so it cannot compute in parallelism.param_dtype="
            f"{self.parallelism.param_dtype}: set param_dtype={self.model.dtype}, or shard_single_process=auto "
            "(FSDP2's mixed precision)",
        )
        _check(self.reward_timeout_s > 0, f"reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        _check(self.reward_workers >= 1, f"reward_workers must be >= 1, got {self.reward_workers}")
        for key in ("reward_max_failure_fraction", "reward_max_timeout_fraction"):
            _check(0.0 <= getattr(self, key) <= 1.0, f"{key} must be in [0, 1], got {getattr(self, key)}")
        _check(
            self.rollout.lora_sync == "merged" or self.model.lora.enabled,
            "rollout.lora_sync=adapter needs model.lora.enabled=true (there is no adapter to send otherwise)",
        )
        groups = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        mb = self.algorithm.minibatches_per_step
        _check(
            groups % mb == 0 and self.rollout.prompts_per_step % mb == 0,
            f"algorithm.minibatches_per_step={mb} must divide rollout.prompts_per_step="
            f"{self.rollout.prompts_per_step} so that every mini-batch holds whole groups",
        )
