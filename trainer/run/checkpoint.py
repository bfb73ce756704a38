"""Checkpoints with torch.distributed.checkpoint: atomic, resumable, and exportable to Hugging Face.

A checkpoint of step ``s`` is the folder ``<run_dir>/checkpoints/step_<s:08d>`` holding the DCP
shards of model and optimizer, one ``trainer_state_rank<r>.pt`` per rank (scheduler, RNG states,
data position, step, algorithm state) and a ``COMPLETE`` marker. It is written under a temporary
name and renamed into place only after every rank finished writing and the marker is on disk, so a
crash or SIGKILL during a save leaves at most a ``*.tmp`` folder that resume ignores.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from rlite.distributed import all_gather_objects, barrier

STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model_state: dict[str, Any],
    trainer_state: dict[str, Any],
    *,
    rank: int,
    keep_last: int,
    provenance: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` (collective: every rank calls it).

    ``model_state`` is the backend's (and critic's) state for ``torch.distributed.checkpoint``;
    ``trainer_state`` is this rank's small state (pickled, with the RNG states and the step);
    ``provenance`` (:mod:`rlite.provenance`) is written by rank 0 as ``provenance.json``.
    """
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:08d}"
    # every rank must write into the same temporary folder: rank 0 names it
    tmp = Path(all_gather_objects(str(root / f"step_{step:08d}.{os.getpid()}.tmp"))[0])
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    dcp.save(model_state, checkpoint_id=str(tmp))
    state = dict(trainer_state, rng=rng_state(), step=step)
    torch.save(state, tmp / f"trainer_state_rank{rank}.pt")
    barrier()
    if rank == 0:
        pause = float(os.environ.get("RLITE_DEBUG_CHECKPOINT_PAUSE", "0"))  # fault-injection point for tests
        if pause:
            time.sleep(pause)
        if provenance is not None:
            from rlite.provenance import write_checkpoint_record

            write_checkpoint_record(tmp, provenance)
        (tmp / MARKER).write_text(f"step {step}\n")
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(root, keep_last)
    barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    complete = list_checkpoints(root)
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob("step_*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def find_resume_checkpoint(run_dir: str | Path, resume: str) -> Path | None:
    """``auto``: latest complete checkpoint of the run, or None; ``never``: None; else a path."""
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(checkpoint_root(run_dir))
        return found[-1] if found else None
    path = Path(resume)
    if not (path / MARKER).is_file():
        from rlite.config import ConfigError

        raise ConfigError(
            f"checkpoint.resume: {str(path)!r} is not a complete rlite checkpoint (no {MARKER} marker); "
            "use 'auto', 'never' or the path of a step_XXXXXXXX folder"
        )
    return path


def load_checkpoint(path: Path, model_state: dict[str, Any], *, rank: int) -> dict[str, Any]:
    """Load ``model_state`` in place (the structure the backend's ``checkpoint_state()`` returned; the
    backend then applies it); return this rank's trainer state (RNG already restored)."""
    from rlite.config import ConfigError

    state_file = path / f"trainer_state_rank{rank}.pt"
    if not state_file.is_file():
        raise ConfigError(
            f"checkpoint.resume: {path} has no {state_file.name}: it was written with a different number of "
            "ranks; resume with the same world size, or start fresh with checkpoint.resume=never"
        )
    try:
        dcp.load(model_state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # CheckpointException derives from BaseException
        raise ConfigError(
            f"checkpoint.resume: cannot load the model/optimizer state of {path} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); it is damaged or from another model. Point "
            "checkpoint.resume at another checkpoint or start fresh with checkpoint.resume=never"
        ) from exc
    trainer_state = torch.load(state_file, weights_only=False)
    set_rng_state(trainer_state["rng"])
    return trainer_state
