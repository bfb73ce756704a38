"""The held-out evaluation a run makes every ``training.eval_every`` steps, and ``rlite eval``, which makes it
for a checkpoint or a model without training."""

from __future__ import annotations

import json
import logging
from typing import Any

from rlite.config import ConfigError, RunConfig
from rlite.distributed import init_distributed, shutdown_distributed
from rlite.hf_models import quiet_transformers_progress
from rlite.plugin_manager import RlitePluginManager, get_plugin_manager
from rlite.run.build import Run, build_run, sandbox_hidden_paths
from rlite.sandbox import hidden_from_programs


def evaluate(run: Run, step: int) -> dict[str, float]:
    """The held-out evaluation of ``step``: its metrics; its first generations go to ``samples.jsonl``."""
    with run.rollouts.exclusive_engine(step):  # async: not while the producer samples
        result = run.evaluation.evaluate(step)
    run.recorder.write_samples(step, "eval", result.samples)
    # an evaluation runs between a sync and the next rollout, which needs the engine whole; after
    # the last step's nothing generates again, and the final checkpoint and export get the memory
    if step == run.config.training.steps:
        run.engine.release_memory()
    return result.metrics


def run_evaluation(cfg: RunConfig, pm: RlitePluginManager | None = None) -> dict[str, Any]:
    """Evaluate, without training, the model a run would start from: the checkpoint that
    ``checkpoint.resume`` names (``auto``: the latest in the run folder), else ``model.path``.

    The held-out split is sampled as a run's evaluations sample it (greedy and sampled, the same seeds),
    so a checkpoint of step s scores what the run's evaluation at step s scored. Rank 0 appends
    ``{"step", "model", "eval/..."}`` to ``<run_dir>/eval.jsonl``, the generations to ``samples.jsonl``,
    and prints the metrics; the run's config, metrics and TensorBoard logs are left as they are.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    ctx = init_distributed()
    finished = False
    try:
        with hidden_from_programs(sandbox_hidden_paths(cfg)):  # what a reward's sandboxed program must not see
            with quiet_transformers_progress():
                run = build_run(cfg, pm if pm is not None else get_plugin_manager(), evaluation_only=True)
            try:
                if not run.evaluation.has_prompts:
                    raise ConfigError("rlite eval: no held-out prompts; set data.eval_files (or use a built-in data.task)")
                with run.recorder.phase("eval"):
                    metrics = evaluate(run, run.start_step)
            finally:
                run.engine.shutdown()
                run.policy.close()
        result = {"step": run.start_step, "model": evaluated_model(cfg, run), **metrics}
        if ctx.is_main:
            from rlite.run_files import open_run_file

            with open_run_file(run.run_dir / "eval.jsonl", "a") as handle:
                handle.write(json.dumps(result) + "\n")
            for key, value in result.items():
                print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}", flush=True)
        finished = True
        return result
    finally:
        shutdown_distributed(ctx, finished=finished)


def evaluated_model(cfg: RunConfig, run: Run) -> str:
    """The checkpoint folder the run resumed from, or ``model.path``."""
    if run.start_step == 0:
        return cfg.model.path
    return str(run.resumed_from)
