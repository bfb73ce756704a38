"""What produced a run: recorded in every checkpoint (``provenance.json``) and as the first row of
``metrics.jsonl``, and printed by ``rlite info RUN_DIR``.

The record (:func:`collect_provenance`) holds the rlite version and, when rlite runs from a git
checkout, its commit (and whether the tree had uncommitted changes); the versions of torch,
transformers, peft, sglang and megatron-core (None when not installed); every plugin the run's plugin
manager holds with its distribution and version (plugins that failed to load with their error); the
SHA-256 of the resolved config; the seeds; the world size and device; and the weight version (the
engine's weights after step s are version s: 0 at the start of a fresh run, the step in a checkpoint).

A resumed run keeps the first row of its ``metrics.jsonl`` (the fresh run's record) and appends a row
with its own record, whose ``resumed_from`` holds the step and the record of the checkpoint it loaded;
its checkpoints carry the same chain. Rows with a ``provenance`` key have no metrics; readers of the
metrics (:func:`rlite.metrics.read_metrics`) skip them.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "transformers", "peft", "sglang", "megatron-core")
"""Distributions whose versions every record names."""

FILE_NAME = "provenance.json"
"""The record's file inside a checkpoint folder."""


def package_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (None: not installed). torch's is ``torch.__version__``,
    whose local label names the build (``2.11.0+cu130``, ``2.13.0+cpu``), which the metadata of PyPI's
    CUDA wheels leaves out (``2.11.0``)."""
    from importlib.metadata import PackageNotFoundError, version

    if distribution == "torch":
        import torch

        return str(torch.__version__)
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def git_commit(path: Path) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the git checkout holding ``path``, or None (not a checkout, no git)."""
    root = next((p for p in [path, *path.parents] if (p / ".git").exists()), None)
    if root is None:
        return None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip()), "path": str(root)}


def config_hash(config: Any) -> str:
    """SHA-256 of the resolved config (every field, defaults included) as canonical JSON."""
    import dataclasses

    data = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
    text = json.dumps(data, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def plugin_records(pm: Any) -> list[dict[str, Any]]:
    """Every plugin of the manager: name, distribution, version (and the error of one that failed)."""
    records = []
    for info in pm.plugin_infos():
        record = {"name": info.name, "distribution": info.distribution, "version": info.version}
        if info.error is not None:
            record["error"] = info.error
        records.append(record)
    return records


def device_description(device: Any) -> str:
    import torch

    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def collect_provenance(config: Any, pm: Any, *, world_size: int, device: Any, weight_version: int) -> dict[str, Any]:
    """The record of this process's run (see the module docstring)."""
    from rlite.version import __version__

    return {
        "rlite_version": __version__,
        "git": git_commit(Path(__file__).resolve().parents[1]),  # the package's folder: run/ is one below it
        "packages": {name: package_version(name) for name in PACKAGES},
        "plugins": plugin_records(pm),
        "config_sha256": config_hash(config),
        "seeds": {"training": config.training.seed, "data": config.data.seed},
        "world_size": world_size,
        "device": device_description(device),
        "weight_version": weight_version,
    }


def with_weight_version(record: dict[str, Any], weight_version: int) -> dict[str, Any]:
    return dict(record, weight_version=weight_version)


def write_checkpoint_record(folder: Path, record: dict[str, Any]) -> None:
    from rlite.run_files import open_run_file

    with open_run_file(Path(folder) / FILE_NAME, "w") as handle:
        handle.write(json.dumps(record, indent=2, sort_keys=True) + "\n")


def read_checkpoint_record(folder: Path) -> dict[str, Any] | None:
    """A checkpoint's record, read without following a link (:mod:`rlite.run_files`); None when it has none."""
    from rlite.run_files import read_run_file

    path = Path(folder) / FILE_NAME
    return json.loads(read_run_file(path)) if os.path.lexists(path) else None


def metrics_records(metrics_file: Path) -> list[dict[str, Any]]:
    """The provenance rows of a ``metrics.jsonl`` (``{"step", "provenance"}``), in file order."""
    from rlite.metrics import read_log_rows

    if not os.path.lexists(metrics_file):  # a link or a FIFO is refused by read_log_rows, never skipped
        return []
    return [row for _, row in read_log_rows(metrics_file) if "provenance" in row]


def append_metrics_record(metrics_file: Path, step: int, record: dict[str, Any]) -> None:
    from rlite.run_files import open_run_file

    metrics_file.parent.mkdir(parents=True, exist_ok=True)
    with open_run_file(metrics_file, "a") as handle:
        handle.write(json.dumps({"step": step, "provenance": record}, sort_keys=True) + "\n")


def describe(record: dict[str, Any], indent: str = "") -> list[str]:
    """Readable lines of one record (``rlite info``)."""
    git = record.get("git")
    lines = [
        f"{indent}rlite {record.get('rlite_version')}"
        + (f" (git {git['commit'][:12]}{', uncommitted changes' if git.get('dirty') else ''})" if git else
           " (not from a git checkout)"),
        f"{indent}packages: " + ", ".join(f"{k} {v or '-'}" for k, v in record.get("packages", {}).items()),
        f"{indent}config sha256: {record.get('config_sha256')}",
        f"{indent}seeds: " + ", ".join(f"{k} {v}" for k, v in record.get("seeds", {}).items()),
        f"{indent}world size {record.get('world_size')}, device {record.get('device')}, "
        f"weight version {record.get('weight_version')}",
        f"{indent}plugins:",
    ]
    for plugin in record.get("plugins", []):
        origin = f"{plugin['distribution']} {plugin['version']}".strip()
        lines.append(f"{indent}  {plugin['name']}: {origin}" + (f" (failed: {plugin['error']})" if "error" in plugin else ""))
    resumed = record.get("resumed_from")
    if resumed:
        lines.append(f"{indent}resumed from the checkpoint of step {resumed['step']}, written by:")
        lines.extend(describe(resumed["provenance"] or {}, indent + "  ") if resumed.get("provenance") else
                     [f"{indent}  (no record in that checkpoint)"])
    return lines
