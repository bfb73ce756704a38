"""The init process of one sandbox run (``rlite.sandbox``); runs as PID 1 of a fresh PID namespace.

Started by ``unshare`` (new network, mount and PID namespaces) as ``python -I -S sandbox_init.py
PAYLOAD STATUS_FD``, with root inside the namespaces (real root, or a user namespace's root). It:

1. reads the payload (a JSON file written by the trainer: program, files, limits, uid) into memory;
2. mounts one size-limited tmpfs over ``/tmp`` and binds it over ``/var/tmp`` and ``/dev/shm``, writes
   the program and files to ``/tmp/work`` (the working directory), and mounts an empty, unreadable
   tmpfs over each hidden path (the trainer's folders);
3. forks the program's process: a new session, the resource limits, the unprivileged uid (when real
   root), no new privileges, then ``execve`` of the interpreter with an empty environment;
4. waits for it (reaping any orphan of the namespace meanwhile), at most the wall limit plus a grace,
   and writes one JSON line to ``STATUS_FD``: how the program ended, and its CPU time.

When this process exits, the kernel kills every process left in the PID namespace: nothing the
program started outlives the run. Standard library only (it runs with ``-S``, before any site).
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
KEPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
              "relatime": 1 << 21}
"""Per-mount flags a read-only remount must repeat (a user namespace may not clear them)."""
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 24, 28, 47, 4
SECBIT_NOROOT_AND_LOCKED = 0b11
"""uid 0 gains no capability at execve, for good: the program, root inside a user namespace, cannot
mount, unmount (uncover a hidden path) or remount the filesystem writable."""
GRACE_S = 1.0


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def mount(libc, source, target, fstype, flags, data):
    if libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                  data.encode() if data else None) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {fstype or 'bind'} on {target}: {os.strerror(errno)}")


def remount_read_only(libc):
    """Every mount of the new mount namespace read-only, so that the program can write nowhere on the
    machine (world-writable folders included) but in its own tmpfs; returns the mount points that
    refused."""
    refused = []
    with open("/proc/self/mountinfo") as f:
        entries = [line.split() for line in f]
    for fields in entries:
        target = fields[4].encode().decode("unicode_escape")  # octal escapes such as \040
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for option in fields[5].split(","):
            flags |= KEPT_FLAGS.get(option, 0)
        try:
            mount(libc, "none", target, None, flags, None)
        except OSError:
            refused.append(target)
    return refused


def prepare_filesystem(libc, payload):
    refused = [t for t in remount_read_only(libc) if not t.startswith(("/proc/", "/sys/"))]
    if refused:
        raise OSError(0, f"could not make {', '.join(refused[:5])} read-only")
    disk = f"size={payload['disk_bytes']},mode=1777"
    mount(libc, "rlite-sandbox", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, disk)
    for other in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(other):
            mount(libc, "/tmp", other, None, MS_BIND, None)
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    for name, content in payload["files"].items():
        path = os.path.join(work, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)
    uid = payload["uid"]
    if uid is not None:
        for folder, dirs, files in os.walk(work):
            for name in [*dirs, *files, None]:
                os.chown(os.path.join(folder, name) if name else folder, uid, uid)
    for hidden in payload["hidden_paths"]:
        if os.path.islink(hidden):
            continue
        if os.path.isdir(hidden):
            mount(libc, "rlite-hidden", hidden, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=4k,mode=000")
        elif os.path.exists(hidden):
            mount(libc, "/dev/null", hidden, None, MS_BIND, None)
    return work


def drop_capabilities(libc):
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL: no such cap
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # (fails harmlessly on kernels before 4.3)
    if libc.prctl(PR_SET_SECUREBITS, SECBIT_NOROOT_AND_LOCKED, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECUREBITS)")


def become_program(libc, payload, work):
    """In the forked child: everything that must hold before the untrusted program's first instruction."""
    os.setsid()
    os.chdir(work)
    limits = payload["limits"]
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu"], limits["cpu"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["as"], limits["as"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize"], limits["fsize"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["nofile"], limits["nofile"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits["nproc"] is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    drop_capabilities(libc)
    uid = payload["uid"]
    if uid is not None:  # real root: become an unprivileged uid that owns nothing outside the workdir
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    argv = payload["argv"]
    os.execve(argv[0], argv, payload["env"])


def report(status_fd, **fields):
    os.write(status_fd, (json.dumps(fields) + "\n").encode())


def main():
    payload_path, status_fd = sys.argv[1], int(sys.argv[2])
    with open(payload_path, encoding="utf-8") as f:
        payload = json.load(f)
    libc = _libc()
    try:
        work = prepare_filesystem(libc, payload)
    except OSError as exc:
        report(status_fd, setup_error=f"preparing the sandbox's filesystem failed: {exc}")
        return
    os.set_inheritable(status_fd, False)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(status_fd)
            become_program(libc, payload, work)
        except BaseException as exc:  # noqa: BLE001 - any failure before exec is a setup failure
            os.write(2, f"rlite sandbox: starting the program failed: {exc}\n".encode())
        os._exit(127)
    def out_of_time(signum, frame):
        raise TimeoutError

    signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, payload["wall_s"] + GRACE_S)
    try:
        while True:  # as the namespace's init, reap its orphans too, until the program ends
            waited, status, usage = os.wait4(-1, 0)
            if waited == pid:
                break
    except TimeoutError:
        report(status_fd, wall_timeout=True)
        return
    except ChildProcessError:
        report(status_fd, setup_error="the program's process vanished")
        return
    signal.setitimer(signal.ITIMER_REAL, 0)
    cpu = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(status):
        report(status_fd, signal=os.WTERMSIG(status), cpu_s=cpu)
    else:
        report(status_fd, exit=os.WEXITSTATUS(status), cpu_s=cpu)

if __name__ == "__main__":
    main()
