"""Loading configs: YAML + overrides + defaults, and every error naming the full key path."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from rlite import hookimpl
from rlite.config import ConfigError, RunConfig, load_config
from rlite.plugin_manager import build_plugin_manager

CONFIG_SOURCE = Path(__file__).resolve().parents[1] / "trainer" / "config" / "schema.py"
REQUIRED = ["model.path=tiny-model", "data.task=addition"]


@dataclasses.dataclass
class ScaleConfig:
    scale: float = 1.0
    """Multiplier."""
    clip: float = 10.0
    """Largest absolute advantage; must exceed ``scale``."""

    def __post_init__(self) -> None:
        if self.clip <= self.scale:
            raise ValueError(f"clip={self.clip} must be larger than scale={self.scale}")


class EstimatorsForTests:
    @hookimpl
    def register_advantage_estimators(self, register):
        register("test_scaled", lambda batch, cfg: None, ScaleConfig)
        register("test_plain", lambda batch, cfg: None)


@pytest.fixture
def pm(stand_ins):
    """Built-ins (with stand-ins for unwritten ones) plus two test estimators; no discovery."""
    manager = build_plugin_manager(autoload=False)
    manager.register(EstimatorsForTests(), name="test-estimators")
    return manager


def load(pm, *overrides: str, yaml: str | None = None, tmp_path: Path | None = None) -> RunConfig:
    path = None
    if yaml is not None:
        path = tmp_path / "run.yaml"
        path.write_text(yaml)
    return load_config(path, [*REQUIRED, *overrides], pm)


def config_error(pm, *overrides: str, **kwargs) -> str:
    with pytest.raises(ConfigError) as excinfo:
        load(pm, *overrides, **kwargs)
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------


def test_unknown_key_names_the_path_the_valid_keys_and_a_suggestion(pm, tmp_path) -> None:
    message = config_error(pm, "training.stepz=3")
    assert message.startswith("training.stepz: unknown key 'stepz'.")
    assert "Valid keys here: steps, seed, micro_batch_size" in message
    assert message.endswith("Did you mean 'steps'?")

    message = config_error(pm, yaml="rollout:\n  tempreature: 0.7\n", tmp_path=tmp_path)
    assert message.startswith("rollout.tempreature: unknown key") and "Did you mean 'temperature'?" in message

    assert config_error(pm, "trainig.steps=3").startswith("trainig: unknown key 'trainig'.")


def test_wrong_type_names_the_path_and_the_expected_type(pm, tmp_path) -> None:
    message = config_error(pm, "training.steps=many")
    assert message.startswith("training.steps:") and "'many'" in message and "Integer" in message

    message = config_error(pm, yaml="rollout:\n  temperature: hot\n", tmp_path=tmp_path)
    assert message.startswith("rollout.temperature:") and "Float" in message


def test_invalid_enumerated_value_lists_the_choices(pm) -> None:
    message = config_error(pm, "model.dtype=bf16")
    assert (
        message
        == "model.dtype: invalid value 'bf16'. Valid choices: float32, bfloat16, float16. Did you mean 'bfloat16'?"
    )


def test_unknown_plugin_name_lists_registered_names_and_a_suggestion(pm) -> None:
    message = config_error(pm, "algorithm.advantage=grpoo")
    assert message.startswith("algorithm.advantage: unknown advantage_estimator 'grpoo'. Valid choices: ")
    assert "grpo" in message.split("Valid choices: ")[1] and "test_scaled" in message
    assert message.endswith("Did you mean 'grpo'?")

    message = config_error(pm, "rewards=[exact_match, exact_macth]")
    assert (
        message.startswith("rewards[1]: unknown reward_function 'exact_macth'")
        and "Did you mean 'exact_match'?" in message
    )


def test_unknown_option_of_an_implementation_names_its_args_path(pm, tmp_path) -> None:
    message = config_error(pm, "algorithm.advantage=test_scaled", "algorithm.advantage.args.scal=2")
    assert message.startswith("algorithm.advantage.args.scal: unknown key 'scal'.")
    assert "Valid keys here: scale, clip." in message and message.endswith("Did you mean 'scale'?")

    yaml = "algorithm:\n  advantage: {name: test_scaled, args: {scale: big}}\n"
    assert config_error(pm, yaml=yaml, tmp_path=tmp_path).startswith("algorithm.advantage.args.scale:")

    message = config_error(pm, "algorithm.advantage=test_plain", "algorithm.advantage.args.scale=2")
    assert message.startswith("algorithm.advantage.args: advantage_estimator 'test_plain' takes no options")


def test_linked_field_rules_fail_at_load_time(pm) -> None:
    message = config_error(pm, "rollout.prompts_per_step=4", "algorithm.minibatches_per_step=3")
    assert "algorithm.minibatches_per_step=3 must divide rollout.prompts_per_step=4" in message

    message = config_error(pm, "algorithm.advantage=test_scaled", "algorithm.advantage.args.scale=20")
    assert message == "algorithm.advantage.args: clip=10.0 must be larger than scale=20.0"


def test_missing_required_value_and_missing_file(pm, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^model.path: missing value"):
        load_config(None, ["data.task=addition"], pm)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml", REQUIRED, pm)


# --------------------------------------------------------------------------------------------------
# merging
# --------------------------------------------------------------------------------------------------


def test_overrides_beat_yaml_and_yaml_beats_defaults(pm, tmp_path) -> None:
    yaml = "training:\n  steps: 5\n  lr: 0.001\nalgorithm:\n  advantage: {name: test_scaled, args: {scale: 2.0}}\n"
    cfg = load(pm, "training.steps=7", "algorithm.advantage.args.clip=30", yaml=yaml, tmp_path=tmp_path)
    assert cfg.training.steps == 7
    assert cfg.training.lr == 0.001
    assert cfg.training.seed == RunConfig.__dataclass_fields__["training"].default_factory().seed
    assert cfg.algorithm.advantage.args == {"scale": 2.0, "clip": 30.0}


def test_renaming_a_choice_drops_the_options_of_the_old_one(pm, tmp_path) -> None:
    yaml = "algorithm:\n  advantage: {name: test_scaled, args: {scale: 2.0}}\n"
    cfg = load(pm, "algorithm.advantage=test_plain", yaml=yaml, tmp_path=tmp_path)
    assert (cfg.algorithm.advantage.name, cfg.algorithm.advantage.args) == ("test_plain", {})

    cfg = load(pm, "algorithm.advantage=test_scaled", yaml=yaml, tmp_path=tmp_path)
    assert cfg.algorithm.advantage.args == {"scale": 2.0, "clip": 10.0}  # same name: options kept


@pytest.mark.parametrize(
    ("yaml", "expected_args"),
    [
        ("algorithm:\n  advantage: test_scaled\n", {"scale": 1.0, "clip": 10.0}),
        ("algorithm:\n  advantage: {name: test_scaled}\n", {"scale": 1.0, "clip": 10.0}),
        (
            "algorithm:\n  advantage:\n    name: test_scaled\n    args: {scale: 3}\n",
            {"scale": 3.0, "clip": 10.0},
        ),
    ],
)
def test_choice_shorthand_and_mapping_forms(pm, tmp_path, yaml: str, expected_args: dict) -> None:
    cfg = load(pm, yaml=yaml, tmp_path=tmp_path)
    assert cfg.algorithm.advantage.name == "test_scaled"
    assert cfg.algorithm.advantage.args == expected_args


def test_choice_forms_on_the_command_line_and_in_lists(pm, tmp_path) -> None:
    cfg = load(pm, "algorithm.advantage={name: test_scaled, args: {scale: 4}}")
    assert cfg.algorithm.advantage.args["scale"] == 4.0

    cfg = load(pm, yaml="rewards:\n  - exact_match\n  - {name: exact_match}\n", tmp_path=tmp_path)
    assert [choice.name for choice in cfg.rewards] == ["exact_match", "exact_match"]


def test_defaults_select_the_documented_builtins(pm) -> None:
    cfg = load(pm)
    assert cfg.algorithm.advantage.name == "grpo"
    assert cfg.algorithm.policy_loss.name == "ppo_clip"
    assert cfg.rollout.engine.name == "transformers"
    assert cfg.parallelism.backend.name == "fsdp2"
    assert [choice.name for choice in cfg.rewards] == ["exact_match"]
    assert "jsonl" in [choice.name for choice in cfg.logging.loggers]


# --------------------------------------------------------------------------------------------------
# documentation
# --------------------------------------------------------------------------------------------------


def dataclass_fields_without_docstring(source: str) -> list[str]:
    missing = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        if not any(
            (isinstance(d, ast.Name) and d.id == "dataclass")
            or (isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "dataclass")
            for d in node.decorator_list
        ):
            continue
        body = node.body
        for index, statement in enumerate(body):
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                following = body[index + 1] if index + 1 < len(body) else None
                documented = (
                    isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)
                    and following.value.value.strip()
                )
                if not documented:
                    missing.append(f"{node.name}.{statement.target.id}")
    return missing


def test_every_config_field_has_a_docstring() -> None:
    source = CONFIG_SOURCE.read_text()
    assert dataclass_fields_without_docstring(source) == []
    assert "RunConfig" in source and source.count("@dataclass") >= 10


def test_field_docstring_check_catches_a_missing_docstring() -> None:
    source = '@dataclass\nclass A:\n    x: int = 1\n    """Doc."""\n    y: int = 2\n    z: int = 3\n    """Doc."""\n'
    assert dataclass_fields_without_docstring(source) == ["A.y"]


def test_bypass_refuses_corrections_that_would_silently_do_nothing(pm, tmp_path) -> None:
    # in bypass mode pi_old is the engine's log-probs: tis/mis/rejection would see rho == 1
    for name in ("tis", "mis", "rejection", "batch_norm"):
        message = config_error(pm, "algorithm.old_logprob_mode=bypass", f"algorithm.corrections=[opsm,{name}]")
        assert f"algorithm.corrections[1]={name}" in message and "old_logprob_mode=decoupled" in message
        assert "reinforce_tis" in message
        load(pm, f"algorithm.corrections=[{name}]")  # decoupled: fine
    # a loss-time correction reads pi_theta and still means something against pi_rollout
    cfg = load(pm, "algorithm.old_logprob_mode=bypass", "algorithm.corrections=[opsm]",
               "algorithm.policy_loss=reinforce_tis")
    assert [c.name for c in cfg.algorithm.corrections] == ["opsm"]


def test_bypass_refusal_reaches_the_command_line(tmp_path, capsys) -> None:
    from rlite.tools.cli import main

    config = tmp_path / "run.yaml"
    config.write_text("model: {path: m}\ndata: {task: addition}\nalgorithm:\n  old_logprob_mode: bypass\n  corrections: [tis]\n")
    assert main(["config", str(config), "plugins.autoload=false"]) == 2
    assert "algorithm.corrections[0]=tis" in capsys.readouterr().err
