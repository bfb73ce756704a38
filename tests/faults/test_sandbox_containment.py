"""Hostile programs against the ``code_exec`` sandbox (``rlite.sandbox``).

Each program is scored by the ``code_exec`` reward, which must give 0 and name the right failure
kind, and then the test checks that nothing escaped: no process of the run's uid is left on the
machine, the trainer's stand-in child process (a ``sleep`` the test started) is alive, nothing was
written or read outside the run's private tmpfs, and no connection reached the test's server.
Every limit is set here, small: a fork bomb meets ``nproc``, a memory hog ``memory_mb``, a disk
filler ``disk_mb``, a printer ``output_bytes``, a sleeper ``timeout_s``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from rlite import hookimpl as hookimpl_rlite
from rlite import sandbox
from rlite.plugins import code_exec as plugin
from rlite.plugins.code_exec import CodeExecConfig, code_exec

pytestmark = pytest.mark.skipif(not sandbox.probe_isolation().namespaces,
                                reason=f"no namespaces here: {sandbox.probe_isolation().reason}")

LIMITS = {"timeout_s": 10, "cpu_s": 2, "memory_mb": 256, "nproc": 16, "disk_mb": 8, "output_bytes": 1 << 16}
NEVER = [{"stdin": "", "stdout": "a line no hostile program prints"}]


@pytest.fixture
def trainer_child():
    """A process of the trainer's (the test's) user that the sandbox must not be able to touch."""
    child = subprocess.Popen(["sleep", "600"])
    yield child
    child.kill()
    child.wait(timeout=10)


@pytest.fixture
def runs(monkeypatch):
    """Every SandboxResult of the code_exec calls of the test."""
    results = []

    def recording(*args, **kwargs):
        result = sandbox.run_untrusted(*args, **kwargs)
        results.append(result)
        return result

    monkeypatch.setattr(plugin, "run_untrusted", recording)
    return results


def processes_of(uid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def score(program: str, runs: list, **options) -> tuple[float, str, sandbox.SandboxResult]:
    outcome = code_exec(program, {"tests": NEVER}, CodeExecConfig(extract="whole", **{**LIMITS, **options}))
    (result,) = runs
    assert outcome.counts[result.kind] == 1 and outcome.counts["runs"] == 1
    return outcome.value, result.kind, result


def assert_contained(result: sandbox.SandboxResult, trainer_child: subprocess.Popen) -> None:
    assert trainer_child.poll() is None, "the trainer's child process was killed"
    if os.geteuid() == 0:
        assert result.uid is not None and result.uid >= sandbox.UID_BASE
        assert processes_of(result.uid) == [], "processes of the sandbox outlived the run"


def test_an_infinite_loop_meets_the_cpu_limit(runs, trainer_child) -> None:
    value, kind, result = score("while True:\n    pass\n", runs, cpu_s=1, timeout_s=60)
    assert (value, kind) == (0.0, "cpu")
    assert_contained(result, trainer_child)


def test_a_fork_bomb_stops_at_nproc_and_dies_with_the_run(runs, trainer_child) -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    value, kind, result = score(bomb, runs, timeout_s=3, cpu_s=30)
    assert (value, kind) == (0.0, "timeout")
    assert_contained(result, trainer_child)


def test_a_memory_hog_meets_the_address_space_limit(runs, trainer_child) -> None:
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"
    value, kind, result = score(hog, runs)
    assert (value, kind) == (0.0, "memory")
    assert_contained(result, trainer_child)


def test_a_disk_filler_fills_only_its_own_tmpfs(runs, trainer_child) -> None:
    marker = f"rlite-filler-{os.getpid()}"
    filler = (f"import itertools\nfor n in itertools.count():\n    with open('/tmp/{marker}-%d' % n, 'wb') as f:\n"
              "        f.write(b'x' * (1 << 20))\n")
    value, kind, result = score(filler, runs)
    assert (value, kind) == (0.0, "disk")
    assert not list(Path("/tmp").glob(f"{marker}*")), "the filler wrote to the machine's /tmp"
    assert_contained(result, trainer_child)


def test_writing_outside_the_working_directory_fails(runs, trainer_child, monkeypatch) -> None:
    outside = Path(tempfile.mkdtemp(prefix=".sandbox-test-write-", dir=Path(__file__).parent))
    monkeypatch.chdir("/")  # so that the folder is not hidden: the read-only mounts must stop the write
    try:
        outside.chmod(0o777)  # world-writable: only the read-only mounts stop the sandbox's uid
        writer = f"open({str(outside / 'escaped')!r}, 'w').write('out')\n"
        value, kind, result = score(writer, runs)
        assert (value, kind) == (0.0, "error")
        # read-only where the host folder shows through; absent where the sandbox's private /tmp covers it
        # (a checkout under /tmp, as CI's fresh clone may be)
        assert "Read-only file system" in result.stderr or "No such file or directory" in result.stderr
        assert not (outside / "escaped").exists()
        assert_contained(result, trainer_child)
    finally:
        for path in outside.iterdir():
            path.unlink()
        outside.rmdir()


def test_a_connection_to_a_local_server_never_arrives(runs, trainer_child) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        client = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5).sendall(b'secret')\n"
        value, kind, result = score(client, runs)
        assert (value, kind) == (0.0, "error")
        assert "Network is unreachable" in result.stderr
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()
    assert_contained(result, trainer_child)


@pytest.mark.skipif(not os.access("/run", os.W_OK), reason="needs a folder of its own in /run")
def test_a_world_writable_unix_socket_in_run_cannot_be_reached(runs, trainer_child) -> None:
    folder = Path(tempfile.mkdtemp(prefix="rlite-sandbox-test-", dir="/run"))
    try:
        folder.chmod(0o755)
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(folder / "socket"))
            (folder / "socket").chmod(0o777)  # like a system bus socket: anyone may connect
            server.listen(8)
            client = f"import socket\nsocket.socket(socket.AF_UNIX).connect({str(folder / 'socket')!r})\n"
            value, kind, result = score(client, runs)
            assert (value, kind) == (0.0, "error")
            assert "PermissionError" in result.stderr or "FileNotFoundError" in result.stderr
            server.setblocking(False)
            with pytest.raises(BlockingIOError):
                server.accept()
        assert_contained(result, trainer_child)
    finally:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


def test_the_run_folder_and_hidden_paths_cannot_be_read(runs, trainer_child, monkeypatch) -> None:
    here = Path(__file__).parent
    run_folder = Path(tempfile.mkdtemp(prefix=".sandbox-test-run-", dir=here))
    data_folder = Path(tempfile.mkdtemp(prefix=".sandbox-test-data-", dir=here))
    try:
        for folder in (run_folder, data_folder):
            folder.chmod(0o755)
            (folder / "secret.txt").write_text("the run's secret")
            (folder / "secret.txt").chmod(0o644)  # world-readable, as a run's files are
        monkeypatch.chdir(run_folder)  # the trainer's working folder, hidden by default
        reader = (f"import os\nprint(open('/etc/os-release').read()[:4])\nfor p in [{str(run_folder / 'secret.txt')!r}, "
                  f"{str(data_folder / 'secret.txt')!r}]:\n    try:\n        print(open(p).read())\n"
                  "    except OSError as e:\n        print(type(e).__name__)\n")
        value, kind, result = score(reader, runs, hidden_paths=[str(data_folder)])
        assert value == 0.0 and kind == "ok"  # it ran, and read what any program may read
        assert "secret" not in result.stdout
        # unreadable, or (a checkout under /tmp, which the sandbox's private /tmp covers) not there at all
        assert all(line in ("PermissionError", "FileNotFoundError") for line in result.stdout.splitlines()[1:])
        assert len(result.stdout.splitlines()) == 3
        assert_contained(result, trainer_child)
    finally:
        for folder in (run_folder, data_folder):
            (folder / "secret.txt").unlink()
            folder.rmdir()


def test_killing_the_parent_or_everything_touches_nothing_outside(runs, trainer_child) -> None:
    killer = ("import os, signal\nfor target in (os.getppid(), -1):\n    try:\n        os.kill(target, signal.SIGKILL)\n"
              "    except OSError as e:\n        print(target, type(e).__name__, flush=True)\nos.kill(0, signal.SIGKILL)\n")
    value, kind, result = score(killer, runs)
    assert (value, kind) == (0.0, "killed")  # its own process group: itself
    # its parent is the namespace's init (root's, and unkillable from inside); kill -1 finds no one to kill
    assert result.stdout.splitlines() == ["1 PermissionError", "-1 ProcessLookupError"]
    assert_contained(result, trainer_child)


def test_a_sleeper_holding_children_is_killed_with_them_at_the_timeout(runs, trainer_child) -> None:
    sleeper = ("import os, signal, time\nfor _ in range(5):\n    if os.fork() == 0:\n        os.setsid()\n"
               "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n        time.sleep(1000)\ntime.sleep(1000)\n")
    value, kind, result = score(sleeper, runs, timeout_s=2)
    assert (value, kind) == (0.0, "timeout")
    assert_contained(result, trainer_child)


def test_printing_gigabytes_is_cut_at_the_output_limit(runs, trainer_child) -> None:
    printer = "import sys\nwhile True:\n    sys.stdout.write('x' * (1 << 20))\n"
    value, kind, result = score(printer, runs)
    assert (value, kind) == (0.0, "output_limit")
    assert len(result.stdout) <= LIMITS["output_bytes"]
    assert_contained(result, trainer_child)


def test_children_left_behind_by_a_finished_program_die_with_the_run(trainer_child) -> None:
    """A program that exits at once while its children keep running: they die with the run."""
    result = sandbox.run_untrusted("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\nprint('bye')\n")
    assert result.kind == "ok" and result.stdout == "bye\n"
    assert_contained(result, trainer_child)  # the namespace's init exited, and the kernel killed the child


# -- a run's own files, wherever they live -----------------------------------------------------------

LOOKS_AROUND = """
import json, os, stat, sys
seen = {}
for name, path in json.loads(sys.stdin.read()).items():
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        seen[name] = "refused: " + type(exc).__name__
        continue
    if stat.S_ISCHR(mode):
        seen[name] = "hidden: a character device"
    elif stat.S_ISDIR(mode):
        try:
            seen[name] = "listed " + ",".join(sorted(os.listdir(path)))
        except OSError as exc:
            seen[name] = "hidden: " + type(exc).__name__ + " " + oct(stat.S_IMODE(mode))
    else:
        try:
            with open(path, "rb") as handle:
                seen[name] = "read " + repr(handle.read(40))
        except OSError as exc:
            seen[name] = "refused: " + type(exc).__name__
print(json.dumps(seen))
"""


class LooksAround:
    """A reward whose first call runs a program in the sandbox that reads the run's files: the program a
    model could write. What it saw is kept in ``seen``."""

    def __init__(self, targets: dict[str, str]) -> None:
        self.targets, self.seen = targets, None

    @hookimpl_rlite
    def register_reward_functions(self, register):
        def look_around(completion, sample, cfg):
            if self.seen is None:
                import json

                result = sandbox.run_untrusted(LOOKS_AROUND, stdin=json.dumps(self.targets),
                                               limits=sandbox.SandboxLimits(timeout_s=60, cpu_s=10))  # fmt: skip
                self.seen = json.loads(result.stdout) if result.ok else {"failed": result.kind + result.stderr}
            return 0.0

        register("look_around", look_around)


@pytest.fixture
def elsewhere():
    """A folder a sandboxed program could see: outside the working folder, and outside /tmp, /var/tmp and
    /dev/shm, which the sandbox replaces with its own tmpfs."""
    import shutil

    for parent in ("/srv", "/var/lib", str(Path.home())):
        if os.access(parent, os.W_OK) and not os.getcwd().startswith(parent):
            folder = Path(tempfile.mkdtemp(prefix="rlite-sandbox-test-", dir=parent))
            break
    else:
        pytest.skip("no writable folder outside the working folder and the temporary folders")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_sandboxed_program_sees_nothing_of_a_run_outside_the_working_folder(elsewhere):
    """With logging.run_dir elsewhere (/srv/elsewhere/run), 31 of 32 programs read the run's config.yaml;
    only the working folder, /run and hidden_paths were hidden, and run folders were world-readable."""
    import json

    tmp_path = elsewhere
    tmp_path.chmod(0o755)  # others may pass: only hiding keeps the program out of what is below

    from rlite.plugin_manager import build_plugin_manager
    from rlite.run.checkpoint import list_checkpoints
    from rlite.run.loop import run_training
    from rlite.tasks import make_task
    from rlite.testing import tiny_config
    from rlite.tokenizer import build_tiny_model_dir

    assert not str(tmp_path).startswith(os.getcwd())  # the working folder is hidden anyway
    model_dir = build_tiny_model_dir(tmp_path / "tiny")
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(row) + "\n" for row in make_task("addition", 32, 0, 0)[0]))
    run_dir, offload = tmp_path / "elsewhere" / "run", tmp_path / "offload"
    common = (f"data.train_files={data}", "data.task=null", "checkpoint.every=1", "checkpoint.export_hf=false")
    run_training(tiny_config(model_dir, run_dir, "training.steps=1", *common))  # a run folder to find
    targets = {"config": str(run_dir / "config.yaml"), "checkpoints": str(run_dir / "checkpoints"),
               "run folder": str(run_dir), "data": str(data), "offload": str(offload)}  # fmt: skip
    peeker = LooksAround(targets)
    pm = build_plugin_manager(autoload=False)
    pm.register(peeker, name="looks_around")
    run_training(tiny_config(model_dir, run_dir, "training.steps=2", "checkpoint.resume=auto", "rewards=[look_around]",
                             "training.optimizer_offload=disk", f"training.optimizer_offload_dir={offload}", *common,
                             pm=pm), pm)  # fmt: skip
    assert peeker.seen is not None and "failed" not in peeker.seen, peeker.seen
    seen = peeker.seen
    # an empty mode-000 tmpfs over each folder, /dev/null over each file; what is inside cannot be reached
    assert seen["run folder"] == seen["offload"] == "hidden: PermissionError 0o0", seen
    assert seen["data"] == "hidden: a character device", seen
    assert seen["config"] == seen["checkpoints"] == "refused: PermissionError", seen
    # and the files themselves are the owner's only: run folder 0700, checkpoint files 0600
    assert stat_mode(run_dir) == 0o700
    (checkpoint,) = list_checkpoints(run_dir / "checkpoints")[-1:]
    assert {stat_mode(file) for file in checkpoint.iterdir()} == {0o600} and stat_mode(checkpoint) == 0o700


def stat_mode(path: Path) -> int:
    import stat

    return stat.S_IMODE(path.stat().st_mode)
