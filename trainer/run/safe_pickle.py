"""Reading a checkpoint without running its code.

A pickle is a program: unpickling a ``__reduce__`` calls whatever it names, so a checkpoint folder
someone handed you would run their code the moment rlite opened it, and its ``MANIFEST.json`` does not
help (whoever writes the folder writes the manifest). rlite reads every pickle of a checkpoint through
an allowlist of the types it writes itself, and refuses anything else with
:class:`UnsafeCheckpointError` (exit status 2) naming the file and the global it would have called:

* ``trainer_state_rank<r>.pt``: ``torch.load(weights_only=True)`` admitting, beyond torch's tensors
  and containers, only :data:`TRAINER_STATE_GLOBALS` (the batches an asynchronous run sampled ahead,
  the date and number types a data row may hold, and the numpy arrays of the RNG state of checkpoints
  written before rlite stored it as plain integers);
* DCP's ``.metadata``: :class:`MetadataUnpickler`, a ``pickle`` unpickler whose ``find_class`` admits
  only the classes of ``torch.distributed.checkpoint.metadata`` and the few torch and ``pathlib`` names
  torch itself writes there (:func:`metadata_globals`), and that builds no state onto a class;
* DCP's non-tensor entries (the optimizer's hyper-parameters), which torch's own planner reads with
  ``weights_only=False``: :class:`SafeLoadPlanner` reads them with ``weights_only=True``.

Tensors in the ``.distcp`` shards torch already reads with ``weights_only=True``.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import enum
import io
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from rlite.config import ConfigError


class UnsafeCheckpointError(ConfigError):
    """A checkpoint file holds a pickled call to something rlite never writes: it was not written by
    rlite as it is, and opening it as a pickle would run that call. Refused, never skipped."""


def unsafe_checkpoint_error(file: Path | str, names: list[str] | str) -> UnsafeCheckpointError:
    listed = ", ".join(sorted(names)) if isinstance(names, list) else names
    return UnsafeCheckpointError(
        f"{file} holds a pickled reference to {listed}, which rlite never writes into a checkpoint: opening it "
        "as a pickle would run code from the checkpoint, so rlite refuses it (nothing was executed). Resume from "
        "a checkpoint you or rlite wrote, or start fresh with checkpoint.resume=never"
    )


# -- the trainer state ---------------------------------------------------------------------------------


def _numpy_array_globals() -> list[Any]:
    """The names a pickled numpy array of unsigned ints refers to (numpy 1 and 2 spellings): the RNG state
    of checkpoints written before rlite stored it as a list of ints."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    uint32 = type(np.dtype(np.uint32))
    return [
        (_reconstruct, "numpy._core.multiarray._reconstruct"), (_reconstruct, "numpy.core.multiarray._reconstruct"),
        (np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype"), (uint32, f"numpy.dtypes.{uint32.__name__}"),
    ]  # fmt: skip


def trainer_state_globals() -> list[Any]:
    """What ``trainer_state_rank<r>.pt`` may name beyond torch's own weights-only allowlist."""
    from rlite.rollout import EnvResults, ScoredBatch

    return [
        ScoredBatch, EnvResults,  # the (scored) batches an asynchronous run had sampled ahead
        # values a data row (a sample's ``samples`` entry) may hold when ``datasets`` read Arrow columns
        datetime.datetime, datetime.date, datetime.time, datetime.timedelta, datetime.timezone, decimal.Decimal,
        *_numpy_array_globals(),
    ]  # fmt: skip


def _file_bytes(file: Path | io.BytesIO) -> io.BytesIO:
    """A checkpoint file's bytes, read without following a link (:mod:`rlite.run_files`)."""
    if isinstance(file, io.BytesIO):
        file.seek(0)
        return file
    from rlite.run_files import read_run_file

    return io.BytesIO(read_run_file(file))


def forbidden_trainer_state_globals(file: Path | io.BytesIO) -> list[str]:
    """The globals a ``torch.save`` file names that :func:`load_trainer_state` would refuse, found by
    reading its pickle's opcodes (nothing is called)."""
    with torch.serialization.safe_globals(trainer_state_globals()):
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(_file_bytes(file)))


def load_trainer_state(file: Path) -> Any:
    """``torch.load`` of a trainer state admitting only what rlite writes; :class:`UnsafeCheckpointError`
    (naming the file and the globals) for anything else. What it loads is data of any shape:
    :func:`rlite.run.checkpoint.trainer_state_damage` says whether it is a trainer state."""
    data = _file_bytes(file)
    forbidden = forbidden_trainer_state_globals(data)
    if forbidden:
        raise unsafe_checkpoint_error(file, forbidden)
    with torch.serialization.safe_globals(trainer_state_globals()):
        try:
            return torch.load(_file_bytes(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:  # a call the scan could not see (pushed by another opcode)
            raise unsafe_checkpoint_error(file, str(exc).strip().splitlines()[-1]) from None


# -- DCP's metadata --------------------------------------------------------------------------------------


def metadata_globals() -> dict[tuple[str, str], Any]:
    """``(module, name) -> object`` that a DCP ``.metadata`` pickle may name: the dataclasses and enums of
    ``torch.distributed.checkpoint.metadata``, the file system reader's ``_StorageInfo``, torch's sizes,
    dtypes and layouts, and the ``pathlib`` path of ``StorageMeta.checkpoint_id``."""
    import torch.distributed.checkpoint.metadata as metadata_module
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    allowed: dict[tuple[str, str], Any] = {
        (metadata_module.__name__, name): value
        for name, value in vars(metadata_module).items()
        if isinstance(value, type) and value.__module__ == metadata_module.__name__
        and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))
    }
    allowed[(_StorageInfo.__module__, "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed.update({("torch", name): value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for module in ("pathlib", "pathlib._local"):  # Python 3.13 moved the classes
        for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
            allowed[(module, name)] = getattr(pathlib, name)
    return allowed


class MetadataUnpickler(pickle._Unpickler):
    """A pickle unpickler that resolves only :func:`metadata_globals` and refuses to build state onto a
    class (``BUILD`` on a class object would set its attributes). The pure-Python unpickler, since the C
    one offers no hook for ``BUILD``; a metadata file is small."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, source: Path | str) -> None:
        super().__init__(file)
        self.source = source
        self.allowed = metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return self.enum_member
        if (module, name) not in self.allowed:
            raise unsafe_checkpoint_error(self.source, f"{module}.{name}")
        return self.allowed[(module, name)]

    def enum_member(self, cls: Any, name: Any) -> enum.Enum:
        """What ``builtins.getattr`` may stand for here: a member of one of the allowed enums by its name.
        Python 3.12 (and 3.11.0 to 3.11.4) pickle an enum member as ``getattr(EnumClass, "NAME")`` where 3.11.5+
        pickle ``EnumClass(value)``; any other ``getattr`` (another object, an attribute that is no member) is
        refused, since it could reach any attribute of an allowed class."""
        allowed = isinstance(cls, type) and issubclass(cls, enum.Enum) and cls in self.allowed.values()
        if not (allowed and isinstance(name, str) and name in cls.__members__):
            what = getattr(cls, "__qualname__", type(cls).__name__)
            raise unsafe_checkpoint_error(self.source, f"builtins.getattr({what}, {name!r})")
        return cls[name]

    def persistent_load(self, pid: Any) -> Any:
        raise unsafe_checkpoint_error(self.source, f"a persistent id ({pid!r})")

    def load_build(self) -> None:
        if isinstance(self.stack[-1], type):
            raise unsafe_checkpoint_error(self.source, f"state set onto the class {self.stack[-1].__qualname__}")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def read_dcp_metadata(path: Path) -> Metadata:
    """The DCP ``Metadata`` of the checkpoint folder ``path``, through :class:`MetadataUnpickler`."""
    from rlite.run_files import open_run_file

    file = Path(path) / ".metadata"
    with open_run_file(file, "rb") as handle:
        metadata = MetadataUnpickler(handle, file).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{file} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file system reader, its ``.metadata`` read by :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # rlite writes one global metadata file, never per-rank ones
            raise UnsafeCheckpointError(f"{self.path}: a per-rank DCP metadata file was asked for; rlite writes none")
        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries with ``weights_only=True``."""

    def __init__(self, source: Path | str) -> None:
        super().__init__()
        self.source = source

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        where = f"{self.source} (entry {read_item.dest_index.fqn})"
        forbidden = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(value))
        if forbidden:
            raise unsafe_checkpoint_error(where, forbidden)
        value.seek(0)
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise unsafe_checkpoint_error(where, str(exc).strip().splitlines()[-1]) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
