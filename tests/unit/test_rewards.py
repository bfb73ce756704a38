"""Built-in reward functions on hand-picked cases, and the runner's isolation of failures and hangs."""

from __future__ import annotations

import importlib.util
import logging
import math
import re
import threading
import time

import pytest
from omegaconf import OmegaConf

from rlite.config import Choice, ConfigError
from rlite.plugin_manager import RlitePluginManager, UnknownChoiceError
from rlite.plugins import rewards as builtin
from rlite.rewards import RewardRunner, build_reward_runner


@pytest.fixture(scope="module")
def registry():
    """The reward registry of a manager holding only the built-in rewards plugin (through pluggy)."""
    pm = RlitePluginManager()
    pm.register(builtin, name="rlite.plugins.rewards")
    return pm.registry("reward_function")


def test_registered_names_and_config_classes(registry):
    assert registry.names() == ["exact_match", "math_verify", "numeric", "overlong_penalty", "python"]
    for name in registry.names():
        config_cls = registry.get(name).config_cls
        assert "weight" in config_cls.__dataclass_fields__
        assert config_cls.__dataclass_fields__["weight"].default == 1.0


# --------------------------------------------------------------------------------------------------
# the functions
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("47", "47", 1.0),
        ("  47\n", "47", 1.0),
        ("47<|im_end|>", "47", 1.0),
        ("47<|im_end|>\n<|im_start|>user\n48", "47", 1.0),
        ("47<|endoftext|>", "47", 1.0),
        ("48", "47", 0.0),
        ("The answer is 47", "47", 0.0),
        ("470", "47", 0.0),
        ("", "47", 0.0),
        ("tzqk", "tzqk", 1.0),
        ("1 1 3 4", "1 1 3 4", 1.0),
        ("7", 7, 1.0),
    ],
)
def test_exact_match(completion, answer, expected):
    assert builtin.exact_match(completion, {"answer": answer}, builtin.ExactMatchConfig()) == expected


def test_exact_match_options():
    sample = {"answer": "Cba"}
    assert builtin.exact_match(" Cba", sample, builtin.ExactMatchConfig(strip=False)) == 0.0
    assert builtin.exact_match("cba", sample, builtin.ExactMatchConfig()) == 0.0
    assert builtin.exact_match("cba", sample, builtin.ExactMatchConfig(case_sensitive=False)) == 1.0
    assert builtin.exact_match("Cba</s>", sample, builtin.ExactMatchConfig(end_texts=["</s>"])) == 1.0


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("47", "47", 1.0),
        ("12+35=47", "47", 1.0),
        ("The answer is 47.", "47", 1.0),
        ("47.0", "47", 1.0),
        ("1,234 apples", "1234", 1.0),
        ("x = -5", "-5", 1.0),
        ("12-5=7", "7", 1.0),  # a minus after a digit is subtraction, not a sign
        ("0.5", "0.50", 1.0),
        ("I think 46", "47", 0.0),
        ("no number here", "47", 0.0),
        ("47 then 12", "47", 0.0),  # the last number counts
        ("so 42<|im_end|>7", "#### 42", 1.0),  # cut at end-of-turn; the answer's own number is read
    ],
)
def test_numeric_last(completion, answer, expected):
    assert builtin.numeric(completion, {"answer": answer}, builtin.NumericConfig()) == expected


def test_numeric_first_and_tolerance():
    first = builtin.NumericConfig(position="first")
    assert builtin.numeric("47 then 12", {"answer": "47"}, first) == 1.0
    assert builtin.numeric("12+35=47", {"answer": "47"}, first) == 0.0
    loose = builtin.NumericConfig(tolerance=0.5)
    assert builtin.numeric("47.4", {"answer": 47}, loose) == 1.0
    assert builtin.numeric("47.6", {"answer": 47}, loose) == 0.0


def test_numeric_config_and_answer_errors():
    with pytest.raises(ConfigError, match="position"):
        builtin.NumericConfig(position="middle")
    with pytest.raises(ConfigError, match="tolerance"):
        builtin.NumericConfig(tolerance=-1)
    with pytest.raises(ValueError, match="holds no number"):
        builtin.numeric("47", {"answer": "forty-seven"}, builtin.NumericConfig())


def test_math_verify():
    pytest.importorskip("math_verify")
    cfg = builtin.MathVerifyConfig()
    assert builtin.math_verify("so the answer is $\\boxed{\\frac{1}{2}}$", {"answer": "0.5"}, cfg) == 1.0
    assert builtin.math_verify("12+35=47<|im_end|>", {"answer": "47"}, cfg) == 1.0
    assert builtin.math_verify("The answer is 46.", {"answer": "47"}, cfg) == 0.0
    assert builtin.math_verify("$x^2+2x+1$", {"answer": "(x+1)^2"}, cfg) == 1.0
    assert builtin.math_verify("no maths", {"answer": "47"}, cfg) == 0.0


def test_math_verify_runs_in_the_runner_threads():
    pytest.importorskip("math_verify")
    runner = RewardRunner(
        [("math_verify", builtin.math_verify, builtin.MathVerifyConfig(), 1.0)], timeout_s=30
    )
    scores, stats = runner.score(["$\\frac{2}{4}$", "3"], [{"answer": "\\frac{1}{2}"}, {"answer": "4"}])
    assert scores == [1.0, 0.0]
    assert stats["reward/failures"] == 0


def test_math_verify_missing_package_fails_at_config_load(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "math_verify" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigError, match=r"pip install 'rlite\[math\]'"):
        builtin.MathVerifyConfig()


def test_python_reward_from_yaml_choice(registry, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(completion, sample, scale=1.0):\n    return scale * len(completion)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yaml = """
    rewards:
      - name: python
        args: {function: "my_rewards:length_reward", kwargs: {scale: 0.5}, weight: 2.0}
      - exact_match
    """
    raw = OmegaConf.to_container(OmegaConf.create(yaml))["rewards"]
    choices = [Choice(name=r) if isinstance(r, str) else Choice(**r) for r in raw]
    runner = build_reward_runner(choices, registry)
    assert runner.names == ["python", "exact_match"]
    scores, stats = runner.score(["abcd", "7"], [{"answer": "x"}, {"answer": "7"}])
    assert scores == [2.0 * 0.5 * 4, 2.0 * 0.5 * 1 + 1.0]
    assert stats["reward/python"] == pytest.approx((2.0 + 0.5) / 2)
    assert stats["reward/exact_match"] == 0.5


@pytest.mark.parametrize(
    "function, message",
    [
        ("", "set it to 'package.module:function'"),
        ("my_rewards.length_reward", "must look like 'package.module:function'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("os.path:no_such_attr", "'os.path:no_such_attr': 'os.path' has no attribute"),
        ("os:sep", "'os:sep' is a str, not a callable"),
    ],
)
def test_python_reward_bad_function_fails_at_config_load(registry, function, message):
    with pytest.raises(ConfigError, match=r"^function: .*" + re.escape(message)):
        builtin.PythonRewardConfig(function=function)
    with pytest.raises(ValueError, match=r"rewards\[0\]\.args: function"):
        build_reward_runner([Choice("python", {"function": function})], registry)


def test_build_reward_runner_errors_and_duplicates(registry):
    with pytest.raises(UnknownChoiceError, match="Valid choices: exact_match, math_verify, numeric, overlong_penalty, python"):
        build_reward_runner([Choice("exact_matc")], registry)
    with pytest.raises(ValueError, match=r"rewards\[1\]\.args: .*no option\(s\) tol\b.*tolerance"):
        build_reward_runner([Choice("exact_match"), Choice("numeric", {"tol": 1})], registry)
    runner = build_reward_runner(
        [Choice("numeric"), Choice("numeric", {"position": "first", "weight": 0.5})], registry
    )
    assert runner.names == ["numeric", "numeric_2"]
    assert [entry[3] for entry in runner.entries] == [1.0, 0.5]
    assert runner.entries[1][2].position == "first"


# --------------------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------------------


def _const(value):
    return lambda completion, sample, cfg: value


def _boom(completion, sample, cfg):
    raise RuntimeError("kaboom")


def test_weighted_sum_and_per_function_means():
    entries = [
        ("exact", builtin.exact_match, builtin.ExactMatchConfig(), 1.0),
        ("numeric", builtin.numeric, builtin.NumericConfig(), 0.5),
        ("bonus", _const(2), None, -1.0),
    ]
    scores, stats = RewardRunner(entries).score(["47", "It is 47", "no"], [{"answer": "47"}] * 3)
    assert scores == [1.0 + 0.5 - 2.0, 0.5 - 2.0, -2.0]
    assert stats == {
        "reward/failures": 0.0,
        "reward/timeouts": 0.0,
        "reward/exact": pytest.approx(1 / 3),
        "reward/numeric": pytest.approx(2 / 3),
        "reward/bonus": 2.0,
    }


def test_failures_score_zero_and_are_counted_and_logged(caplog):
    entries = [("ok", _const(1.0), None, 1.0), ("boom", _boom, None, 1.0)]
    with caplog.at_level(logging.WARNING, logger="rlite.rewards"):
        scores, stats = RewardRunner(entries).score(["a", "b", "c"], [{}] * 3)
    assert scores == [1.0, 1.0, 1.0]
    assert stats["reward/failures"] == 3.0 and stats["reward/boom"] == 0.0 and stats["reward/ok"] == 1.0
    records = [r for r in caplog.records if "boom" in r.getMessage()]
    assert len(records) == 1  # rate-limited: one warning for three failures
    assert "RuntimeError: kaboom" in records[0].getMessage()


@pytest.mark.parametrize("bad", [math.nan, math.inf, "1.0", None, [1.0]])
def test_non_finite_or_non_numeric_returns_are_failures(bad):
    scores, stats = RewardRunner([("bad", _const(bad), None, 1.0)]).score(["x"], [{}])
    assert scores == [0.0] and stats["reward/failures"] == 1.0


def test_bool_and_int_returns_are_numbers():
    scores, stats = RewardRunner([("b", _const(True), None, 1.0), ("i", _const(3), None, 1.0)]).score(
        ["x"], [{}]
    )
    assert scores == [4.0] and stats["reward/failures"] == 0.0


def test_hung_function_times_out_without_hanging(caplog):
    release = threading.Event()

    def hang(completion, sample, cfg):
        release.wait(60)
        return 1.0

    timeout = 0.2
    runner = RewardRunner(
        [("hang", hang, None, 1.0), ("ok", _const(1.0), None, 1.0)], timeout_s=timeout, max_workers=2
    )
    try:
        with caplog.at_level(logging.WARNING, logger="rlite.rewards"):
            start = time.monotonic()
            scores, stats = runner.score(["a", "b"], [{}, {}])
            elapsed = time.monotonic() - start
        assert scores == [1.0, 1.0]
        assert stats["reward/timeouts"] == 2.0 and stats["reward/hang"] == 0.0
        assert elapsed < 10 * timeout + 2.0
        assert any("'hang' timed out" in r.getMessage() for r in caplog.records)
        # The abandoned calls hold no slot: the next batch still runs.
        scores, stats = runner.score(["c"], [{}])
        assert scores == [1.0] and stats["reward/timeouts"] == 1.0
    finally:
        release.set()


def test_slow_call_timeout_counts_from_its_own_start():
    """With one worker, calls queue; a call that is quick enough is not timed out by the wait before it."""

    def slow(completion, sample, cfg):
        time.sleep(0.05)
        return 1.0

    scores, stats = RewardRunner([("slow", slow, None, 1.0)], timeout_s=0.5, max_workers=1).score(
        ["x"] * 12, [{}] * 12
    )
    assert scores == [1.0] * 12 and stats["reward/timeouts"] == 0.0


def test_runner_argument_checks():
    with pytest.raises(ValueError, match="at least one"):
        RewardRunner([])
    with pytest.raises(ValueError, match="distinct"):
        RewardRunner([("a", _const(1), None, 1.0), ("a", _const(1), None, 1.0)])
    with pytest.raises(ValueError, match="2 completions but 1 samples"):
        RewardRunner([("a", _const(1), None, 1.0)]).score(["x", "y"], [{}])
    assert RewardRunner([("a", _const(1), None, 1.0)]).score([], []) == (
        [],
        {"reward/failures": 0.0, "reward/timeouts": 0.0, "reward/a": 0.0},
    )
