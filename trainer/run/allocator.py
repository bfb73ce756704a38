"""Keep freed host memory inside the process instead of handing it back to the OS after every step.

glibc ``malloc`` serves large blocks (above a threshold that grows to 32 MB) with fresh ``mmap``
regions and unmaps them on ``free``; it also trims the top of its heap when enough is free there.
A training step allocates and frees the same large tensors every time (activations, logits,
gradients), so with those defaults every step page-faults and zero-fills gigabytes afresh: on the
SmolLM2-135M job of ``benchmarks/vs_trl.py`` a third of the run's time was kernel time. With
:func:`keep_freed_memory` every block comes from the heap and freed memory stays there for the next
step to reuse (``mallopt(M_MMAP_MAX, 0)`` and ``mallopt(M_TRIM_THRESHOLD, 2 GiB)``); the peak RSS
changes little, because the next step reuses what the last one freed. ``benchmarks/RESULTS.md`` has
the measurements.

This is what ``training.keep_freed_memory`` switches; it does nothing where the C library is not
glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
_TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the largest value it accepts


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (no per-block ``mmap``, no heap trimming).

    Returns whether the settings were applied (False where the C library is not glibc). Affects the
    whole process from now on; blocks allocated before keep their own kind.
    """
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not ok:  # pragma: no cover - glibc always accepts these values
        log.warning("mallopt refused the keep-freed-memory settings; the allocator keeps its defaults")
    return ok
