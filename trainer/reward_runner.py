"""Scoring completions with the configured reward functions, isolated from their failures and hangs.

A sample's reward is the weighted sum over the configured functions::

    reward_i = sum_j weight_j * r_j(completion_i, sample_i)

**Where a function runs** is declared when it is registered (``register(name, fn, cfg_cls,
isolation=...)``):

* ``"inline"``: called directly in the trainer's thread, with no deadline. For functions that cannot
  hang: the built-in ``exact_match``, ``numeric`` and ``overlong_penalty`` (a regular expression or a
  comparison, linear in the completion) and ``reward_model`` (a forward pass of a fixed model).
* ``"process"``: in the runner's pool of worker processes (``workers`` per function, started once and
  reused; calls are sent in chunks and answered one by one). A call still running at the deadline
  has its worker killed and replaced; a worker that dies fails the call it was running and the rest
  of its chunk goes to its replacement. The ``python``
  reward (a user's function) and ``math_verify`` (sympy can take unbounded time) run here. The
  function and its config must be picklable (module-level), and the pool is forked from a
  ``multiprocessing`` fork server into which the functions' modules are imported once.
* ``"thread"`` (the default for plugins): in the runner's pool of worker threads, reused from batch
  to batch. Python cannot kill a thread: a call past the deadline is abandoned (it keeps running as a
  daemon thread, its result ignored) and a new thread takes its place.

**Deadline.** The calls of one batch (one step's rollouts, one evaluation pass) share one deadline,
``timeout_s`` after the batch starts, and run concurrently on the workers: a batch never takes much
longer than ``timeout_s``, however many of its calls hang. Calls unfinished at the deadline, and calls
not started by then, count as timeouts.

**Failures.** A call that raises, returns something that is not a finite real number (NaN, inf, a
string, None), or whose worker process dies counts as a failure. Failed and timed-out calls score 0
for that function and are counted (``reward/failures``, ``reward/timeouts``) and logged
(rate-limited). They are bounded by :class:`FailureLimits`: when one batch's calls of a function all
fail or time out, or when a function's failures (or timeouts) over the run pass their allowed
fraction of its calls, :meth:`RewardRunner.score` reports the problem, with the first failure's
traceback, in :attr:`RewardScores.error`, and the training loop stops with it.

**Counts.** A function may return a :class:`RewardOutcome` instead of a float: its ``value`` is the
reward and its ``counts`` (e.g. ``{"timeout": 1}``) are summed over the batch into the stats as
``reward/<name>/n_<count>`` (``code_exec`` reports how its runs ended this way).

**Batched functions** (``batched=True`` at registration) are called once per batch as
``fn(completions, samples, cfg) -> list[float]``; each returned value is checked like a single call's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import pickle
import queue
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlite.config import Choice, ConfigError

if TYPE_CHECKING:
    from rlite.rollout import EnvResults

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Any]
MAX_CHUNK = 16
"""Most calls sent to a worker process in one message."""
START_TIMEOUT_S = 600.0
"""How long the worker processes may take to start (the fork server imports the functions' modules)."""
ISOLATIONS = ("inline", "thread", "process")


@dataclasses.dataclass
class RewardEntry:
    """One configured reward function."""

    name: str
    """Its name in the stats (``reward/<name>``); distinct within a runner."""
    fn: RewardFn
    """``fn(completion, sample, cfg) -> float``, or with ``batched``, ``fn(completions, samples, cfg) -> list[float]``."""
    cfg: Any = None
    """The function's config instance, passed as ``cfg``."""
    weight: float = 1.0
    """Its weight in the summed reward."""
    isolation: str = "thread"
    """Where its calls run: ``inline``, ``thread`` or ``process`` (module docstring)."""
    batched: bool = False
    """Called once per batch with every completion and sample."""

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"reward function {self.name!r}: isolation must be one of {ISOLATIONS}, got {self.isolation!r}")


@dataclasses.dataclass(frozen=True)
class FailureLimits:
    """How many failed and timed-out calls a run tolerates, per reward function."""

    max_failure_fraction: float = 0.01
    """A function's failures over the run may be at most this fraction of its calls (1 = no limit)."""
    max_timeout_fraction: float = 0.01
    """A function's timeouts over the run may be at most this fraction of its calls (1 = no limit)."""

    def __post_init__(self) -> None:
        for name in ("max_failure_fraction", "max_timeout_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")


@dataclasses.dataclass
class RewardScores:
    """What :meth:`RewardRunner.score` returns."""

    scores: list[float]
    """Each completion's weighted reward (a failed or timed-out call adds 0)."""
    stats: dict[str, float]
    """``reward/failures`` and ``reward/timeouts`` (counts), ``reward/<name>`` (each function's mean
    unweighted value, failed calls counting 0)."""
    error: str | None = None
    """Set when a :class:`FailureLimits` bound was passed: what happened, the first failure's
    traceback and what to change. The caller stops the run with it."""
    components: list[list[float]] = dataclasses.field(default_factory=list)
    """Each function's unweighted value per completion: one row per completion, one column per
    function (``RewardRunner.names``), failed and timed-out calls 0."""


@dataclasses.dataclass(frozen=True)
class RewardOutcome:
    """A reward value with counts to report: what a reward function may return instead of a float."""

    value: float
    """The reward."""
    counts: dict[str, float] = dataclasses.field(default_factory=dict)
    """Summed over the batch into ``reward/<name>/n_<key>`` (module docstring)."""


COUNT_STATS = ("reward/failures", "reward/timeouts")
_COUNT_STAT = re.compile(r"reward/[^/]+/n_[\w.-]+")


def is_count_stat(key: str) -> bool:
    """Whether the reward stat ``key`` is a count (summed over ranks and rounds) rather than a mean."""
    return key in COUNT_STATS or _COUNT_STAT.fullmatch(key) is not None


class RewardFailureError(RuntimeError):
    """Reward functions failed or timed out more often than the run allows (``RewardScores.error``)."""


@dataclasses.dataclass
class _Failure:
    """A failed call: a one-line summary and the formatted traceback (or the reason)."""

    summary: str
    detail: str


_TIMED_OUT = object()


class _RateLimitedWarnings:
    """Log at most one warning per (function, kind) every ``interval_s``, with a count of the rest."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def warn(self, name: str, kind: str, message: str) -> None:
        key = (name, kind)
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        suppressed = self._suppressed.pop(key, 0)
        self._last[key] = now
        extra = f" ({suppressed} similar messages suppressed)" if suppressed else ""
        logger.warning("reward function %r %s: %s%s", name, kind, message, extra)


def _check_value(value: Any) -> float | RewardOutcome:
    if isinstance(value, RewardOutcome):
        return dataclasses.replace(value, value=_check_value(value.value))
    if isinstance(value, numbers.Real):
        value = float(value)
        if math.isfinite(value):
            return value
        raise ValueError(f"returned a non-finite value {value}")
    raise TypeError(f"returned {type(value).__name__} {value!r:.100}, not a number")


def _failure_from(exc: BaseException) -> _Failure:
    # drop the runner's own frame: the traceback starts in the reward function
    tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
    detail = "".join(traceback.format_exception(type(exc), exc, tb))
    return _Failure(f"{type(exc).__name__}: {exc}", detail)


def _call(entry: RewardEntry, completions: Sequence[str], samples: Sequence[dict]) -> list[Any]:
    """One call of ``entry``: a value (float) or a :class:`_Failure` per completion."""
    try:
        if not entry.batched:
            result = entry.fn(completions[0], samples[0], entry.cfg)
        else:
            result = entry.fn(list(completions), list(samples), entry.cfg)
    except BaseException as exc:  # a reward function must never take training down
        return [_failure_from(exc)] * len(completions)
    if not entry.batched:
        result = [result]
    elif not isinstance(result, Sequence) or isinstance(result, (str, bytes)) or len(result) != len(completions):
        got = f"{len(result)} values" if isinstance(result, Sequence) else f"a {type(result).__name__}"
        failure = _Failure(f"returned {got} for {len(completions)} completions",
                           "a batched reward returns one value per completion\n" + returned_where(entry))
        return [failure] * len(completions)
    out: list[Any] = []
    for value in result:
        try:
            out.append(_check_value(value))
        except (TypeError, ValueError) as exc:  # the value is the function's: show its return, not this frame
            out.append(_Failure(str(exc), f"{returned_where(entry)}{type(exc).__name__}: {exc}"))
    return out


def returned_where(entry: RewardEntry) -> str:
    """Where ``entry``'s function returns, as a traceback shows a line: ``File "f.py", line 7, in fn`` and the
    source line, for each ``return`` of the function (the value that came back was made on one of them).
    The function is the user's one behind a wrapper that names it (``fn.reward_source(cfg)``: the
    ``python`` reward's file or module function), else ``entry.fn``; empty when its source is not readable."""
    import ast
    import inspect
    import textwrap

    fn = entry.fn
    try:
        source_of = getattr(fn, "reward_source", None)
        fn = inspect.unwrap(source_of(entry.cfg) if source_of is not None else fn)
        lines, first = inspect.getsourcelines(fn)
        file = inspect.getsourcefile(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except Exception:  # noqa: BLE001 - a builtin, a lambda in a REPL, a file changed since: no line to show
        return ""
    returns = [node for node in _own_nodes(tree.body[0]) if isinstance(node, ast.Return)]
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", "?"))
    if not returns:  # it falls off its end: None
        return f'  File "{file}", line {first}, in {name}\n    {lines[0].strip()}\n  (it has no return statement)\n'
    shown = [f'  File "{file}", line {first + node.lineno - 1}, in {name}\n    {lines[node.lineno - 1].strip()}\n'
             for node in returns]
    return "".join(shown)


def _own_nodes(function) -> list:
    """The nodes of ``function``'s body, not those of functions or lambdas defined inside it."""
    import ast

    found, todo = [], list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda node: getattr(node, "lineno", 0))


# --------------------------------------------------------------------------------------------------
# worker pools
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Call:
    """One unit of work: ``entry`` on the completions ``items`` (one, or all for a batched function)."""

    entry: int
    items: list[int]
    outcome: Any = None  # list of values/_Failure per item, or _TIMED_OUT; None while pending


class _ThreadPool:
    """Worker threads reused across batches; a thread whose call passed the deadline is abandoned
    (its eventual result dropped) and replaced."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._workers: set[threading.Thread] = set()
        self._current: dict[threading.Thread, tuple[int, int]] = {}  # thread -> (batch, call) it runs
        self._abandoned: set[threading.Thread] = set()
        self._batch = 0
        self._created = 0

    @property
    def abandoned_alive(self) -> int:
        """Abandoned threads whose call is still running."""
        self._abandoned = {t for t in self._abandoned if t.is_alive()}
        return len(self._abandoned)

    def _ensure_workers(self) -> None:
        with self._lock:
            while len(self._workers) < self.size:
                self._created += 1
                thread = threading.Thread(target=self._work, daemon=True, name=f"rlite-reward-{self._created}")
                self._workers.add(thread)
                thread.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            batch, index, fn, results = job
            with self._lock:
                if batch != self._batch or me not in self._workers:
                    continue  # a job of a batch that is over: skip it
                self._current[me] = (batch, index)
            outcome = fn()
            with self._lock:
                self._current.pop(me, None)
                if me not in self._workers:
                    return  # abandoned at the deadline: its result is dropped and it leaves
            results.put((index, outcome))

    def submit(self, calls: list[_Call], make: Callable[[_Call], Callable[[], list[Any]]]) -> tuple[int, queue.Queue]:
        """Queue ``calls`` (a new batch); :meth:`wait` collects them."""
        results: queue.Queue = queue.Queue()
        if not calls:
            return 0, results
        self._ensure_workers()
        with self._lock:
            self._batch += 1
            batch = self._batch
        for index, call in enumerate(calls):
            self._jobs.put((batch, index, make(call), results))
        return batch, results

    def wait(self, calls: list[_Call], handle: tuple[int, queue.Queue], deadline: float) -> None:
        """Collect the outcomes of a submitted batch until ``deadline``; abandon what still runs then."""
        if not calls:
            return
        batch, results = handle
        pending = len(calls)
        while pending:
            try:
                index, outcome = results.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            calls[index].outcome = outcome
            pending -= 1
        with self._lock:
            self._batch += 1  # queued jobs of this batch are skipped from now on
            for thread, (job_batch, _) in list(self._current.items()):
                if job_batch == batch:
                    self._workers.discard(thread)
                    self._abandoned.add(thread)
                    del self._current[thread]
        while not results.empty():  # answers that raced the deadline
            index, outcome = results.get_nowait()
            calls[index].outcome = outcome
        for call in calls:
            if call.outcome is None:
                call.outcome = _TIMED_OUT
        self._ensure_workers()

    def close(self) -> None:
        with self._lock:
            workers, self._workers = list(self._workers), set()
        for _ in workers:
            self._jobs.put(None)


def _worker_main(conn, pickled_entries: bytes, sys_path: list[str], cwd: str) -> None:
    """A reward worker process: answer each ``(call_id, entry, completions, samples)`` of the chunks it
    receives, one message per call as soon as it is done, until told to stop.

    The entries arrive pickled, to be loaded once the trainer's ``sys.path`` and working folder are
    in place (the fork server keeps those of the moment it started)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops us
    sys.path[:] = sys_path
    os.chdir(cwd)
    entries: dict[int, RewardEntry] = pickle.loads(pickled_entries)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        for call_id, j, completions, samples in message:  # a chunk of calls; each answered when done
            outcome = _call(entries[j], completions, samples)
            try:
                conn.send((call_id, outcome))
            except Exception as exc:  # noqa: BLE001 - e.g. an exception that does not pickle
                conn.send((call_id, [_Failure(f"result could not be sent back: {exc}", repr(exc))] * len(completions)))


class _Worker:
    def __init__(self, context, entries: dict[int, RewardEntry], entry: int) -> None:
        self.entry = entry
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_worker_main, args=(child, pickle.dumps({entry: entries[entry]}), list(sys.path), os.getcwd()), daemon=True,
            name=f"rlite-reward-{entries[entry].name}",
        )
        self.process.start()
        child.close()
        self.calls: list[int] = []
        """The calls sent and not answered yet, in the order the worker runs them."""

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)
        self.conn.close()


class _ProcessPool:
    """Worker processes reused across batches, ``size`` per function (so that one function's hung
    calls never hold another's workers); a worker whose call passes the deadline, or that dies, is
    killed and replaced by a fresh one."""

    def __init__(self, entries: dict[int, RewardEntry], size: int) -> None:
        self.entries = entries
        self.size = size
        self.replaced = 0
        """Workers killed (at a deadline) or found dead, and replaced, since the pool started."""
        self._workers: dict[int, list[_Worker]] = {j: [] for j in entries}
        modules = sorted({entry.fn.__module__ for entry in entries.values()} - {"__main__"} | {__name__})
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(modules)  # imported once, in the fork server

    def start(self) -> None:
        for j, workers in self._workers.items():
            while len(workers) < self.size:
                workers.append(_Worker(self._context, self.entries, j))

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for workers in self._workers.values() for w in workers]

    def run(self, calls: list[_Call], payload: Callable[[_Call], tuple], deadline: float) -> None:
        """Run ``calls`` until they are done or ``deadline``. Calls go to a function's idle workers in
        chunks (fewer round trips for quick functions; smaller as the queue drains, so that the
        workers finish together); a worker answers each call as it finishes it."""
        if not calls:
            return
        self.start()
        waiting = {j: [k for k in reversed(range(len(calls))) if calls[k].entry == j] for j in self._workers}
        idle = {j: list(workers) for j, workers in self._workers.items()}
        busy: dict[Any, _Worker] = {}
        while any(waiting.values()) or busy:
            for j in waiting:
                while waiting[j] and idle[j]:
                    chunk = min(MAX_CHUNK, max(1, len(waiting[j]) // (2 * self.size)))
                    self._dispatch(idle[j].pop(), [waiting[j].pop() for _ in range(chunk)], calls, payload,
                                   idle, busy, waiting[j])
            if not busy:
                continue
            ready = multiprocessing.connection.wait(list(busy), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for handle in ready:
                worker = busy.get(handle)
                if worker is None:
                    continue
                try:
                    while worker.calls and worker.conn.poll():
                        k, outcome = worker.conn.recv()
                        calls[k].outcome = outcome
                        worker.calls.remove(k)
                    if worker.calls and worker.process.is_alive():
                        continue  # still working on its chunk
                    if worker.calls:
                        raise EOFError
                except (EOFError, OSError):
                    worker.process.join(timeout=5)
                    code = worker.process.exitcode
                    k = worker.calls.pop(0)  # the call it died on; the rest of its chunk goes back
                    calls[k].outcome = [_Failure(f"the worker process died (exit code {code})", "")] * len(calls[k].items)
                    waiting[worker.entry].extend(reversed(worker.calls))
                    worker.calls = []
                    del busy[worker.conn], busy[worker.process.sentinel]
                    idle[worker.entry].append(self._replace(worker))
                    continue
                del busy[worker.conn], busy[worker.process.sentinel]
                idle[worker.entry].append(worker)
        for worker in {id(w): w for w in busy.values()}.values():  # still running at the deadline
            for k in worker.calls:
                calls[k].outcome = _TIMED_OUT
            worker.calls = []
            self._replace(worker)
        for call in calls:
            if call.outcome is None:
                call.outcome = _TIMED_OUT

    def _dispatch(self, worker: _Worker, ks: list[int], calls: list[_Call], payload, idle, busy, waiting) -> None:
        try:
            worker.conn.send([(k, *payload(calls[k])) for k in ks])
        except (OSError, ValueError) as exc:  # the worker died between batches: a fresh one takes the rest
            calls[ks[0]].outcome = [_Failure(f"the worker process died: {exc}", repr(exc))] * len(calls[ks[0]].items)
            waiting.extend(reversed(ks[1:]))
            idle[worker.entry].append(self._replace(worker))
            return
        except Exception as exc:  # noqa: BLE001 - a sample does not pickle
            for k in ks:
                calls[k].outcome = [_Failure(f"the sample could not be sent to a worker: {exc}", repr(exc))] * len(calls[k].items)
            idle[worker.entry].append(worker)
            return
        worker.calls = list(ks)
        busy[worker.conn] = busy[worker.process.sentinel] = worker

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        workers = self._workers[worker.entry]
        workers.remove(worker)
        workers.append(_Worker(self._context, self.entries, worker.entry))
        self.replaced += 1
        return workers[-1]

    def close(self) -> None:
        for workers in self._workers.values():
            for worker in workers:
                worker.stop()
            workers.clear()


# --------------------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------------------


class RewardRunner:
    """Runs the reward functions over a batch of completions; see the module docstring.

    :param entries: the functions; names must be distinct (they key the stats).
    :param timeout_s: the deadline of a batch's calls, from the batch's start.
    :param workers: worker threads and worker processes (each pool this many).
    :param limits: how many failures and timeouts the run tolerates.
    """

    def __init__(self, entries: Sequence[RewardEntry], timeout_s: float = 60.0, workers: int = 4,
                 limits: FailureLimits | None = None) -> None:
        if not entries:
            raise ValueError("rewards: list at least one reward function")
        names = [entry.name for entry in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"reward function names must be distinct, got {names}")
        if timeout_s <= 0 or workers < 1:
            raise ValueError(f"need timeout_s > 0 and workers >= 1, got {timeout_s} and {workers}")
        self.entries = list(entries)
        self.timeout_s = timeout_s
        self.workers = workers
        self.limits = limits if limits is not None else FailureLimits()
        self._warnings = _RateLimitedWarnings()
        self.threads = _ThreadPool(workers)
        in_processes = {j: e for j, e in enumerate(self.entries) if e.isolation == "process"}
        self.processes = _ProcessPool(in_processes, workers) if in_processes else None
        self._starting: threading.Thread | None = None
        self.calls = {e.name: 0 for e in self.entries}
        """Per function: calls (one per completion scored) over the run so far."""
        self.failures = {e.name: 0 for e in self.entries}
        """Per function: failed calls over the run so far."""
        self.timeouts = {e.name: 0 for e in self.entries}
        """Per function: timed-out calls over the run so far."""

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self.entries]

    @property
    def weights(self) -> list[float]:
        return [entry.weight for entry in self.entries]

    def start(self) -> None:
        """Start the worker processes in the background now rather than at the first batch (the fork
        server imports the functions' modules once, which takes seconds when they import torch)."""
        if self.processes is not None and self._starting is None:
            self._starting = threading.Thread(target=self.processes.start, daemon=True, name="rlite-reward-start")
            self._starting.start()

    def _started(self) -> None:
        if self._starting is not None:
            self._starting.join(START_TIMEOUT_S)
            if self._starting.is_alive():
                raise RuntimeError(f"the reward worker processes did not start within {START_TIMEOUT_S:g}s")
            self._starting = None

    def close(self) -> None:
        """Stop the worker threads and processes (idempotent)."""
        self._started()
        self.threads.close()
        if self.processes is not None:
            self.processes.close()

    def score(self, completions: Sequence[str], samples: Sequence[dict]) -> RewardScores:
        """Score a batch: each completion's weighted reward, the batch's stats, and an error when a
        failure bound was passed (module docstring)."""
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
        n = len(completions)
        calls: list[_Call] = []
        for j, entry in enumerate(self.entries):
            if n and entry.batched:
                calls.append(_Call(j, list(range(n))))
            else:
                calls.extend(_Call(j, [i]) for i in range(n))
        if self.processes is not None:  # the workers' start is not the functions' time
            self.start()
            self._started()
        deadline = time.monotonic() + self.timeout_s

        def payload(call: _Call) -> tuple:
            return call.entry, [completions[i] for i in call.items], [samples[i] for i in call.items]

        def make(call: _Call) -> Callable[[], list[Any]]:
            return lambda: _call(self.entries[call.entry], *payload(call)[1:])

        by_isolation = {kind: [c for c in calls if self.entries[c.entry].isolation == kind] for kind in ISOLATIONS}
        handle = self.threads.submit(by_isolation["thread"], make)
        for call in by_isolation["inline"]:  # while the threads work
            call.outcome = make(call)()
        if self.processes is not None:
            self.processes.run(by_isolation["process"], payload, deadline)
        self.threads.wait(by_isolation["thread"], handle, deadline)
        return self._collect(calls, n)

    def _collect(self, calls: list[_Call], n: int) -> RewardScores:
        values = [[0.0] * len(self.entries) for _ in range(n)]
        failures = [0] * len(self.entries)
        timeouts = [0] * len(self.entries)
        first: list[tuple[int, _Failure] | None] = [None] * len(self.entries)
        counts: dict[str, float] = {}
        for call in calls:
            j, name = call.entry, self.entries[call.entry].name
            if call.outcome is _TIMED_OUT:
                timeouts[j] += len(call.items)
                self._warnings.warn(name, "timed out", f"unfinished {self.timeout_s:g}s after the batch started; scored 0")
                continue
            for i, outcome in zip(call.items, call.outcome):
                if isinstance(outcome, _Failure):
                    failures[j] += 1
                    if first[j] is None:
                        first[j] = (i, outcome)
                    self._warnings.warn(name, "failed", f"{outcome.summary}; scored 0")
                elif isinstance(outcome, RewardOutcome):
                    values[i][j] = outcome.value
                    for key, count in outcome.counts.items():
                        stat = f"reward/{name}/n_{key}"
                        counts[stat] = counts.get(stat, 0.0) + float(count)
                else:
                    values[i][j] = outcome
        totals = [sum(entry.weight * v for entry, v in zip(self.entries, row)) for row in values]
        stats = {"reward/failures": float(sum(failures)), "reward/timeouts": float(sum(timeouts))}
        for j, entry in enumerate(self.entries):
            stats[f"reward/{entry.name}"] = sum(row[j] for row in values) / n if n else 0.0
        stats.update(counts)
        errors = []
        for j, entry in enumerate(self.entries):
            self.calls[entry.name] += n
            self.failures[entry.name] += failures[j]
            self.timeouts[entry.name] += timeouts[j]
            problem = self._over_limit(entry.name, n, failures[j], timeouts[j], first[j])
            if problem:
                errors.append(problem)
        return RewardScores(totals, stats, "\n\n".join(errors) if errors else None, values)

    def _over_limit(self, name: str, n: int, failed: int, timed_out: int, first: tuple[int, _Failure] | None) -> str | None:
        """What to tell the user when ``name``'s failures or timeouts pass their bound, else None."""
        limits = self.limits
        calls, run_failed, run_timed_out = self.calls[name], self.failures[name], self.timeouts[name]
        whole_batch = n > 0 and failed + timed_out == n
        too_many_failures = limits.max_failure_fraction < 1 and (
            run_failed > limits.max_failure_fraction * calls or (whole_batch and failed > 0))
        too_many_timeouts = limits.max_timeout_fraction < 1 and (
            run_timed_out > limits.max_timeout_fraction * calls or (whole_batch and timed_out > 0))
        parts = []
        if too_many_failures:
            parts.append(
                f"reward function {name!r} failed on {failed} of {n} calls in this batch ({run_failed} of {calls} in the "
                f"run; reward_max_failure_fraction={limits.max_failure_fraction:g}). Failed calls score 0; raise "
                "reward_max_failure_fraction to tolerate them."
            )
            if first is not None:
                index, failure = first
                parts.append(f"First failure (completion {index} of the batch): {failure.summary}\n{failure.detail}".rstrip())
        if too_many_timeouts:
            parts.append(
                f"reward function {name!r} timed out on {timed_out} of {n} calls in this batch ({run_timed_out} of {calls} "
                f"in the run; reward_max_timeout_fraction={limits.max_timeout_fraction:g}): they had not finished "
                f"{self.timeout_s:g}s after the batch started, with reward_workers={self.workers}. Make the function "
                "faster, or raise reward_timeout_s or reward_workers, or reward_max_timeout_fraction to tolerate them."
            )
        return "\n".join(parts) if parts else None


def reward_samples(rows: Sequence[dict], response_lengths: Sequence[int], finish_reasons: Sequence[str],
                   env: EnvResults | None = None) -> list[dict[str, Any]]:
    """What the reward functions receive as ``sample``: a copy of each data row (``rows``: as loaded, never
    changed) with what the rollout adds: ``response_length`` (sampled tokens), ``finish_reason`` and, for
    a multi-turn rollout (``env``), ``env_reward`` (the environment's rewards, summed), ``turns`` and
    ``env_metrics`` (the environment's ``metrics()``). Built for the call: the batch keeps these as typed
    fields, and a reward function that changes its ``sample`` changes nothing else."""
    added: list[dict[str, Any]] = [{} for _ in rows]
    if env is not None:
        added = [{"env_reward": reward, "turns": turns, "env_metrics": metrics}
                 for reward, turns, metrics in zip(env.rewards.tolist(), env.turns.tolist(), env.metrics, strict=True)]
    return [dict(row, **extra, response_length=int(length), finish_reason=reason)
            for row, extra, length, reason in zip(rows, added, response_lengths, finish_reasons, strict=True)]  # fmt: skip


def _make_config(name: str, config_cls: type | None, args: dict[str, Any], key: str) -> Any:
    if config_cls is None:
        if args:
            raise ValueError(f"{key}.args: reward function {name!r} takes no options, got {sorted(args)}")
        return None
    valid = [f.name for f in dataclasses.fields(config_cls)]
    unknown = sorted(set(args) - set(valid))
    if unknown:
        raise ValueError(
            f"{key}.args: reward function {name!r} has no option(s) {', '.join(unknown)}. "
            f"Valid options: {', '.join(valid)}."
        )
    try:
        merged = OmegaConf.merge(OmegaConf.structured(config_cls), dict(args))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        raise ValueError(f"{key}.args: {str(cause).splitlines()[0]}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{key}.args: {exc}") from None


def _metadata(value: Any, cfg: Any) -> Any:
    """A registration's metadata value, which may depend on the config instance (a callable of it)."""
    return value(cfg) if callable(value) else value


def build_reward_runner(
    choices: Sequence[Choice], registry, timeout_s: float = 60.0, workers: int = 4,
    limits: FailureLimits | None = None, example_sample: dict | None = None,
) -> RewardRunner:
    """Build a :class:`RewardRunner` from ``rewards`` choices and the ``reward_function`` registry.

    Each choice's ``args`` become an instance of the config class its function registered; the
    weight is that instance's ``weight`` (1.0 when it has none). A function listed twice gets
    ``name``, ``name_2``, ... as stat names. A registration's metadata say where its calls run
    (``isolation``, default ``thread``) and whether it is ``batched`` (each may be a callable of the
    config instance), and may give a ``check(cfg, sample)`` that is called here with
    ``example_sample`` (a data row as the functions will see it) and raises
    :class:`~rlite.config.ConfigError` when the function cannot be called on it.
    """
    entries: list[RewardEntry] = []
    seen: dict[str, int] = {}
    for index, choice in enumerate(choices):
        registered = registry.get(choice.name)
        key = f"rewards[{index}]"
        cfg = _make_config(choice.name, registered.config_cls, choice.args, key)
        weight = float(getattr(cfg, "weight", 1.0)) if cfg is not None else 1.0
        seen[choice.name] = seen.get(choice.name, 0) + 1
        label = choice.name if seen[choice.name] == 1 else f"{choice.name}_{seen[choice.name]}"
        meta = registered.metadata
        isolation = _metadata(meta.get("isolation", "thread"), cfg)
        if isolation not in ISOLATIONS:
            raise ValueError(f"{key}: reward function {choice.name!r} was registered with isolation={isolation!r}; "
                             f"valid: {', '.join(ISOLATIONS)}")
        entry = RewardEntry(label, registered.implementation, cfg, weight, isolation, bool(_metadata(meta.get("batched", False), cfg)))
        if isolation == "process":
            try:
                pickle.dumps((entry.fn, entry.cfg))
            except Exception as exc:  # noqa: BLE001 - any pickling problem
                raise ConfigError(
                    f"{key}: reward function {choice.name!r} runs in worker processes (isolation='process'), so its "
                    f"function and config must be picklable (defined at module level): {exc}"
                ) from None
        check = meta.get("check")
        if check is not None and example_sample is not None:
            try:
                check(cfg, example_sample)
            except ConfigError as exc:
                raise ConfigError(f"{key}: {exc}") from None
        entries.append(entry)
    return RewardRunner(entries, timeout_s=timeout_s, workers=workers, limits=limits)
