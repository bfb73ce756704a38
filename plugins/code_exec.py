"""Built-in plugin: the ``code_exec`` reward, which runs the model's program against tests in a sandbox.

The completion's code (its last fenced ```python block, or the whole completion; ``extract``) is
put into ``template`` (``{code}`` by default; ``print({code})`` scores an expression) and run by
:func:`rlite.api.run_untrusted` once per test case of the data row's ``tests`` column:

* ``{"stdin": "...", "stdout": "..."}``: the program reads ``stdin``; it passes when it exits with
  status 0 and its stdout equals ``stdout`` (trailing whitespace of each line and trailing blank
  lines ignored);
* ``{"assert": "..."}`` (or a plain string): the test code is appended to the program, followed by a
  line printing a random token; it passes when the program exits with status 0 and the token is the
  last line of its stdout (so a program that exits early with status 0 does not pass).

The score is the fraction of cases passed (``score: fraction``) or 1 only when all pass (``all``).
Every run's failure kind (``ok``, ``error``, ``timeout``, ``cpu``, ``memory``, ``disk``,
``output_limit``, ``crash``, ``killed``, ``setup``) is counted into ``reward/code_exec/n_<kind>``,
with ``n_runs`` and ``n_no_code``. The runs of a batch go through the reward runner's worker threads
(``reward_workers`` of them, each waiting on one sandboxed process), within ``reward_timeout_s``.
What the sandbox guarantees on which machine: ``docs/code_rewards.md``.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field

from rlite.api import (
    SANDBOX_KINDS,
    ConfigError,
    RewardOutcome,
    SandboxLimits,
    hookimpl,
    probe_isolation,
    run_untrusted,
)

END_TEXTS = ["<|im_end|>", "<|endoftext|>"]
EXTRACTS = ("fence_or_whole", "fence", "whole")
SCORES = ("fraction", "all")
FENCE_RE = re.compile(r"```(?:python3?|py)?[ \t]*\r?\n(.*?)```", re.DOTALL | re.IGNORECASE)


@dataclass
class CodeExecConfig:
    """Options of ``code_exec``: run the completion's program against the row's tests in a sandbox."""

    weight: float = 1.0
    """Weight of this function in the summed reward."""
    extract: str = "fence_or_whole"
    """Where the code is: ``fence`` (the last ```python fenced block; none scores 0), ``whole`` (the whole
    completion) or ``fence_or_whole`` (the last fenced block, else the whole completion)."""
    template: str = "{code}"
    """The program run, with ``{code}`` replaced by the extracted code: ``print({code})`` evaluates an
    expression."""
    tests_key: str = "tests"
    """The data row's column holding the test cases (module docstring)."""
    score: str = "fraction"
    """``fraction``: the fraction of test cases passed; ``all``: 1 when every case passes, else 0."""
    interpreter: str = ""
    """The Python that runs the program (empty: this Python's base interpreter when an unprivileged uid
    may run it, else /usr/bin/python3)."""
    timeout_s: float = 5.0
    """Wall-clock limit of one run, seconds."""
    cpu_s: int = 5
    """CPU-time limit of one run (RLIMIT_CPU), seconds."""
    memory_mb: int = 512
    """Address-space limit per process (RLIMIT_AS), MiB."""
    nproc: int = 16
    """Processes and threads one run may have (RLIMIT_NPROC)."""
    disk_mb: int = 16
    """Size of the run's private tmpfs (working directory and /tmp) and largest file, MiB."""
    output_bytes: int = 65536
    """stdout + stderr one run may write before it is killed."""
    hidden_paths: list[str] = field(default_factory=list)
    """Folders made unreadable to the program besides the trainer's working folder (the run folder,
    data and checkpoints when they live elsewhere)."""
    allow_unisolated: bool = False
    """Run even where namespaces are unavailable (resource limits only, loud warning); False refuses."""
    end_texts: list[str] = field(default_factory=lambda: list(END_TEXTS))
    """The completion is cut at the first of these texts before the code is extracted."""

    def __post_init__(self) -> None:
        if self.extract not in EXTRACTS:
            raise ConfigError(f"extract: invalid value {self.extract!r}. Valid choices: {', '.join(EXTRACTS)}.")
        if self.score not in SCORES:
            raise ConfigError(f"score: invalid value {self.score!r}. Valid choices: {', '.join(SCORES)}.")
        if "{code}" not in self.template:
            raise ConfigError(f"template: must contain {{code}}, got {self.template!r}")
        try:
            self.limits()
        except ValueError as exc:
            raise ConfigError(str(exc).replace("sandbox limits: ", "")) from None
        isolation = probe_isolation()
        if not isolation.namespaces and not self.allow_unisolated:
            raise ConfigError(
                f"the code_exec reward cannot isolate programs on this machine ({isolation.reason}); run as root or "
                "with user namespaces, or set allow_unisolated: true to run them with resource limits only "
                "(docs/code_rewards.md)")

    def limits(self) -> SandboxLimits:
        return SandboxLimits(timeout_s=self.timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb, nproc=self.nproc,
                             disk_mb=self.disk_mb, output_bytes=self.output_bytes, hidden_paths=tuple(self.hidden_paths),
                             allow_unisolated=self.allow_unisolated)


def extract_code(completion: str, extract: str, end_texts: list[str] | tuple[str, ...] = ()) -> str | None:
    """The code of ``completion`` as ``extract`` says (:class:`CodeExecConfig`), or None when there is none."""
    for end in end_texts:
        completion = completion.split(end, 1)[0]
    if extract != "whole":
        blocks = FENCE_RE.findall(completion)
        if blocks:
            return blocks[-1]
        if extract == "fence":
            return None
    return completion if completion.strip() else None


def read_test_cases(sample: dict, key: str) -> list[dict[str, str]]:
    """The row's test cases, each ``{"stdin", "stdout"}`` or ``{"assert"}``; raises ValueError naming
    ``key`` for anything else."""
    if key not in sample:
        raise ValueError(f"tests_key: the data row has no column {key!r} (columns: {', '.join(sorted(sample))})")
    cases = sample[key]
    if isinstance(cases, (str, dict)):
        cases = [cases]
    if not isinstance(cases, (list, tuple)) or not cases:
        raise ValueError(f"{key}: expected a non-empty list of test cases, got {type(cases).__name__} {cases!r:.100}")
    out = []
    for index, case in enumerate(cases):
        if isinstance(case, str):
            case = {"assert": case}
        if not isinstance(case, dict):
            raise ValueError(f"{key}[{index}]: a test case is a dict or a string, got {type(case).__name__}")
        if "assert" in case and isinstance(case["assert"], str) and set(case) <= {"assert"}:
            out.append({"assert": case["assert"]})
        elif "stdout" in case and set(case) <= {"stdin", "stdout"}:
            out.append({"stdin": str(case.get("stdin", "")), "stdout": str(case["stdout"])})
        else:
            raise ValueError(f"{key}[{index}]: a test case is {{'stdin': ..., 'stdout': ...}} or {{'assert': ...}}, "
                             f"got keys {sorted(case)}")
    return out


def _normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def run_case(program: str, case: dict[str, str], limits: SandboxLimits, interpreter: str | None) -> tuple[bool, str]:
    """Run ``program`` on one test case: (passed, the run's failure kind)."""
    if "assert" in case:
        token = secrets.token_hex(16)
        result = run_untrusted(f"{program}\n\n{case['assert']}\nprint({token!r})\n", "", None, limits, interpreter)
        lines = result.stdout.rstrip().splitlines()
        return result.ok and bool(lines) and lines[-1] == token, result.kind
    result = run_untrusted(program, case["stdin"], None, limits, interpreter)
    return result.ok and _normalized(result.stdout) == _normalized(case["stdout"]), result.kind


def code_exec(completion: str, sample: dict, cfg: CodeExecConfig) -> RewardOutcome:
    """The fraction of the row's test cases the completion's program passes (or all-pass), with a count
    of how its runs ended."""
    counts: dict[str, float] = {kind: 0.0 for kind in SANDBOX_KINDS}
    counts.update(runs=0.0, no_code=0.0)
    cases = read_test_cases(sample, cfg.tests_key)
    code = extract_code(completion, cfg.extract, cfg.end_texts)
    if code is None:
        counts["no_code"] = 1.0
        return RewardOutcome(0.0, counts)
    program = cfg.template.replace("{code}", code)
    limits, passed = cfg.limits(), 0
    for case in cases:
        ok, kind = run_case(program, case, limits, cfg.interpreter or None)
        passed += ok
        counts[kind] += 1
        counts["runs"] += 1
        if not ok and cfg.score == "all":
            break  # the rest cannot change the score
    if cfg.score == "all":
        return RewardOutcome(float(passed == len(cases)), counts)
    return RewardOutcome(passed / len(cases), counts)


def check_code_exec(cfg: CodeExecConfig, sample: dict) -> None:
    """Before training: the first data row holds test cases the reward can read."""
    try:
        read_test_cases(sample, cfg.tests_key)
    except ValueError as exc:
        raise ConfigError(f"args.{exc}") from None


@hookimpl
def register_reward_functions(register) -> None:
    # each call waits on sandboxed processes: threads suffice, and a thread past the deadline is only
    # waiting on a sandbox that its own wall-clock limit kills
    register("code_exec", code_exec, CodeExecConfig, isolation="thread", check=check_code_exec)
