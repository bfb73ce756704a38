"""What a run does when something goes wrong that is not a bug in the config: numbers that stop being
finite, a preemption signal, a rollout engine process that dies.

Each of them costs at most a step, never the run's past: the run either carries on (a skipped update,
a restarted engine) or stops at a step boundary with a message and a checkpoint to resume from.
How each one is handled, with the exit codes, is in ``docs/faults.md``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

from rlite.errors import EXIT_STOPPED, RunStopped  # noqa: F401 (the names callers use)
from rlite.run.disk import (  # noqa: F401 (DISK_FULL_*: the names callers use)
    DISK_FULL_ERRNOS,
    DISK_FULL_TEXTS,
    free_space_text,
    is_disk_full,
    request_stop_now,
    stop_now_requested,
)

EXIT_PREEMPTED = 75
"""Exit status of a run stopped by SIGTERM (or Ctrl-C) after it saved a checkpoint at a step boundary
(75 is ``EX_TEMPFAIL``: try again later). Running the same command again resumes exactly there."""


def latest_checkpoint_text(run_dir: str | Path) -> str:
    """Which checkpoint a stopped run resumes from, as a sentence for its message."""
    from rlite.run.checkpoint import checkpoint_root, list_checkpoints

    try:
        found = list_checkpoints(checkpoint_root(run_dir))
    except OSError:  # the run folder itself is unreadable
        return "the checkpoints could not be listed"
    if not found:
        return "no checkpoint was saved yet (checkpoint.every=0): a re-run starts from the beginning"
    return f"the last good checkpoint is {found[-1]}"


def disk_full_message(what: str, folder: str | Path, error: BaseException | str, run_dir: str | Path) -> str:
    """The one message of every write a full disk stopped: what, where, how much space is left, and the
    checkpoint the same command resumes from once there is space."""
    first_line = (f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error).splitlines()[0]
    return (
        f"{what} could not be written to {folder} ({free_space_text(folder)}): {first_line}. "
        "Free disk space (or point logging.run_dir at another disk) and run the same command again to resume; "
        f"{latest_checkpoint_text(run_dir)}"
    )


@contextlib.contextmanager
def stop_on_full_disk(what: str, folder: str | Path, run_dir: str | Path) -> Iterator[None]:
    """Turn a full disk while writing ``what`` into ``folder`` into a clean stop (:class:`RunStopped`, exit
    status 4) naming the folder, its free space and the checkpoint to resume from; other errors pass. Any
    exception counts whose text says so (:func:`is_disk_full`): writers in other languages raise their own kinds
    (safetensors' ``SafetensorError``)."""
    try:
        yield
    except RunStopped:  # an inner write path's own stop, which names what it was writing
        raise
    except Exception as exc:
        if stop_now_requested():  # a second Ctrl-C interrupted the write: stop now (status 130)
            raise KeyboardInterrupt from None
        if not is_disk_full(exc):
            raise
        raise RunStopped(disk_full_message(what, folder, exc, run_dir)) from None


class NonFiniteGuard:
    """Counts optimizer updates skipped for a NaN/inf loss or gradient norm, and stops the run once
    ``limit`` of them came in a row.

    :func:`rlite.stages.update.train_minibatches` skips such an update (the weights and the optimizer stay
    as they were, so nothing non-finite is ever synced or saved); this decides when skipping has
    become pointless. The counter runs across steps and resets at the first update that is applied.
    One guard per trained model (:meth:`for_critic`: PPO's critic, counted apart from the policy).
    """

    def __init__(self, limit: int, run_dir: str | Path, *, updates: str = "updates",
                 keys: tuple[str, str] = ("training.lr", "training.grad_clip")) -> None:  # fmt: skip
        self.limit = limit
        self.run_dir = run_dir
        self.updates = updates
        """What the message calls the skipped updates."""
        self.keys = keys
        """The model's learning rate and gradient clip, which the message suggests lowering."""
        self.in_a_row = 0

    @classmethod
    def for_critic(cls, limit: int, run_dir: str | Path) -> NonFiniteGuard:
        return cls(limit, run_dir, updates="critic updates", keys=("algorithm.critic.lr", "algorithm.critic.grad_clip"))

    def record(self, step: int, outcomes: list[dict[str, float] | None]) -> None:
        """``outcomes``: one entry per optimizer update of ``step`` (``None``: applied; else the
        skipped update's ``loss``, ``grad_norm`` and ``lr``). Raises :class:`RunStopped` at the limit."""
        for outcome in outcomes:
            if outcome is None:
                self.in_a_row = 0
                continue
            self.in_a_row += 1
            if self.in_a_row >= self.limit:
                raise RunStopped(self._message(step, outcome))

    def _message(self, step: int, outcome: dict[str, float]) -> str:
        loss, norm, lr = outcome["loss"], outcome["grad_norm"], outcome["lr"]
        what = "loss" if not math.isfinite(loss) else "gradient norm"
        return (
            f"step {step}: {self.in_a_row} {self.updates} in a row had a non-finite {what} (loss {loss:g}, "
            f"gradient norm {norm:g}, learning rate {lr:g}) and were skipped "
            f"(training.max_nonfinite_in_a_row={self.limit}). Likely cause: the learning rate is too high "
            f"(lower {self.keys[0]}, or clip harder with {self.keys[1]}); also check the rewards and "
            f"parallelism.param_dtype. No non-finite weights reached the engine or a checkpoint; "
            f"{latest_checkpoint_text(self.run_dir)}"
        )


class Preemption:
    """SIGTERM (a scheduler preempting the job) or Ctrl-C: finish at the next step boundary with a
    checkpoint, then exit with :data:`EXIT_PREEMPTED`.

    The first SIGTERM or SIGINT only sets a flag; :meth:`requested` (a collective: any rank's signal
    counts on every rank) is asked at the boundaries of a step. A second Ctrl-C stops at once
    (``KeyboardInterrupt``, exit status 130; the previous checkpoint stays). If no boundary is reached
    within ``timeout_s`` of the signal the process exits anyway with :data:`EXIT_PREEMPTED`; a save
    in progress is then abandoned and resume ignores it, so the previous checkpoint is what resumes.
    """

    def __init__(self, timeout_s: float, group=None) -> None:
        self.timeout_s = timeout_s
        self.group = group
        self.signal_name: str | None = None
        self._signalled_at = 0.0
        self._previous: dict[int, object] = {}
        self._watchdog = None

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def set_timeout(self, timeout_s: float) -> None:
        """The configured timeout, known only once the config is read (``rlite train`` installs the
        handlers before that); a signal already received keeps its time of arrival."""
        import time

        self.timeout_s = timeout_s
        if self.signal_name is not None:
            self._start_watchdog(max(0.0, timeout_s - (time.monotonic() - self._signalled_at)) if timeout_s else 0.0)

    def install(self) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set there; an embedding application handles signals itself
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _on_signal(self, signum, frame) -> None:
        import logging
        import signal
        import time

        name = signal.Signals(signum).name
        if self.signal_name is not None:
            if signum == signal.SIGINT:
                request_stop_now()
                raise KeyboardInterrupt
            return
        self.signal_name = name
        self._signalled_at = time.monotonic()
        logging.getLogger("rlite").warning(
            "%s received: saving a checkpoint at the next step boundary, then exiting with status %d "
            "(within checkpoint.preempt_timeout_s=%g s)%s", name, EXIT_PREEMPTED, self.timeout_s,
            "; press Ctrl-C again to stop now without saving" if signum == signal.SIGINT else "",
        )  # fmt: skip
        if self.timeout_s > 0:
            self._start_watchdog(self.timeout_s)

    def _start_watchdog(self, seconds: float) -> None:
        import threading

        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.timeout_s > 0:
            self._watchdog = threading.Timer(seconds, self._give_up)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _give_up(self) -> None:
        import os
        import sys

        print(
            f"rlite train: stopped: {self.signal_name}: no step boundary within checkpoint.preempt_timeout_s="
            f"{self.timeout_s:g} s; exiting without a new checkpoint (the previous one is intact and resumes)",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        os._exit(EXIT_PREEMPTED)

    def requested(self) -> bool:
        """Whether any rank was signalled (a collective: every rank calls it at the same boundaries)."""
        import torch

        from rlite.distributed import all_reduce_sum

        return bool(all_reduce_sum(torch.tensor([1.0 if self.signal_name else 0.0]), self.group)[0] > 0)

    def stop_before_training(self, run_dir: str | Path, start_step: int) -> RunStopped:
        """The stop of a run signalled while it was being built: no step ran, so nothing is saved."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        where = (f"a re-run resumes from the checkpoint of step {start_step} ({latest_checkpoint_text(run_dir)})"
                 if start_step else "a re-run starts from the beginning")
        return RunStopped(
            f"{self.signal_name or 'a signal'} received before the first step: nothing new to save; {where}",
            exit_code=EXIT_PREEMPTED,
        )

    def stop(self, step: int, checkpoint: Path, resume: str) -> RunStopped:
        if self._watchdog is not None:
            self._watchdog.cancel()
        again = "run the same command again" + (" with checkpoint.resume=auto" if resume == "never" else "")
        return RunStopped(
            f"{self.signal_name or 'a signal'} received: saved the checkpoint of step {step} ({checkpoint}); "
            f"{again} to resume from it",
            exit_code=EXIT_PREEMPTED,
        )
