"""Features compose: every pair of the options users combine either runs, keeping rlite's invariants,
or is refused up front (when the config loads, or for a fact of the run such as its number of ranks when the
run starts, before any step) with exit status 2 and a message naming both keys.

The cases come from :mod:`rlite.tools.matrix` (an all-pairs covering set over its ``OPTIONS``), the refusals
from the rules (:func:`rlite.config.compat.rules`: rlite's own and those the built-in plugins and megatron
declare); ``docs/compatibility.md`` is generated from the same two.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlite.testing import run_in_subprocess_env, spawn_ranks
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools import matrix
from rlite.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
CASES = matrix.pairwise_cases()
REFUSALS = matrix.refusal_cases()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {
        "model": str(build_tiny_model_dir(root / "dense", hidden=32, layers=2)),
        "moe_model": str(build_tiny_model_dir(root / "moe", hidden=32, layers=2, num_experts=4, experts_per_token=2)),
        "draft_model": str(build_tiny_model_dir(root / "draft", hidden=16, layers=1, seed=1)),
    }


def config_file(tmp_path: Path, models: dict[str, str]) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{path: {models['model']}}}\ndata: {{task: addition, num_train: 64, num_eval: 8}}\n"
                    f"logging: {{run_dir: {tmp_path / 'run'}, progress_bar: false, plot: false, loggers: [jsonl]}}\n")
    return path


# -- the generator ----------------------------------------------------------------------------------


def test_the_cases_cover_every_allowed_pair_and_none_is_refused():
    covered = {matrix._pair(x, y) for case in CASES for x, y in itertools.combinations(case.items(), 2)}
    assert set(matrix.allowed_pairs()) <= covered
    assert all(matrix.refusing_rule(case) is None for case in CASES)
    assert matrix.pairwise_cases() == CASES  # deterministic
    refused = {(a, b) for a, b, _ in matrix.refused_pairs()}
    assert not refused & covered
    assert len(CASES) < len(matrix.allowed_pairs()) / 10  # a covering set, far fewer runs than pairs


def test_docs_table_is_generated_from_the_rules():
    committed = (ROOT / "docs" / "compatibility.md").read_text()
    assert committed == matrix.compatibility_markdown(), "regenerate: python -m rlite.tools.matrix > docs/compatibility.md"


# -- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", [r for r in matrix.matrix_rules() if not r.at_start],
                         ids=lambda r: f"{r.a.key}+{r.b.key}")
def test_each_rule_refuses_at_config_load_with_exit_2_naming_both_keys(tmp_path, models, capsys, rule):
    if "parallelism.backend=megatron" in (*rule.a.example, *rule.b.example):
        pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'rlite[megatron]'")
    code = main(["train", str(config_file(tmp_path, models)), *rule.a.example, *rule.b.example])
    err = capsys.readouterr().err
    assert code == 2, err
    for key in (*rule.a.named_keys, *rule.b.named_keys):
        assert key in err, (key, err)
    assert rule.why in err and not (tmp_path / "run" / "config.yaml").exists()  # refused before the run folder


@pytest.mark.parametrize("case,rule", [pytest.param(c, r, id=matrix.case_id(c), marks=[pytest.mark.matrix_long]
                                                    if c["world_size"] != "1" else []) for c, r in REFUSALS])  # fmt: skip
def test_each_refused_pair_of_the_matrix_is_refused_by_its_rule(tmp_path, models, capsys, case, rule):
    if case["backend"] == "megatron":
        pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'rlite[megatron]'")
    overrides = matrix.case_overrides(case, models)
    if rule.at_start and case["world_size"] == "2":
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "-m", "rlite", "train", str(config_file(tmp_path, models)), *overrides,
                               "training.steps=1", "checkpoint.resume=never"],
                              env=run_in_subprocess_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
        err = done.stderr
        code = 2 if "exitcode  : 2" in err else done.returncode  # torchrun reports its ranks' status so
    else:
        code = main(["train", str(config_file(tmp_path, models)), *overrides])
        err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    for key in (*rule.a.named_keys, *rule.b.named_keys):
        assert key in err, (key, err[-3000:])


def test_routing_replay_on_a_dense_model_is_refused_when_the_model_loads(tmp_path, models, capsys):
    code = main(["train", str(config_file(tmp_path, models)), "algorithm.routing_replay=rollout", "training.steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and "algorithm.routing_replay=rollout with the dense model model.path=" in err, err


# -- the runs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [pytest.param(c, id=matrix.case_id(c), marks=[pytest.mark.matrix_long] if matrix.long_case(c)
                                               else []) for c in CASES])  # fmt: skip
def test_case_runs_and_keeps_the_invariants(tmp_path, models, case):
    if case["backend"] == "megatron":
        pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'rlite[megatron]'")
    overrides = matrix.case_overrides(case, models)
    world_size = int(case["world_size"])
    out = tmp_path / "out"
    out.mkdir()
    args = (world_size, str(tmp_path / "init"), models["model"], str(tmp_path / "run"), str(out), overrides)
    if world_size == 1:
        matrix.run_case(0, *args)
    else:
        spawn_ranks(matrix.run_case, args, nprocs=world_size, timeout_s=500)
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    assert matrix.invariant_failures(case, records, STEPS) == []


def test_rules_read_the_registry(tmp_path, models):
    from rlite.config import ConfigError
    from rlite.config.compat import check_compatibility
    from rlite.hookspecs import hookimpl
    from rlite.plugin_manager import build_plugin_manager
    from rlite.testing import tiny_config

    class Plugin:
        @hookimpl
        def register_rollout_workflows(self, register):
            register("one_shot", lambda cfg, tokenizer: None, single_turn=True)

    class MultiTurn:
        @hookimpl
        def register_rollout_workflows(self, register):
            register("one_shot", lambda cfg, tokenizer: None)

    pm = build_plugin_manager(autoload=False)
    pm.register(Plugin(), name="one-shot")
    # a plugin's single-turn workflow is single-turn for the rules (its registration says so, not its name)
    cfg = tiny_config(models["model"], tmp_path, "rollout.workflow=one_shot", "rollout.draft=ngram", pm=pm)
    cfg.rollout.mode, cfg.rollout.engine.args["process"] = "one_step_off", True
    check_compatibility(cfg, pm)
    check_compatibility(cfg)  # without the registry no rule that reads a registration applies
    multi = build_plugin_manager(autoload=False)
    multi.register(MultiTurn(), name="one-shot")
    with pytest.raises(ConfigError, match="rollout.workflow=one_shot \\(multi-turn\\) with rollout.draft=ngram"):
        check_compatibility(cfg, multi)  # the same name registered without single_turn=True
    check_compatibility(cfg, pm, world_size=2)  # asynchronous rollouts over several ranks run


def test_engine_rules_read_the_engines_declarations(tmp_path, models):
    """The weight-sharing and in-process rules apply to any engine that declares them, by its registration
    (named options in the message), and to none that does not."""
    from dataclasses import dataclass

    from rlite.config import ConfigError
    from rlite.config.compat import check_compatibility
    from rlite.hookspecs import hookimpl
    from rlite.plugin_manager import build_plugin_manager
    from rlite.testing import tiny_config

    @dataclass
    class BindingConfig:
        bind: bool = False

    class Engines:
        @hookimpl
        def register_rollout_engines(self, register):
            register("binding", lambda *a: None, BindingConfig, samples_in_process=True,
                     shares_weights=lambda cfg: ("bind",) if cfg.bind else ())
            register("remote", lambda *a: None)

    pm = build_plugin_manager(autoload=False)
    pm.register(Engines(), name="engines")
    overlapping = ("rollout.mode=one_step_off",)
    cfg = tiny_config(models["model"], tmp_path, "rollout.engine=binding", *overlapping, pm=pm)
    check_compatibility(cfg, pm)
    cfg.rollout.engine.args["bind"] = True
    with pytest.raises(ConfigError, match=r"rollout.mode=one_step_off with rollout.engine=binding with "
                                          r"rollout.engine.args.bind=true \(binds the trainer's own tensors\)"):
        check_compatibility(cfg, pm)
    with pytest.raises(ConfigError, match=r"model.lora.dropout=0.05 with rollout.mode=one_step_off with "
                                          r"rollout.engine=binding \(samples in the trainer's process\)"):
        tiny_config(models["model"], tmp_path, "rollout.engine=binding", *overlapping, "model.lora.enabled=true",
                    "model.lora.dropout=0.05", pm=pm)
    tiny_config(models["model"], tmp_path, "rollout.engine=remote", *overlapping, "model.lora.enabled=true",
                "model.lora.dropout=0.05", pm=pm)  # declares neither: left to its built engine's capabilities
