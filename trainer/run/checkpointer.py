"""A run's checkpoints as a run's component (:class:`Checkpointer`): the periodic and final ones, and the one a
run that must stop saves (a preemption signal, an engine dead past its restarts); built once by
:func:`rlite.run.build.build_run`.

A checkpoint holds the policy's model and optimizer state (and the critic's) in ``torch.distributed.checkpoint``
shards, plus per-rank trainer state: the LR scheduler, the rollouts' data position (and batches sampled ahead),
the KL controller and a trained speculative draft (weights and optimizer) (:mod:`rlite.run.checkpoint` is the
folder format).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlite.data import PromptSampler
from rlite.drafts import SpeculativeDraft
from rlite.errors import RunStopped
from rlite.metrics import StepTimer
from rlite.run.faults import Preemption
from rlite.run.policy import Policy
from rlite.stages.collect import Rollouts
from rlite.stages.targets import Targets


class Checkpointer:
    """Saves the run's checkpoints. What changes during a run lives here: the step in progress and, until its
    policy update, the state it started from (:meth:`step_started`, :meth:`policy_moved`), so that a run that
    must stop saves exactly the checkpoint a save at the end of the last whole step would have written."""

    def __init__(self, *, run_dir: Path, rank: int, keep_last: int, resume: str, provenance: dict, policy: Policy,
                 rollouts: Rollouts, targets: Targets, draft: SpeculativeDraft | None, sampler: PromptSampler,
                 hooks: Any, timer: StepTimer, preemption: Preemption) -> None:  # fmt: skip
        self.run_dir, self.rank, self.keep_last, self.resume = run_dir, rank, keep_last, resume
        self.provenance = provenance
        """What produced this run (:mod:`rlite.run.provenance`), written into every checkpoint."""
        self.policy, self.rollouts, self.targets, self.draft = policy, rollouts, targets, draft
        self.sampler = sampler
        """The run's prompt sampler (an asynchronous run's producer draws from a copy of its own)."""
        self.hooks, self.timer, self.preemption = hooks, timer, preemption
        self.in_progress: tuple[int, dict | None] = (0, None)

    def step_started(self, step: int) -> None:
        """``step`` begins: what it changes before its policy update (the prompt position, the RNG states, the
        KL controller) is kept, to save the previous step's checkpoint if the step is abandoned there."""
        from rlite.run.checkpoint import rng_state

        self.in_progress = (step, {"sampler": self.sampler.state_dict(), "kl_controller": self.targets.state_dict(),
                                   "rng": rng_state()})

    def policy_moved(self, step: int) -> None:
        """``step``'s policy update is done: a stop from here saves this step."""
        self.in_progress = (step, None)

    @property
    def last_whole_step(self) -> int:
        """The last step whose checkpoint can be written exactly: the one in progress once its policy moved,
        else the one before it (0: none)."""
        step, at_start = self.in_progress
        return step - 1 if at_start is not None else step

    def save(self, step: int) -> Path:
        """The checkpoint of ``step`` (timed as ``time/checkpoint``); a full disk stops the run."""
        from rlite.run.checkpoint import CheckpointWriteError, save_checkpoint

        with self.timer.phase("checkpoint"):
            trainer_state = {
                "scheduler": self.policy.backend.lr_scheduler_state(),
                **self.rollouts.checkpoint_state(step),  # the prompt position (and batches sampled ahead: async)
                "kl_controller": self.targets.state_dict(),
            }
            if self.draft is not None:
                trainer_state["draft"] = self.draft.state_dict()
            try:
                path = save_checkpoint(
                    self.run_dir, step, self.policy.checkpoint_state(), trainer_state, rank=self.rank,
                    keep_last=self.keep_last,
                    provenance=dict(self.provenance, weight_version=step),  # the weights of step s are version s
                )
            except CheckpointWriteError as exc:  # a full disk: stop with the folder and its free space named
                raise RunStopped(str(exc)) from None
            self.policy.backend.after_checkpoint()
            self.hooks.on_checkpoint_save(step=step, path=path)
        return path

    def save_for_stop(self) -> Path:
        """Write the checkpoint of :attr:`last_whole_step` (unless it is on disk already) for a run that stops.
        A step abandoned before its policy update has its start state put back first, so the checkpoint is
        exactly the one a save at the end of the step before would have written."""
        from rlite.run.checkpoint import checkpoint_root, list_checkpoints, set_rng_state

        _, at_start = self.in_progress
        if at_start is not None:
            self.sampler.load_state_dict(at_start["sampler"])
            self.targets.load_state_dict(at_start["kl_controller"])
            set_rng_state(at_start["rng"])
        path = checkpoint_root(self.run_dir) / f"step_{self.last_whole_step:08d}"
        if path in list_checkpoints(path.parent):
            return path
        return self.save(self.last_whole_step)

    def stop_for_preemption(self) -> RunStopped:
        """The :class:`RunStopped` to raise after a preemption signal, with :meth:`save_for_stop`'s checkpoint."""
        return self.preemption.stop(self.last_whole_step, self.save_for_stop(), self.resume)
