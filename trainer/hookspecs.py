"""The plugin author's contract: every hook rlite calls, grouped by stage.

A plugin is any module or object with functions decorated by :data:`rlite.hookimpl` whose names
match the specs below. Built-ins (``rlite.plugins.*``) and third-party packages (entry-point group
``rlite``) go through exactly the same path. An implementation may accept fewer arguments than the
spec lists (pluggy passes only the ones it names), so hooks can gain arguments without breaking
plugins.

Two kinds of hooks:

* **Registration hooks** (``register_*``) are called once, when the plugin manager is built. Each
  receives a ``register`` callback and calls it once per implementation it provides::

      register(name, implementation, config_cls=None, **metadata)

  ``config_cls`` is an optional dataclass of options for that implementation; the YAML's ``args``
  for the choice are validated against it when the config loads, and the implementation receives
  an instance of it, nested options built too (a field holding a dataclass; a nested choice declared
  ``field(metadata={"choice_of": kind})``, whose ``<name>_args`` arrive as that implementation's config
  instance: :mod:`rlite.config.options`). Names must be unique across all plugins of a kind. ``metadata``
  declares what the implementation needs or offers, where a kind's hook lists such keys (``needs_critic``,
  ``needs_group`` and ``needs_greedy_baseline`` for advantage estimators; an engine's ``memory``, a backend's
  ``unsupported``, ...); one table holds every key (:data:`rlite.config.capabilities.CAPABILITIES`, shown in
  ``docs/plugins.md``), and the config loader, the compatibility rules, the memory check and the audit read
  it, so no rlite code tests implementation names. Any registration may pass
  ``check_config=fn(config: RunConfig, cfg) -> None``: called when the config loads (after validation) for
  each implementation the config chooses, with the run config and the choice's config instance (None
  without ``config_cls``); it raises ``ConfigError`` naming the key to refuse a config the implementation
  cannot honour, and the load fails naming the choice and the plugin.

* **Lifecycle hooks** (``on_*``, ``after_*``, ``before_*``) are called by the training loop on
  every rank unless the docstring says otherwise. Their return values are ignored unless stated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from rlite.config import RunConfig
    from rlite.engines.base import RolloutEngine
    from rlite.rollout import RolloutBatch

PROJECT_NAME = "rlite"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[..., None]
"""``register(name: str, implementation: object, config_cls: type | None = None, **metadata) -> None``."""


# --------------------------------------------------------------------------------------------------
# Registration: named choices that YAML selects
# --------------------------------------------------------------------------------------------------


@hookspec
def register_advantage_estimators(register: Register) -> None:
    """Register advantage estimators, selected by ``algorithm.advantage.name``.

    :param register: call ``register(name, fn, config_cls)`` for each estimator. ``fn(batch, cfg)``
        takes an :class:`rlite.algorithms.AdvantageInput` and the estimator's config instance and
        returns ``(advantages, returns)``, both float tensors of shape ``[B, T]`` that are zero
        where ``batch.response_mask`` is zero. Pass ``needs_critic=True`` for an estimator that reads
        ``batch.values`` (the config then requires ``algorithm.critic.enabled``), and ``needs_group``
        for one whose baseline comes from the other samples of a prompt's group: ``True``, or a
        function of the estimator's config instance (``lambda cfg: cfg.singleton == "zero"``); the
        config then refuses ``rollout.samples_per_prompt=1``, under which every advantage would be 0),
        and ``needs_greedy_baseline=True`` for one that reads ``batch.baseline_scores`` (the rollout
        stage then generates one greedy completion per prompt and scores it, as ReMax needs).
        ``batch.reward_components`` and ``batch.reward_weights`` carry each reward function's value.
        Pass ``reference=fn64``, the same formula written independently in float64 (same arguments,
        same ``(advantages, returns)``), to have ``rlite audit`` and :func:`rlite.testing.conformance.check_estimator`
        check ``fn`` against it; the built-ins all register one.
    """


@hookspec
def register_policy_losses(register: Register) -> None:
    """Register policy losses, selected by ``algorithm.policy_loss.name``.

    :param register: call ``register(name, fn, config_cls)``. ``fn(logprobs, old_logprobs,
        advantages, response_mask, cfg)`` takes ``[B, T]`` tensors (``logprobs`` carries the
        gradient) and returns ``(per_token_loss, token_metrics)``: a ``[B, T]`` loss to minimise
        before aggregation, and a dict of ``[B, T]`` per-token metric values (for example a 0/1
        clip indicator) that the trainer averages over the response tokens of the whole batch.
        Pass ``reference=fn64``, the same loss written independently in float64 (same arguments,
        returning the ``[B, T]`` per-token loss), to have ``rlite audit`` and
        :func:`rlite.testing.conformance.check_policy_loss` check ``fn`` against it.
    """


@hookspec
def register_kl_estimators(register: Register) -> None:
    """Register estimators of KL(pi_theta || pi_ref), selected by ``algorithm.kl.estimator``.

    :param register: call ``register(name, fn)``. ``fn(logprobs, ref_logprobs)`` takes two
        ``[B, T]`` tensors and returns the per-token estimate ``[B, T]`` (its gradient flows through
        ``logprobs``).
    """


@hookspec
def register_mismatch_corrections(register: Register) -> None:
    """Register train/inference mismatch corrections, listed in ``algorithm.corrections``.

    :param register: call ``register(name, fn, config_cls)``. ``fn(old_logprobs,
        rollout_logprobs, response_mask, cfg)`` returns ``(weights, mask, metrics)``: a ``[B, T]``
        detached weight multiplying the per-token policy loss (or ``None`` for no weighting), the
        ``[B, T]`` mask of tokens kept, and a dict of scalar metrics. Corrections compose in the
        order listed: weights multiply and masks intersect.
    """


@hookspec
def register_rollout_quantizers(register: Register) -> None:
    """Register rollout-weight quantizers, selected by ``rollout.quantization.name``.

    :param register: call ``register(name, quantizer, config_cls)``. ``quantizer(name, tensor,
        cfg)`` is applied to each weight at sync time and returns the tensor the engine should
        load (already dequantized for engines that cannot run the quantized format). For engines
        that run quantized kernels (``EngineCapabilities.quantized_layout``, e.g. SGLang) the
        quantizer also carries ``quantizer.engine_layout(name, tensor, cfg) -> [(name, tensor),
        ...]`` (the quantized weight and its scales, named as in a quantized checkpoint) and
        ``quantizer.checkpoint_quantization_config(cfg) -> dict`` (that checkpoint's Hugging Face
        ``quantization_config``, which the engine is started with). The tensors arrive in the
        engine's ``weight_dtype``.
    """


@hookspec
def register_speculative_drafts(register: Register) -> None:
    """Register speculative-decoding drafts, selected by ``rollout.draft.name``.

    :param register: call ``register(name, factory, config_cls, method=...)``, with ``method`` the
        kind of draft (:attr:`rlite.api.DraftSpec.method`: ``model``, ``ngram`` or ``eagle``; the config
        loader refuses a draft the chosen engine cannot run). ``factory(context, cfg)`` receives a
        :class:`rlite.api.DraftContext` (the policy's model config and tokenizer, the rollout config,
        the device and the data-parallel layout) and the draft's config instance, and returns a
        :class:`rlite.api.SpeculativeDraft`: its ``spec`` (what the engine runs), ``update(batch)``
        (called every step with the step's rollouts, after the policy's update; the draft's loss must
        not reach the policy), ``named_weights()`` (sent to the engine after the policy's in every
        weight sync when ``spec.trained``), ``state_dict()``/``load_state_dict()`` for checkpoints and
        ``export(out_dir)``.
    """


@hookspec
def register_training_backends(register: Register) -> None:
    """Register training backends, selected by ``parallelism.backend.name``.

    :param register: call ``register(name, factory, config_cls)``. ``factory(config, cfg, device,
        total_optimizer_steps)`` receives the run config, the backend's own config instance, the
        rank's torch device and the number of optimizer steps of the run, and returns a
        :class:`rlite.api.TrainingBackend`: log-probs of a batch, ``backward`` and ``step``, the full
        weights as (Hugging Face name, tensor) pairs for weight sync and export, checkpoint state,
        the LoRA adapter where it trains one, reference model and critic, ``close()``. The loop,
        weight sync, export and checkpointing use nothing else; a backend that reports numbers for the
        step's metrics row holds an :class:`rlite.api.MetricsSink` as its ``metrics`` attribute (drained
        after the update). ``unsupported={feature: Unsupported(why, instead)}`` lists the run's features it
        does not implement (refused when the config loads), ``model_parallel=(...)`` its options that split
        the model. Optional ``trainer_memory=fn``:
        ``fn(config, cfg, parameters, world_size)`` returns the bytes one rank holds by part
        (``{"weights": ..., "gradients": ..., "AdamW moments": ...}``) for the memory check a run makes
        before it allocates (docs/memory.md); without it the backend is estimated as FSDP2's shards.
    """


@hookspec
def register_rollout_engines(register: Register) -> None:
    """Register rollout engines, selected by ``rollout.engine.name``.

    :param register: call ``register(name, factory, config_cls)``. ``factory(model_config,
        tokenizer, rollout_config, cfg, context)`` receives the ``model`` and ``rollout`` config
        sections, the tokenizer, the engine's own config instance and an
        :class:`rlite.api.EngineContext` (every rank's host, GPU, free device memory and what its
        trainer will still allocate, the rollout quantizer, the speculative draft, and ``metrics``: the
        :class:`rlite.api.MetricsSink` where the engine reports numbers for the step's row), and returns a
        :class:`rlite.api.RolloutEngine` (its weights are overwritten by the first sync) whose
        ``capabilities`` (:class:`rlite.api.EngineCapabilities`) say whether it shares the trainer's
        weights, serves LoRA adapters, wants its weights in another dtype or pre-quantized. It is
        called on every rank that builds an engine (``context.engine_ranks``), at the same time. An
        engine that runs speculative drafts registers with ``draft_methods=(...)`` (the
        :attr:`rlite.api.DraftSpec.method` values it runs) and finds the draft's
        :class:`rlite.api.DraftSpec` in ``context.draft`` (None when ``rollout.draft`` is off; an
        engine registered without ``draft_methods`` is never given one). ``memory=fn(config, cfg, shape,
        tokens, world_size, on_gpu)`` returns the bytes it holds on the trainer's device by part, for the
        memory check; ``samples_in_process`` and ``shares_weights`` say whether it samples in the trainer's
        process and binds its tensors; ``available=fn()`` says what it lacks to start on this machine.
    """


@hookspec
def register_rollout_workflows(register: Register) -> None:
    """Register rollout workflows (environments), selected by ``rollout.workflow.name``.

    :param register: call ``register(name, factory, config_cls)``. ``factory(cfg, tokenizer)`` is called
        once per trajectory and returns an environment (:class:`rlite.api.Environment`):
        ``reset(sample) -> first observation`` (None, text, or token ids appended to the prompt) and
        ``step(action) -> (observation, reward, done)`` after every sampled turn, where ``action`` is an
        :class:`rlite.api.Action` (the sampled token ids and their text). Observations are appended as
        tokens between the chat template's turn separators and masked out of the loss; rewards are
        summed over the trajectory (``batch.env.rewards``), which the reward functions see as
        ``sample["env_reward"]`` (the ``env_reward`` reward function returns it). Pass
        ``single_turn=True`` for a workflow whose environment always stops after one turn with no
        reward: the loop then samples it with one engine call, as a plain rollout.
    """


@hookspec
def register_reward_functions(register: Register) -> None:
    """Register reward functions, selected by ``rewards[*].name``.

    :param register: call ``register(name, fn, config_cls)``. ``fn(completion, sample, cfg)``
        receives the decoded completion text and the data row (a dict with at least ``prompt``
        and, for verifiable tasks, ``answer``) and returns a float. Keywords say how the reward
        runner calls it: ``isolation="thread"`` (default), ``"process"`` (worker processes killed
        at the deadline; module-level function and config) or ``"inline"`` (cannot hang);
        ``batched=True`` for ``fn(completions, samples, cfg) -> list[float]``; ``check=fn(cfg,
        sample)``, called with the first data row before training, raising ConfigError to refuse.
    """


@hookspec
def register_loggers(register: Register) -> None:
    """Register metric loggers, listed in ``logging.loggers``.

    :param register: call ``register(name, factory, config_cls)``. ``factory(run_dir, config, cfg)``
        returns an :class:`rlite.api.Logger` (or None when it cannot run): ``log(step: int, metrics:
        dict[str, float])`` and ``close()``, and optionally ``log_samples(step: int, kind: str, rows:
        list[dict])``, which receives rollouts (``kind`` train or eval; rows as in ``samples.jsonl``,
        ``rlite.samples``), and ``resume(step)``, called once before anything is logged when the run resumes
        from a checkpoint of ``step``: forget what an interrupted run logged after it. Loggers are built on
        rank 0 only.
    """


# --------------------------------------------------------------------------------------------------
# Lifecycle: called by the training loop, in this order within a step
# --------------------------------------------------------------------------------------------------


@hookspec
def on_run_start(config: RunConfig, run_dir: Path) -> None:
    """Called once on every rank after the model, engine and data are built, before step 1.

    :param config: the validated run configuration.
    :param run_dir: the output folder of the run (checkpoints, metrics, plots).
    """


@hookspec
def after_rollout(step: int, batch: RolloutBatch) -> None:
    """Called after generation, before rewards. The batch may be modified in place.

    With asynchronous rollouts (``rollout.mode`` other than ``sync``) this runs on the producer thread,
    while the trainer's thread trains: a collective here must go on that thread's group (rlite's own
    collectives do with no group given; ``torch.distributed`` calls need
    ``group=rlite.distributed.thread_group()``), never on the default group.

    :param step: the 1-based training step.
    :param batch: the generated samples of this rank (token ids, rollout log-probs, finish reasons).
    """


@hookspec
def after_rewards(step: int, batch: RolloutBatch) -> None:
    """Called once the rewards have scored the batch, before advantages. May modify the scores. Runs on the
    producer thread with asynchronous rollouts (see :func:`after_rollout`).

    :param step: the 1-based training step.
    :param batch: the samples with their scores, a :class:`rlite.rollout.ScoredBatch`: the
        :class:`RolloutBatch`'s fields plus the scalar rewards in ``batch.scores``, ``correct``,
        ``reward_components`` and, for an estimator that asks for it, the greedy ``baseline_*``.
    """


@hookspec
def before_optimizer_step(step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Called after gradients are accumulated and clipped, just before ``optimizer.step()``.

    :param step: the 1-based training step.
    :param model: the training model (FSDP2-sharded).
    :param optimizer: its optimizer; gradients are in ``param.grad``.
    """


@hookspec
def after_optimizer_step(step: int, model: torch.nn.Module, metrics: dict[str, float]) -> None:
    """Called after the optimizer and LR scheduler stepped.

    :param step: the 1-based training step.
    :param model: the training model with its new weights.
    :param metrics: this step's training metrics so far (loss, grad norm, ...); may be extended.
    """


@hookspec
def after_weight_sync(step: int, weight_version: int, engine: RolloutEngine) -> None:
    """Called after the rollout engine received and acknowledged new weights.

    :param step: the 1-based training step.
    :param weight_version: the version the engine now samples with.
    :param engine: the rollout engine.
    """


@hookspec
def on_metrics(step: int, metrics: dict[str, float]) -> None:
    """Called on rank 0 with the final metrics of a step (after evaluation if one ran).

    :param step: the 1-based training step; 0 for the baseline evaluation of a fresh run, before
        the first step.
    :param metrics: flat ``name -> value`` mapping, names like ``actor/pg_loss``.
    """


@hookspec
def on_checkpoint_save(step: int, path: Path) -> None:
    """Called on every rank after a checkpoint is completely written and published.

    :param step: the step the checkpoint holds.
    :param path: the checkpoint folder.
    """


@hookspec
def on_checkpoint_load(step: int, path: Path) -> None:
    """Called on every rank after a checkpoint was loaded to resume a run.

    :param step: the step the run resumes after.
    :param path: the checkpoint folder it was loaded from.
    """


@hookspec
def on_run_end(config: RunConfig, summary: dict[str, Any]) -> None:
    """Called once on every rank when training finishes normally.

    :param config: the run configuration.
    :param summary: final numbers of the run (steps, last reward, eval accuracy, time breakdown).
    """
