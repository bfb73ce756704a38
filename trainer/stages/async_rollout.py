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

The engine is used by one thread at a time (a lock): a weight sync or an evaluation waits for the
generation in flight to finish. In ``async`` mode a multi-turn rollout lets a pending weight sync in
between two turns (a partial rollout): its later turns sample with the new weights, and every token's
version is recorded (``RolloutBatch.token_weight_versions``); a sample's version is its oldest token's,
so the bound holds for every token. A single engine call is never interrupted. Every sample keeps the version it was drawn with
(``RolloutBatch.weight_versions``); its log-probs are the behaviour policy's, which is what the
mismatch corrections compare the trainer's log-probs against (``docs/multiturn.md``).
"""

from __future__ import annotations

import contextlib
import queue
import threading

from rlite.metrics import StepTimer
from rlite.rollout import RolloutBatch
from rlite.stages.collect import Rollouts
from rlite.stages.partial import SegmentedGeneration

MODES = ("sync", "one_step_off", "async")


def staleness_metrics(batch: RolloutBatch, step: int) -> dict[str, float]:
    """Per sample ``(step - 1) - weight_version``: mean and max over the batch."""
    staleness = [step - 1 - v for v in batch.weight_versions] or [0]
    return {"rollout/staleness_mean": sum(staleness) / len(staleness), "rollout/staleness_max": float(max(staleness))}


class AsyncRollouts(Rollouts):
    """:class:`Rollouts` whose batches come from a producer thread, ahead of the trainer."""

    def __init__(self, *args, mode: str, max_staleness: int, last_step: int, wait_timeout_s: float,
                 partial_segment_tokens: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if mode not in MODES[1:]:
            raise ValueError(f"rollout.mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.last_step, self.wait_timeout_s = mode, last_step, wait_timeout_s
        self.max_staleness = 1 if mode == "one_step_off" else max_staleness
        self.main_timer, self.timer = self.timer, StepTimer()  # the producer's phases are its own
        self.engine_lock = threading.Lock()
        self.versions = threading.Condition()
        self.produced = 0
        """The last step whose batch the producer finished."""
        self.batches: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.sync_pending = threading.Event()
        if mode == "async" and self.max_staleness > 0:
            self.between_turns = self._let_sync_in
            if partial_segment_tokens:  # and between the segments of one generation (rlite.stages.partial)
                self.partial = SegmentedGeneration(self.engine, partial_segment_tokens, self._let_sync_in)

    def _let_sync_in(self) -> None:
        """Between two turns of the producer's multi-turn rollout: a waiting weight sync goes first."""
        if not self.sync_pending.is_set():
            return
        self.engine_lock.release()
        try:
            self._wait_for(lambda: not self.sync_pending.is_set())
        finally:
            self.engine_lock.acquire()

    # -- the producer -----------------------------------------------------------------------------
    def _wait_for(self, ready) -> bool:
        with self.versions:
            while not ready():
                if self.stop.is_set():
                    return False
                self.versions.wait(timeout=0.5)
        return True

    def _oldest_version(self, step: int) -> int:
        if self.mode == "one_step_off":
            return max(0, step - 2)
        return max(0, step - 1 - self.max_staleness)

    def _produce(self, first_step: int) -> None:
        for step in range(first_step, self.last_step + 1):
            if not self._wait_for(lambda step=step: self.engine.weight_version >= self._oldest_version(step)):
                return
            try:
                with self.engine_lock:
                    batch, stats = self.sample(step)
                stats.update({f"rollout/producer_{k}": v for k, v in self.timer.step_metrics().items()})
            except BaseException as exc:  # the trainer re-raises it at its next collect
                self.batches.put((step, exc, None))
                return
            self.batches.put((step, batch, stats))
            with self.versions:
                self.produced = step
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
        """Hold the engine for a weight sync to ``version``; in ``one_step_off`` only once the batch
        drawn with the version before it is complete."""
        if self.mode == "one_step_off" and self.thread is not None and version + 1 <= self.last_step:
            self._wait_for(lambda: self.produced >= version + 1 or not self.thread.is_alive())
        self.sync_pending.set()
        try:
            with self.engine_lock:
                yield
        finally:
            self.sync_pending.clear()
            with self.versions:
                self.versions.notify_all()

    def weights_synced(self, version: int) -> None:
        with self.versions:
            self.versions.notify_all()

    def evaluate(self, eval_prompts, step: int, max_prompts: int) -> dict[str, float]:
        with self.engine_lock:
            return super().evaluate(eval_prompts, step, max_prompts)

    def close(self) -> None:
        self.stop.set()
        with self.versions:
            self.versions.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=self.wait_timeout_s)

