"""Checkpoints with torch.distributed.checkpoint: atomic, resumable, and exportable to Hugging Face.

A checkpoint of step ``s`` is the folder ``<run_dir>/checkpoints/step_<s:08d>`` holding the DCP
shards of model and optimizer, one ``trainer_state_rank<r>.pt`` per rank (scheduler, RNG states,
data position, step, algorithm state), a ``MANIFEST.json`` with the size and SHA-256 of every other
file, and a ``COMPLETE`` marker. It is written under a temporary name and renamed into place only
after every rank finished writing and the manifest and marker are on disk, so a crash or SIGKILL
during a save leaves at most a ``*.tmp`` folder that resume ignores, and a save that fails (a full
disk) removes its folder and leaves the previous checkpoint as it was.

``resume: auto`` checks the newest checkpoint against its manifest and falls back to the newest one
that is intact, saying which ones it skipped and why. A checkpoint without a manifest is refused
unless ``checkpoint.verify=false``, which checks what can be checked without one. Every pickle of the
folder is read without running code (:mod:`rlite.run.safe_pickle`): a checkpoint is data someone may
have handed you, not code.
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
from rlite.run.safe_pickle import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    forbidden_trainer_state_globals,
    load_trainer_state,
    read_dcp_metadata,
    unsafe_checkpoint_error,
)
from rlite.run_files import FILE_MODE, FOLDER_MODE, RunFolderError, link_in_folder, open_run_file, refusal

STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"

log = logging.getLogger("rlite")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (typically a full disk); the previous one is untouched."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_state() -> dict[str, Any]:
    """The RNG states, in types a weights-only load admits (numpy's key as a list of ints)."""
    name, key, position, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = (name, key.tolist(), position, has_gauss, cached_gaussian)
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, key, *rest = state["numpy"]  # a list of ints, or the array of checkpoints written before that
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open_run_file(file, "rb") as handle:
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
    ``provenance`` (:mod:`rlite.run.provenance`) is written by rank 0 as ``provenance.json``.
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
        state_file = tmp / f"trainer_state_rank{rank}.pt"
        torch.save(state, state_file)
        forbidden = forbidden_trainer_state_globals(state_file)
        if forbidden:  # a checkpoint its own resume would refuse: say so now, not at the resume
            raise RuntimeError(
                f"the trainer state holds {', '.join(forbidden)}, which rlite's checkpoint loader does not admit "
                "(rlite.run.safe_pickle.trainer_state_globals); a plugin's state_dict must hold tensors and plain "
                "Python values"
            )

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
                from rlite.run.provenance import write_checkpoint_record

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
    from rlite.run.disk import stop_now_requested

    try:
        write()
    except CheckpointException as exc:  # the first rank's own error
        rank, (error, _) = next(iter(exc.failures.items()))
        if isinstance(error, KeyboardInterrupt) or stop_now_requested():  # a second Ctrl-C: stop, not a failure
            raise KeyboardInterrupt from None
        return f"rank {rank}: {type(error).__name__}: {error}"
    except (OSError, RuntimeError) as exc:
        if stop_now_requested():  # torch.save's writer turns the Ctrl-C it was interrupted by into a RuntimeError
            raise KeyboardInterrupt from None
        return f"{type(exc).__name__}: {exc}"
    return ""


MANIFEST_FORMAT = 2
"""Manifests of this format hash each file together with its step and name (:func:`manifest_digest`); those
written before (no ``format``) hash the bytes alone and are still read."""


def _publish(tmp: Path, step: int) -> None:
    """The manifest of every file written, then the marker; both on disk before the rename. Every file is
    made readable by its owner only (a checkpoint is the run's weights, and a sandboxed program runs as
    another uid)."""
    for item in [tmp, *tmp.rglob("*")]:
        item.chmod(FOLDER_MODE if item.is_dir() else FILE_MODE)
    manifest = {
        str(file.relative_to(tmp)): {"bytes": file.stat().st_size,
                                     "sha256": manifest_digest(file, step, str(file.relative_to(tmp)))}
        for file in sorted(tmp.rglob("*"))
        if file.is_file()
    }  # fmt: skip
    for name, text in ((MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "step": step, "files": manifest}, indent=1)),
                       (MARKER, f"step {step}\n")):  # fmt: skip
        with open_run_file(tmp / name, "w") as handle:
            handle.write(text)
    _fsync_tree(tmp)


def manifest_digest(file: Path, step: int, name: str) -> str:
    """The SHA-256 a manifest gives ``file`` (``name`` in the checkpoint of ``step``): of the line
    ``rlite checkpoint step_XXXXXXXX/NAME`` and then the file's bytes. Bound to the step and the name, a file
    moved from another checkpoint (or to another name) no longer matches even when its bytes are intact."""
    return _sha256(file, f"rlite checkpoint step_{step:08d}/{name}\n".encode())


def _sha256(path: Path, prefix: bytes = b"") -> str:
    digest = hashlib.sha256(prefix)
    with open_run_file(path, "rb") as handle:  # hashlib.file_digest is Python 3.11+
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _describe_write_failure(step: int, root: Path, error: str) -> str:
    from rlite.run.disk import free_space_text, is_disk_full

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


def verify_checkpoint(path: Path, *, checksums: bool = True) -> str:
    """Why the checkpoint at ``path`` is damaged ("" when it is intact).

    ``checksums``: every file must match the size and SHA-256 its ``MANIFEST.json`` gives, bound to the step
    (:func:`manifest_digest`; a checkpoint without one is reported as such); without, only what can be told
    without a manifest: the DCP metadata reads, every shard it names is there and long enough, every trainer
    state loads and holds what rlite writes (:func:`trainer_state_damage`). Both ways every pickle is read
    inertly (:mod:`rlite.run.safe_pickle`): one that names anything rlite never writes raises
    :class:`~rlite.run.safe_pickle.UnsafeCheckpointError`, and a link anywhere in the folder raises
    :class:`~rlite.run_files.RunFolderError`, rather than counting as damage (a tampered folder needs a look).
    """
    refuse_links(path)
    structure = _structure_damage(path)  # first: code or a link is refused whatever the manifest says
    if checksums:
        damage = _manifest_damage(path)
        if damage:
            return damage
    return structure


def refuse_links(path: Path) -> None:
    """Refuse (:class:`~rlite.run_files.RunFolderError`) a checkpoint folder that is a link or holds one (or a
    special file): rlite writes neither, and a shard linked to a file elsewhere would be loaded as the run's."""
    found = link_in_folder(path)
    if found:
        raise refusal(*found)


def checkpoint_step(path: Path) -> int | None:
    """The step a checkpoint folder's name says (None for another name)."""
    match = STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def _manifest_damage(path: Path) -> str:
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        return f"it has no {MANIFEST}"
    try:
        with open_run_file(manifest_file, "rb") as handle:
            manifest = json.loads(handle.read())
        files, step, bound = manifest["files"], manifest["step"], manifest.get("format") == MANIFEST_FORMAT
        if not isinstance(step, int) or not isinstance(files, dict):
            raise TypeError("step or files")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its {MANIFEST} is unreadable ({type(exc).__name__})"
    if checkpoint_step(path) not in (None, step):
        return f"its {MANIFEST} was written for step {step}, not for {path.name}"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, {expected['bytes']} were written"
        digest = manifest_digest(file, step, name) if bound else _sha256(file)
        if digest != expected["sha256"]:
            return f"{name} does not match the checksum written with it"
    return ""


def _structure_damage(path: Path) -> str:
    """What a torn or truncated write (or a file from elsewhere) left that shows without checksums ("" if
    nothing)."""
    try:
        metadata = read_dcp_metadata(path)
    except (UnsafeCheckpointError, RunFolderError):
        raise
    except Exception as exc:  # noqa: BLE001 - a torn pickle raises many kinds
        return f".metadata is unreadable ({type(exc).__name__}: {str(exc)[:120]})"
    step = checkpoint_step(path)
    written_to = getattr(getattr(metadata, "storage_meta", None), "checkpoint_id", None)
    if step is not None and written_to is not None and not Path(str(written_to)).name.startswith(f"step_{step:08d}"):
        return f".metadata was written for {Path(str(written_to)).name}, not for {path.name}"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        if Path(name).is_absolute() or ".." in Path(name).parts:  # DCP would read it, as tensors
            raise UnsafeCheckpointError(
                f"{path / '.metadata'} points at {name}, outside the checkpoint folder: rlite writes no such entry, so "
                "it refuses the checkpoint. Resume from a checkpoint you or rlite wrote, or start fresh with "
                "checkpoint.resume=never"
            )
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size < length:
            return f"{name} has {file.stat().st_size} bytes, its metadata needs {length}"
    states = sorted(path.glob("trainer_state_rank*.pt"))
    if not states:
        return "it has no trainer_state_rank*.pt"
    for file in states:  # every rank checks every rank's file, so all ranks choose the same checkpoint
        damage = _trainer_state_file_damage(file, step)
        if damage:
            return f"{file.name} {damage}"
    return ""


def _trainer_state_file_damage(file: Path, step: int | None) -> str:
    """What is wrong with a trainer state file ("" if nothing): :func:`load_checked_trainer_state`'s damage."""
    return load_checked_trainer_state(file, step)[1]


def load_checked_trainer_state(file: Path, step: int | None) -> tuple[Any, str]:
    """A trainer state file loaded, and what is wrong with it ("" if nothing): its pickle is scanned first
    (a call rlite never writes raises :class:`~rlite.run.safe_pickle.UnsafeCheckpointError`), then loaded as
    data and its structure checked (:func:`trainer_state_damage`; ``step``: its folder's)."""
    try:
        forbidden = forbidden_trainer_state_globals(file)
    except RunFolderError:
        raise
    except Exception as exc:  # noqa: BLE001 - a torn zip raises many kinds
        return None, f"is unreadable ({type(exc).__name__}: {str(exc)[:120]})"
    if forbidden:
        raise unsafe_checkpoint_error(file, forbidden)
    try:
        state = load_trainer_state(file)
    except (UnsafeCheckpointError, RunFolderError):
        raise
    except Exception as exc:  # noqa: BLE001 - a tensor view out of its storage, a torn pickle, a recursion, ...
        return None, f"does not load ({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})"
    return state, trainer_state_damage(state, step)


TRAINER_STATE_SECTIONS = {"scheduler": dict, "sampler": dict, "kl_controller": dict, "rng": dict, "step": int}
"""What every trainer state rlite writes holds (beyond these: an async run's batches, a draft's state)."""
MAX_STATE_DEPTH = 32
"""Containers nested deeper than this are no state rlite writes (its deepest is about 6); a structure
200,000 levels deep loads, then breaks whatever walks it recursively."""


def trainer_state_damage(state: Any, step: int | None = None) -> str:
    """Why a loaded trainer state is not one rlite wrote ("" when it is): not a dict, a section missing or of
    another type, another step than ``step`` (its folder's), containers nested past :data:`MAX_STATE_DEPTH`,
    or RNG states that the generators refuse."""
    if not isinstance(state, dict):
        return f"holds {type(state).__name__} {str(state)[:40]!r}, not a trainer state (a dict)"
    for key, kind in TRAINER_STATE_SECTIONS.items():
        value = state.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"has {'no ' + repr(key) if key not in state else f'a {type(value).__name__} as {key!r}'} ({kind.__name__} expected)"
    if step is not None and state["step"] != step:
        return f"holds the state of step {state['step']}, not of step {step}"
    if _nesting_depth(state, MAX_STATE_DEPTH) > MAX_STATE_DEPTH:
        return f"nests containers more than {MAX_STATE_DEPTH} levels deep"
    return rng_state_damage(state["rng"])


def _nesting_depth(root: Any, limit: int) -> int:
    """How deep ``root``'s containers (dicts, lists, tuples, sets, objects' attributes) nest, counted without
    recursion and no further than ``limit + 1``."""
    deepest, stack = 0, [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = list(node.values())
        elif isinstance(node, (list, tuple, set, frozenset)):
            children = list(node)
        elif hasattr(node, "__dict__") and not isinstance(node, (torch.Tensor, type)):
            children = list(vars(node).values())
        else:
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        stack.extend((child, depth + 1) for child in children)
    return deepest


def rng_state_damage(rng: dict[str, Any]) -> str:
    """Why ``rng`` cannot be the RNG states :func:`rng_state` wrote ("" when it can): each is set on a fresh
    generator of its kind, which checks it, so nothing of the process's own RNGs changes."""
    try:
        torch.Generator().set_state(rng["torch"])
        version, internal, gauss = rng["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        name, key, *rest = rng["numpy"]
        np.random.RandomState().set_state((name, np.asarray(key, dtype=np.uint32), *rest))
        for state in rng.get("cuda", []):
            if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1):
                raise TypeError("a CUDA RNG state is not a 1-D uint8 tensor")
    except Exception as exc:  # noqa: BLE001 - each generator refuses in its own way
        return f"holds RNG states that do not load ({type(exc).__name__}: {str(exc)[:120]})"
    return ""


def unsafe_content(path: Path) -> str:
    """Why the checkpoint at ``path`` would be refused as holding code or links ("" if it holds neither), read
    inertly without a tensor (``rlite info``); damage is :func:`checkpoint_damage`'s."""
    try:
        refuse_links(path)
        _structure_damage(path)
    except (UnsafeCheckpointError, RunFolderError) as exc:
        return str(exc)
    return ""


def checkpoint_damage(path: Path) -> str:
    """What ``rlite info`` can tell of a checkpoint's damage without hashing its shards ("" if nothing): the
    sizes its manifest gives, and :func:`verify_checkpoint`'s checks without checksums (the trainer states
    loaded and checked). A refused checkpoint (:func:`unsafe_content`) reports nothing here."""
    try:
        refuse_links(path)
        manifest_file = path / MANIFEST
        if manifest_file.is_file():
            with open_run_file(manifest_file, "rb") as handle:
                files = json.loads(handle.read()).get("files", {})
            for name, expected in files.items():
                if not (path / name).is_file():
                    return f"{name} is missing"
                if (path / name).stat().st_size != expected.get("bytes"):
                    return f"{name} has {(path / name).stat().st_size} bytes, {expected.get('bytes')} were written"
        return _structure_damage(path)
    except (UnsafeCheckpointError, RunFolderError):
        return ""
    except (OSError, ValueError, AttributeError) as exc:
        return f"its {MANIFEST} is unreadable ({type(exc).__name__})"


def find_resume_checkpoint(run_dir: str | Path, resume: str, *, verify: bool = True, fallback: bool = True) -> Path | None:
    """``auto``: the newest intact checkpoint of the run, or None when there is none; ``never``: None;
    else that path (refused if incomplete or damaged). ``auto`` logs every newer checkpoint it skipped
    and why; if every checkpoint is damaged it refuses rather than starting over. ``fallback=False``
    (``rlite eval``, ``rlite chat``: they describe the run's latest model, which an older checkpoint is not)
    refuses a damaged newest checkpoint instead, naming it and why. ``verify`` (``checkpoint.verify``):
    check the checksums of the manifest, refusing a checkpoint without one; without, :func:`verify_checkpoint`'s
    checks that need none. A checkpoint whose pickles name anything rlite never writes, or that holds a link,
    is refused, never skipped."""
    from rlite.config import ConfigError

    if resume == "never":
        return None
    if resume == "auto":
        root = checkpoint_root(run_dir)
        skipped = []
        for path in reversed(list_checkpoints(root)):
            _refuse_without_manifest(path, verify)
            damage = verify_checkpoint(path, checksums=verify)
            if not damage:
                return path
            if not fallback:
                raise ConfigError(
                    f"the latest checkpoint {path} is damaged: {damage}. Refused rather than answered for by an older "
                    "checkpoint, which holds another model than the run's latest (rlite train resumes from the newest "
                    "intact one; rlite eval takes checkpoint.resume=PATH of another)"
                )
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
    _refuse_without_manifest(path, verify)
    damage = verify_checkpoint(path, checksums=verify)
    if damage:
        raise ConfigError(f"checkpoint.resume: {path} is damaged: {damage}; point it at another checkpoint")
    return path


def _refuse_without_manifest(path: Path, verify: bool) -> None:
    from rlite.config import ConfigError

    if verify and not (path / MANIFEST).is_file():
        raise ConfigError(
            f"checkpoint.resume: {path} has no {MANIFEST}, so its files cannot be checked against what was written "
            "(a checkpoint from before rlite wrote manifests, or one copied without it). If you trust where it comes "
            "from, resume it with checkpoint.verify=false (its pickles are still read without running code)"
        )


def load_checkpoint(path: Path, model_state: dict[str, Any], *, rank: int) -> dict[str, Any]:
    """Load ``model_state`` in place (the structure the backend's ``checkpoint_state()`` returned; the
    backend then applies it); return this rank's trainer state (RNG already restored). Nothing in the
    folder is unpickled but through :mod:`rlite.run.safe_pickle`; a checkpoint whose keys or shapes differ
    from ``model_state``'s is refused whatever ``checkpoint.resume_mismatch`` says."""
    from rlite.config import ConfigError

    state_file = path / f"trainer_state_rank{rank}.pt"
    if not state_file.is_file():
        raise ConfigError(
            f"checkpoint.resume: {path} has no {state_file.name}: it was written with a different number of "
            "ranks; resume with the same world size, or start fresh with checkpoint.resume=never"
        )
    # first: it is refused before any weight is touched
    trainer_state, damage = load_checked_trainer_state(state_file, checkpoint_step(path))
    if damage:
        raise ConfigError(
            f"checkpoint.resume: {state_file} {damage}: it is damaged or not a checkpoint rlite wrote. Point "
            "checkpoint.resume at another checkpoint or start fresh with checkpoint.resume=never"
        )
    refuse_another_model(path, read_dcp_metadata(path), model_state)
    try:
        dcp.load(model_state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(path))
    except (Exception, CheckpointException) as exc:  # CheckpointException derives from BaseException
        unsafe = _unsafe_failure(exc)
        if unsafe is not None:
            raise unsafe from None
        raise ConfigError(
            f"checkpoint.resume: cannot load the model/optimizer state of {path} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); it is damaged or from another model. Point "
            "checkpoint.resume at another checkpoint or start fresh with checkpoint.resume=never"
        ) from exc
    set_rng_state(trainer_state["rng"])
    return trainer_state


def _unsafe_failure(exc: BaseException) -> UnsafeCheckpointError | None:
    """The refusal inside a DCP error (DCP wraps each rank's exception), if that is what it was."""
    if isinstance(exc, UnsafeCheckpointError):
        return exc
    for error, _ in getattr(exc, "failures", {}).values():
        if isinstance(error, UnsafeCheckpointError):
            return error
    return None


WEIGHT_SECTIONS = ("model", "critic")
"""The sections of a checkpoint's model state that hold weights (``TrainingBackend.checkpoint_state``'s
``model``, ``CriticModel.checkpoint_state``'s ``critic``); the others hold optimizer state."""


def refuse_another_model(path: Path, metadata: Any, model_state: dict[str, Any]) -> None:
    """Refuse (:class:`~rlite.config.ConfigError`) a checkpoint whose weights (the :data:`WEIGHT_SECTIONS`
    of ``model_state``) have other keys than the model's, or any of whose tensors has another shape: DCP
    itself loads a 2-layer model from a 4-layer checkpoint, silently, by ignoring the other layers."""
    import torch.distributed as dist
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from rlite.config import ConfigError

    flat, _ = flatten_state_dict(model_state)
    saved = metadata.state_dict_metadata

    def weights(keys) -> set[str]:  # an optimizer's entries may come and go with its state (disk offload)
        return {key for key in keys if key.split(".", 1)[0] in WEIGHT_SECTIONS}

    model_keys = weights(flat)
    if dist.is_initialized() and dist.get_world_size() > 1:
        # ranks may hold different keys (megatron's tensor-parallel shards are named per rank): the
        # checkpoint holds the union of every rank's
        every_rank: list[set[str]] = [set() for _ in range(dist.get_world_size())]
        dist.all_gather_object(every_rank, model_keys)
        all_keys = set().union(*every_rank)
    else:
        all_keys = model_keys
    only_saved = sorted(weights(saved) - all_keys)
    only_model = sorted(model_keys - weights(saved))
    shapes = []
    for key in sorted(set(saved) & set(flat)):
        entry, value = saved[key], flat[key]
        if isinstance(entry, TensorStorageMetadata) != isinstance(value, torch.Tensor):
            shapes.append(f"{key}: {'a tensor' if isinstance(entry, TensorStorageMetadata) else 'a value'} in the "
                          f"checkpoint, {'a tensor' if isinstance(value, torch.Tensor) else 'a value'} in the model")
        elif isinstance(value, torch.Tensor) and tuple(entry.size) != tuple(value.size()):
            shapes.append(f"{key}: {list(entry.size)} in the checkpoint, {list(value.size())} in the model")
    if not (only_saved or only_model or shapes):
        return

    def first(items: list[str], what: str) -> str:
        more = f" and {len(items) - 3} more" if len(items) > 3 else ""
        return f"{what} {', '.join(items[:3])}{more}"

    differences = [first(only_saved, "keys only in the checkpoint:")] if only_saved else []
    differences += [first(only_model, "keys only in this run's model:")] if only_model else []
    differences += [first(shapes, "shapes differ:")] if shapes else []
    raise ConfigError(
        f"checkpoint.resume: {path} holds the state of another model than this run's ({'; '.join(differences)}). "
        "checkpoint.resume_mismatch=allow admits another config, never another model's tensors: resume it with "
        "the model it was written with, or start fresh with checkpoint.resume=never"
    )
