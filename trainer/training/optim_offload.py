"""AdamW with its moments on disk: the same numbers as ``torch.optim.AdamW(fused=True)``, and half
the memory that weights, gradients and moments take together.

Full fine-tuning with AdamW holds four fp32 copies of the model: weights, gradients and the two moments
``exp_avg`` (m) and ``exp_avg_sq`` (v). The moments are touched once per optimizer step and never by
the forward, the backward or the rollout engine, so between steps they can live in a file.
``DiskOffloadAdamW`` keeps each parameter's m and v in one file on disk (``m`` at offset 0, ``v`` at
the next page boundary) and steps in chunks of ``chunk_mb`` (m and v together) through a few staging
buffers that stay in memory, as a three-stage pipeline:

1. a reader thread reads the next chunks' m and v into free staging buffers (``preadv``);
2. the training thread runs torch's own fused AdamW kernel (``torch._fused_adamw_``, the one
   ``AdamW(fused=True)`` runs) on the chunk of the parameter, its gradient and the staged moments;
3. a writer thread writes the chunk's moments back (``pwritev``) and frees its buffer.

Reads, arithmetic and writes of neighbouring chunks overlap. Where the file system supports it the
files are read and written with ``O_DIRECT``: the data moves between the disk and the staging buffers
without passing through the page cache, so the moments take neither process memory (beyond the
staging buffers, ``slots x chunk_mb``) nor page cache at any time. Elsewhere (file systems without
``O_DIRECT``, such as tmpfs on older kernels) the I/O is buffered and a background thread writes the
dirty pages out and drops them after the step (``fdatasync``, ``posix_fadvise(POSIX_FADV_DONTNEED)``);
the next step waits for it first.

An earlier version mapped the files and stepped on the mapping. On the virtual machine this project
runs on, every step then took a gigabyte of page-cache pages from the kernel and gave it back, and the
arithmetic on freshly handed-out pages ran at a third of its speed: 2.0-2.7 s per step of a 135M
model, against about 1 s with the staging buffers (``benchmarks/optimizer_offload.py``).

Exactness: AdamW is elementwise and the chunks are whole multiples of 4096 elements, so every element
goes through the same kernel code as in one ``AdamW(fused=True)`` step: the result is bitwise equal
(``tests/unit/test_optim_offload.py`` checks it over several steps with weight decay and a changing
learning rate, with direct and buffered I/O; the integration and invariance tests check whole runs on
FSDP2 parameters, at world sizes 1 and 2, through a checkpoint and a resume). The step count is one per
parameter, incremented once per step as in torch.

The files are scratch space. Their disk blocks are reserved when they are created, so a full disk is
a clear error then and not a crash at a later write. Checkpoints hold the moments like any optimizer
state: ``state_dict()`` reads them through a memory mapping of each file, and after a save or a load
:meth:`DiskOffloadAdamW.release_pages` writes back and drops what the mapping touched, before the next
step reads the files directly. ``close()`` deletes the files.
"""

from __future__ import annotations

import mmap
import os
import queue
import shutil
import threading
from pathlib import Path
from typing import Any, NamedTuple

import torch

PAGE = mmap.PAGESIZE
_ALIGN_ELEMS = 4096  # chunk boundaries: whole pages of fp32 and whole vector widths of the kernel
_IO_TIMEOUT_S = 600.0  # one chunk's read or write; a stuck disk is an error, not a hang


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (an FSDP2 DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _direct_io_works(directory: Path) -> bool:
    """Whether files in ``directory`` take ``O_DIRECT`` reads and writes of whole pages."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".direct-probe"
    buffer = mmap.mmap(-1, PAGE)  # page-aligned, as O_DIRECT needs
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            return os.pwritev(fd, [buffer], 0) == PAGE and os.preadv(fd, [buffer], 0) == PAGE
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        buffer.close()
        probe.unlink(missing_ok=True)


class _MomentFile:
    """One parameter's m and v in one file: m at byte 0, v at the next page boundary. Steps read and
    write it through ``io_fd`` (``O_DIRECT`` when ``direct``); ``exp_avg``/``exp_avg_sq`` view it
    through a shared memory mapping, for state dicts."""

    def __init__(self, path: Path, numel: int, direct: bool) -> None:
        self.path = path
        self.numel = numel
        self.v_offset = _round_up(max(numel, 1) * 4, PAGE)  # (an empty FSDP2 shard still gets a page)
        size = 2 * self.v_offset
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.fd, size)  # reads as zeros, as the moments start
        if hasattr(os, "posix_fallocate"):
            # reserve the blocks now: a write of a full disk fails later, and into a mapping it kills (SIGBUS)
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError as exc:
                os.close(self.fd)
                raise OSError(
                    f"training.optimizer_offload_dir: cannot reserve {size / 2**20:.0f} MiB for {path} ({exc}); "
                    "free disk space there or point the option at a larger local disk"
                ) from exc
        self.direct = direct
        self.io_fd = os.open(path, os.O_RDWR | os.O_DIRECT) if direct else self.fd
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        count = max(numel, 1)  # frombuffer refuses count 0
        self.exp_avg = torch.frombuffer(self.map, dtype=torch.float32, count=count, offset=0)[:numel]
        self.exp_avg_sq = torch.frombuffer(self.map, dtype=torch.float32, count=count, offset=self.v_offset)[:numel]

    def _io(self, call, start: int, stop: int, m: memoryview, v: memoryview) -> None:
        """``preadv``/``pwritev`` elements ``[start, stop)`` of both moments from/to ``m`` and ``v``,
        rounded up to whole pages (the file pads each moment to a page boundary)."""
        nbytes = _round_up((stop - start) * 4, PAGE)
        for base, buffer in ((0, m), (self.v_offset, v)):
            done = 0
            while done < nbytes:
                n = call(self.io_fd, [buffer[done:nbytes]], base + start * 4 + done)
                if n <= 0:
                    raise OSError(f"short {call.__name__} of {self.path} at byte {base + start * 4 + done}")
                done += n

    def read(self, start: int, stop: int, m: memoryview, v: memoryview) -> None:
        self._io(os.preadv, start, stop, m, v)

    def write(self, start: int, stop: int, m: memoryview, v: memoryview) -> None:
        self._io(os.pwritev, start, stop, m, v)

    def drop_mapped_pages(self) -> None:
        """Unmap every page of the file from this process (``MADV_DONTNEED``; dirty data stays in
        the page cache until :meth:`flush`)."""
        self.map.madvise(mmap.MADV_DONTNEED, 0, len(self.map))

    def flush(self) -> None:
        """Write the dirty pages to disk, then drop them from the page cache (where the OS has
        ``posix_fadvise``; elsewhere the OS evicts them when it needs the memory)."""
        getattr(os, "fdatasync", os.fsync)(self.fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        del self.exp_avg, self.exp_avg_sq  # the tensors export the mapping's buffer
        try:
            self.map.close()
        except BufferError:  # a state_dict() copy still views the mapping: the OS unmaps it later
            pass
        if self.io_fd != self.fd:
            os.close(self.io_fd)
        os.close(self.fd)


class _Staging:
    """``slots`` page-aligned buffers, each holding one chunk of m and one of v (kept for the whole
    run, so their memory is mapped once and reused)."""

    def __init__(self, slots: int, chunk: int) -> None:
        self.buffer = mmap.mmap(-1, slots * 2 * chunk * 4)
        flat = torch.frombuffer(self.buffer, dtype=torch.float32)
        self.view = memoryview(self.buffer)
        self.tensors = [(flat[(2 * i) * chunk : (2 * i + 1) * chunk], flat[(2 * i + 1) * chunk : (2 * i + 2) * chunk])
                        for i in range(slots)]
        self.views = [(self.view[(2 * i) * chunk * 4 : (2 * i + 1) * chunk * 4],
                       self.view[(2 * i + 1) * chunk * 4 : (2 * i + 2) * chunk * 4]) for i in range(slots)]

    def close(self) -> None:
        for m, v in self.views:
            m.release()
            v.release()
        self.view.release()
        self.tensors = self.views = []
        try:
            self.buffer.close()
        except BufferError:  # a tensor still views the buffer: the OS unmaps it when that goes
            pass


class _Chunk(NamedTuple):
    """Elements ``[start, stop)`` of one parameter: what the step pipeline reads, steps and writes."""

    group: dict[str, Any]
    param: torch.Tensor  # flat local shard
    grad: torch.Tensor
    file: _MomentFile
    step: torch.Tensor
    start: int
    stop: int



def _adamw_step(chunk: _Chunk, m: torch.Tensor, v: torch.Tensor) -> None:
    """AdamW on one chunk of a parameter, its moments ``m`` and ``v`` read from disk (torch's fused kernel, as
    the in-memory optimizer runs it)."""
    start, stop, group = chunk.start, chunk.stop, chunk.group
    beta1, beta2 = group["betas"]
    torch._fused_adamw_(
        [chunk.param[start:stop]],
        [chunk.grad[start:stop]],
        [m],
        [v],
        [],
        [chunk.step],
        amsgrad=False,
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
        grad_scale=None,
        found_inf=None,
    )

class DiskOffloadAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, no amsgrad) whose moments live in files under ``directory``;
    bitwise equal to ``torch.optim.AdamW(..., fused=True)``. See the module docstring.

    ``chunk_mb``: m and v of one pipeline chunk; ``slots``: staging buffers of that size (at least
    3: one being read, one stepped, one written); ``direct_io``: read and write with ``O_DIRECT``
    (None: where the file system takes it)."""

    def __init__(
        self,
        params,
        directory: str | Path,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        chunk_mb: float = 16.0,
        slots: int = 3,
        direct_io: bool | None = None,
    ) -> None:
        if chunk_mb <= 0:
            raise ValueError(f"DiskOffloadAdamW: chunk_mb must be > 0, got {chunk_mb}")
        if slots < 3:
            raise ValueError(f"DiskOffloadAdamW: slots must be >= 3 (read, step, write), got {slots}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / ".probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise OSError(
                f"training.optimizer_offload_dir: cannot write optimizer state files under {self.directory} "
                f"({exc}); point it at a writable folder on a local disk"
            ) from exc
        for stale in self.directory.glob("param*.bin"):  # left by a killed run: scratch, never read
            stale.unlink()
        # elements per chunk (m and v together take 8 bytes an element), a whole number of pages
        self.chunk = max(_ALIGN_ELEMS, int(chunk_mb * 2**20 / 8) // _ALIGN_ELEMS * _ALIGN_ELEMS)
        self.slots = slots
        self.direct_io = _direct_io_works(self.directory) if direct_io is None else direct_io
        self._staging: _Staging | None = None  # made at the first step
        self._files: dict[int, _MomentFile] = {}  # id(param) -> its file
        self._flusher: threading.Thread | None = None
        self._flush_error: BaseException | None = None

    # -- state ------------------------------------------------------------------------------------

    def _file_of(self, p: torch.Tensor) -> _MomentFile:
        """Create ``p``'s moment file and its state entry (zeros, step 0), once."""
        f = self._files.get(id(p))
        if f is not None:
            return f
        local = _local(p)
        if local.dtype != torch.float32 or local.device.type != "cpu":
            raise TypeError(
                "training.optimizer_offload=disk steps fp32 parameters held in CPU memory; got "
                f"{local.dtype} on {local.device}"
            )
        f = _MomentFile(self.directory / f"param{len(self._files):05d}.bin", local.numel(), self.direct_io)
        self._files[id(p)] = f
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = self._like(p, f.exp_avg)
        state["exp_avg_sq"] = self._like(p, f.exp_avg_sq)
        return f

    @staticmethod
    def _like(p: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` shaped like ``p`` (a DTensor over the same mesh when ``p`` is one)."""
        local = flat.view(_local(p).shape)
        if not hasattr(p, "to_local"):
            return local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )

    def init_state(self) -> None:
        """Create every parameter's moment file and state entry (zeros, step 0) now rather than at the first
        step: a backend that loads a checkpoint into ``self.state`` in place (megatron's) needs them."""
        for group in self.param_groups:
            for p in group["params"]:
                self._file_of(p)

    def load_state_dict(self, state_dict) -> None:
        """Load as torch does, then move every loaded moment into its parameter's file."""
        self.wait()
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                loaded = dict(self.state.get(p, {}))
                if "exp_avg" not in loaded:
                    continue
                f = self._file_of(p)  # (creating it resets self.state[p]: ``loaded`` is a copy)
                step = loaded["step"]
                m, v = _local(loaded["exp_avg"]), _local(loaded["exp_avg_sq"])
                if m.data_ptr() != f.exp_avg.data_ptr():
                    f.exp_avg.copy_(m.reshape(-1))
                if v.data_ptr() != f.exp_avg_sq.data_ptr():
                    f.exp_avg_sq.copy_(v.reshape(-1))
                self.state[p] = {
                    "step": _local(step).detach().clone().float().cpu(),
                    "exp_avg": self._like(p, f.exp_avg),
                    "exp_avg_sq": self._like(p, f.exp_avg_sq),
                }
        self.release_pages()

    def release_pages(self) -> None:
        """Unmap every page of the moment files from the process and write them back and drop them
        from the page cache in the background, after anything used the mappings (a checkpoint save
        or load): the next step reads the files themselves, and waits for this first."""
        self.wait()
        for f in self._files.values():
            f.drop_mapped_pages()
        self._start_flush()

    # -- step -------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait()
        work: list[_Chunk] = []  # in order
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                f = self._file_of(p)
                step_t = self.state[p]["step"]
                step_t += 1  # once per parameter and step, as torch's _fused_adam does
                param, grad = _local(p).view(-1), _local(p.grad).view(-1)
                for start in range(0, param.numel(), self.chunk):
                    work.append(_Chunk(group, param, grad, f, step_t, start, min(param.numel(), start + self.chunk)))
        if work:
            self._pipeline(work)
        if not self.direct_io:
            self._start_flush()  # buffered writes: out to disk and out of the page cache
        return loss

    def _pipeline(self, work: list[_Chunk]) -> None:
        """Read chunk i + 1 (reader thread) while chunk i is stepped here and chunk i - 1 is written
        back (writer thread); a staging buffer goes back to the reader once its chunk is written."""
        if self._staging is None:
            self._staging = _Staging(self.slots, self.chunk)
        staging = self._staging
        free: queue.Queue = queue.Queue()
        loaded: queue.Queue = queue.Queue()
        stepped: queue.Queue = queue.Queue()
        for slot in range(self.slots):
            free.put(slot)
        errors: list[BaseException] = []
        stop_reading = threading.Event()

        def reader() -> None:
            try:
                for chunk in work:
                    slot = free.get(timeout=_IO_TIMEOUT_S)
                    if stop_reading.is_set():
                        return
                    chunk.file.read(chunk.start, chunk.stop, *staging.views[slot])
                    loaded.put(slot)
            except BaseException as exc:
                errors.append(exc)
                loaded.put(None)

        def writer() -> None:
            while True:
                item = stepped.get()
                if item is None:
                    return
                index, slot = item
                chunk = work[index]
                try:
                    if not errors:
                        chunk.file.write(chunk.start, chunk.stop, *staging.views[slot])
                except BaseException as exc:
                    errors.append(exc)
                free.put(slot)

        threads = [threading.Thread(target=reader, name="rlite-optimizer-read", daemon=True),
                   threading.Thread(target=writer, name="rlite-optimizer-write", daemon=True)]
        for t in threads:
            t.start()
        try:
            for index, chunk in enumerate(work):
                try:
                    slot = loaded.get(timeout=_IO_TIMEOUT_S)
                except queue.Empty:
                    raise TimeoutError(f"optimizer offload: reading the moments from {self.directory} took over "
                                       f"{_IO_TIMEOUT_S:.0f}s") from None
                if slot is None:
                    break
                _adamw_step(chunk, *(t[: chunk.stop - chunk.start] for t in staging.tensors[slot]))
                stepped.put((index, slot))
        finally:
            stop_reading.set()
            free.put(0)  # wakes a reader waiting for a buffer after a failure
            stepped.put(None)
            for t in threads:
                t.join(_IO_TIMEOUT_S)
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"optimizer offload: a read or write of the moments under {self.directory} took over "
                               f"{_IO_TIMEOUT_S:.0f}s")
        if errors:
            raise OSError(f"optimizer offload: reading or writing the moments under {self.directory} failed: "
                          f"{errors[0]}") from errors[0]

    def _start_flush(self) -> None:
        files = list(self._files.values())

        def run() -> None:
            try:
                for f in files:
                    f.flush()
            except BaseException as exc:  # re-raised by wait() on the training thread
                self._flush_error = exc

        self._flusher = threading.Thread(target=run, name="rlite-optimizer-flush", daemon=True)
        self._flusher.start()

    def wait(self, timeout: float = 600.0) -> None:
        """Wait for the background write-back of the last step; raise its error, if any."""
        if self._flusher is not None:
            self._flusher.join(timeout)
            if self._flusher.is_alive():
                raise TimeoutError(
                    f"optimizer offload: writing the moments to {self.directory} took over {timeout:.0f}s"
                )
            self._flusher = None
        if self._flush_error is not None:
            exc, self._flush_error = self._flush_error, None
            raise OSError(f"optimizer offload: writing the moments to {self.directory} failed: {exc}") from exc

    def close(self) -> None:
        """Wait for the write-back, unmap and delete the moment files (they are scratch space)."""
        self.wait()
        self.state.clear()  # drop the views of the mappings first, so that they can be unmapped now
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        shutil.rmtree(self.directory, ignore_errors=True)


def optimizer_offload_dir(optimizer_offload_dir: str, run_dir: str | Path, rank: int) -> Path:
    """This rank's folder for the moments of ``training.optimizer_offload=disk``: under
    ``training.optimizer_offload_dir`` (given as ``optimizer_offload_dir``), or ``<run_dir>/optimizer_offload``."""
    return Path(optimizer_offload_dir or Path(run_dir) / "optimizer_offload") / f"rank{rank}"
