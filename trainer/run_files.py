"""Files of a run folder, opened without following links.

A run folder may come from someone else (``docs/faults.md``, threat model), and rlite writes into it when a
run resumes: a ``metrics.jsonl`` that is a symbolic link to ``~/.ssh/authorized_keys`` would have the resume
rewrite and append to that file, and a checkpoint shard linked to a file elsewhere would be loaded as the
run's. So every file rlite opens in a run folder is opened with ``O_NOFOLLOW`` and must be a regular file; a
link, FIFO, device or socket where a run's file belongs is refused (:class:`RunFolderError`, exit status 2)
naming it. Folders read whole (a checkpoint, ``hf_model/``) are checked entry by entry
(:func:`link_in_folder`). The run folder itself may be a link: pointing ``logging.run_dir`` at another disk
is the user's own choice.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import IO

from rlite.config import ConfigError

FILE_MODE = 0o600
"""Files rlite creates in a run folder: only their owner reads them (the folder itself is 0700)."""
FOLDER_MODE = 0o700
"""The run folder and the folders rlite makes in it: a sandboxed program's uid, or another user of a shared
node, cannot list or read them."""

_OPEN_FLAGS = {
    "r": os.O_RDONLY, "rb": os.O_RDONLY,
    "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT, "ab": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "w": os.O_WRONLY | os.O_TRUNC | os.O_CREAT, "wb": os.O_WRONLY | os.O_TRUNC | os.O_CREAT,
}  # fmt: skip


class RunFolderError(ConfigError):
    """A run folder holds a link or a special file where rlite reads or writes one of its own files."""


def not_a_regular_file(path: str | Path) -> str:
    """What ``path`` is when it exists and is not a regular file, without following a link ("" otherwise):
    ``a symbolic link to /home/u/.ssh/id_ed25519.pub``, ``a folder``, ``a FIFO``, ..."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return ""
    if stat.S_ISREG(mode):
        return ""
    return _kind(path, mode)


def _kind(path: str | Path, mode: int) -> str:
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link to {os.readlink(path)}"
        except OSError:
            return "a symbolic link"
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def refusal(path: str | Path, what: str) -> RunFolderError:
    return RunFolderError(
        f"{path} is {what}, where rlite keeps a file of its own: rlite never follows a link or opens a special file "
        "in a run folder (it could make a resume read or overwrite a file that is not the run's). Remove it, or "
        "replace it with the file itself"
    )


def open_run_file(path: str | Path, mode: str = "rb", encoding: str | None = None) -> IO:
    """``open(path, mode)`` for a file of a run folder (modes ``r``, ``a``, ``w``, text or ``b``): the last part
    of ``path`` is never followed if it is a link, a FIFO cannot block the open, and anything but a regular file
    is refused (:class:`RunFolderError`). A file it creates is readable by its owner only (:data:`FILE_MODE`)."""
    flags = _OPEN_FLAGS[mode] | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError:
        what = not_a_regular_file(path)
        if what:  # ELOOP (a link), ENXIO (a FIFO without a reader), EISDIR, ...
            raise refusal(path, what) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise refusal(path, _kind(path, info.st_mode))
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding or "utf-8"}))
    except BaseException:
        os.close(fd)
        raise


def read_run_file(path: str | Path) -> bytes:
    """The bytes of a run folder's file (:func:`open_run_file`)."""
    with open_run_file(path, "rb") as handle:
        return handle.read()


def replace_run_file(path: str | Path, data: bytes | str) -> None:
    """Put ``data`` at ``path`` in one step: written to a new file beside it (created afresh, never through a
    link), then renamed over ``path``, which replaces a link rather than writing where it points. A reader
    sees the old file or the new one, never a mix."""
    path = Path(path)
    refuse_link_or_special(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def refuse_link_or_special(path: str | Path) -> None:
    """Refuse (:class:`RunFolderError`) ``path`` when it exists and is not a regular file."""
    what = not_a_regular_file(path)
    if what:
        raise refusal(path, what)


def link_in_folder(folder: str | Path) -> tuple[Path, str] | None:
    """The first thing under ``folder`` (itself included) that is a link or neither a regular file nor a
    folder, with what it is (``a symbolic link to TARGET``); None when there is none. The walk follows no link."""
    folder = Path(folder)
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(mode):
        return folder, _kind(folder, mode)
    for parent, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs + files):
            path = Path(parent) / name
            mode = os.lstat(path).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                return path, _kind(path, mode)
    return None


def make_run_folder(path: str | Path) -> None:
    """Create the run folder (and its parents) if needed, readable by its owner only (:data:`FOLDER_MODE`): a
    sandboxed program runs as another uid, and other users of a node have no business in a run's checkpoints.
    An existing folder the user owns is narrowed to that mode too; the parents are left as they are."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_uid == os.geteuid():
        path.chmod(FOLDER_MODE)
