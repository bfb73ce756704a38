"""What the children of ``vs_trl.py`` share: the job both frameworks run, and how a child measures.

* The job: rlite's reward functions (called by both frameworks), the chat messages of a prompt and
  rlite's token ids for them (TRL's are checked against these).
* The measurement: :class:`StepClock` (wall and CPU time per step and per phase, and with
  ``--memory-phases`` a thread that samples the resident memory and malloc's live bytes and charges
  them to the phase running), the peak RSS of the process, one thread per process.
* :func:`child_main`: the entry point of every child script (``<script> KIND SPEC_JSON RESULT_JSON``),
  with the optional cProfile of the training loop.

Nothing here touches rlite's or TRL's internals: each child decides how its phases are delimited.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

OUTSIDE = "outside the timed phases"


class BenchError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------------
# the job both frameworks run
# --------------------------------------------------------------------------------------------------


def reward_fn(name: str) -> Callable[[str, str], float]:
    """rlite's own reward function, as ``f(completion_text, answer) -> float`` (used by both frameworks)."""
    from rlite.plugins.rewards import ExactMatchConfig, NumericConfig, exact_match, numeric

    if name == "exact_match":
        cfg = ExactMatchConfig()
        return lambda text, answer: exact_match(text, {"answer": answer}, cfg)
    if name == "numeric":
        cfg = NumericConfig(position="last")
        return lambda text, answer: numeric(text, {"answer": answer}, cfg)
    if name == "digit_fraction":
        return lambda text, answer: digit_fraction(text)
    raise ValueError(f"unknown reward {name!r}")


def digit_fraction(text: str) -> float:
    """The GPU job's reward: the share of a completion's characters that are digits. Cheap and the same in
    both frameworks, and dense enough on a random model that groups rarely score alike."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def messages_of(prompt: str, system_prompt: str | None) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": prompt}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def rlite_prompt_ids(rows: list[dict], tokenizer, system_prompt: str | None) -> list[list[int]]:
    """Token ids of the prompts exactly as rlite builds them (chat template, no special tokens added)."""
    from rlite.data import build_prompt_set

    prompt_set = build_prompt_set(
        rows, tokenizer, source="bench", key="bench", chat_template=True, system_prompt=system_prompt
    )
    if len(prompt_set) != len(rows):
        raise BenchError(f"rlite dropped {len(rows) - len(prompt_set)} prompts as too long")
    return [item.prompt_ids for item in prompt_set]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------------


def setup_threads(threads: int | None = 1) -> None:
    """One thread per process (the CPU jobs: the frameworks compared on equal footing on a shared machine);
    ``None`` leaves torch's setting as the environment made it (the GPU job, where the host only feeds the
    device; ``vs_trl.py`` starts every child with ``OMP_NUM_THREADS=1``)."""
    import torch

    if threads is None:
        return
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(threads)


def synchronize() -> None:
    """Wait for the GPU's queued work (no-op without CUDA): a phase timed between two synchronisations holds
    its own kernels, not the ones queued before it, on a GPU where calls return before their kernels run."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def device_memory_gib() -> dict[str, float]:
    """The process's peak GPU memory (``torch.cuda.max_memory_allocated`` and ``_reserved``, GiB); empty on CPU."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}  # fmt: skip


class Deadline:
    """The ``--budget-s`` guard of one child: after ``seconds`` from its start, the child finishes the step
    under way and stops (what it measured so far is its result)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()
        self.hit = False

    def passed(self) -> bool:
        self.hit = self.seconds is not None and time.perf_counter() - self.start > self.seconds
        return self.hit


def max_rss_mib() -> float:
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) / 1024.0  # Linux: KiB


def malloc_live_mib() -> Callable[[], float] | None:
    """A function returning the bytes glibc's malloc has handed out and not yet had back (MiB), or
    None off glibc. RSS minus this is what the allocator keeps after frees (plus non-malloc memory:
    code, mapped files)."""
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = Mallinfo2

    def live() -> float:
        info = mallinfo2()
        return (info.uordblks + info.hblkhd) / 2**20

    return live


PROFILER = None  # a cProfile.Profile in a training child run with --profile (set by child_main)


class StepClock:
    """Wall and CPU time (``time.process_time``: all threads of this process) per step and per phase.

    CPU time is the steadier number on a machine shared with other jobs: time spent waiting for a
    core counts in wall time only. ``active`` names the phases running now (innermost last); the
    memory sampler charges each sample to the innermost one. A child keeps it current either by
    timing calls with :meth:`phase` or by assigning it at phase boundaries.
    """

    def __init__(self) -> None:
        self.current: dict[str, list[float]] = {}
        self.steps: list[dict[str, list[float]]] = []
        self.step_wall: list[float] = []
        self.step_cpu: list[float] = []
        self.last = (time.perf_counter(), time.process_time())
        self.active: list[str] = []
        self.peak_rss: dict[str, float] = {}  # MiB: the highest resident memory sampled inside each phase
        self.peak_live: dict[str, float] = {}  # MiB: the most bytes malloc had handed out (glibc only)
        self._sampler: threading.Thread | None = None
        self._sampling = threading.Event()

    def sample_memory(self, interval: float = 0.002) -> None:
        """Sample the resident memory every ``interval`` s on a thread and charge it to the innermost
        active phase: ``peak_rss`` then says which phase reaches the process's peak, and how high the
        others go. (A peak shorter than the interval can be missed; ``getrusage`` still has it.)"""
        page = os.sysconf("SC_PAGE_SIZE") / 2**20
        live_mib = malloc_live_mib()

        def run() -> None:
            samples = 0
            with open("/proc/self/statm") as statm:
                while not self._sampling.wait(interval):
                    statm.seek(0)
                    rss = int(statm.read().split()[1]) * page
                    try:  # the training thread changes `active` while this reads it
                        label = self.active[-1]
                    except IndexError:
                        label = OUTSIDE
                    if rss > self.peak_rss.get(label, 0.0):
                        self.peak_rss[label] = rss
                    samples += 1
                    # mallinfo2 walks malloc's free lists under its locks: every 10th sample only
                    if live_mib is not None and samples % 10 == 0:
                        live = live_mib()
                        if live > self.peak_live.get(label, 0.0):
                            self.peak_live[label] = live

        self._sampler = threading.Thread(target=run, name="rss-sampler", daemon=True)
        self._sampler.start()

    def start(self) -> None:
        """The training loop starts: step 1 is timed from here (and profiled, with ``--profile``)."""
        self.current = {}
        if PROFILER is not None:
            PROFILER.enable()
        self.last = (time.perf_counter(), time.process_time())

    def stop(self) -> None:
        if PROFILER is not None:
            PROFILER.disable()
        if self._sampler is not None:
            self._sampling.set()
            self._sampler.join()
            self._sampler = None

    def end_step(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.step_wall.append(wall - self.last[0])
        self.step_cpu.append(cpu - self.last[1])
        self.last = (wall, cpu)
        self.steps.append(self.current)
        self.current = {}

    def add(self, label: str, wall: float, cpu: float) -> None:
        acc = self.current.setdefault(label, [0.0, 0.0])
        acc[0] += wall
        acc[1] += cpu

    def phase(self, label: str):
        """A context manager that times its body as ``label`` (and marks it active)."""
        return _Phase(self, label)

    def phases(self, derive) -> list[dict[str, list[float]]]:
        """Per step: ``derive(raw) -> {phase: [wall, cpu]}`` (exclusive phases that add up to at most the step)."""
        out = []
        for raw in self.steps:

            def get(key: str, raw: dict = raw) -> list[float]:
                return raw.get(key, [0.0, 0.0])

            out.append({k: [float(v[0]), float(v[1])] for k, v in derive(get).items()})
        return out


class _Phase:
    def __init__(self, clock: StepClock, label: str) -> None:
        self.clock, self.label = clock, label

    def __enter__(self) -> None:
        self.start = (time.perf_counter(), time.process_time())
        self.clock.active.append(self.label)

    def __exit__(self, *exc) -> None:
        self.clock.active.pop()
        self.clock.add(self.label, time.perf_counter() - self.start[0], time.process_time() - self.start[1])


def minus(a: list[float], *others: list[float]) -> list[float]:
    return [a[0] - sum(o[0] for o in others), a[1] - sum(o[1] for o in others)]


# --------------------------------------------------------------------------------------------------
# the child entry point
# --------------------------------------------------------------------------------------------------


def child_main(children: dict[str, Callable[[dict], dict]], argv: list[str]) -> None:
    """``argv = [kind, spec_json, result_json]``: run ``children[kind](spec)`` and write its result.

    With ``spec["profile"]`` a training child (``rlite``, ``trl``) runs its loop under cProfile (the
    :class:`StepClock` switches it on and off); the statistics go into the result and next to it.
    """
    global PROFILER
    kind, spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("profile") and kind in ("rlite", "trl"):
        import cProfile

        PROFILER = cProfile.Profile()
    result = children[kind](spec)
    if PROFILER is not None:
        import io
        import pstats

        text = io.StringIO()
        stats_ = pstats.Stats(PROFILER, stream=text)
        stats_.dump_stats(str(Path(out_path).with_suffix(".prof")))
        stats_.sort_stats("tottime").print_stats(spec.get("profile_top", 30))
        stats_.sort_stats("cumulative").print_stats(spec.get("profile_top", 30))
        result["profile"] = text.getvalue()
    Path(out_path).write_text(json.dumps(result, indent=1))
