"""Built-in reward functions on hand-picked cases, and the runner's isolation of failures and hangs."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
import textwrap
import threading

import pytest
from omegaconf import OmegaConf

from rlite.config import Choice, ConfigError
from rlite.plugin_manager import RlitePluginManager, UnknownChoiceError
from rlite.plugins import rewards as builtin
from rlite.reward_runner import FailureLimits, RewardEntry, RewardRunner, build_reward_runner


@pytest.fixture(scope="module")
def registry():
    """The reward registry of a manager holding only the built-in rewards plugin (through pluggy)."""
    pm = RlitePluginManager()
    pm.register(builtin, name="rlite.plugins.rewards")
    return pm.registry("reward_function")


def test_registered_names_and_config_classes(registry):
    assert registry.names() == ["exact_match", "math_verify", "numeric", "overlong_penalty", "python", "reward_model"]
    for name in registry.names():
        config_cls = registry.get(name).config_cls
        assert "weight" in config_cls.__dataclass_fields__
        assert config_cls.__dataclass_fields__["weight"].default == 1.0


def test_where_the_built_in_rewards_run(registry):
    """Pure functions that cannot hang run inline; a user's function and sympy run in processes."""
    isolation = {name: registry.get(name).metadata["isolation"] for name in registry.names()}
    assert isolation == {"exact_match": "inline", "numeric": "inline", "overlong_penalty": "inline",
                         "math_verify": "process", "python": "process", "reward_model": "inline"}


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


def test_math_verify_runs_in_the_runner_processes(registry):
    pytest.importorskip("math_verify")
    runner = build_reward_runner([Choice("math_verify")], registry, timeout_s=60, workers=1)
    try:
        result = runner.score(["$\\frac{2}{4}$", "3"], [{"answer": "\\frac{1}{2}"}, {"answer": "4"}])
        assert result.scores == [1.0, 0.0]
        assert result.stats["reward/failures"] == 0 and result.error is None
        assert len(runner.processes.pids) == 1 and runner.processes.pids[0] != os.getpid()
    finally:
        runner.close()


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
    try:
        assert runner.names == ["python", "exact_match"]
        result = runner.score(["abcd", "7"], [{"answer": "x"}, {"answer": "7"}])
    finally:
        runner.close()
    assert result.scores == [2.0 * 0.5 * 4, 2.0 * 0.5 * 1 + 1.0]
    assert result.stats["reward/python"] == pytest.approx((2.0 + 0.5) / 2)
    assert result.stats["reward/exact_match"] == 0.5


@pytest.mark.parametrize(
    "function, message",
    [
        ("", "set it to 'path/to/file.py:function' or 'package.module:function'"),
        ("my_rewards.length_reward", "must look like 'path/to/file.py:function' or 'package.module:function'"),
        ("no/such/file.py:f", "the file /"),
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


def _python_runner(registry, *choices, **kwargs):
    return build_reward_runner([Choice("python", args) for args in choices], registry, **kwargs)


def test_python_reward_by_file_path_relative_or_absolute(registry, tmp_path, monkeypatch):
    (tmp_path / "rewards_here.py").write_text("def length(completion, sample):\n    return float(len(completion))\n")
    monkeypatch.chdir(tmp_path)
    runner = _python_runner(registry, {"function": "rewards_here.py:length"},
                            {"function": f"{tmp_path}/rewards_here.py:length", "weight": 10.0})
    try:
        result = runner.score(["ab", "abcd"], [{}, {}])
    finally:
        runner.close()
    assert result.scores == [2.0 + 20.0, 4.0 + 40.0] and result.error is None


def test_python_reward_file_that_fails_to_load(tmp_path):
    (tmp_path / "broken.py").write_text("def f(completion, sample):\n    return 1\nraise ImportError('no sympy here')\n")
    with pytest.raises(ConfigError, match=r"loading .*broken.py failed: ImportError: no sympy here"):
        builtin.PythonRewardConfig(function=f"{tmp_path}/broken.py:f")


def test_batched_python_reward_gets_the_columns_like_trl(registry, tmp_path):
    (tmp_path / "batched.py").write_text(
        "def matches(completions, answer, prompts, response_length, scale=1.0, **kwargs):\n"
        "    assert len(prompts) == len(completions) == len(response_length)\n"
        "    return [scale * (c.strip() == str(a)) for c, a in zip(completions, answer)]\n"
    )
    runner = _python_runner(registry, {"function": f"{tmp_path}/batched.py:matches", "batched": True,
                                       "kwargs": {"scale": 2.0}},
                            example_sample={"prompt": "1+1=", "answer": "2", "response_length": 1})
    assert runner.entries[0].batched and runner.entries[0].isolation == "process"
    rows = [{"prompt": "1+1=", "answer": "2", "response_length": 1}, {"prompt": "2+2=", "answer": "4", "response_length": 2}]
    try:
        result = runner.score([" 2", "5"], rows)
    finally:
        runner.close()
    assert result.scores == [2.0, 0.0] and result.error is None


SIGNATURES = """
def per_sample(completion, sample):
    return 1.0


def batched(completions, **kwargs):
    return [1.0] * len(completions)


def needs_column(completions, ground_truth, **kwargs):
    return [1.0] * len(completions)


def three_args(completion, sample, scale):
    return scale
"""


@pytest.mark.parametrize(
    "function, args, message",
    [
        ("batched", {}, r"\(batched in .*signatures.py, line 6\) cannot be called as batched\(completion: str, sample: dict\) "
                        r"-> float on a data row: too many positional arguments\. It looks like a batched function: "
                        r"set args\.batched: true"),
        ("per_sample", {"batched": True}, r"per_sample\(completions: list\[str\], \*\*columns\) -> list\[float\], the "
                                          r"columns being prompt, answer, prompts on a data row: missing a required argument: 'sample'\. "
                                          r"It looks like a per-completion function: drop args\.batched"),
        ("needs_column", {"batched": True}, r"missing a required argument: 'ground_truth'"),
        ("three_args", {}, r"three_args\(completion: str, sample: dict\) -> float on a data row: missing a required "
                           r"argument: 'scale'"),
        ("three_args", {"kwargs": {"scale": 1, "bonus": 2}}, r"got an unexpected keyword argument 'bonus'"),
        ("batched", {"batched": True, "kwargs": {"answer": 1}}, r"answer also name data columns"),
    ],
)
def test_python_reward_signature_is_checked_against_a_data_row(registry, tmp_path, function, args, message):
    (tmp_path / "signatures.py").write_text(SIGNATURES)
    path = f"{tmp_path}/signatures.py:{function}"
    clash = "data columns" in message
    prefix = r"^rewards\[0\]: args\.kwargs: " if clash else r"^rewards\[0\]: args\.function: " + re.escape(repr(path))
    with pytest.raises(ConfigError, match=prefix + ".*" + message):
        _python_runner(registry, {"function": path, **args}, example_sample={"prompt": "1+1=", "answer": "2"})


def test_build_reward_runner_errors_and_duplicates(registry):
    with pytest.raises(UnknownChoiceError, match="Valid choices: exact_match, math_verify, numeric, overlong_penalty, python, reward_model"):
        build_reward_runner([Choice("exact_matc")], registry)
    with pytest.raises(ValueError, match=r"rewards\[1\]\.args: .*no option\(s\) tol\b.*tolerance"):
        build_reward_runner([Choice("exact_match"), Choice("numeric", {"tol": 1})], registry)
    runner = build_reward_runner(
        [Choice("numeric"), Choice("numeric", {"position": "first", "weight": 0.5})], registry
    )
    assert runner.names == ["numeric", "numeric_2"]
    assert [entry.weight for entry in runner.entries] == [1.0, 0.5]
    assert runner.entries[1].cfg.position == "first"


# --------------------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------------------


def _const(value):
    return lambda completion, sample, cfg: value


def _boom(completion, sample, cfg):
    raise RuntimeError("kaboom")


def _entry(name, fn, weight=1.0, isolation="thread", batched=False, cfg=None):
    return RewardEntry(name, fn, cfg, weight, isolation, batched)


TOLERANT = FailureLimits(max_failure_fraction=1.0, max_timeout_fraction=1.0)


def test_weighted_sum_and_per_function_means():
    entries = [
        _entry("exact", builtin.exact_match, cfg=builtin.ExactMatchConfig(), isolation="inline"),
        _entry("numeric", builtin.numeric, 0.5, cfg=builtin.NumericConfig()),
        _entry("bonus", _const(2), -1.0),
    ]
    result = RewardRunner(entries).score(["47", "It is 47", "no"], [{"answer": "47"}] * 3)
    assert result.scores == [1.0 + 0.5 - 2.0, 0.5 - 2.0, -2.0]
    assert result.error is None
    assert result.stats == {
        "reward/failures": 0.0,
        "reward/timeouts": 0.0,
        "reward/exact": pytest.approx(1 / 3),
        "reward/numeric": pytest.approx(2 / 3),
        "reward/bonus": 2.0,
    }


@pytest.mark.parametrize("isolation", ["inline", "thread"])
def test_failures_score_zero_and_are_counted_and_logged(caplog, isolation):
    entries = [_entry("ok", _const(1.0)), _entry("boom", _boom, isolation=isolation)]
    runner = RewardRunner(entries, limits=TOLERANT)
    with caplog.at_level(logging.WARNING, logger="rlite.reward_runner"):
        result = runner.score(["a", "b", "c"], [{}] * 3)
    assert result.scores == [1.0, 1.0, 1.0] and result.error is None
    assert result.stats["reward/failures"] == 3.0 and result.stats["reward/boom"] == 0.0
    assert runner.failures == {"ok": 0, "boom": 3} and runner.calls == {"ok": 3, "boom": 3}
    records = [r for r in caplog.records if "boom" in r.getMessage()]
    assert len(records) == 1  # rate-limited: one warning for three failures
    assert "RuntimeError: kaboom" in records[0].getMessage()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "1.0", None, [1.0]])
def test_non_finite_or_non_numeric_returns_are_failures(bad):
    result = RewardRunner([_entry("bad", _const(bad))], limits=TOLERANT).score(["x"], [{}])
    assert result.scores == [0.0] and result.stats["reward/failures"] == 1.0
    assert result.stats["reward/timeouts"] == 0.0


def test_bool_and_int_returns_are_numbers():
    result = RewardRunner([_entry("b", _const(True)), _entry("i", _const(3))]).score(["x"], [{}])
    assert result.scores == [4.0] and result.stats["reward/failures"] == 0.0


def test_strict_default_stops_on_a_failing_function_with_its_traceback():
    runner = RewardRunner([_entry("ok", _const(1.0)), _entry("boom", _boom)])
    result = runner.score(["a", "b"], [{}, {}])
    assert result.error is not None
    assert "reward function 'boom' failed on 2 of 2 calls" in result.error
    assert "reward_max_failure_fraction" in result.error
    assert 'raise RuntimeError("kaboom")' in result.error and "RuntimeError: kaboom" in result.error
    assert "'ok'" not in result.error


def test_rare_failures_are_tolerated_and_counted_until_they_pass_the_fraction():
    calls = {"n": 0}

    def flaky(completion, sample, cfg):
        calls["n"] += 1
        if completion == "bad":
            raise ValueError("rare")
        return 1.0

    runner = RewardRunner([_entry("flaky", flaky, isolation="inline")],
                          limits=FailureLimits(max_failure_fraction=0.05, max_timeout_fraction=0.0))
    # 1 failure in 50 calls: 2% <= 5%
    result = runner.score(["bad"] + ["ok"] * 49, [{}] * 50)
    assert result.error is None and result.stats["reward/failures"] == 1.0
    assert result.scores == [0.0] + [1.0] * 49
    # 3 more in the next 10: 4 of 60 calls = 6.7% > 5%
    result = runner.score(["bad"] * 3 + ["ok"] * 7, [{}] * 10)
    assert runner.failures["flaky"] == 4 and runner.calls["flaky"] == 60
    assert result.error is not None and "4 of 60 in the run" in result.error and "ValueError: rare" in result.error


def test_a_whole_failing_batch_stops_even_under_a_loose_fraction():
    runner = RewardRunner([_entry("ok", _const(1.0)), _entry("boom", _boom, isolation="inline")],
                          limits=FailureLimits(max_failure_fraction=0.9, max_timeout_fraction=0.9))
    assert "failed on 4 of 4 calls in this batch" in runner.score(["a"] * 4, [{}] * 4).error
    never = RewardRunner([_entry("boom", _boom, isolation="inline")], limits=TOLERANT)
    assert never.score(["a"] * 4, [{}] * 4).error is None


def test_batched_function_is_called_once_and_each_value_checked():
    seen = []

    def lengths(completions, samples, cfg):
        seen.append(len(completions))
        return [len(c) if c != "nan" else math.nan for c in completions]

    runner = RewardRunner([_entry("len", lengths, isolation="inline", batched=True)], limits=TOLERANT)
    result = runner.score(["a", "bbb", "nan"], [{}] * 3)
    assert seen == [3]
    assert result.scores == [1.0, 3.0, 0.0] and result.stats["reward/failures"] == 1.0
    wrong = RewardRunner([_entry("short", lambda cs, ss, cfg: [1.0], batched=True)], limits=TOLERANT)
    result = wrong.score(["a", "b"], [{}, {}])
    assert result.scores == [0.0, 0.0] and result.stats["reward/failures"] == 2.0


def test_hung_thread_call_is_abandoned_and_its_worker_replaced(caplog):
    release = threading.Event()

    def hang(completion, sample, cfg):
        if completion == "hang":
            release.wait(60)
        return 1.0

    runner = RewardRunner([_entry("hang", hang), _entry("ok", _const(1.0))], timeout_s=0.5, workers=2, limits=TOLERANT)
    threads_before = threading.active_count()
    try:
        with caplog.at_level(logging.WARNING, logger="rlite.reward_runner"):
            result = runner.score(["hang", "b"], [{}, {}])
        assert result.scores == [1.0, 2.0]
        assert result.stats["reward/timeouts"] == 1.0 and result.stats["reward/hang"] == 0.5
        assert any("'hang' timed out" in r.getMessage() for r in caplog.records)
        assert runner.threads.abandoned_alive == 1
        # the pool still has its two workers: the next batch runs in full
        result = runner.score(["c", "d", "e"], [{}] * 3)
        assert result.scores == [2.0] * 3 and result.stats["reward/timeouts"] == 0.0
    finally:
        release.set()
    # the abandoned call ends; its thread leaves instead of rejoining the pool
    for thread in list(runner.threads._abandoned):
        thread.join(10)
    assert runner.threads.abandoned_alive == 0
    runner.close()
    assert threading.active_count() <= threads_before + 2


def test_runner_argument_checks():
    with pytest.raises(ValueError, match="at least one"):
        RewardRunner([])
    with pytest.raises(ValueError, match="distinct"):
        RewardRunner([_entry("a", _const(1)), _entry("a", _const(1))])
    with pytest.raises(ValueError, match="2 completions but 1 samples"):
        RewardRunner([_entry("a", _const(1))]).score(["x", "y"], [{}])
    with pytest.raises(ValueError, match="isolation"):
        _entry("a", _const(1), isolation="fork")
    empty = RewardRunner([_entry("a", _const(1))]).score([], [])
    assert (empty.scores, empty.stats, empty.error) == (
        [], {"reward/failures": 0.0, "reward/timeouts": 0.0, "reward/a": 0.0}, None)


# --------------------------------------------------------------------------------------------------
# worker processes
# --------------------------------------------------------------------------------------------------

WORKER_FUNCTIONS = '''
import os
import time


def record_and_hang(completion, sample, cfg):
    """Write this worker's pid to a marker file, then hang on "hang" completions."""
    with open(os.path.join(sample["markers"], f"{os.getpid()}-{time.monotonic_ns()}"), "w"):
        pass
    if completion == "hang":
        time.sleep(600)
    return len(completion)


def raise_value_error(completion, sample, cfg):
    raise ValueError("no answer in " + completion)


def die(completion, sample, cfg):
    os._exit(7)


def die_on_die(completion, sample, cfg):
    if completion == "die":
        os._exit(7)
    return len(completion)
'''


@pytest.fixture
def worker_functions(tmp_path, monkeypatch):
    (tmp_path / "rlite_test_reward_workers.py").write_text(textwrap.dedent(WORKER_FUNCTIONS))
    monkeypatch.syspath_prepend(str(tmp_path))
    import rlite_test_reward_workers

    (tmp_path / "markers").mkdir()
    return rlite_test_reward_workers, str(tmp_path / "markers")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead too
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_hung_process_calls_time_out_together_and_their_workers_are_replaced(worker_functions):
    """12 hanging calls on 2 workers: the batch ends at its one deadline (only 2 calls ever start,
    not 12 one after another); the killed workers are gone and fresh ones serve the next batch."""
    module, markers = worker_functions
    runner = RewardRunner([_entry("slow", module.record_and_hang, isolation="process")],
                          timeout_s=1.0, workers=2, limits=TOLERANT)
    threads_before = threading.active_count()
    try:
        first_pids = None
        runner.start()
        runner._started()
        first_pids = runner.processes.pids
        result = runner.score(["hang"] * 12, [{"markers": markers}] * 12)
        assert result.stats["reward/timeouts"] == 12.0 and result.scores == [0.0] * 12
        started = os.listdir(markers)
        assert len(started) == 2 and {int(m.split("-")[0]) for m in started} == set(first_pids)
        assert runner.processes.replaced == 2
        assert not any(_alive(pid) for pid in first_pids)
        new_pids = runner.processes.pids
        assert len(new_pids) == 2 and not set(new_pids) & set(first_pids)
        # a batch with one hanging call: the other calls finish on the other worker (a longer
        # deadline, so that a loaded machine finishes them in time)
        runner.timeout_s = 5.0
        result = runner.score(["hang", "ab", "abc", "a"], [{"markers": markers}] * 4)
        assert result.scores == [0.0, 2.0, 3.0, 1.0] and result.stats["reward/timeouts"] == 1.0
        assert runner.processes.replaced == 3
    finally:
        runner.close()
    assert threading.active_count() == threads_before
    assert not any(_alive(pid) for pid in new_pids)


def test_process_failures_carry_the_functions_traceback(worker_functions):
    module, _ = worker_functions
    runner = RewardRunner([_entry("strict", module.raise_value_error, isolation="process"),
                           _entry("dies", module.die, isolation="process")], timeout_s=60, workers=1,
                          limits=FailureLimits(max_failure_fraction=0.0))
    try:
        result = runner.score(["x", "y"], [{}, {}])
    finally:
        runner.close()
    assert result.stats["reward/failures"] == 4.0 and result.stats["reward/timeouts"] == 0.0
    assert "rlite_test_reward_workers.py" in result.error and "ValueError: no answer in x" in result.error
    assert "the worker process died (exit code 7)" in result.error
    assert runner.processes.replaced == 2


def test_unpicklable_process_reward_fails_at_build(registry, monkeypatch):
    from rlite.plugin_manager import Registered

    local = Registered("local", lambda c, s, cfg: 1.0, None, "test", {"isolation": "process"})
    monkeypatch.setitem(registry.entries, "local", local)
    with pytest.raises(ConfigError, match=r"rewards\[0\]: reward function 'local' runs in worker processes"):
        build_reward_runner([Choice("local")], registry)


def test_a_worker_dying_mid_chunk_fails_one_call_and_the_rest_run_elsewhere(worker_functions):
    """Calls reach a worker in chunks (16 calls on 1 worker: 8 at once); when it dies on one, that
    call fails and the rest of its chunk runs on the fresh worker that replaces it."""
    module, _ = worker_functions
    runner = RewardRunner([_entry("d", module.die_on_die, isolation="process")], timeout_s=60, workers=1,
                          limits=TOLERANT)
    completions = ["a", "die"] + ["x" * n for n in range(2, 16)]
    try:
        result = runner.score(completions, [{}] * 16)
    finally:
        runner.close()
    assert result.stats["reward/failures"] == 1.0 and result.stats["reward/timeouts"] == 0.0
    assert result.scores == [1.0, 0.0] + [float(n) for n in range(2, 16)]
    assert runner.processes.replaced == 1
