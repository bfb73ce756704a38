"""Scoring completions with the configured reward functions, isolated from their failures.

A sample's reward is the weighted sum over the configured functions::

    reward_i = sum_j weight_j * r_j(completion_i, sample_i)

Each call ``r_j(completion, sample, cfg)`` runs in a worker thread with its own deadline of
``timeout_s`` seconds from the moment it starts. A call that raises, returns something that is not a
finite real number, or runs past its deadline counts as 0 for that function, is counted in the
stats and logged (rate-limited); it never crashes or stalls training. A call past its deadline is
abandoned: Python cannot kill a thread, so it keeps running in the background as a daemon thread
(it cannot block interpreter exit, which is why this does not use ``concurrent.futures``, whose
workers are joined at exit) and its slot goes to the next call.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlite.config import Choice

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, dict, Any], float]
RewardEntry = tuple[str, RewardFn, Any, float]
"""``(name, fn, cfg, weight)``: ``fn(completion, sample, cfg)`` is called with ``cfg``."""

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


def _check_value(value: Any) -> float:
    if isinstance(value, numbers.Real):
        value = float(value)
        if math.isfinite(value):
            return value
        raise ValueError(f"returned a non-finite value {value}")
    raise TypeError(f"returned {type(value).__name__} {value!r:.100}, not a number")


class RewardRunner:
    """Runs the reward functions over a batch of completions; see the module docstring.

    :param entries: ``(name, fn, cfg, weight)`` per function; names must be distinct (they key the
        stats).
    :param timeout_s: deadline of one call, from when it starts.
    :param max_workers: calls running at once (abandoned calls do not count).
    """

    def __init__(self, entries: Sequence[RewardEntry], timeout_s: float = 10.0, max_workers: int = 4) -> None:
        if not entries:
            raise ValueError("rewards: list at least one reward function")
        names = [entry[0] for entry in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"reward function names must be distinct, got {names}")
        if timeout_s <= 0 or max_workers < 1:
            raise ValueError(f"need timeout_s > 0 and max_workers >= 1, got {timeout_s} and {max_workers}")
        self.entries = list(entries)
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self._warnings = _RateLimitedWarnings()
        self._abandoned: list[threading.Thread] = []

    @property
    def names(self) -> list[str]:
        return [entry[0] for entry in self.entries]

    @property
    def weights(self) -> list[float]:
        return [entry[3] for entry in self.entries]

    def score(
        self, completions: Sequence[str], samples: Sequence[dict]
    ) -> tuple[list[float], dict[str, float]]:
        """Return each completion's weighted reward and the stats of this batch (:meth:`score_components`)."""
        totals, _, stats = self.score_components(completions, samples)
        return totals, stats

    def score_components(
        self, completions: Sequence[str], samples: Sequence[dict]
    ) -> tuple[list[float], list[list[float]], dict[str, float]]:
        """Return each completion's weighted reward, each function's unweighted value per completion
        (one row per completion, one column per function, failed calls 0) and the stats of this batch.

        Stats: ``reward/failures`` (exceptions and bad return values), ``reward/timeouts``, and
        ``reward/<name>``, the mean unweighted value of each function (failed calls count as 0).
        """
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
        calls = [(i, j) for i in range(len(completions)) for j in range(len(self.entries))]
        raw = self._run_calls(calls, completions, samples)
        values = [[0.0] * len(self.entries) for _ in completions]
        failures = timeouts = 0
        for (i, j), outcome in zip(calls, raw):
            name = self.entries[j][0]
            if outcome is _TIMED_OUT:
                timeouts += 1
                self._warnings.warn(name, "timed out", f"no result after {self.timeout_s:g}s; scored 0")
                continue
            if isinstance(outcome, BaseException):
                failures += 1
                self._warnings.warn(name, "failed", f"{type(outcome).__name__}: {outcome}; scored 0")
                continue
            values[i][j] = outcome
        totals = [sum(entry[3] * v for entry, v in zip(self.entries, row)) for row in values]
        stats = {"reward/failures": float(failures), "reward/timeouts": float(timeouts)}
        for j, entry in enumerate(self.entries):
            stats[f"reward/{entry[0]}"] = sum(row[j] for row in values) / len(values) if values else 0.0
        return totals, values, stats

    def _run_calls(self, calls: list[tuple[int, int]], completions, samples) -> list[Any]:
        """Run every call with bounded concurrency; each outcome is a float, an exception or _TIMED_OUT."""
        outcomes: list[Any] = [None] * len(calls)
        done: queue.Queue[tuple[int, Any]] = queue.Queue()
        running: dict[int, float] = {}  # call number -> deadline
        threads: dict[int, threading.Thread] = {}
        next_call = 0
        finished = 0

        def work(k: int) -> None:
            i, j = calls[k]
            _, fn, cfg, _ = self.entries[j]
            try:
                result: Any = _check_value(fn(completions[i], samples[i], cfg))
            except BaseException as exc:  # a reward function must never take training down
                result = exc
            done.put((k, result))

        while finished < len(calls):
            while next_call < len(calls) and len(running) < self.max_workers:
                thread = threading.Thread(
                    target=work, args=(next_call,), daemon=True, name=f"rlite-reward-{next_call}"
                )
                running[next_call] = time.monotonic() + self.timeout_s
                threads[next_call] = thread
                thread.start()
                next_call += 1
            wait = max(0.0, min(running.values()) - time.monotonic())
            try:
                k, result = done.get(timeout=wait)
            except queue.Empty:
                now = time.monotonic()
                for k, deadline in list(running.items()):
                    if deadline <= now:
                        outcomes[k] = _TIMED_OUT
                        del running[k]
                        self._abandoned.append(threads.pop(k))
                        finished += 1
                continue
            if k in running:  # a late answer from an abandoned call is ignored
                outcomes[k] = result
                del running[k]
                threads.pop(k)
                finished += 1
        self._abandoned = [t for t in self._abandoned if t.is_alive()]
        if self._abandoned:
            logger.debug("%d abandoned reward calls are still running", len(self._abandoned))
        return outcomes


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


def build_reward_runner(
    choices: Sequence[Choice], registry, timeout_s: float = 10.0, max_workers: int = 4
) -> RewardRunner:
    """Build a :class:`RewardRunner` from ``rewards`` choices and the ``reward_function`` registry.

    Each choice's ``args`` become an instance of the config class its function registered; the
    weight is that instance's ``weight`` (1.0 when it has none). A function listed twice gets
    ``name``, ``name_2``, ... as stat names.
    """
    entries: list[RewardEntry] = []
    seen: dict[str, int] = {}
    for index, choice in enumerate(choices):
        registered = registry.get(choice.name)
        cfg = _make_config(choice.name, registered.config_cls, choice.args, f"rewards[{index}]")
        weight = float(getattr(cfg, "weight", 1.0)) if cfg is not None else 1.0
        seen[choice.name] = seen.get(choice.name, 0) + 1
        label = choice.name if seen[choice.name] == 1 else f"{choice.name}_{seen[choice.name]}"
        entries.append((label, registered.implementation, cfg, weight))
    return RewardRunner(entries, timeout_s=timeout_s, max_workers=max_workers)
