"""What a full disk and a second Ctrl-C look like to code that writes files.

Below both :mod:`rlite.run.checkpoint` (which reports a checkpoint it could not write) and
:mod:`rlite.run.faults` (which stops the run on either, naming the checkpoint to resume from).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""A full disk, or a full quota (what a shared cluster's home and scratch folders usually run out of)."""

DISK_FULL_TEXTS = (f"[Errno {errno.ENOSPC}]", f"[Errno {errno.EDQUOT}]", "No space left on device", "Disk quota exceeded",
                   f"(os error {errno.ENOSPC})", f"(os error {errno.EDQUOT})", "unexpected pos", "file write failed")
"""How a full disk reads once it has been turned into text or another exception: ``torch.save``'s zip writer reports
ENOSPC as ``[enforce fail at inline_container.cc] unexpected pos`` or ``file write failed``, without the errno, and
safetensors (Rust) as ``SafetensorError: ... No space left on device (os error 28)``, no OSError."""


_STOP_NOW = False
"""Set by a second Ctrl-C: a write it interrupted fails with whatever the writer makes of it (torch.save's
zip writer: ``unexpected pos``), which must read as the interrupt, not as a full disk."""


def stop_now_requested() -> bool:
    """Whether a second Ctrl-C asked the run to stop at once."""
    return _STOP_NOW


def request_stop_now() -> None:
    """Record a second Ctrl-C (the preemption handler's), for :func:`stop_now_requested`."""
    global _STOP_NOW
    _STOP_NOW = True


def is_disk_full(error: BaseException | str) -> bool:
    """Whether ``error`` (an exception, or its text) says the disk or the quota is full."""
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return True
    text = error if isinstance(error, str) else f"{error}"
    return any(marker in text for marker in DISK_FULL_TEXTS)


def free_space_text(folder: str | Path) -> str:
    """``"1.25 GiB free of 50.00 GiB"`` for the disk holding ``folder`` (or its nearest existing parent)."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return "free space unknown"
    return f"{usage.free / 2**30:.2f} GiB free of {usage.total / 2**30:.2f} GiB"
