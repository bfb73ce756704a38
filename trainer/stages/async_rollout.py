"""Asynchronous rollouts: the engine samples the next batches while the trainer trains, at a bounded
staleness (``rollout.mode``, ``rollout.max_staleness``).

Versions: the engine samples with weight version ``v`` after the sync that ends step ``v`` (0: the
initial weights). The trainer at step ``s`` trains the weights of version ``s - 1``; a sample drawn with
version ``v`` has staleness ``s - 1 - v``.

* ``sync``: step ``s``'s batch is drawn with version ``s - 1`` (staleness 0), between the sync and the
  update (:class:`~rlite.stages.collect.Rollouts`).
* ``one_step_off``: a producer thread draws step ``s``'s batch with exactly version ``max(0, s - 2)``
  while the trainer runs step ``s - 1``; the sync of version ``s - 1`` waits for that batch. Staleness
  is 1 from step 2 on, deterministic (same batches on every run).
* ``async``: the producer draws step ``s``'s batch as soon as the engine holds a version ``>= s - 1 -
  max_staleness``, with whatever newest version it holds then; the staleness is at most
  ``max_staleness`` by construction and checked on every batch. With ``max_staleness: 0`` nothing
  overlaps and the batches are those of ``sync``, bitwise.

The engine is used by one thread at a time, on every rank in the same order. The trainer asks for it
(a weight sync, an evaluation: :meth:`AsyncRollouts.exclusive_engine`) and the producer lets it in at
its *agreement points*, before each batch and between two turns: there the producers of all ranks
agree (one collective on their own process group) on how many of the trainer's requests to let in,
and each lets exactly those in, in order, and waits until they are done. So every rank's engine takes
the same weight syncs between the same generations, whatever each rank's timing: no rank waits in a
collective (the sync's, the producer's) that another rank never reaches. The producer's collectives
(this agreement, reward and dynamic-sampling reductions) run on a process group of their own
(:func:`rlite.distributed.new_side_group`), never interleaved with the trainer's on the default group.

In ``async`` mode a multi-turn rollout lets a pending weight sync in between two turns (a partial rollout): its later turns sample with the new weights, and every token's
version is recorded (``RolloutBatch.token_weight_versions``); a sample's version is its oldest token's,
so the bound holds for every token. A single engine call is never interrupted. Every sample keeps the version it was drawn with
(``RolloutBatch.weight_versions``); its log-probs are the behaviour policy's, which is what the
mismatch corrections compare the trainer's log-probs against (``docs/multiturn.md``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import torch

from rlite.distributed import all_reduce_max, use_thread_group
from rlite.metrics import StepTimer
from rlite.rollout import RolloutBatch
from rlite.stages.collect import Rollouts

MODES = ("sync", "one_step_off", "async")


def staleness_metrics(batch: RolloutBatch, step: int) -> dict[str, float]:
    """Per sample ``(step - 1) - weight_version``: mean and max over the batch."""
    staleness = [step - 1 - v for v in batch.weight_versions] or [0]
    return {"rollout/staleness_mean": sum(staleness) / len(staleness), "rollout/staleness_max": float(max(staleness))}


class AsyncRollouts(Rollouts):
    """:class:`Rollouts` whose batches come from a producer thread, ahead of the trainer.

    ``group``: the producer's own process group (:func:`rlite.distributed.new_side_group`; ``None`` in
    a world of one)."""

    def __init__(self, *args, mode: str, max_staleness: int, last_step: int, wait_timeout_s: float,
                 group=None, **kwargs) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        if mode not in MODES[1:]:
            raise ValueError(f"rollout.mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.last_step, self.wait_timeout_s = mode, last_step, wait_timeout_s
        self.max_staleness = 1 if mode == "one_step_off" else max_staleness
        self.main_timer, self.timer = self.timer, StepTimer()  # the producer's phases are its own
        self.group = group
        if group is not None:
            self.sample_group = group
        self.engine_lock = threading.Lock()
        self.versions = threading.Condition()
        self.produced = 0
        """The last step whose batch the producer finished."""
        self.batches: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.sync_pending = threading.Event()
        self.requests: list[int] = []
        """The weight version of each of the trainer's requests for the engine, in order (a sync to ``v``:
        ``v``; an evaluation after it: ``v``)."""
        self.granted = 0
        """How many of :attr:`requests` the producer let in."""
        self.released = 0
        """How many of :attr:`requests` are done."""
        self.finished = False
        """The producer will not use the engine again (every batch drawn, or it stopped)."""
        self.producing = 0
        """The step whose batch the producer is drawing."""
        self.turn_points = 0
        """Agreement points between turns in the generation under way (multi-turn ``async``)."""
        if mode == "async" and self.max_staleness > 0:
            self.between_turns = self._let_sync_in

    def _let_sync_in(self) -> None:
        """Between two turns of the producer's multi-turn rollout: a waiting weight sync goes first
        (an agreement point; the engine is the trainer's meanwhile)."""
        self.turn_points += 1
        self.engine_lock.release()
        try:
            self._agree(limit=self.producing - 1)
        finally:
            self.engine_lock.acquire()

    def _generate_turns(self, prompts: list, params, step: int, extra_round: tuple) -> RolloutBatch:
        self.turn_points = 0
        batch = super()._generate_turns(prompts, params, step, extra_round)
        if self.between_turns is not None and self.group is not None:
            # every rank passes max_turns - 1 agreement points per generation, however many turns its
            # own trajectories took: the producers' collectives pair up
            while self.turn_points < self.turns.max_turns - 1:
                self._let_sync_in()
        return batch

    # -- the producer -----------------------------------------------------------------------------
    def _wait_for(self, ready, timeout_s: float | None = None, what: str = "") -> bool:
        """Wait until ``ready()`` (False: the run is stopping); past ``timeout_s`` raise, naming ``what``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.versions:
            while not ready():
                if self.stop.is_set():
                    return False
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"{what} did not happen within {timeout_s:g}s (rollout.timeout_s)")
                self.versions.wait(timeout=0.5)
        return True

    def _oldest_version(self, step: int) -> int:
        if self.mode == "one_step_off":
            return max(0, step - 2)
        return max(0, step - 1 - self.max_staleness)

    def _agree(self, limit: int) -> None:
        """An agreement point: let in, in order, the trainer's requests for the engine that some rank's
        trainer has made (the maximum over the producers' group), up to the first whose version is
        over ``limit``; each is waited for (this rank's trainer makes it too) and waited on until done.
        Every rank decides the same from the same numbers, so every engine sees the same schedule."""
        with self.versions:
            asked = len(self.requests)
        agreed = int(all_reduce_max(torch.tensor([asked]), self.group)[0])
        while self.granted < agreed:
            n = self.granted + 1
            if not self._wait_for(lambda n=n: len(self.requests) >= n, self.wait_timeout_s,
                                  f"the trainer's request {n} for the engine (made on another rank)"):
                return
            if self.requests[n - 1] > limit:  # the same version on every rank: the same decision
                return
            with self.versions:
                self.granted = n
                self.versions.notify_all()
            if not self._wait_for(lambda n=n: self.released >= n, self.wait_timeout_s,
                                  f"the trainer's use of the engine (request {n})"):
                return

    def _produce(self, first_step: int) -> None:
        use_thread_group(self.group)  # an engine group's messages from this thread: on the producer's group
        try:
            for step in range(first_step, self.last_step + 1):
                self.producing = step
                oldest = self._oldest_version(step)
                # one_step_off: exactly version step - 2, so a sync to step - 1 waits for this batch
                limit = oldest if self.mode == "one_step_off" else step - 1
                while not self.stop.is_set():
                    self._agree(limit)
                    if self.engine.weight_version >= oldest:
                        break
                    self._wait_for(lambda: len(self.requests) > self.granted)  # this rank's trainer asks
                if self.stop.is_set():
                    return
                with self.engine_lock:
                    batch, stats = self.sample(step)
                stats.update({f"rollout/producer_{k}": v for k, v in self.timer.step_metrics().items()})
                self.batches.put((step, batch, stats))
                with self.versions:
                    self.produced = step
                    self.versions.notify_all()
        except BaseException as exc:  # the trainer re-raises it at its next collect
            self.batches.put((self.producing, exc, None))
        finally:
            with self.versions:
                self.finished = True
                self.versions.notify_all()

    def collect(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        if self.thread is None:
            self.thread = threading.Thread(target=self._produce, args=(step,), name="rlite-rollouts", daemon=True)
            self.thread.start()
        with self.main_timer.phase("rollout_wait"):
            try:
                produced, batch, stats = self.batches.get(timeout=self.wait_timeout_s)
            except queue.Empty:
                raise RuntimeError(
                    f"step {step}: no rollout batch after {self.wait_timeout_s:g}s (rollout.timeout_s); "
                    "the producer thread is stuck"
                ) from None
        if isinstance(batch, BaseException):
            raise batch
        if produced != step:
            raise RuntimeError(f"step {step}: the producer delivered the batch of step {produced}")
        metrics = staleness_metrics(batch, step)
        if batch.token_weight_versions is not None:  # samples whose turns span a weight sync
            mixed = [len(set(row[row >= 0].tolist())) > 1 for row in batch.token_weight_versions]
            metrics["rollout/partial_fraction"] = sum(mixed) / max(len(mixed), 1)
        if metrics["rollout/staleness_max"] > self.max_staleness:
            raise RuntimeError(
                f"step {step}: a sample is {metrics['rollout/staleness_max']:g} weight versions old, "
                f"over rollout.max_staleness={self.max_staleness}"
            )
        return batch, {**stats, **metrics}

    def check_versions(self, completions, step: int) -> None:
        engine = self.engine
        versions = {c.weight_version for c in completions}
        oldest = self._oldest_version(step)
        exact = self.mode == "one_step_off"
        newest = oldest if exact else step - 1
        # a multi-turn sample's version is its oldest token's; the engine may have moved on since
        if not all(oldest <= v <= newest for v in versions | {engine.weight_version}):
            raise RuntimeError(
                f"step {step}: the engine sampled with weight version(s) {sorted(versions)}, expected "
                f"{oldest if exact else f'{oldest}..{step - 1}'} ({self.mode}): a weight sync was lost"
            )

    # -- the trainer's side -------------------------------------------------------------------------
    @contextlib.contextmanager
    def exclusive_engine(self, version: int):
        """Hold the engine for a weight sync to ``version`` (or an evaluation after it), once the
        producer lets the request in at an agreement point (in ``one_step_off`` only once the batch
        drawn with the version before it is complete), or once it is done with the engine."""
        if self.thread is None:  # before the first batch (the baseline evaluation): nothing samples yet
            with self.engine_lock:
                yield
            return
        with self.versions:
            self.requests.append(version)
            n = len(self.requests)
            self.versions.notify_all()
        self.sync_pending.set()
        try:
            self._wait_for(lambda: self.granted >= n or self.finished, self.wait_timeout_s,
                           f"the rollout producer letting the trainer's use of the engine at version {version} in")
            with self.engine_lock:
                yield
        finally:
            self.sync_pending.clear()
            with self.versions:
                self.released = max(self.released, n)
                self.versions.notify_all()

    def weights_synced(self, version: int) -> None:
        with self.versions:
            self.versions.notify_all()

    def evaluate(self, eval_prompts, step: int, max_prompts: int) -> dict[str, float]:
        with self.exclusive_engine(step):
            return super().evaluate(eval_prompts, step, max_prompts)

    def close(self) -> None:
        self.stop.set()
        with self.versions:
            self.versions.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=self.wait_timeout_s)
        if self.group is not None and (self.thread is None or not self.thread.is_alive()):
            import torch.distributed as dist

            dist.destroy_process_group(self.group)  # not while a stuck producer may still be in it
            self.group = None
