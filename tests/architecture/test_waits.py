"""Nothing hangs without a timeout: every blocking wait on a process, thread, pipe, socket, future or
subprocess in the loop, its stages, the engines (rlite's own engine plugins included), the weight-sync
wire and the reward runner passes a timeout, or is listed in :data:`BOUNDED_ELSEWHERE` with the reason it cannot block for ever.

The waits are found in the syntax tree: calls of ``join``, ``wait``, ``recv``, ``recv_bytes``,
``result``, ``communicate``, ``acquire``, ``accept``, an HTTP ``open``/``urlopen``, a ``get`` without a
key (a queue's; ``dict.get(key)`` is not a wait) and ``subprocess.run``; a string's
``"sep".join(...)`` is not a wait.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [*(f"trainer/{entry}" for entry in ("reward_runner.py", "sandbox.py", "sandbox_init.py", "distributed.py",
                                              "stages", "engines", "sync", "run")),
           "plugins/transformers", "plugins/sglang"]  # fmt: skip
WAITS = {"join", "wait", "recv", "recv_bytes", "result", "communicate", "acquire", "accept", "urlopen"}

BOUNDED_ELSEWHERE = {
    ("plugins/transformers/process.py", "self.conn.recv_bytes()"):
        "read only after multiprocessing.connection.wait(..., timeout) reported the pipe readable",
    ("plugins/transformers/process.py", "conn.recv()"):
        "the engine process's idle loop: it ends with EOF when the trainer goes, and the trainer's side "
        "of every exchange has a timeout",
    ("trainer/sync/transport.py", "self.conn.recv()"):
        "read only after self.conn.poll(timeout_s) reported the pipe readable",
    ("trainer/reward_runner.py", "self._jobs.get()"):
        "a reward worker thread's idle loop: close() puts one None per thread, and every batch's wait on the "
        "threads has the batch's deadline",
    ("trainer/reward_runner.py", "conn.recv()"):
        "a reward worker process's idle loop: it ends with EOF when the trainer goes, and the trainer kills a "
        "worker that passes the batch's deadline",
    ("trainer/reward_runner.py", "worker.conn.recv()"):
        "read only after multiprocessing.connection.wait(..., timeout) reported the worker's pipe readable",
    ("trainer/stages/async_rollout.py", "self.engine_lock.acquire()"):
        "taken back from the trainer's weight sync, which holds it only for the sync, itself bounded by the "
        "engine's timeouts",
}  # fmt: skip


def files() -> list[Path]:
    found = []
    for entry in SCANNED:
        path = ROOT / entry
        found += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return found


def has_timeout(call: ast.Call) -> bool:
    return bool(call.args) or any(k.arg in ("timeout", "timeout_s") for k in call.keywords)


def waits_in(path: Path, root: Path = ROOT) -> list[tuple[str, int, str, bool]]:
    """``(path relative to root, line, source, has a timeout)`` of every wait in ``path``."""
    rel = str(path.relative_to(root))
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute):
            if isinstance(func.value, ast.Constant) and isinstance(func.value.value, str):
                continue  # ", ".join(...)
            receiver = ast.unparse(func.value).lower()
            if func.attr in ("get", "open") and not node.args or func.attr == "run" and receiver == "subprocess" or (
                func.attr == "open" and "opener" in receiver
            ):
                found.append((rel, node.lineno, ast.unparse(node), any(k.arg == "timeout" for k in node.keywords)))
                continue
            if func.attr not in WAITS:
                continue
        elif not (isinstance(func, ast.Name) and func.id == "wait"):
            continue
        found.append((rel, node.lineno, ast.unparse(node), has_timeout(node)))
    return found


def test_every_wait_has_a_timeout_or_a_reason():
    waits = [w for path in files() for w in waits_in(path)]
    assert len(waits) >= 10, "the scan found too few waits: is it still looking at the right files?"
    unbounded = [
        f"{rel}:{line}: {source}"
        for rel, line, source, timed in waits
        if not timed and (rel, source) not in BOUNDED_ELSEWHERE
    ]
    assert not unbounded, "waits without a timeout (pass one, or say in BOUNDED_ELSEWHERE why none is needed):\n" + "\n".join(unbounded)
    listed = {(rel, source) for rel, _, source, _ in waits}
    stale = [key for key in BOUNDED_ELSEWHERE if key not in listed]
    assert not stale, f"BOUNDED_ELSEWHERE lists waits that no longer exist: {stale}"


def test_the_scan_sees_a_wait_without_a_timeout(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("def f(p, q, futures, inbox):\n    p.join()\n    q.join(5.0)\n    ', '.join(q)\n"
                      "    futures.result()\n    inbox.get()\n    subprocess.run(['x'])\n    wait([p], timeout=1)\n"
                      "    {}.get('k')\n    done.get(timeout=2)\n    opener.open(r)\n")  # fmt: skip
    found = {(line, timed) for _, line, _, timed in waits_in(source, tmp_path)}
    assert found == {(2, False), (3, True), (5, False), (6, False), (7, False), (8, True), (10, True), (11, False)}
