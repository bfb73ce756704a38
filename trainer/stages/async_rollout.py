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

What the two threads share, and who owns it when: the engine (the thread that holds ``engine_lock``:
the producer while it samples, the trainer for a sync or an evaluation it was let in for); the process
groups (one thread each: :func:`rlite.distributed.new_side_group` says why that is safe, and rlite's
collectives called without a group run on the calling thread's); a batch (the producer's until it is
queued; then the trainer's, and the producer keeps only a shallow copy for checkpoints, under
``versions``); the batch's speculative-decoding counts travel with it (the producer is already counting
the next batch's). Torch's global random generator is the producer's while it samples (the engine seeds
it for every call and restores it after); the trainer draws from it only through LoRA dropout, which is
therefore refused with an in-process engine here (``docs/compatibility.md``): the restore would repeat the
trainer's masks, and the two threads' draws would interleave.

In ``async`` mode a multi-turn rollout lets a pending weight sync in between two turns (a partial rollout): its later turns sample with the new weights, and every token's
version is recorded (``RolloutBatch.token_weight_versions``); a sample's version is its oldest token's,
so the bound holds for every token. With ``rollout.partial_segment_tokens`` a sync also gets in
between two segments of one generation (:mod:`rlite.stages.partial`), for single-turn rollouts too.
Every sample keeps the version it was drawn with (``RolloutBatch.weight_versions``); its log-probs are
the behaviour policy's, which is what the mismatch corrections compare the trainer's log-probs against
(``docs/multiturn.md``).

Checkpoints (:meth:`AsyncRollouts.checkpoint_state`) keep the data position of the batches the
trainer has consumed and the batches already sampled for the steps after it, so a resumed run trains
the same prompts at every step; ``one_step_off`` resumes bitwise.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import threading
import time
from dataclasses import replace

import torch

from rlite.distributed import all_reduce_max, use_thread_group
from rlite.metrics import Reported, StepTimer
from rlite.rollout import RolloutBatch, ScoredBatch
from rlite.stages.collect import Rollout, Rollouts
from rlite.stages.partial import SegmentedGeneration
from rlite.stages.scoring import GreedyBaseline

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
                 partial_segment_tokens: int = 0, group=None, **kwargs) -> None:  # fmt: skip
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
        # what a checkpoint keeps (under ``versions``): the batches sampled for steps the trainer has not
        # finished, and the prompt sampler's position before each step's batch. The producer draws from
        # its own copy of the sampler, so the run's sampler stays where the checkpoint put it.
        self.sampler = copy.copy(self.sampler)
        self.ready: dict[int, tuple[ScoredBatch, dict[str, float], Reported]] = {}
        self.sampler_at: dict[int, dict] = {}
        self.resumed_version = 0
        """The weights a resumed run starts with: nothing older samples again (its first fresh batch, when
        the checkpoint did not keep the batch of the step after it, lags none, like step 1's)."""
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
        """Agreement points passed in the generation under way (between turns and between segments)."""
        if mode == "async" and self.max_staleness > 0:
            self.between_turns = self._let_sync_in
            if partial_segment_tokens:  # and between the segments of one generation (rlite.stages.partial)
                self.partial = SegmentedGeneration(self.engine, partial_segment_tokens, self._let_sync_in)

    def _let_sync_in(self) -> None:
        """Between two turns of the producer's multi-turn rollout, or two segments of one engine call: a
        waiting weight sync goes first (an agreement point; the engine is the trainer's meanwhile)."""
        self.turn_points += 1
        self.engine_lock.release()
        try:
            self._agree(limit=self.producing - 1)
        finally:
            self.engine_lock.acquire()

    def points_per_generation(self) -> int:
        """The agreement points every rank passes in one generation, however many turns and segments its
        own sequences took, so that the producers' collectives pair up: one between two turns
        (``max_turns - 1``) and one between two segments of an engine call (at most
        ``ceil(max_new_tokens / partial_segment_tokens) - 1`` per call, one call per turn)."""
        if self.between_turns is None:
            return 0
        segments = 0 if self.partial is None else -(-self.rollout.max_new_tokens // self.partial.segment_tokens) - 1
        if self.turns is None:
            return segments
        return self.turns.max_turns - 1 + self.turns.max_turns * segments

    def _generate(self, prompts: list, step: int, round_index: int) -> tuple[RolloutBatch, GreedyBaseline | None]:
        self.turn_points = 0
        generated = super()._generate(prompts, step, round_index)
        if self.group is not None:  # N ranks: every rank passes the same number of agreement points
            while self.turn_points < self.points_per_generation():
                self._let_sync_in()
        return generated

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
            return max(self.resumed_version, step - 2)
        return max(self.resumed_version, step - 1 - self.max_staleness)

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
                with self.versions:
                    restored = self.ready.get(step)  # sampled before the checkpoint this run resumed from
                    if restored is None:
                        self.sampler_at[step] = self.sampler.state_dict()
                if restored is not None:  # every rank's checkpoint kept its batch: no rank samples it
                    rollout = Rollout(copy.copy(restored[0]), dict(restored[1]),
                                      engine_report=dict(restored[2]) if len(restored) > 2 else {})
                else:
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
                        rollout = self.sample(step)
                    producer = {f"rollout/producer_{k}": v for k, v in self.timer.step_metrics().items()}
                    rollout = replace(rollout, reward_stats={**rollout.reward_stats, **producer})
                with self.versions:  # a checkpoint's own copy (what the engine reported travels too)
                    self.ready[step] = (copy.copy(rollout.batch), dict(rollout.reward_stats), dict(rollout.engine_report))
                self.batches.put((step, rollout))
                with self.versions:
                    self.produced = step
                    self.versions.notify_all()
        except BaseException as exc:  # the trainer re-raises it at its next collect
            self.batches.put((self.producing, exc))
        finally:
            with self.versions:
                self.finished = True
                self.versions.notify_all()

    def collect(self, step: int) -> Rollout:
        if self.thread is None:
            self.thread = threading.Thread(target=self._produce, args=(step,), name="rlite-rollouts", daemon=True)
            self.thread.start()
        with self.main_timer.phase("rollout_wait"):
            try:
                produced, rollout = self.batches.get(timeout=self.wait_timeout_s)
            except queue.Empty:
                raise RuntimeError(
                    f"step {step}: no rollout batch after {self.wait_timeout_s:g}s (rollout.timeout_s); "
                    "the producer thread is stuck"
                ) from None
        if isinstance(rollout, BaseException):
            raise rollout
        if produced != step:
            raise RuntimeError(f"step {step}: the producer delivered the batch of step {produced}")
        batch = rollout.batch  # (the producer is drawing the next: its stats and reports travel with each batch)
        with self.versions:  # a checkpoint from now on is of step - 1 or later
            for done in [k for k in self.ready if k < step]:
                del self.ready[done]
            for done in [k for k in self.sampler_at if k < step]:
                del self.sampler_at[done]
        metrics = staleness_metrics(batch, step)
        if batch.token_weight_versions is not None:  # samples whose turns span a weight sync
            mixed = [len(set(row[row >= 0].tolist())) > 1 for row in batch.token_weight_versions]
            metrics["rollout/partial_fraction"] = sum(mixed) / max(len(mixed), 1)
        if metrics["rollout/staleness_max"] > self.max_staleness:
            raise RuntimeError(
                f"step {step}: a sample is {metrics['rollout/staleness_max']:g} weight versions old, "
                f"over rollout.max_staleness={self.max_staleness}"
            )
        return replace(rollout, reward_stats={**rollout.reward_stats, **metrics})

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

    # -- checkpoints ---------------------------------------------------------------------------------
    def checkpoint_state(self, step: int) -> dict:
        """The trained data position of a checkpoint of ``step`` (``sampler``: before step ``step + 1``'s
        batch), and what the producer has sampled beyond it (``rollouts_ahead``: the finished batches
        of the following steps and the sampler's position before each and after the last). The batch
        the producer is drawing is left out: a resumed run draws it again from the same position."""
        with self.versions:
            batches = {}
            while step + 1 + len(batches) in self.ready:
                after = step + 1 + len(batches)
                batches[after] = self.ready[after]
            positions = {k: self.sampler_at[k] for k in range(step + 1, step + 2 + len(batches)) if k in self.sampler_at}
            last = step + 1 + len(batches)
            if last not in positions:  # the producer has not begun that step: it is where its sampler stands
                positions[last] = self.sampler.state_dict()
        return {"sampler": positions[step + 1],
                "rollouts_ahead": {"batches": batches, "sampler_at": positions}}  # fmt: skip

    def resume_ahead(self, ahead: dict, step: int) -> None:
        """Take the batches a checkpoint of ``step`` kept (:meth:`checkpoint_state`) that this run's
        staleness rule accepts (``one_step_off``: exactly its version; ``async``: within the bound; in
        order, up to the first that is not), and sample on from the position after them."""
        batches, positions = ahead.get("batches", {}), ahead.get("sampler_at", {})
        after = step + 1
        while after in batches and self._fits(after, batches[after][0].weight_versions):
            self.ready[after] = batches[after]
            after += 1
        if after in positions:
            self.sampler.load_state_dict(positions[after])
        self.sampler_at.update({k: v for k, v in positions.items() if k <= after})
        self.resumed_version = step

    def _fits(self, step: int, versions: list[int]) -> bool:
        oldest = self._oldest_version(step)
        if self.mode == "one_step_off":
            return all(v == oldest for v in versions)
        return all(oldest <= v <= step - 1 for v in versions)

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
