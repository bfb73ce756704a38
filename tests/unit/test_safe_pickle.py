"""DCP's ``.metadata`` as each Python writes it: 3.11.5+ pickle an enum member as ``EnumClass(value)``, 3.12
(and 3.11.0 to 3.11.4) as ``getattr(EnumClass, "NAME")``. rlite's metadata reader takes both, and takes
``getattr`` for nothing else: not for an attribute of an allowed enum that is no member, not on an allowed
class that is no enum."""

from __future__ import annotations

import enum
import io
import pathlib
import pickle
import re

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from rlite.run.safe_pickle import UnsafeCheckpointError, read_dcp_metadata


def metadata(memory_format=torch.contiguous_format) -> Metadata:
    properties = TensorProperties(dtype=torch.bfloat16, memory_format=memory_format)
    tensor = TensorStorageMetadata(properties=properties, size=torch.Size([2, 3]),
                                   chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))])
    return Metadata(state_dict_metadata={"w": tensor})


class EnumsByName(pickle.Pickler):
    """Pickles every enum member as Python 3.12 does, whatever Python runs the test."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


class EnumsByValue(pickle.Pickler):
    """Pickles every enum member as Python 3.11.5+ does."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return type(obj), (obj.value,)
        return NotImplemented


def write(tmp_path, pickler_cls, obj) -> pathlib.Path:
    buffer = io.BytesIO()
    pickler_cls(buffer, protocol=4).dump(obj)
    (tmp_path / ".metadata").write_bytes(buffer.getvalue())
    return tmp_path


@pytest.mark.parametrize("pickler_cls", [EnumsByName, EnumsByValue], ids=["getattr (3.12)", "by value (3.11.5+)"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_the_metadata_reads_back_equal_whichever_way_its_enums_were_pickled(tmp_path, pickler_cls, memory_format):
    written = metadata(memory_format)
    data = (write(tmp_path, pickler_cls, written) / ".metadata").read_bytes()
    assert (b"getattr" in data) == (pickler_cls is EnumsByName)  # the file is pickled the way the case says
    read = read_dcp_metadata(tmp_path)
    assert read == written
    properties = read.state_dict_metadata["w"].properties
    assert properties.memory_format == memory_format and properties.dtype == torch.bfloat16


class Reach:
    """Pickles as ``getattr(target, name)``: how a hostile file would use an allowed ``getattr``."""

    def __init__(self, target, name) -> None:
        self.target, self.name = target, name

    def __reduce__(self):
        return getattr, (self.target, self.name)


@pytest.mark.parametrize(
    ("target", "name", "named"),
    [
        (_MEM_FORMAT_ENCODING, "__class__", "getattr(_MEM_FORMAT_ENCODING, '__class__')"),  # an enum, no member
        (_MEM_FORMAT_ENCODING, "_missing_", "getattr(_MEM_FORMAT_ENCODING, '_missing_')"),
        (TensorProperties, "create_from_tensor", "getattr(TensorProperties, 'create_from_tensor')"),  # no enum
        (pathlib.PosixPath, "write_text", "getattr(PosixPath, 'write_text')"),
    ],
)
def test_a_getattr_that_is_no_enum_member_is_refused_naming_it(tmp_path, target, name, named):
    written = metadata()
    written.planner_data = Reach(target, name)
    write(tmp_path, pickle.Pickler, written)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata holds a pickled reference to " + re.escape(f"builtins.{named}")):
        read_dcp_metadata(tmp_path)
