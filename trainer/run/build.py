"""Building a run from its config (:func:`build_run`): data, the models (:func:`rlite.run.policy.build_models`),
the loss, the engine (last, so a failure before it leaves no engine process behind), resuming from a
checkpoint, then each of the run's components from its own builder: the policy
(:func:`rlite.run.policy.build_policy`), the targets (:func:`build_targets`), the rollouts
(:func:`build_rollouts`), the weight sync (:func:`build_weight_sync`), the recorder
(:func:`rlite.run.recorder.build_recorder`) and the checkpointer.

:class:`~rlite.run.state.Run` holds what :func:`rlite.run.loop.train` works with; every field names its type.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import time
from pathlib import Path

import torch

from rlite.algorithms.mismatch import build_corrections, needs_current_logprobs
from rlite.config import ConfigError, RunConfig, config_to_yaml
from rlite.config.advantage import AdvantageChoice, advantage_choice
from rlite.data import PromptSampler, PromptSet, load_prompt_splits
from rlite.distributed import DataLayout, DistContext, init_distributed, new_side_group
from rlite.drafts import DraftContext, SpeculativeDraft
from rlite.engines.base import IdleEngine, RolloutEngine
from rlite.engines.placement import describe_rank, gather_engine_context
from rlite.engines.supervisor import SupervisedEngine
from rlite.metrics import MetricsSink, StepTimer
from rlite.perf import PerfMeter
from rlite.plugin_manager import RlitePluginManager, resolve_choice
from rlite.reward_runner import FailureLimits, RewardRunner, build_reward_runner, reward_samples
from rlite.run.checkpoint import find_resume_checkpoint
from rlite.run.checkpointer import Checkpointer
from rlite.run.faults import Preemption
from rlite.run.lifecycle import Resumed, check_resume_config, maybe_resume
from rlite.run.limits import check_run_fits
from rlite.run.policy import Policy, build_loss, build_models, build_policy, forward_spec
from rlite.run.recorder import build_recorder, open_run_logs
from rlite.run.state import Run
from rlite.run_files import link_in_folder, make_run_folder, refusal, refuse_link_or_special, replace_run_file
from rlite.stages.async_rollout import AsyncRollouts
from rlite.stages.collect import RolloutOptions, Rollouts
from rlite.stages.evaluate import Evaluation
from rlite.stages.kl_control import KLController, build_kl_controller
from rlite.stages.routing import RoutingSetup, replay_plan, routing_setup
from rlite.stages.scoring import RolloutScoring
from rlite.stages.sync import WeightSync
from rlite.stages.targets import Targets, TargetsSpec
from rlite.training.backend import TrainingBackend
from rlite.workflows import TurnRunner, turn_format

log = logging.getLogger("rlite")


def write_run_config(run_dir: Path, text: str) -> None:
    """Replace ``<run_dir>/config.yaml`` in one step (a temporary file renamed over it): every other rank
    reads the old one in :func:`rlite.run.lifecycle.check_resume_config` while the main rank writes, and
    must see it whole, never a file cut short (which reads as another run's config)."""
    replace_run_file(run_dir / "config.yaml", text)


RUN_FILES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "eval.jsonl")
"""The files a run reads and writes at the top of its folder (its loggers' own files are opened likewise)."""


def check_run_folder(run_dir: Path) -> None:
    """Refuse (:class:`~rlite.run_files.RunFolderError`, exit status 2) a run folder holding a link or a special
    file where the run keeps one of its files, or a link in its exported ``hf_model/``: a resume would read or
    overwrite whatever it points to (``docs/faults.md``, threat model). Checkpoints are checked when chosen."""
    for name in RUN_FILES:
        refuse_link_or_special(run_dir / name)
    found = link_in_folder(run_dir / "hf_model")
    if found:
        raise refusal(*found)


def build_run(cfg: RunConfig, pm: RlitePluginManager, *, evaluation_only: bool = False,
              preemption: Preemption | None = None) -> Run:
    """Everything a run needs, resumed from ``checkpoint.resume``'s checkpoint: the models first, the engine
    last (a failure before it leaves no engine process behind), then the components that need both, and the
    first weight sync. ``evaluation_only`` (``rlite eval``): the run folder's config, metrics and loggers are
    left as they are. ``preemption``: the signal handlers' flag (:func:`rlite.run.loop.run_training`'s)."""
    started = time.perf_counter()
    ctx, resume_from = prepare_run(cfg, evaluation_only)
    tokenizer = load_tokenizer(cfg)
    train_prompts, eval_prompts = load_data(cfg, pm, ctx, tokenizer)
    rewards = build_rewards(cfg, pm, train_prompts)  # before any model loads: a bad reward fails fast
    models = build_models(cfg, pm, ctx)
    layout = models.backend.data_layout()
    sampler = PromptSampler(
        train_prompts.items, cfg.rollout.prompts_per_step, layout.rank, layout.size, cfg.data.seed, cfg.data.shuffle
    )
    turns = build_turn_runner(cfg, pm, tokenizer)
    corrections = build_corrections(cfg.algorithm.corrections, pm.registry("mismatch_correction"))
    loss_time = needs_current_logprobs(corrections)
    loss = build_loss(cfg, pm, turns, corrections if loss_time else [])
    forward = forward_spec(cfg, ctx.device.type, models.backend.capabilities)
    advantage = advantage_choice(cfg.algorithm, pm.registries)
    targets_spec = build_targets_spec(cfg, advantage, [] if loss_time else corrections, rewards.weights)
    kl_controller = build_kl_controller(cfg.algorithm.kl)
    if layout.leader:  # the replica's leader scores its batches
        rewards.start()
    draft = build_draft(cfg, pm, tokenizer, ctx.device, layout)
    weight_sync = build_weight_sync(cfg, pm, models.backend, draft)
    resumed = maybe_resume(resume_from, models, sampler, kl_controller, ctx, pm, draft=draft)
    provenance = run_provenance(cfg, pm, ctx, resume_from, resumed.step)
    loggers = open_run_logs(cfg, pm, ctx, resumed.step, provenance, training=not evaluation_only)
    engine, engine_metrics = launch_engine(cfg, pm, ctx, layout, tokenizer, models.backend, weight_sync, draft)
    timer = StepTimer()
    try:
        weight_sync.check(engine, cfg.rollout.engine.name)
        routing = routing_setup(cfg, models.backend, engine, layout, pm)
        policy = build_policy(cfg, models, dataclasses.replace(forward, routing=replay_plan(routing)), loss,
                              layout=layout, hooks=pm.hook, timer=timer)
        targets = build_targets(targets_spec, policy, kl_controller, layout, routing)
        options = rollout_options(cfg, engine, layout, draft=draft, record_routing=routing is not None, turns=turns,
                                  greedy_baseline=advantage.needs_greedy_baseline)
        scoring = RolloutScoring(rewards, layout, cfg.training.accuracy_threshold)
        rollouts = build_rollouts(cfg, engine, sampler, scoring, tokenizer, layout, pm.hook, timer, options,
                                  engine_metrics=engine_metrics, resumed=resumed)
        perf = None if evaluation_only else PerfMeter.for_run(
            cfg, policy.backend.hf_config(), ctx, critic=policy.critic is not None,
            reference=policy.reference is not None, routing_metrics=routing is not None and routing.metrics,
        )  # model FLOPs of the trainer's passes, MFU against the device's peak
        recorder = build_recorder(cfg, pm, ctx, loggers=loggers, timer=timer, perf=perf, start_step=resumed.step,
                                  started=started, reward_names=rewards.names, tokenizer=tokenizer,
                                  training=not evaluation_only)
        preemption = preemption if preemption is not None else Preemption(0.0)
        run = Run(
            config=cfg, ctx=ctx, pm=pm, run_dir=Path(cfg.logging.run_dir), tokenizer=tokenizer, start_step=resumed.step,
            resumed_from=resume_from, preemption=preemption, engine=engine, draft=draft, rollouts=rollouts,
            targets=targets, policy=policy, weight_sync=weight_sync, recorder=recorder,
            evaluation=Evaluation(engine, tokenizer, scoring, options, layout, eval_prompts,
                                  cfg.training.eval_max_prompts, sample_count=cfg.logging.samples_per_step
                                  if recorder.samples is not None else 0, engine_metrics=engine_metrics),
            checkpointer=Checkpointer(
                run_dir=Path(cfg.logging.run_dir), rank=ctx.rank, keep_last=cfg.checkpoint.keep_last,
                resume=cfg.checkpoint.resume, provenance=provenance, policy=policy, rollouts=rollouts,
                targets=targets, draft=draft, sampler=sampler, hooks=pm.hook, timer=timer, preemption=preemption,
            ),
        )  # fmt: skip
        weight_sync.send(engine, resumed.step)
    except BaseException:
        engine.shutdown()
        rewards.close()
        raise
    return run


def prepare_run(cfg: RunConfig, evaluation_only: bool) -> tuple[DistContext, Path | None]:
    """Before anything loads: the input paths checked, the process set up (distributed, threads, allocator,
    seed), the run folder checked and made, the checkpoint to resume from found (its checksums verified) and
    checked against this config, and (a training run, main rank) this run's ``config.yaml`` written; the
    process context and that checkpoint (``None``: a fresh run)."""
    check_input_paths(cfg)  # before anything loads or the run folder is touched
    ctx = init_distributed()
    if cfg.training.num_threads is not None:
        torch.set_num_threads(cfg.training.num_threads)
    if cfg.training.keep_freed_memory:
        from rlite.run.allocator import keep_freed_memory

        keep_freed_memory()
    torch.manual_seed(cfg.training.seed)
    run_dir = Path(cfg.logging.run_dir)
    check_run_folder(run_dir)  # a link where the run keeps a file: refused before anything is read or written
    # found (and its checksums verified) once; the config check, the load and the provenance use it
    # (an evaluation describes the checkpoint it was pointed at: a damaged one is refused, not replaced)
    resume_from = find_resume_checkpoint(run_dir, cfg.checkpoint.resume, verify=cfg.checkpoint.verify,
                                         fallback=not evaluation_only)
    check_resume_config(cfg, resume_from)  # before this run's config.yaml replaces the one the check reads
    if ctx.is_main:
        try:
            make_run_folder(run_dir)  # 0700: a sandboxed program's uid, or another user, reads nothing in it
        except OSError as exc:  # /proc/x, a read-only mount, no permission
            raise ConfigError(f"logging.run_dir: cannot create the run folder {str(run_dir)!r} ({exc.strerror or exc}); "
                              "point it at a folder you can write") from None
    if ctx.is_main and not evaluation_only:
        write_run_config(run_dir, config_to_yaml(cfg))
    return ctx, resume_from


def load_data(cfg: RunConfig, pm: RlitePluginManager, ctx: DistContext, tokenizer) -> tuple[PromptSet, PromptSet | None]:
    """The training and held-out prompts (``data``), the run's context and memory checked against the longest
    (before any model allocates)."""
    try:
        train_prompts, eval_prompts = load_prompt_splits(cfg.data, tokenizer)
    except (FileNotFoundError, ValueError, KeyError) as exc:  # bad data files: the messages name the key
        raise ConfigError(str(exc).strip("'\"")) from exc
    longest_prompt = max((len(p.prompt_ids) for split in (train_prompts, eval_prompts) if split is not None
                          for p in split.items), default=None)
    check_run_fits(cfg, ctx.device, ctx.world_size, longest_prompt, pm)  # context and memory, before models allocate
    return train_prompts, eval_prompts


def build_targets_spec(cfg: RunConfig, advantage: AdvantageChoice, corrections: list,
                       reward_weights: list[float]) -> TargetsSpec:
    """The algorithm's choices that shape stage 3 (``corrections``: those applied there, not in the loss)."""
    algo = cfg.algorithm
    return TargetsSpec(
        advantage=advantage.resolved,
        old_logprob_mode=algo.old_logprob_mode,
        minibatches=algo.minibatches_per_step,
        epochs=algo.epochs_per_step,
        kl_in_reward=algo.kl.in_reward,
        mask_truncated=algo.mask_truncated,
        corrections=corrections,
        micro_batch_size=cfg.training.micro_batch_size,
        reward_weights=tuple(reward_weights),
    )


def build_targets(spec: TargetsSpec, policy: Policy, kl_controller: KLController, layout: DataLayout,
                  routing: RoutingSetup | None) -> Targets:
    """The run's :class:`~rlite.stages.targets.Targets`: the policy's models score the batch with its forward spec."""
    return Targets(spec, policy=policy.backend, reference=policy.reference, critic=policy.critic,
                   forward=policy.forward, kl_fn=policy.loss.kl_fn, kl_controller=kl_controller, layout=layout,
                   routing=routing)


def build_weight_sync(cfg: RunConfig, pm: RlitePluginManager, backend: TrainingBackend,
                      draft: SpeculativeDraft | None) -> WeightSync:
    """The run's :class:`~rlite.stages.sync.WeightSync` (``rollout.lora_sync``, ``rollout.quantization``)."""
    quantizer = None
    if cfg.rollout.quantization.name != "none":
        quantizer = resolve_choice(pm.registry("rollout_quantizer"), cfg.rollout.quantization)
    return WeightSync(backend, cfg.rollout.lora_sync, quantizer, draft)


def launch_engine(cfg: RunConfig, pm: RlitePluginManager, ctx: DistContext, layout: DataLayout, tokenizer,
                  backend: TrainingBackend, weight_sync: WeightSync,
                  draft: SpeculativeDraft | None) -> tuple[RolloutEngine, MetricsSink | None]:
    """The rollout engine of this rank (an :class:`IdleEngine` on the ranks that receive their replica leader's
    batches) and where it reports its metrics. Every rank tells the engine factories where it runs and what its
    trainer will still allocate (a collective). At world size 1 the engine is supervised: restarted when its
    process dies and re-synced (``weight_sync``); with several ranks a death stops the run."""
    context = gather_engine_context(
        describe_rank(ctx.rank, ctx.local_rank, ctx.device, bytes_to_come=backend.device_bytes_to_come(),
                      builds_engine=layout.leader),
        weight_sync.quantizer,
        draft=None if draft is None else draft.spec,
        compute_dtype=cfg.parallelism.param_dtype,
    )  # fmt: skip
    if not layout.leader:
        return IdleEngine(), context.metrics
    make_engine, engine_cfg = resolve_choice(pm.registry("rollout_engine"), cfg.rollout.engine)
    start = functools.partial(make_engine, cfg.model, tokenizer, cfg.rollout, engine_cfg, context)
    if ctx.world_size == 1:  # the re-sync after a restart is this rank's alone
        return SupervisedEngine.launch(start, cfg.rollout.engine_restarts, resync=weight_sync.send), context.metrics
    return start(), context.metrics


HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
"""What a Hugging Face hub repo id looks like (``name`` or ``owner/name``)."""


def check_model_source(key: str, source: str) -> None:
    """A model (or tokenizer) source must be an existing folder, or look like a hub repo id while the
    hub is reachable; anything else is reported as a missing folder (not transformers' repo-id error).
    Messages say where a relative path is read from and, for a name that could be a hub repo id, that
    it would be downloaded from the hub."""
    path = Path(source).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise ConfigError(f"{key}: {source!r} is a file; point it at the model's folder (config.json, weights, tokenizer)")
    looks_local = (
        not HUB_REPO_ID.match(source) or source.startswith((".", "~", "/")) or (
            len(path.parts) > 1 and path.parent.is_dir())
    )  # fmt: skip
    where = where_relative_paths_are_read(path)
    if looks_local:
        existing = next((p for p in path.absolute().parents if p.is_dir()), None)
        # the working folder, or the root, is no hint: only a deeper folder that exists says where the path broke off
        hint = existing is not None and existing not in (Path.cwd(), Path(existing.anchor))
        raise ConfigError(
            f"{key}: folder {str(path)!r} does not exist{where}"
            + (f"; its nearest existing folder is {str(existing)!r}" if hint else "")
        )
    offline = any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    if offline:
        raise ConfigError(
            f"{key}: {source!r} is not a local folder{where}, and as a Hugging Face hub name it would be downloaded, "
            "but the Hugging Face hub is offline (HF_HUB_OFFLINE), so it cannot be; point it at a model folder"
        )
    log.info("%s: %r is not a local folder%s: trying it as a Hugging Face hub name (a download)", key, source, where)


def where_relative_paths_are_read(path: Path) -> str:
    """`` (relative paths are read from the working folder, CWD)`` for a relative path, else ``""``."""
    return "" if path.is_absolute() else f" (relative paths are read from the working folder, {os.getcwd()})"


def check_input_paths(cfg: RunConfig) -> None:
    """Every model folder and data file the run reads exists (globs match, folders hold data files)."""
    from rlite.data import resolve_data_files

    check_model_source("model.path", cfg.model.path)
    if cfg.model.tokenizer:
        check_model_source("model.tokenizer", cfg.model.tokenizer)
    if cfg.model.gguf_file and Path(cfg.model.path).is_dir() and not (Path(cfg.model.path) / cfg.model.gguf_file).is_file():
        raise ConfigError(f"model.gguf_file: {cfg.model.gguf_file!r} is not a file in {cfg.model.path!r}")
    if cfg.algorithm.critic.enabled and cfg.algorithm.critic.path:
        check_model_source("algorithm.critic.path", cfg.algorithm.critic.path)
    if cfg.data.train_files is not None:
        for key in ("train_files", "eval_files"):
            spec = getattr(cfg.data, key)
            if spec is not None:
                try:
                    resolve_data_files(spec, f"data.{key}")
                except (FileNotFoundError, ValueError) as exc:
                    raise ConfigError(str(exc).strip("'\"")) from None


def sandbox_hidden_paths(cfg: RunConfig) -> list[str]:
    """What every program a reward runs in the sandbox must not see of this run, wherever it lives: the run
    folder (its config, checkpoints, metrics and samples), the data files (the answers) and the optimizer
    offload folder, and a checkpoint resumed from another folder (:func:`rlite.sandbox.hidden_from_programs`)."""
    import glob

    from rlite.data import GLOB_CHARS
    from rlite.training.optim_offload import optimizer_offload_dir

    paths = [cfg.logging.run_dir, str(optimizer_offload_dir(cfg.training.optimizer_offload_dir, cfg.logging.run_dir, 0).parent)]
    if cfg.checkpoint.resume not in ("auto", "never"):
        paths.append(cfg.checkpoint.resume)
    for spec in (cfg.data.train_files, cfg.data.eval_files):
        for entry in [spec] if isinstance(spec, str) else list(spec or []):
            text = os.path.expanduser(str(entry))
            paths += sorted(glob.glob(text, recursive=True)) if any(ch in text for ch in GLOB_CHARS) else [text]
    return [os.path.abspath(path) for path in paths]


def run_provenance(cfg: RunConfig, pm: RlitePluginManager, ctx: DistContext, resume_from: Path | None,
                   start_step: int) -> dict:
    """This run's record; a resumed run's names the record of the checkpoint it loaded (``resume_from``)."""
    from rlite.run.provenance import collect_provenance, read_checkpoint_record

    record = collect_provenance(cfg, pm, world_size=ctx.world_size, device=ctx.device, weight_version=start_step)
    if resume_from is not None:
        record["resumed_from"] = {"step": start_step, "provenance": read_checkpoint_record(resume_from)}
    return record


def rollout_options(cfg: RunConfig, engine: RolloutEngine, layout: DataLayout, *, draft: SpeculativeDraft | None,
                    record_routing: bool, turns: TurnRunner | None, greedy_baseline: bool) -> RolloutOptions:
    """How the run samples: the rollout config and what the advantage estimator (``greedy_baseline``: its
    declared needs, :mod:`rlite.config.advantage`), the draft, MoE routing and the workflow ask of the
    rollouts; a draft is checked against the engine that must run it."""
    if draft is not None and layout.leader and draft.spec.method not in engine.capabilities.draft_methods:
        raise ConfigError(
            f"rollout.draft: the {cfg.rollout.engine.name!r} engine cannot run a {draft.spec.method!r} draft "
            f"(it runs: {', '.join(engine.capabilities.draft_methods) or 'no drafts'}); set rollout.draft=none"
        )
    return RolloutOptions(
        rollout=cfg.rollout,
        seed=cfg.training.seed,
        dynamic_sampling=cfg.algorithm.dynamic_sampling,
        dynamic_sampling_max_rounds=cfg.algorithm.dynamic_sampling_max_rounds,
        greedy_baseline=greedy_baseline,
        record_routing=record_routing,
        speculating=draft is not None,
        top_logprobs=0 if draft is None else int(draft.rollout_top_logprobs),
        turns=turns,
    )


def build_rollouts(cfg: RunConfig, engine, sampler, scoring: RolloutScoring, tokenizer, layout: DataLayout,
                   hooks, timer: StepTimer, options: RolloutOptions, engine_metrics: MetricsSink | None = None,
                   resumed: Resumed | None = None) -> Rollouts:
    """Stages 1-2 of the run: synchronous rollouts, or a producer thread ahead of the trainer
    (``rollout.mode``); ``engine_metrics``: where the engine reports (its context's sink), drained with each
    batch; ``resumed``: the checkpoint's batches sampled ahead, taken where they fit."""
    rollouts = rollouts_of_mode(cfg, (engine, sampler, scoring, tokenizer, options, layout, hooks, timer, engine_metrics))
    if resumed is not None:
        rollouts.resume_ahead(resumed.rollouts_ahead, resumed.step)
    return rollouts


def rollouts_of_mode(cfg: RunConfig, args: tuple) -> Rollouts:
    """:class:`Rollouts` (``rollout.mode=sync``) or :class:`AsyncRollouts` built with ``args``, the mode's checks
    passed."""
    engine, layout = args[0], args[5]
    mode = cfg.rollout.mode
    if mode == "sync":
        return Rollouts(*args)
    if layout.replica_size > 1:
        raise ConfigError(
            f"rollout.mode={mode}: asynchronous rollouts need every rank to sample its own batch, and this backend "
            f"lays out replicas of {layout.replica_size} ranks whose leader samples for them (tensor parallelism); "
            "use rollout.mode=sync, or a backend without tensor parallelism (fsdp2)"
        )
    overlaps = mode == "one_step_off" or cfg.rollout.max_staleness > 0
    if overlaps and engine.capabilities.shares_weights:  # a third-party engine's (the built-in's is a config rule)
        raise ConfigError(
            f"rollout.mode={mode}: the engine samples while the trainer updates, so it needs its own copy of the "
            "weights; set rollout.engine.args.share_weights=false (or rollout.engine.args.process=true)"
        )
    # the producer thread's collectives get a process group of their own (every rank creates it, here)
    return AsyncRollouts(*args, mode=mode, max_staleness=cfg.rollout.max_staleness, last_step=cfg.training.steps,
                         wait_timeout_s=cfg.rollout.timeout_s, partial_segment_tokens=cfg.rollout.partial_segment_tokens,
                         group=new_side_group())


def build_turn_runner(cfg: RunConfig, pm: RlitePluginManager, tokenizer) -> TurnRunner | None:
    """The runner of a multi-turn ``rollout.workflow`` (``None`` for a single-turn one)."""
    entry = pm.registry("rollout_workflow").get(cfg.rollout.workflow.name)
    if entry.metadata.get("single_turn"):
        return None
    factory, workflow_cfg = resolve_choice(pm.registry("rollout_workflow"), cfg.rollout.workflow)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        fmt = turn_format(tokenizer, cfg.rollout.observation_role, cfg.data.chat_template, eos)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return TurnRunner(lambda: factory(workflow_cfg, tokenizer), tokenizer, fmt, max_turns=cfg.rollout.max_turns,
                      max_response_tokens=cfg.rollout.max_response_tokens, workflow=entry.name)


def build_rewards(cfg: RunConfig, pm: RlitePluginManager, train_prompts) -> RewardRunner:
    """The reward runner of ``cfg.rewards``, each function checked against the first training row as
    the functions will see it."""
    example = None
    if len(train_prompts):
        example = reward_samples([train_prompts.items[0].row], [1], ["stop"])[0]
    limits = FailureLimits(cfg.reward_max_failure_fraction, cfg.reward_max_timeout_fraction)
    return build_reward_runner(cfg.rewards, pm.registry("reward_function"), timeout_s=cfg.reward_timeout_s,
                               workers=cfg.reward_workers, limits=limits, example_sample=example)


def build_draft(cfg: RunConfig, pm: RlitePluginManager, tokenizer, device: torch.device,
                layout: DataLayout) -> SpeculativeDraft | None:
    """The draft plugin's draft (``rollout.draft``), or ``None`` for plain decoding."""
    if cfg.rollout.draft.name == "none":
        return None
    make_draft, draft_cfg = resolve_choice(pm.registry("speculative_draft"), cfg.rollout.draft)
    return make_draft(DraftContext(cfg.model, tokenizer, cfg.rollout, device, layout), draft_cfg)


def load_tokenizer(cfg: RunConfig):
    from transformers import AutoTokenizer

    source = cfg.model.tokenizer or cfg.model.path
    kwargs = {"gguf_file": cfg.model.gguf_file} if cfg.model.gguf_file and not cfg.model.tokenizer else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
        tried_hub = not Path(source).expanduser().is_dir()
        how = (f" (not a local folder{where_relative_paths_are_read(Path(source))}, so it was tried as a Hugging Face "
               "hub name: check the name and the network, or point it at a model folder)") if tried_hub else ""
        raise ConfigError(f"{key}: cannot load a tokenizer from {source!r}{how}: {exc}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
