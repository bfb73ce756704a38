"""``rlite audit CONFIG [overrides]``: prove a config's invariants on a tiny replica before the real run.

The replica keeps the config's plugins, algorithm settings, backend, engine and quantizer, and swaps
the model for a tiny random one of the same architecture family (Qwen2, Llama, or Qwen3-MoE for MoE
models; other families are replaced by Qwen2), a few prompts and 3 steps. What it cannot keep on this
machine it replaces and the table's title says so: data files that are not here (synthetic data with
the same keys), an engine that cannot start here (as its registration's ``available`` says; the default engine
instead, and the mismatch row is then n/a), the backend's model-parallel sizes (its ``model_parallel``: 1). Each check prints what it measured:

* ``on-policy ratio``: in the first micro-batch of every step's first optimizer step the PPO ratio
  exp(lp − old) is exactly 1 (max |lp − old| = 0; not applicable in bypass mode without true on-policy).
* ``world size 2 == 1`` and ``micro-batch x accumulation``: one optimizer step of the configured backend,
  estimator, loss, KL and aggregation on a fixed batch gives the same weights and loss at 2 ranks x 2
  micro-batches (spawned processes, gloo) and at 1 x 4 micro-batches as at 1 x 1 (the machinery of
  ``tests/invariants``: :func:`update_worker` follows ``fixed_batch_update`` of ``tests/workers/rank_workers.py``).
* ``weight sync``: after every step the engine reports the step as its weight version, and the SHA-256 of
  the tensors it received equals that of the stream the trainer's weights produce for that engine
  (same dtype, quantizer and LoRA mode).
* ``mismatch``: the engine's and trainer's log-probs of the sampled tokens (``mismatch/*``): finite, and
  k3 KL at most 1e-3 (5e-2 with a rollout quantizer); bitwise equal with ``rollout.true_on_policy``.
* ``advantage formula`` and ``loss formula``: the configured estimator and loss against the float64
  reference their plugin registered with them (``register(..., reference=fn)``; the built-ins' are the
  formulas of docs/algorithms.md as plain loops, in ``rlite.plugins.advantages`` and ``.policy_losses``),
  by one path for built-in and third-party plugins (:mod:`rlite.testing.conformance`), on a random batch with a
  singleton group, a constant group, a masked row, masked tokens inside responses, per-token rewards,
  critic values and extreme ratios, advantages and returns both; n/a for a plugin that registered no
  reference.
* ``resume == uninterrupted``: 2 steps, checkpoint, resume for the 3rd gives metrics identical to 3
  steps straight (evaluations aside: the shorter run evaluates at its last step).

Exit status 1 when any check fails. A few minutes on 2 CPU cores.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlite.config import ConfigError, RunConfig, load_config

PASS, FAIL, SKIP = "pass", "FAIL", "n/a"


@dataclass
class Check:
    name: str
    result: str
    measured: str


# --------------------------------------------------------------------------------------------------
# the replica
# --------------------------------------------------------------------------------------------------


MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass
class ModelFamily:
    """What the replica keeps of the configured model: its architecture family, whether it is a
    Mixture-of-Experts model, whether its embeddings are tied, and where that was read."""

    family: str
    moe: bool
    tied: bool
    source: str


def model_family(model) -> ModelFamily:
    """The configured model's family, read as rlite loads the model: ``config.json`` of a folder, the
    metadata of ``model.gguf_file`` (through transformers, as the trainer reads it), or the local Hugging
    Face cache for a hub name. Nothing is downloaded; a model that is not on this machine is "unknown"
    (a hub name that says MoE is taken as an MoE model, and the note says it was guessed from the name)."""
    import json

    path = model.path
    data = None
    if path and (Path(path) / "config.json").is_file() and not model.gguf_file:
        data, source = json.loads((Path(path) / "config.json").read_text()), "config.json"
    elif path:
        try:
            from transformers import AutoConfig

            kwargs = {"gguf_file": model.gguf_file} if model.gguf_file else {}
            with contextlib.redirect_stderr(io.StringIO()):
                data = AutoConfig.from_pretrained(path, local_files_only=True, **kwargs).to_dict()
            source = "GGUF metadata" if model.gguf_file else "the local Hugging Face cache"
        except Exception as exc:  # not here, or not readable: the family is unknown, and the note says why
            if model.gguf_file and (Path(path) / model.gguf_file).is_file():
                return ModelFamily("unknown", False, False, f"{model.gguf_file} unreadable: {type(exc).__name__}")
            data = None
    if data is None:
        guessed = bool(path) and "moe" in str(path).lower()
        return ModelFamily("unknown", guessed, False, "MoE guessed from the name" if guessed else "not on this machine")
    family = data.get("model_type", "unknown")
    moe = "moe" in family or any((data.get(key) or 0) > 1 for key in MOE_KEYS)
    return ModelFamily(family, moe, bool(data.get("tie_word_embeddings", False)), source)


def build_replica_model(found: ModelFamily, out: Path) -> tuple[Path, str]:
    """A tiny random model of the family (and the note the table prints about it)."""
    from rlite.tokenizer import build_tiny_model_dir

    tied = ", tied embeddings" if found.tied else ""
    what = f"{found.family} ({found.source})" if found.family != "unknown" else f"model family unknown ({found.source})"
    if found.moe:
        return (build_tiny_model_dir(out, num_experts=4, experts_per_token=2, tie_word_embeddings=found.tied),
                f"{what} -> tiny Qwen3-MoE (4 experts{tied})")
    if found.family in ("qwen2", "llama"):
        name = {"qwen2": "Qwen2", "llama": "Llama"}[found.family]
        return (build_tiny_model_dir(out, family=found.family, tie_word_embeddings=found.tied),
                f"{what} -> tiny {name}{tied}")
    return (build_tiny_model_dir(out, tie_word_embeddings=found.tied),
            f"{what} -> tiny Qwen2{tied} (no tiny replica of this family)")


def files_missing(spec) -> bool:
    """Does a ``data.train_files``/``eval_files`` entry name a path or glob that matches nothing here?"""
    import glob

    for item in [spec] if isinstance(spec, str) else list(spec or []):
        if not (glob.glob(str(item), recursive=True) if glob.has_magic(str(item)) else Path(item).exists()):
            return True
    return False


def synthetic_data(data, out: Path) -> tuple[Path, Path]:
    """A tiny train and eval set (.jsonl) with the configured prompt and answer keys (dotted keys nest):
    2-digit sums, for a replica whose real data files are not on this machine."""
    import json
    import random

    def row(a: int, b: int) -> dict:
        record: dict = {}
        for key, value in ((data.prompt_key, f"What is {a} + {b}?"), (data.answer_key, str(a + b))):
            *parents, leaf = key.split(".")
            node = record
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = value
        return record

    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for name, count in (("train", 32), ("eval", 4)):
        path = out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row(rng.randint(10, 99), rng.randint(10, 99))) + "\n" for _ in range(count)))
        files.append(path)
    return files[0], files[1]


def default_engine() -> str:
    """The engine a config gets when it names none (the schema's default)."""
    from rlite.config.schema import RolloutConfig

    return RolloutConfig.__dataclass_fields__["engine"].default_factory().name


def replica_adjustments(cfg: RunConfig, workdir: Path, pm) -> tuple[list[str], list[str]]:
    """Overrides for what a replica on this machine cannot keep, and the notes that say so: data files
    that are not here (a synthetic set with the same keys), an engine that cannot start here (its
    registration's ``available`` says why; the default engine instead), the backend's model-parallel sizes
    (its registration's ``model_parallel``: 1), a speculative draft (off)."""
    overrides, notes = [], []
    data = cfg.data
    if data.train_files is not None and (files_missing(data.train_files) or files_missing(data.eval_files)):
        train, held_out = synthetic_data(data, workdir / "data")
        overrides += [f"data.train_files={train}", f"data.eval_files={held_out}"]
        notes.append(f"data files not here -> 32 synthetic sums with keys {data.prompt_key!r}/{data.answer_key!r}"
                     + (" and the system prompt" if data.system_prompt else ""))
    engine = pm.registry("rollout_engine").get(cfg.rollout.engine.name)
    missing = engine.metadata["available"]() if "available" in engine.metadata else None
    if missing is not None:
        fallback = default_engine()
        overrides.append(f"rollout.engine={fallback}")
        notes.append(f"engine {engine.name} cannot start here ({missing}) -> {fallback} engine")
    args = cfg.parallelism.backend.args or {}
    backend = pm.registry("training_backend").get(cfg.parallelism.backend.name)
    for key in backend.metadata.get("model_parallel", ()):
        if isinstance(args.get(key), int) and args[key] > 1:
            overrides.append(f"parallelism.backend.args.{key}=1")
            notes.append(f"{key} {args[key]} -> 1")
    if cfg.rollout.draft.name != "none":
        overrides.append("rollout.draft=none")  # a draft model of the real run's size does not fit a replica
        notes.append("speculative draft off")
    return overrides, notes


def replica_overrides(cfg: RunConfig, model_dir: Path, run_dir: Path, steps: int) -> list[str]:
    samples = max(2, min(cfg.rollout.samples_per_prompt, 4))
    prompts = 2 * cfg.algorithm.minibatches_per_step
    out = [
        f"model.path={model_dir}", "model.tokenizer=null", "model.gguf_file=null",
        f"rollout.prompts_per_step={prompts}", f"rollout.samples_per_prompt={samples}",
        f"rollout.max_new_tokens={min(cfg.rollout.max_new_tokens, 4)}",
        f"training.steps={steps}", "training.micro_batch_size=4", "training.eval_every=0", "training.warmup_steps=0",
        "training.num_threads=1", f"logging.run_dir={run_dir}", "logging.progress_bar=false", "logging.plot=false",
        "logging.loggers=[jsonl]", "logging.profile=false", "checkpoint.every=2", "checkpoint.save_final=false",
        "checkpoint.export_hf=false", "checkpoint.resume=auto",
    ]
    if cfg.data.task:
        out += ["data.num_train=32", "data.num_eval=4"]
    if cfg.algorithm.critic.enabled:
        out.append("algorithm.critic.path=null")
    return out


# --------------------------------------------------------------------------------------------------
# instrumented runs
# --------------------------------------------------------------------------------------------------


def tensor_digest(named) -> str:
    digest = hashlib.sha256()
    for name, tensor in named:
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        data = tensor.detach().contiguous().cpu()
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


class RecordingEngine:
    """Receives a weight sync like the real engine (same capabilities) and keeps only a digest."""

    def __init__(self, capabilities) -> None:
        self.capabilities, self.weight_version, self.digest = capabilities, -1, None

    def update_weights(self, named_tensors, version: int) -> None:
        self.digest = None if named_tensors is None else tensor_digest(list(named_tensors))
        self.weight_version = version

    def update_lora_adapter(self, named_tensors, config: dict, version: int) -> None:
        self.digest = tensor_digest(list(named_tensors))
        self.weight_version = version

    def resume_memory(self) -> None:
        pass


class Probe:
    """Hooks and wrappers on one replica run: ratios of first micro-batches, sync digests, versions."""

    def __init__(self) -> None:
        self.first_call = False
        self.ratio_gaps: list[float] = []
        self.syncs: list[tuple[int, int, bool]] = []  # (step, engine version, digests equal)
        self.received: str | None = None
        self.run = None

    def instrument(self, run) -> None:
        from rlite import hookimpl

        self.run = run
        probe = self
        loss_fn = run.policy.loss.policy_loss

        def recording_loss(logprobs, old_logprobs, advantages, response_mask, cfg):
            if probe.first_call:
                probe.first_call = False
                gap = ((logprobs.detach() - old_logprobs.detach()).abs() * response_mask).max()
                probe.ratio_gaps.append(float(gap))
            return loss_fn(logprobs, old_logprobs, advantages, response_mask, cfg)

        run.policy.loss.policy_loss = recording_loss
        train_mode = run.policy.backend.train_mode

        def arming_train_mode():
            # update_policy's first call, once a step, on the thread that trains: the next loss call is the
            # step's first micro-batch (after_rollout would not do: with asynchronous rollouts it runs on the
            # producer thread, a step ahead, while this thread is still inside the previous update)
            probe.first_call = True
            return train_mode()

        run.policy.backend.train_mode = arming_train_mode
        engine = run.engine
        update_weights, update_lora = engine.update_weights, getattr(engine, "update_lora_adapter", None)

        def recording_update(named_tensors, version):
            named = None if named_tensors is None else list(named_tensors)
            probe.received = None if named is None else tensor_digest(named)
            return update_weights(named, version)

        def recording_lora(named_tensors, config, version):
            named = list(named_tensors)
            probe.received = tensor_digest(named)
            return update_lora(named, config, version)

        engine.update_weights = recording_update
        if update_lora is not None:
            engine.update_lora_adapter = recording_lora

        class Hooks:
            @hookimpl
            def after_weight_sync(self, step, weight_version, engine):
                recorder = RecordingEngine(engine.capabilities)
                run.weight_sync.send(recorder, weight_version)
                probe.syncs.append((step, engine.weight_version, recorder.digest == probe.received))

        self.hooks = Hooks()
        run.pm.register(self.hooks, name="rlite-audit-probe")

    def remove(self) -> None:
        if self.run is not None:
            self.run.pm.unregister(name="rlite-audit-probe")


def replica_run(cfg: RunConfig, pm, probe: Probe | None = None) -> list[dict[str, Any]]:
    """Train the replica (in this process); its metric rows."""
    from rlite.distributed import init_distributed, shutdown_distributed
    from rlite.metrics import read_metrics
    from rlite.run.build import build_run
    from rlite.run.loop import train

    ctx = init_distributed()
    finished = False
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the replica's end-of-run summary
            run = build_run(cfg, pm)
            try:
                if probe is not None:
                    probe.instrument(run)
                train(run)
            finally:
                if probe is not None:
                    probe.remove()
                run.engine.shutdown()
                run.policy.close()
        finished = True
    finally:
        shutdown_distributed(ctx, finished=finished)
    return read_metrics(Path(cfg.logging.run_dir) / "metrics.jsonl")


def comparable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows without timings, and without evaluations: a run evaluates at its last step, so the interrupted
    2-step run has an evaluation at step 2 that the straight run has not."""
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/", "eval/"))} for row in rows]


# --------------------------------------------------------------------------------------------------
# update invariance (world size, micro-batches)
# --------------------------------------------------------------------------------------------------


@dataclass
class UpdateSpec:
    """What one audited optimizer step needs; picklable for spawned ranks."""

    cfg: RunConfig
    estimator: tuple
    policy_loss: tuple
    kl: tuple


def update_worker(rank: int, world_size: int, init_file: str, out_file: str, spec: UpdateSpec, micro: int) -> None:
    """One optimizer step of the configured backend on a fixed batch of 16 sequences; rank r takes slice r
    (like ``fixed_batch_update`` in ``tests/workers/rank_workers.py``, with the config's estimator, loss, KL and aggregation)."""
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a rank process of its own: its load bars would interleave with rlite's lines
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        from rlite.algorithms import AdvantageInput
        from rlite.plugin_manager import build_plugin_manager, resolve_choice
        from rlite.rollout import TrainTargets
        from rlite.stages.update import LossSpec, update_policy
        from rlite.testing import fixed_batch
        from rlite.training.backend import ForwardSpec

        cfg = spec.cfg
        cfg.training.micro_batch_size = micro
        pm = build_plugin_manager(autoload=cfg.plugins.autoload, only=cfg.plugins.enable)
        factory, backend_cfg = resolve_choice(pm.registry("training_backend"), cfg.parallelism.backend)
        backend = factory(cfg, backend_cfg, torch.device("cpu"), 1)
        batch = fixed_batch(num_prompts=4, samples=4, prompt_len=6, max_len=7, vocab=250)
        g = torch.Generator().manual_seed(1)
        width = batch.response_mask.shape[1]
        estimator, estimator_cfg = spec.estimator
        advantages, returns = estimator(AdvantageInput(
            batch.scores, batch.group_ids, batch.response_mask,
            values=torch.randn(len(batch), width, generator=g) * batch.response_mask,
            baseline_scores=torch.rand(len(batch), generator=g), reward_components=batch.scores[:, None],
            reward_weights=torch.ones(1, dtype=torch.float64),
        ), estimator_cfg)
        ref = -torch.rand(len(batch), width, generator=g) * 3 * batch.response_mask
        targets = TrainTargets(advantages.float(), returns.float(), batch.response_mask.clone(),
                               ref_logprobs=ref if spec.kl[1] else None)
        layout = backend.data_layout()
        per_rank = len(batch) // layout.size
        mine = slice(layout.rank * per_rank, (layout.rank + 1) * per_rank)
        policy_loss, policy_cfg = spec.policy_loss
        metrics = update_policy(
            backend, batch.select(mine), targets.select(mine),
            ForwardSpec(micro_batch_size=micro, temperature=1.0, chunk_size=16, exact_layout=False),
            LossSpec(policy_loss, policy_cfg, cfg.algorithm.loss_agg_mode,
                     float(cfg.algorithm.loss_agg_horizon or cfg.rollout.max_new_tokens), spec.kl[0], spec.kl[1],
                     cfg.algorithm.entropy_coef),
            minibatches=1, epochs=1, dp_size=layout.size, dp_group=layout.group,
        ).metrics
        params = {name: t.detach().clone() for name, t in backend.full_weights()}
        if rank == 0:
            torch.save({"metrics": metrics, "params": params}, out_file)
        backend.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_update(spec: UpdateSpec, world_size: int, micro: int, workdir: Path, name: str) -> dict:
    from rlite.distributed import spawn_local_ranks

    out, init = workdir / f"{name}.pt", workdir / f"{name}.init"
    args = (world_size, str(init), str(out), spec, micro)
    if world_size == 1:
        update_worker(0, *args)
    else:  # each rank leaves through os._exit once its work is done (see leave_rank_process)
        spawn_local_ranks(update_worker, args, nprocs=world_size)
    return torch.load(out, weights_only=True)  # metrics (floats) and tensors: nothing to unpickle but data


def update_difference(a: dict, b: dict) -> tuple[bool, str]:
    """Equal within float32 rounding of a reordered sum (the tolerances of tests/invariants)?"""
    worst_param = max(
        float(((a["params"][n].double() - b["params"][n].double()).abs()
               - 1e-5 * b["params"][n].double().abs()).max()) for n in a["params"]
    )
    loss_a, loss_b = a["metrics"]["actor/pg_loss"], b["metrics"]["actor/pg_loss"]
    loss_ok = math.isclose(loss_a, loss_b, rel_tol=1e-5, abs_tol=1e-7)
    ok = loss_ok and worst_param <= 1e-7
    return ok, f"pg_loss {loss_a:.6g} vs {loss_b:.6g}; max weight diff beyond rtol 1e-5: {max(worst_param, 0):.2e}"


# --------------------------------------------------------------------------------------------------
# formulas: each estimator and loss against the float64 reference its plugin registered with it
# --------------------------------------------------------------------------------------------------


def formula_check(kind: str, entry, cfg) -> Check:
    """The ``advantage formula`` or ``loss formula`` row of a registry entry: the comparison of
    :mod:`rlite.testing.conformance` with the reference registered in ``entry.metadata["reference"]``, built in or
    third-party alike; n/a, never a pass, when the plugin registered none."""
    from rlite.testing.conformance import estimator_reference_error, loss_reference_error

    title = f"{'advantage' if kind == 'advantage_estimator' else 'loss'} formula ({entry.name})"
    reference = entry.metadata.get("reference")
    if reference is None:
        return Check(title, SKIP, f"no reference registered by plugin {entry.plugin!r} (register(..., reference=fn))")
    if kind == "advantage_estimator":
        error = estimator_reference_error(entry.implementation, reference, cfg)
        where = ("over advantages and returns of 12 responses (per-token rewards, critic values, masked tokens "
                 "inside responses, singletons, a constant group, an empty row)")
    else:
        error = loss_reference_error(entry.implementation, reference, cfg)
        where = "on 72 tokens (log-ratios up to +-30)"
    return Check(title, PASS if error <= 1e-9 else FAIL, f"max |plugin - formula| = {error:.2e} {where}")


def check_formulas(cfg: RunConfig, pm) -> list[Check]:
    from rlite.plugin_manager import resolve_choice

    checks = []
    for kind, choice in (("advantage_estimator", cfg.algorithm.advantage), ("policy_loss", cfg.algorithm.policy_loss)):
        _, options = resolve_choice(pm.registry(kind), choice)
        checks.append(formula_check(kind, pm.registry(kind).get(choice.name), options))
    return checks


# --------------------------------------------------------------------------------------------------
# the audit
# --------------------------------------------------------------------------------------------------


def run_audit(config_path: str | None, overrides: list[str], pm, workdir: Path | None = None) -> tuple[list[Check], str]:
    """All checks of the module docstring; returns them and the replica's note."""
    base = load_config(config_path, overrides, pm=pm)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="rlite-audit-"))
    model_dir, note = build_replica_model(model_family(base.model), workdir / "model")
    adjusted, notes = replica_adjustments(base, workdir, pm)
    note = "; ".join([note, *notes])

    def replica(run_dir: str, steps: int) -> RunConfig:
        return load_config(config_path, [*overrides, *adjusted, *replica_overrides(base, model_dir, workdir / run_dir, steps)],
                           pm=pm)

    straight_cfg = replica("straight", 3)
    probe = Probe()
    try:
        straight = replica_run(straight_cfg, pm, probe)
    except (ConfigError, RuntimeError, ValueError, OSError, ImportError) as exc:
        return [Check("replica run", FAIL, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")], note
    checks = [ratio_check(straight_cfg, probe)]
    checks += invariance_checks(straight_cfg, pm, workdir)
    checks.append(sync_check(base, straight_cfg, probe))
    checks.append(mismatch_check(base, straight_cfg, straight))
    checks.extend(check_formulas(straight_cfg, pm))
    replica_run(replica("resumed", 2), pm)
    resumed = replica_run(replica("resumed", 3), pm)
    same = comparable(resumed) == comparable(straight)
    differing = sorted({k for a, b in zip(comparable(resumed), comparable(straight)) for k in a if a.get(k) != b.get(k)})
    checks.append(Check("resume == uninterrupted (3 steps)", PASS if same else FAIL,
                        "metrics of every step identical" if same else f"differ in {differing[:6]}"))
    return checks, note


def ratio_check(cfg: RunConfig, probe: Probe) -> Check:
    """The PPO ratio of each step's first micro-batch is exactly 1 (unless pi_old is the engine's)."""
    if cfg.algorithm.old_logprob_mode == "bypass" and not cfg.rollout.true_on_policy:
        return Check("on-policy ratio", SKIP, "bypass mode: pi_old is the engine's (ratio pi/pi_rollout)")
    worst = max(probe.ratio_gaps, default=math.inf)
    return Check("on-policy ratio", PASS if worst == 0.0 and len(probe.ratio_gaps) == 3 else FAIL,
                 f"max |lp - old| in each step's first micro-batch: {probe.ratio_gaps}")


def invariance_checks(cfg: RunConfig, pm, workdir: Path) -> list[Check]:
    """One optimizer step of the configured backend, estimator, loss and KL: world size 2 equals 1, and 4
    micro-batches equal 1 (in float32 when the run computes in a lower precision)."""
    from rlite.config.advantage import advantage_choice
    from rlite.plugin_manager import resolve_choice

    algo = cfg.algorithm
    spec = UpdateSpec(
        cfg=cfg,
        estimator=advantage_choice(algo, pm.registries).resolved,
        policy_loss=resolve_choice(pm.registry("policy_loss"), algo.policy_loss),
        kl=(pm.registry("kl_estimator").get(algo.kl.estimator).implementation,
            0.0 if algo.kl.in_reward else algo.kl.coef),
    )
    spec.cfg.training.lr, spec.cfg.training.eps, spec.cfg.training.grad_clip = 1e-2, 1.0, 0.0
    precision = ""
    dtypes = {cfg.model.dtype, cfg.parallelism.param_dtype, cfg.parallelism.reduce_dtype}
    if dtypes != {"float32"}:  # equal only up to the rounding of a reordered bf16 sum: the check runs in float32
        precision = (f"in float32 (the run computes in {'/'.join(sorted(dtypes - {'float32'}))}, whose rounding of "
                     "reordered sums is beyond these tolerances); ")
        spec.cfg.model.dtype = spec.cfg.parallelism.param_dtype = spec.cfg.parallelism.reduce_dtype = "float32"
    checks, whole = [], None
    for name, world_size, micro, what in (
        ("world size 2 == world size 1", 2, 4, "2 ranks x 2 micro-batches vs 1 x 1"),
        (f"micro-batch x accumulation ({algo.loss_agg_mode})", 1, 4, "4 micro-batches of 4 vs 1 of 16"),
    ):
        try:
            whole = whole or run_update(spec, 1, 16, workdir, "ws1-mb16")
            ok, text = update_difference(run_update(spec, world_size, micro, workdir, f"ws{world_size}-mb{micro}"), whole)
        except Exception as exc:  # a rank that fails: the row says why
            ok, text = False, f"the step failed: {type(exc).__name__}: {str(exc).splitlines()[-1] if str(exc) else ''}"
        checks.append(Check(name, PASS if ok else FAIL, f"{precision}{what}: {text}"))
    return checks


def sync_check(base: RunConfig, cfg: RunConfig, probe: Probe) -> Check:
    """Every step's sync reached the engine as that step's version, every byte as sent."""
    versions_ok = [version == step for step, version, _ in probe.syncs]
    digests_ok = [same for _, _, same in probe.syncs]
    configured_engine, engine = base.rollout.engine.name, cfg.rollout.engine.name
    stand_in = f" ({engine} engine standing in for {configured_engine}: its sync path is not exercised)" \
        if engine != configured_engine else ""
    return Check("weight sync: version and checksum", PASS if probe.syncs and all(versions_ok) and all(digests_ok)
                 and len(probe.syncs) == 3 else FAIL,
                 f"steps {[s for s, _, _ in probe.syncs]}: engine versions {[v for _, v, _ in probe.syncs]}, "
                 f"sha256 of received == sent {digests_ok}{stand_in}")


def mismatch_check(base: RunConfig, cfg: RunConfig, rows: list[dict[str, Any]]) -> Check:
    """The engine's log-probs against the trainer's, each step: bitwise equal (true on-policy) or within a k3 KL
    bound; skipped when another engine stood in for the configured one."""
    kls = [row.get("mismatch/k3_kl", math.nan) for row in rows if "reward/mean" in row]
    bitwise = [row.get("mismatch/bitwise_equal_fraction", math.nan) for row in rows if "reward/mean" in row]
    bound = 5e-2 if cfg.rollout.quantization.name != "none" else 1e-3
    if cfg.rollout.true_on_policy:
        ok = all(b == 1.0 for b in bitwise)
    else:
        ok = all(math.isfinite(k) and k <= bound for k in kls)
    measured = (f"k3 KL per step {[f'{k:.2e}' for k in kls]} (bound {'bitwise' if cfg.rollout.true_on_policy else bound}), "
                f"bitwise-equal fraction {[round(b, 3) for b in bitwise]}")
    configured_engine, engine = base.rollout.engine.name, cfg.rollout.engine.name
    quantizer = cfg.rollout.quantization.name
    if engine != configured_engine:  # the stand-in's numbers say nothing about the configured engine's kernels
        return Check(f"mismatch ({configured_engine}, quantizer {quantizer})", SKIP,
                     f"{configured_engine} did not run in the replica; the {engine} engine standing in measured {measured}")
    return Check(f"mismatch ({engine}, quantizer {quantizer})", PASS if ok and kls else FAIL, measured)


def print_table(checks: list[Check], title: str) -> None:
    import os
    import sys

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
    table = Table(title=title, title_justify="left", show_lines=True)
    table.add_column("invariant", style="bold", overflow="fold")
    table.add_column("result")
    table.add_column("measured", overflow="fold")
    for check in checks:
        style = {"pass": "green", "FAIL": "bold red"}.get(check.result, "yellow")
        table.add_row(check.name, f"[{style}]{check.result}[/{style}]", check.measured)
    console.print(table)
