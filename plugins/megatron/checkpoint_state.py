"""A Hugging Face checkpoint read one tensor at a time, so that a rank builds its megatron shard
without ever holding the whole model.

``transformers.from_pretrained`` materialises every weight; with expert parallelism over 8 ranks
that is 8 full copies of a model of which each rank keeps an eighth. :class:`CheckpointState` is a
read-only mapping over the checkpoint's safetensors files: ``state[name]`` reads that tensor (cast to
``model.dtype``, as ``from_pretrained`` would) and keeps only the last two read. It answers to the
names of the transformers model's own parameters: where transformers fuses a checkpoint's experts on
load (``experts.gate_up_proj`` of shape ``[E, 2I, H]`` from ``experts.<e>.gate_proj/up_proj.weight``),
``state[name]`` is a :class:`FusedExperts` whose ``[e]`` reads expert ``e`` only. Checkpoints that are not plain safetensors folders (GGUF, ``.bin``, hub names not on disk) return
``None`` from :func:`open_checkpoint_state` and load the usual way.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch


class CheckpointState(Mapping):
    """``name -> tensor`` over a folder's safetensors files, read on access."""

    def __init__(self, files: dict[str, Path], dtype: torch.dtype) -> None:
        self.files = files
        """Tensor name -> the file holding it."""
        self.dtype = dtype
        self.reads: list[str] = []
        """Every name read, in order (what a rank actually loaded)."""
        self._recent: dict[str, torch.Tensor] = {}
        """The last two tensors read: fused experts are one tensor per projection, indexed per expert
        with the two projections in turn."""

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._recent:
            return self._recent[name]
        if name not in self.files:
            prefix = self._fused_prefix(name)
            if prefix is None:
                raise KeyError(name)
            return FusedExperts(self, prefix, name[len(prefix):])
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as handle:
            tensor = handle.get_tensor(name)
        if tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        self.reads.append(name)
        if len(self._recent) == 2:
            del self._recent[next(iter(self._recent))]
        self._recent[name] = tensor
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def release(self) -> None:
        """Drop the tensors kept from the last reads."""
        self._recent.clear()

    def resolves(self, name: str) -> bool:
        """Whether ``state[name]`` can be read (as stored, or as fused experts)."""
        return name in self.files or self._fused_prefix(name) is not None

    def _fused_prefix(self, name: str) -> str | None:
        for kind, first in (("gate_up_proj", "gate_proj"), ("down_proj", "down_proj")):
            if name.endswith("experts." + kind):
                prefix = name[: -len(kind)]
                return prefix if f"{prefix}0.{first}.weight" in self.files else None
        return None


class FusedExperts:
    """A model's fused expert tensor over a checkpoint that stores experts one by one: ``[e]`` is
    expert ``e``'s slice (``gate_up_proj``: gate rows then up rows), read on access."""

    def __init__(self, state: CheckpointState, prefix: str, kind: str) -> None:
        self.state, self.prefix, self.kind = state, prefix, kind

    def __getitem__(self, expert: int) -> torch.Tensor:
        p = f"{self.prefix}{expert}."
        if self.kind == "gate_up_proj":
            return torch.cat([self.state[p + "gate_proj.weight"], self.state[p + "up_proj.weight"]])
        return self.state[p + "down_proj.weight"]


def open_checkpoint_state(path: str, dtype: torch.dtype, gguf_file: str | None = None) -> CheckpointState | None:
    """The lazy state of the Hugging Face folder ``path`` (``model.safetensors`` or a sharded
    ``model.safetensors.index.json``), or ``None`` when it is not such a folder."""
    folder = Path(path)
    if gguf_file or not folder.is_dir():
        return None
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return CheckpointState({name: folder / file for name, file in weight_map.items()}, dtype)
    single = folder / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        names = list(handle.keys())
    return CheckpointState(dict.fromkeys(names, single), dtype)
