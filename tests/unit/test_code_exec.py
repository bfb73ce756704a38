"""The ``code_exec`` reward and ``run_untrusted`` on well-behaved programs: extraction, test cases,
scores, counts, config errors, and the refusal where programs cannot be isolated. Hostile programs:
``tests/faults/test_sandbox_containment.py``."""

from __future__ import annotations

import logging

import pytest

from rlite import sandbox
from rlite.config import Choice, ConfigError
from rlite.plugin_manager import RlitePluginManager
from rlite.plugins import code_exec as plugin
from rlite.plugins.code_exec import CodeExecConfig, code_exec, extract_code, read_test_cases
from rlite.reward_runner import FailureLimits, build_reward_runner, is_count_stat
from rlite.sandbox import SandboxLimits, SandboxUnavailable, run_untrusted
from rlite.tasks import make_task

needs_namespaces = pytest.mark.skipif(not sandbox.probe_isolation().namespaces,
                                      reason=f"no namespaces here: {sandbox.probe_isolation().reason}")

SQUARE = "n = int(input())\nprint(n * n)\n"
IO_TESTS = [{"stdin": "3\n", "stdout": "9"}, {"stdin": "-4\n", "stdout": "16\n"}, {"stdin": "12", "stdout": "144"}]


def test_extract_code_takes_the_last_python_fence_or_the_whole_completion() -> None:
    text = "Here:\n```python\nprint(1)\n```\nand better:\n```py\nprint(2)\n```<|im_end|>```python\nprint(3)\n```"
    assert extract_code(text, "fence", ["<|im_end|>"]) == "print(2)\n"
    assert extract_code("print(4)", "fence", []) is None
    assert extract_code("print(4)", "fence_or_whole", []) == "print(4)"
    assert extract_code("```python\nprint(5)\n```", "whole", []) == "```python\nprint(5)\n```"
    assert extract_code("  \n", "whole", []) is None


def test_test_cases_accept_both_forms_and_name_the_key_on_bad_input() -> None:
    assert read_test_cases({"tests": "assert f(1) == 2"}, "tests") == [{"assert": "assert f(1) == 2"}]
    assert read_test_cases({"t": [{"stdout": 1}]}, "t") == [{"stdin": "", "stdout": "1"}]
    with pytest.raises(ValueError, match="tests_key: the data row has no column 'tests'"):
        read_test_cases({"prompt": "x"}, "tests")
    with pytest.raises(ValueError, match=r"tests\[1\]: a test case is"):
        read_test_cases({"tests": [{"stdout": "1"}, {"expected": "2"}]}, "tests")
    with pytest.raises(ValueError, match="tests: expected a non-empty list"):
        read_test_cases({"tests": []}, "tests")


@pytest.mark.parametrize(("option", "value", "message"), [
    ("extract", "first", "extract: invalid value 'first'"),
    ("score", "mean", "score: invalid value 'mean'"),
    ("template", "print(x)", "template: must contain {code}"),
    ("timeout_s", 0, "timeout_s must be > 0"),
])
def test_bad_options_name_the_option(option, value, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CodeExecConfig(**{option: value})


@needs_namespaces
def test_a_correct_program_passes_every_case_and_scores_1() -> None:
    completion = f"Read n and square it.\n```python\n{SQUARE}```"
    outcome = code_exec(completion, {"tests": IO_TESTS}, CodeExecConfig())
    assert outcome.value == 1.0
    assert outcome.counts["ok"] == 3 and outcome.counts["runs"] == 3


@needs_namespaces
def test_assert_tests_are_appended_and_an_early_exit_does_not_pass() -> None:
    tests = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]
    right = code_exec("def add(a, b):\n    return a + b\n", {"tests": tests}, CodeExecConfig())
    assert right.value == pytest.approx(2 / 3)
    assert right.counts["ok"] == 2 and right.counts["error"] == 1  # the wrong assert fails its run
    assert code_exec("def add(a, b):\n    return a + b\n", {"tests": tests}, CodeExecConfig(score="all")).value == 0.0
    quitter = "import os\ndef add(a, b):\n    return 0\nos._exit(0)\n"
    assert code_exec(quitter, {"tests": tests}, CodeExecConfig()).value == 0.0


@needs_namespaces
def test_a_wrong_or_missing_program_scores_0_and_partial_credit_is_a_fraction() -> None:
    half = "n = int(input())\nprint(n * n if n > 0 else 0)\n"
    assert code_exec(half, {"tests": IO_TESTS}, CodeExecConfig()).value == pytest.approx(2 / 3)
    assert code_exec(half, {"tests": IO_TESTS}, CodeExecConfig(score="all")).value == 0.0
    missing = code_exec("I do not know.", {"tests": IO_TESTS}, CodeExecConfig(extract="fence"))
    assert missing.value == 0.0 and missing.counts["no_code"] == 1 and missing.counts["runs"] == 0


@needs_namespaces
def test_files_and_stdin_reach_the_program_in_its_own_working_directory() -> None:
    result = run_untrusted("import os\nprint(open('data/in.txt').read() + input(), os.getcwd())",
                           stdin="wörld\n", files={"data/in.txt": "héllo "})
    assert result.kind == "ok" and result.stdout == "héllo wörld /tmp/work\n"
    with pytest.raises(ValueError, match="files: '../x' must be a relative path"):
        run_untrusted("print(1)", files={"../x": ""})


@needs_namespaces
def test_the_python_expression_task_is_scored_by_the_sandbox() -> None:
    train, _ = make_task("python_expression", 4, 0, seed=0)
    row = train[0]
    a, b = row["operands"]
    cfg = CodeExecConfig(extract="whole", template="print({code})")
    assert code_exec(f"{a}+{b}", row, cfg).value == 1.0
    assert code_exec(str(a + b), row, cfg).value == 1.0
    assert code_exec(str(a + b + 1), row, cfg).value == 0.0


@needs_namespaces
def test_the_runner_reports_how_the_runs_ended_as_counts() -> None:
    pm = RlitePluginManager()
    pm.register(plugin, name="rlite.plugins.code_exec")
    choice = Choice("code_exec", {"extract": "whole", "timeout_s": 30, "cpu_s": 1})
    runner = build_reward_runner([choice], pm.registry("reward_function"), timeout_s=60, workers=2,
                                 limits=FailureLimits(1.0, 1.0), example_sample={"tests": IO_TESTS})
    try:
        completions = [SQUARE, "while True: pass", "print(", SQUARE]
        result = runner.score(completions, [{"tests": IO_TESTS[:1]}] * 4)
    finally:
        runner.close()
    assert result.scores == [1.0, 0.0, 0.0, 1.0]
    stats = result.stats
    assert (stats["reward/code_exec/n_ok"], stats["reward/code_exec/n_cpu"], stats["reward/code_exec/n_error"]) == (2, 1, 1)
    assert stats["reward/code_exec/n_runs"] == 4 and stats["reward/failures"] == 0
    assert is_count_stat("reward/code_exec/n_cpu") and not is_count_stat("reward/code_exec")


def test_a_row_without_tests_is_refused_before_training() -> None:
    pm = RlitePluginManager()
    pm.register(plugin, name="rlite.plugins.code_exec")
    with pytest.raises(ConfigError, match=r"rewards\[0\]: args.tests_key: the data row has no column 'tests'"):
        build_reward_runner([Choice("code_exec", {"allow_unisolated": True})], pm.registry("reward_function"),
                            example_sample={"prompt": "1+1=", "answer": "2"})


UNAVAILABLE = sandbox.Isolation(False, False, False, "unshare: unshare failed: Operation not permitted")


def test_without_namespaces_it_refuses_unless_told_and_then_warns(monkeypatch, caplog) -> None:
    monkeypatch.setattr(sandbox, "probe_isolation", lambda: UNAVAILABLE)
    monkeypatch.setattr(plugin, "probe_isolation", lambda: UNAVAILABLE)
    monkeypatch.setattr(sandbox, "_WARNED", False)
    with pytest.raises(SandboxUnavailable, match="cannot isolate untrusted code on this machine: unshare"):
        run_untrusted("print(1)")
    with pytest.raises(ConfigError, match="code_exec reward cannot isolate programs.*allow_unisolated"):
        CodeExecConfig()
    with caplog.at_level(logging.WARNING, logger="rlite.sandbox"):
        result = run_untrusted("print(6 * 7)", limits=SandboxLimits(allow_unisolated=True))
    assert result.kind == "ok" and result.stdout == "42\n" and result.uid is None
    assert "UNTRUSTED CODE RUNS WITHOUT ISOLATION" in caplog.text
    looping = run_untrusted("while True: pass", limits=SandboxLimits(allow_unisolated=True, timeout_s=30, cpu_s=1))
    assert looping.kind == "cpu"


@needs_namespaces
def test_the_user_namespace_path_isolates_network_and_files(monkeypatch) -> None:
    """What a non-root trainer gets (forced here: root may also make a user namespace)."""
    user_namespace = sandbox.Isolation(True, True, False)
    try:
        sandbox.subprocess.run([*sandbox._unshare_command(True), "true"], check=True, capture_output=True, timeout=30)
    except (OSError, sandbox.subprocess.SubprocessError):
        pytest.skip("user namespaces are not allowed here")
    monkeypatch.setattr(sandbox, "probe_isolation", lambda: user_namespace)
    hidden = sandbox.os.getcwd()
    program = ("import ctypes, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(os.getuid())\n"
               f"def umount():\n    if libc.umount2({hidden!r}.encode(), 2) != 0:\n        raise OSError(ctypes.get_errno(), 'umount')\n"
               "def remount():\n    if libc.mount(b'none', b'/', None, 32 | 4096, None) != 0:\n"
               "        raise OSError(ctypes.get_errno(), 'remount')\n"
               f"for attempt in (lambda: socket.create_connection(('127.0.0.1', 9)), lambda: os.listdir({hidden!r}),"
               " lambda: open('/etc/rlite-escaped', 'w'), umount, remount):\n"
               "    try:\n        print(attempt())\n    except OSError as e:\n        print(e.errno)\n")
    result = run_untrusted(program)
    assert result.kind == "ok" and result.uid is None
    # root inside its namespace, without capabilities: no network (ENETUNREACH); the working folder
    # hidden (EACCES; ENOENT for a checkout under /tmp, which the sandbox's private /tmp covers, so there
    # is nothing to unmount either); the filesystem read-only (EROFS); no unmounting or remounting (EPERM)
    uid, network, folder, write, umount, remount = result.stdout.split()
    assert [uid, network, write, remount] == ["0", "101", "30", "1"]
    assert (folder, umount) in (("13", "1"), ("2", "2"))
