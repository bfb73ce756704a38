"""Checkpoints with torch.distributed.checkpoint: atomic, resumable, and exportable to Hugging Face.

A checkpoint of step ``s`` is the folder ``<run_dir>/checkpoints/step_<s:08d>`` holding the DCP
shards of model and optimizer, one ``trainer_state_rank<r>.pt`` per rank (scheduler, RNG states,
data position, step, algorithm state), a ``MANIFEST.json`` with the size and SHA-256 of every other
file, and a ``COMPLETE`` marker. It is written under a temporary name and renamed into place only
after every rank finished writing and the manifest and marker are on disk, so a crash or SIGKILL
during a save leaves at most a ``*.tmp`` folder that resume ignores, and a save that fails (a full
disk) removes its folder and leaves the previous checkpoint as it was.

``resume: auto`` checks the newest checkpoint against its manifest and falls back to the newest one
that is intact, saying which ones it skipped and why (a checkpoint from before manifests is taken
as it is).
"""

from __future__ import annotations

import hashlib
import json
import logging
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

from rlite.distributed import all_gather_objects, barrier, broadcast_object

STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"

log = logging.getLogger("rlite")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (typically a full disk); the previous one is untouched."""


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

    def make_folder() -> None:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)

    def write() -> None:  # DCP's save is collective: an error on one rank is raised on every rank
        dcp.save(model_state, checkpoint_id=str(tmp))
        state = dict(trainer_state, rng=rng_state(), step=step)
        torch.save(state, tmp / f"trainer_state_rank{rank}.pt")

    # an error on one rank (a full disk) becomes every rank's, so no rank waits for another
    errors = all_gather_objects(_attempt(make_folder) if rank == 0 else "")
    if not any(errors):
        errors = all_gather_objects(_attempt(write))
    if rank == 0 and not any(errors):
        pause = float(os.environ.get("RLITE_DEBUG_CHECKPOINT_PAUSE", "0"))  # fault-injection point for tests
        if pause:
            time.sleep(pause)
        def publish() -> None:
            if provenance is not None:  # in the manifest like every other file
                from rlite.provenance import write_checkpoint_record

                write_checkpoint_record(tmp, provenance)
            _publish(tmp, step)

        errors[0] = _attempt(publish)
    errors = [e for e in broadcast_object(errors, 0) if e]
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the previous checkpoint stays
        barrier()
        raise CheckpointWriteError(_describe_write_failure(step, root, errors[0]))
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(root, keep_last)
    barrier()
    return final


def _attempt(write) -> str:
    """Run ``write()``; the error it raised as text ("" when it succeeded). DCP wraps a rank's error
    in a ``CheckpointException`` (a ``BaseException``); a full disk there reads ``[Errno 28]``."""
    try:
        write()
    except CheckpointException as exc:  # the first rank's own error
        rank, (error, _) = next(iter(exc.failures.items()))
        if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C during the save: stop now, not a write failure
            raise KeyboardInterrupt from None
        return f"rank {rank}: {type(error).__name__}: {error}"
    except (OSError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _publish(tmp: Path, step: int) -> None:
    """The manifest of every file written, then the marker; both on disk before the rename."""
    manifest = {
        str(file.relative_to(tmp)): {"bytes": file.stat().st_size, "sha256": _sha256(file)}
        for file in sorted(tmp.rglob("*"))
        if file.is_file()
    }
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=1))
    (tmp / MARKER).write_text(f"step {step}\n")
    _fsync_tree(tmp)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:  # hashlib.file_digest is Python 3.11+
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _describe_write_failure(step: int, root: Path, error: str) -> str:
    from rlite.run.faults import free_space_text, is_disk_full

    previous = list_checkpoints(root)
    kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
    return (
        f"the checkpoint of step {step} could not be written to {root} ({free_space_text(root)}): "
        f"{error.splitlines()[0]}. Its partial folder was removed and {kept}. "
        + ("Free disk space" if is_disk_full(error) else "Fix the folder")
        + " (or point logging.run_dir at another disk) and run the same command again to resume"
    )


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


def verify_checkpoint(path: Path) -> str:
    """Why the checkpoint at ``path`` is damaged ("" when every file matches its manifest; a checkpoint
    written before manifests existed is taken as it is)."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        return ""
    try:
        files = json.loads(manifest_file.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its {MANIFEST} is unreadable ({type(exc).__name__})"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, {expected['bytes']} were written"
        if _sha256(file) != expected["sha256"]:
            return f"{name} does not match the checksum written with it"
    return ""


def find_resume_checkpoint(run_dir: str | Path, resume: str) -> Path | None:
    """``auto``: the newest intact checkpoint of the run, or None when there is none; ``never``: None;
    else that path (refused if incomplete or damaged). ``auto`` logs every newer checkpoint it skipped
    and why; if every checkpoint is damaged it refuses rather than starting over."""
    from rlite.config import ConfigError

    if resume == "never":
        return None
    if resume == "auto":
        root = checkpoint_root(run_dir)
        skipped = []
        for path in reversed(list_checkpoints(root)):
            damage = verify_checkpoint(path)
            if not damage:
                return path
            log.warning("checkpoint %s is damaged and skipped: %s", path.name, damage)
            skipped.append(f"{path.name}: {damage}")
        if skipped:
            raise ConfigError(
                f"checkpoint.resume=auto: every checkpoint in {root} is damaged ({'; '.join(skipped)}); point "
                "checkpoint.resume at a checkpoint, or start fresh with checkpoint.resume=never"
            )
        return None
    path = Path(resume)
    if not (path / MARKER).is_file():
        raise ConfigError(
            f"checkpoint.resume: {str(path)!r} is not a complete rlite checkpoint (no {MARKER} marker); "
            "use 'auto', 'never' or the path of a step_XXXXXXXX folder"
        )
    damage = verify_checkpoint(path)
    if damage:
        raise ConfigError(f"checkpoint.resume: {path} is damaged: {damage}; point it at another checkpoint")
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
