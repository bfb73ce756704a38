"""Running untrusted code (a model's program) so that it cannot touch the trainer or the machine.

:func:`run_untrusted` runs one program under these layers, with no service and no privilege beyond
what the machine offers (``docs/code_rewards.md`` says which hold where):

* **namespaces** (``unshare``): a new network namespace (only a loopback that is down: no
  connection to anything, 127.0.0.1 included), a new PID namespace (the program sees only its own
  processes; when the run ends its init exits and the kernel kills every process left in it), a new
  mount namespace (a fresh ``/proc``; ``/tmp``, ``/var/tmp`` and ``/dev/shm`` replaced by one
  size-limited tmpfs that holds the working directory; every other mount read-only; the trainer's
  working folder, ``/run`` (Unix sockets), the run's own folder, data files and offload folder
  (:func:`hidden_from_programs`) and ``hidden_paths`` covered by an empty, unreadable tmpfs);
* **an unprivileged uid** when the trainer is root (a fresh uid per run, so ``RLIMIT_NPROC``, which
  root ignores, binds it and it owns no file outside its tmpfs), with ``no_new_privs``; without root,
  a user namespace (the program keeps the user's uid, mapped to root inside);
* **resource limits**: ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``,
  ``RLIMIT_NOFILE``, no core files;
* **a wall-clock limit**, enforced twice: the trainer kills the whole process group (and with it the
  PID namespace) at the limit, and the sandbox's init gives up a second later on its own;
* **an output limit**: stdout and stderr are read as they come, and the run is killed once they pass
  ``output_bytes``, so a program printing gigabytes costs the trainer nothing;
* a scrubbed environment, none of the trainer's file descriptors (``close_fds``), the interpreter
  started with ``-I`` (no user site, no ``PYTHON*`` variables).

Where namespaces cannot be created, :func:`run_untrusted` refuses (:class:`SandboxUnavailable`)
unless ``limits.allow_unisolated`` is set, and then warns once, loudly, per process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

INIT_SCRIPT = str(Path(__file__).with_name("sandbox_init.py"))
KINDS = ("ok", "error", "timeout", "cpu", "memory", "disk", "output_limit", "crash", "killed", "setup")
"""Failure kinds of a run: ``ok`` (exit status 0), ``error`` (another exit status: an exception, a
failed assert), ``timeout`` (wall-clock limit), ``cpu`` (``RLIMIT_CPU``), ``memory`` (``MemoryError``
under ``RLIMIT_AS``), ``disk`` (the tmpfs full or ``RLIMIT_FSIZE``), ``output_limit`` (stdout + stderr
passed ``output_bytes``), ``crash`` (killed by a signal such as SIGSEGV or SIGABRT), ``killed``
(SIGKILL that the sandbox did not send), ``setup`` (the sandbox itself could not start the program)."""
UID_BASE = 1_500_000_000
"""Sandbox runs as root take a uid in ``[UID_BASE, UID_BASE + UID_SPAN)``, owned by nobody."""
UID_SPAN = 1_000_000
ALWAYS_HIDDEN = ("/run",)
"""Hidden in every run besides the trainer's working folder: the home of the machine's Unix sockets,
which a network namespace does not cover and a read-only mount does not stop (connecting is allowed)."""
RUN_PATHS_ENV = "RLITE_SANDBOX_HIDDEN_PATHS"
"""The environment variable holding (JSON) the paths a running run hides from every program besides
``hidden_paths``: its run folder, data files and offload folder (:func:`hidden_from_programs`). An environment
variable, so that reward worker processes started during the run inherit it."""
KILL_WAIT_S = 5.0
"""How long to wait for the killed sandbox's processes to go (SIGKILL takes microseconds)."""


class SandboxUnavailable(RuntimeError):
    """This machine cannot isolate a program (no namespaces), and unisolated runs were not allowed."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """What one run of an untrusted program may use."""

    timeout_s: float = 10.0
    """Wall-clock limit: the program and everything it started are killed then (kind ``timeout``)."""
    cpu_s: int = 10
    """CPU seconds (``RLIMIT_CPU``, per process; kind ``cpu``)."""
    memory_mb: int = 512
    """Address space per process, MiB (``RLIMIT_AS``; kind ``memory``)."""
    nproc: int = 16
    """Processes and threads of the run (``RLIMIT_NPROC``): a fork bomb stops there. Without root it
    is counted on top of the user's own processes (docs/code_rewards.md)."""
    disk_mb: int = 64
    """Size of the run's tmpfs (working directory, ``/tmp``) and largest file, MiB (kind ``disk``)."""
    output_bytes: int = 1 << 20
    """stdout + stderr kept; past this the run is killed (kind ``output_limit``)."""
    nofile: int = 64
    """Open file descriptors (``RLIMIT_NOFILE``)."""
    hidden_paths: tuple[str, ...] = ()
    """Folders (or files) made unreadable inside the sandbox besides the trainer's working folder:
    run folders, data and checkpoints kept elsewhere."""
    allow_unisolated: bool = False
    """Where namespaces are unavailable, run anyway with resource limits and a process group only
    (no network, PID or mount isolation), with a loud warning; False refuses."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_mb", "nproc", "disk_mb", "output_bytes", "nofile"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox limits: {name} must be > 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """How one run ended."""

    kind: str
    """One of :data:`KINDS`."""
    exit_code: int | None
    """The program's exit status, None when a signal ended it (or it never ran)."""
    signal: int | None
    """The signal that ended the program, when one did."""
    stdout: str
    """Its standard output, cut at ``output_bytes`` (decoded as UTF-8, invalid bytes replaced)."""
    stderr: str
    """Its standard error, cut likewise."""
    wall_s: float
    """Wall-clock seconds from start to the end of everything it started."""
    cpu_s: float | None = None
    """CPU seconds of the program's main process and its waited-for children, when known."""
    detail: str = ""
    """Why, for ``setup`` and ``timeout``."""
    uid: int | None = None
    """The uid the program ran as (a fresh one per run as root; None when it kept the user's)."""

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What this machine lets the sandbox do (probed once per process)."""

    namespaces: bool
    """Network, PID and mount namespaces can be created."""
    user_namespace: bool
    """They need a user namespace (not root)."""
    as_root: bool
    """The trainer is root: runs drop to an unprivileged uid."""
    reason: str = ""
    """Why namespaces are unavailable."""

    @property
    def summary(self) -> str:
        if not self.namespaces:
            return f"no namespaces ({self.reason}): resource limits and a process group only"
        who = "root, runs as a fresh unprivileged uid" if self.as_root else "user namespace, runs as the user's uid"
        return f"network, PID and mount namespaces; {who}"


def _unshare_command(user_namespace: bool) -> list[str]:
    command = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--propagation", "private"]
    if user_namespace:
        command[1:1] = ["--user", "--map-root-user"]
    return command


@functools.lru_cache(maxsize=1)
def probe_isolation() -> Isolation:
    """Which isolation this machine offers: namespaces as root, in a user namespace, or none."""
    as_root = os.geteuid() == 0
    if shutil.which("unshare") is None:
        return Isolation(False, False, as_root, "the unshare program (util-linux) is not installed")
    reasons = []
    for user_namespace in ((False, True) if as_root else (True,)):
        try:
            done = subprocess.run([*_unshare_command(user_namespace), "true"], capture_output=True, text=True,
                                  timeout=30, env={}, close_fds=True)
        except (OSError, subprocess.TimeoutExpired) as exc:
            reasons.append(str(exc))
            continue
        if done.returncode == 0:
            return Isolation(True, user_namespace, as_root and not user_namespace)
        reasons.append(done.stderr.strip() or f"exit status {done.returncode}")
    return Isolation(False, False, as_root, "; ".join(reasons))


def _traversable(path: str) -> bool:
    """Every folder above ``path`` lets others through and the file lets others run it."""
    path = os.path.realpath(path)
    parts = Path(path).parents
    try:
        return all(os.stat(p).st_mode & 0o001 for p in parts) and bool(os.stat(path).st_mode & 0o005 == 0o005)
    except OSError:
        return False


@functools.lru_cache(maxsize=8)
def default_interpreter() -> str:
    """A Python the sandbox uid can run: this one's base interpreter when others may run it, else
    ``/usr/bin/python3``."""
    base = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    for candidate in (base, "/usr/bin/python3"):
        if os.path.exists(candidate) and (os.geteuid() != 0 or _traversable(candidate)):
            return candidate
    raise SandboxUnavailable(
        f"interpreter: no Python that an unprivileged uid can run was found ({base} sits in a folder others "
        "cannot enter); install python3 at /usr/bin/python3 or set the interpreter option"
    )


def _classify(status: dict, stderr: str, limits: SandboxLimits) -> tuple[str, int | None, int | None]:
    """(kind, exit code, signal) from the init's report and the program's stderr."""
    if "exit" in status:
        code = status["exit"]
        if code == 0:
            return "ok", 0, None
        tail = stderr[-2000:]
        if "MemoryError" in tail:
            return "memory", code, None
        if "[Errno 28]" in tail or "[Errno 27]" in tail:  # ENOSPC (the tmpfs), EFBIG (RLIMIT_FSIZE)
            return "disk", code, None
        return "error", code, None
    sig = status["signal"]
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and (status.get("cpu_s") or 0) >= limits.cpu_s):
        return "cpu", None, sig
    if sig == signal.SIGXFSZ:
        return "disk", None, sig
    if sig == signal.SIGKILL:
        return "killed", None, sig
    return "crash", None, sig


def _user_tasks() -> int:
    """Processes and threads of this uid now (what RLIMIT_NPROC counts for a non-root user)."""
    uid, count = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return count


_WARNED = False


def _warn_unisolated(isolation: Isolation) -> None:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        logger.warning(
            "UNTRUSTED CODE RUNS WITHOUT ISOLATION: %s. The program can open network connections, read every file "
            "this user can, and signal this user's processes; only resource limits and a process group hold "
            "(allow_unisolated is set). See docs/code_rewards.md.", isolation.reason)


def run_untrusted(
    source: str,
    stdin: str = "",
    files: Mapping[str, str] | None = None,
    limits: SandboxLimits | None = None,
    interpreter: str | None = None,
) -> SandboxResult:
    """Run ``source`` (a Python program) with ``stdin`` in a fresh working directory holding
    ``files`` (relative path -> text), under ``limits``; see the module docstring.

    :param interpreter: the Python to run it with (default :func:`default_interpreter`).
    :raises SandboxUnavailable: namespaces are unavailable and ``limits.allow_unisolated`` is False.
    """
    limits = limits if limits is not None else SandboxLimits()
    files = dict(files or {})
    for name in files:
        if os.path.isabs(name) or ".." in Path(name).parts or name == "main.py":
            raise ValueError(f"files: {name!r} must be a relative path inside the working directory, not main.py")
    isolation = probe_isolation()
    if not isolation.namespaces and not limits.allow_unisolated:
        raise SandboxUnavailable(
            f"cannot isolate untrusted code on this machine: {isolation.reason}. Run as root, or allow user "
            "namespaces (sysctl kernel.unprivileged_userns_clone=1), or in a container started with them; "
            "or set allow_unisolated to run without network, PID and filesystem isolation (docs/code_rewards.md)"
        )
    interpreter = interpreter or default_interpreter()
    hidden = _hidden_paths(limits, interpreter)
    files["main.py"] = source
    if isolation.namespaces:
        return _run_isolated(isolation, interpreter, stdin, files, limits, hidden)
    _warn_unisolated(isolation)
    return _run_unisolated(interpreter, stdin, files, limits)


def run_hidden_paths() -> list[str]:
    """The paths the current run hides from every program (:func:`hidden_from_programs`)."""
    try:
        paths = json.loads(os.environ.get(RUN_PATHS_ENV) or "[]")
    except ValueError:
        return []
    return [path for path in paths if isinstance(path, str)] if isinstance(paths, list) else []


@contextlib.contextmanager
def hidden_from_programs(paths: list[str]) -> Iterator[None]:
    """Hide ``paths`` (folders or files) from every program :func:`run_untrusted` runs while the block lasts,
    besides each call's ``hidden_paths``: a run hides its run folder (config, checkpoints, metrics), its data
    files (the answers) and its optimizer offload folder, wherever they live, without anyone listing them."""
    previous = os.environ.get(RUN_PATHS_ENV)
    os.environ[RUN_PATHS_ENV] = json.dumps(sorted({*run_hidden_paths(), *map(str, paths)}))
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(RUN_PATHS_ENV, None)
        else:
            os.environ[RUN_PATHS_ENV] = previous


def _hidden_paths(limits: SandboxLimits, interpreter: str) -> list[str]:
    hidden = []
    for path in dict.fromkeys((os.getcwd(), *ALWAYS_HIDDEN, *limits.hidden_paths, *run_hidden_paths())):
        path = os.path.realpath(path)
        if path == "/":
            continue
        # (the init script and the trainer's Python are loaded before the paths are hidden)
        needed = os.path.realpath(interpreter)
        if needed == path or needed.startswith(path + os.sep):
            raise ValueError(f"hidden_paths: {path} holds the interpreter {needed}, which the program needs; set "
                             "another interpreter or run from another working folder")
        hidden.append(path)
    return hidden


def _argv(interpreter: str) -> list[str]:
    return [interpreter, "-I", "-B", "main.py"]


def _run_isolated(isolation: Isolation, interpreter: str, stdin: str, files: dict[str, str],
                  limits: SandboxLimits, hidden: list[str]) -> SandboxResult:
    nproc = limits.nproc if isolation.as_root else _user_tasks() + limits.nproc
    payload = {
        "files": files,
        "uid": UID_BASE + secrets.randbelow(UID_SPAN) if isolation.as_root else None,  # not `random`: seeded alike in workers
        "hidden_paths": hidden,
        "disk_bytes": limits.disk_mb << 20,
        "limits": {"cpu": limits.cpu_s, "as": limits.memory_mb << 20, "fsize": limits.disk_mb << 20,
                   "nofile": limits.nofile, "nproc": nproc},
        "argv": _argv(interpreter),
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp/work", "PYTHONHASHSEED": "0"},
        "wall_s": limits.timeout_s,
    }
    scratch = tempfile.mkdtemp(prefix="rlite-sandbox-")  # 0700: only the trainer's user reads the payload
    try:
        payload_path = os.path.join(scratch, "payload.json")
        with open(payload_path, "w", encoding="utf-8") as f:
            json.dump(payload, f)
        status_read, status_write = os.pipe()
        command = [*_unshare_command(isolation.user_namespace), sys.executable, "-I", "-S", INIT_SCRIPT,
                   payload_path, str(status_write)]
        try:
            result = _supervise(command, stdin, limits, pass_fds=(status_write,), status_fd=status_read)
        finally:
            os.close(status_read)
        return dataclasses.replace(result, uid=payload["uid"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_unisolated(interpreter: str, stdin: str, files: dict[str, str], limits: SandboxLimits) -> SandboxResult:
    work = tempfile.mkdtemp(prefix="rlite-sandbox-")
    try:
        for name, content in files.items():
            path = os.path.join(work, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(content)
        script = (
            "import os, resource, sys\n"
            f"resource.setrlimit(resource.RLIMIT_CPU, ({limits.cpu_s}, {limits.cpu_s + 1}))\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({limits.memory_mb << 20}, {limits.memory_mb << 20}))\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limits.disk_mb << 20}, {limits.disk_mb << 20}))\n"
            f"resource.setrlimit(resource.RLIMIT_NOFILE, ({limits.nofile}, {limits.nofile}))\n"
            f"resource.setrlimit(resource.RLIMIT_NPROC, ({_user_tasks() + limits.nproc},) * 2)\n"
            "os.execv(sys.argv[1], sys.argv[1:])\n"
        )
        command = [sys.executable, "-I", "-S", "-c", script, *_argv(interpreter)]
        return _supervise(command, stdin, limits, cwd=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _supervise(command: list[str], stdin: str, limits: SandboxLimits, pass_fds: tuple[int, ...] = (),
               status_fd: int | None = None, cwd: str | None = None) -> SandboxResult:
    """Start ``command`` in its own session, feed it ``stdin``, read its output up to the limit, and
    kill its process group at the wall-clock limit or when the output passes the limit."""
    start = time.monotonic()
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=True,
        pass_fds=pass_fds, start_new_session=True, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, cwd=cwd,
    )
    for fd in pass_fds:
        os.close(fd)  # the child holds it now; its end-of-file means the sandbox is gone
    deadline = start + limits.timeout_s
    outputs, status_raw, stopped = _exchange(process, stdin, limits, deadline, status_fd)
    if stopped:
        _kill_group(process, status_fd is not None)
    try:
        process.wait(timeout=KILL_WAIT_S if stopped else max(KILL_WAIT_S, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        stopped = stopped or "timeout"
        _kill_group(process, status_fd is not None)
        process.wait(timeout=KILL_WAIT_S)
    for stream in (process.stdin, process.stdout, process.stderr):
        if not stream.closed:
            stream.close()
    wall = time.monotonic() - start
    stdout, stderr = (bytes(b[: limits.output_bytes]).decode("utf-8", "replace") for b in outputs)
    if stopped:
        detail = f"killed after {limits.timeout_s:g}s" if stopped == "timeout" else f"output passed {limits.output_bytes} bytes"
        return SandboxResult(stopped, None, None, stdout, stderr, wall, detail=detail)
    return _ended(process.returncode, status_raw if status_fd is not None else None, stdout, stderr, wall, limits)


def _exchange(process: subprocess.Popen, stdin: str, limits: SandboxLimits, deadline: float,
              status_fd: int | None) -> tuple[list[bytearray], bytearray, str]:
    """Write ``stdin`` to the process and read its stdout, stderr and (``status_fd``) the sandbox's status until
    all close, the ``deadline`` passes (``"timeout"``) or the output passes the limit (``"output_limit"``):
    ``([stdout, stderr], status, why it stopped early or "")``."""
    outputs = {process.stdout: bytearray(), process.stderr: bytearray()}
    pending_stdin = memoryview(stdin.encode())
    selector = selectors.DefaultSelector()
    for stream in outputs:
        os.set_blocking(stream.fileno(), False)
        selector.register(stream, selectors.EVENT_READ)
    if pending_stdin:
        os.set_blocking(process.stdin.fileno(), False)
        selector.register(process.stdin, selectors.EVENT_WRITE)
    else:
        process.stdin.close()
    status_raw = bytearray()
    if status_fd is not None:
        selector.register(status_fd, selectors.EVENT_READ)
    open_streams = len(outputs) + (status_fd is not None)
    stopped = ""
    while open_streams and not stopped:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stopped = "timeout"
            break
        for key, _ in selector.select(timeout=remaining):
            if key.fileobj is process.stdin:
                try:
                    written = os.write(process.stdin.fileno(), pending_stdin[:65536])
                except (BrokenPipeError, OSError):
                    written = len(pending_stdin)
                pending_stdin = pending_stdin[written:]
                if not pending_stdin:
                    selector.unregister(process.stdin)
                    process.stdin.close()
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                selector.unregister(key.fileobj)
                open_streams -= 1
                continue
            if key.fileobj is status_fd:
                status_raw += chunk
                continue
            outputs[key.fileobj] += chunk
            if sum(len(b) for b in outputs.values()) > limits.output_bytes:
                stopped = "output_limit"
                break
    selector.close()
    return list(outputs.values()), status_raw, stopped


def _ended(returncode: int, status_raw: bytearray | None, stdout: str, stderr: str, wall: float,
           limits: SandboxLimits) -> SandboxResult:
    """The result of a program that ended by itself: from its exit status (``status_raw`` ``None``: unisolated,
    the process itself is the program), else from the status the sandbox reported."""
    if status_raw is None:
        status = {"exit": returncode} if returncode >= 0 else {"signal": -returncode}
    else:
        try:
            status = json.loads(bytes(status_raw).decode().splitlines()[0])
        except (IndexError, ValueError):
            return SandboxResult("setup", None, None, stdout, stderr, wall,
                                 detail=f"the sandbox ended without a status (exit status {returncode}): {stderr[-500:]}")
    if "setup_error" in status:
        return SandboxResult("setup", None, None, stdout, stderr, wall, detail=status["setup_error"])
    if status.get("wall_timeout"):
        return SandboxResult("timeout", None, None, stdout, stderr, wall, detail=f"killed after {limits.timeout_s:g}s")
    if status.get("exit") == 127 and "rlite sandbox: starting the program failed" in stderr:
        return SandboxResult("setup", None, None, stdout, stderr, wall, detail=stderr.strip()[-500:])
    kind, code, sig = _classify(status, stderr, limits)
    return SandboxResult(kind, code, sig, stdout, stderr, wall, status.get("cpu_s"))


def _kill_group(process: subprocess.Popen, isolated: bool) -> None:
    """SIGKILL the run. With namespaces: the PID namespace's init (``unshare``'s child) first, whose
    death makes the kernel kill, and wait for, every process of the namespace, and then ``unshare``
    returns; so once it has, nothing of the run is left. Then (or without namespaces) the whole
    process group."""
    children = []
    if isolated:
        try:
            with open(f"/proc/{process.pid}/task/{process.pid}/children") as f:
                children = [int(pid) for pid in f.read().split()]
        except OSError:
            pass
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if children:
        try:
            process.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
    if process.returncode is None:  # (a reaped group id could be reused)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
