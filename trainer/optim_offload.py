"""AdamW with its moments on disk: the same numbers as ``torch.optim.AdamW(fused=True)``, and half
the memory that weights, gradients and moments take together.

Full fine-tuning with AdamW holds four fp32 copies of the model: weights, gradients and the two moments
``exp_avg`` (m) and ``exp_avg_sq`` (v). The moments are touched once per optimizer step and never by
the forward, the backward or the rollout engine, so between steps they can live in a file.
``DiskOffloadAdamW`` keeps each parameter's m and v in one file on disk (``m`` at offset 0, ``v`` at
the next page boundary), memory-mapped, and steps in chunks of ``chunk_mb``:

1. ask the kernel to read the next chunk ahead (``madvise(MADV_WILLNEED)``: asynchronous readahead,
   so the disk read overlaps this chunk's arithmetic);
2. map the chunk's pages in one call (``MADV_POPULATE_WRITE``, not one fault per page), then run
   torch's own fused AdamW kernel (``torch._fused_adamw_``, the one ``AdamW(fused=True)`` runs) on
   that chunk of the parameter, its gradient and its moments, in place in the mapping;
3. unmap the chunk's pages from the process (``madvise(MADV_DONTNEED)``; the data stays in the page
   cache, marked dirty).

After the step a background thread writes the dirty pages to disk (``fdatasync``) and drops them from
the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``), so the moments take neither process memory
nor page cache until the next step reads them again. The next step waits for that thread first.

Exactness: AdamW is elementwise and the chunks are whole multiples of 4096 elements, so every element
goes through the same kernel code as in one ``AdamW(fused=True)`` step: the result is bitwise equal
(``tests/unit/test_optim_offload.py`` checks it over several steps with weight decay and a changing
learning rate; the integration and invariance tests check whole runs on FSDP2 parameters, at world
sizes 1 and 2, through a checkpoint and a resume). The step count is one per parameter, incremented once per step
as in torch.

Cost: each step reads and writes 2 x 4 bytes per trainable parameter (1 GiB for a 135M model). The
reads overlap the arithmetic, the writes happen while the next rollout generates. On this project's
2-core VM the optimizer step of a 135M model takes 0.9-1.0 s (1.6 s with the write-back waited for)
instead of 0.16 s, bound by reading 1 GiB from disk (``benchmarks/optimizer_offload.py``).

The files are scratch space. Their disk blocks are reserved when they are created, so a full disk is
a clear error then and not a crash at a later write into the mapping. Checkpoints hold the moments
like any optimizer state (``state_dict()`` reads them through the mapping), and ``close()`` deletes
the files.
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

PAGE = mmap.PAGESIZE
# Linux's MADV_POPULATE_WRITE (Python < 3.13 lacks the name); other systems number their advice differently
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else 0)
_ALIGN_ELEMS = 4096  # chunk boundaries: whole pages of fp32 and whole vector widths of the kernel


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (an FSDP2 DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class _MomentFile:
    """One parameter's m and v in one memory-mapped file: m at byte 0, v at the next page boundary."""

    def __init__(self, path: Path, numel: int) -> None:
        self.path = path
        self.numel = numel
        self.v_offset = _round_up(max(numel, 1) * 4, PAGE)  # (an empty FSDP2 shard still gets a page)
        size = 2 * self.v_offset
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.fd, size)  # reads as zeros, as the moments start
        if hasattr(os, "posix_fallocate"):
            # reserve the blocks now: a write into a mapped page of a full disk would kill the process (SIGBUS)
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError as exc:
                os.close(self.fd)
                raise OSError(
                    f"training.optimizer_offload_dir: cannot reserve {size / 2**20:.0f} MiB for {path} ({exc}); "
                    "free disk space there or point the option at a larger local disk"
                ) from exc
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        count = max(numel, 1)  # frombuffer refuses count 0
        self.exp_avg = torch.frombuffer(self.map, dtype=torch.float32, count=count, offset=0)[:numel]
        self.exp_avg_sq = torch.frombuffer(self.map, dtype=torch.float32, count=count, offset=self.v_offset)[:numel]

    def advise(self, advice: int, start: int, stop: int) -> None:
        """``madvise`` elements ``[start, stop)`` of both moments (rounded out to whole pages)."""
        lo, hi = start * 4 // PAGE * PAGE, _round_up(stop * 4, PAGE)
        for base in (0, self.v_offset):
            self.map.madvise(advice, base + lo, hi - lo)

    def populate(self, start: int, stop: int) -> None:
        """Map elements ``[start, stop)`` of both moments writable in one call
        (``MADV_POPULATE_WRITE``, Linux 5.14+) instead of one page fault per 4 KiB page; a no-op
        where the kernel lacks it."""
        global _POPULATE_WRITE
        if _POPULATE_WRITE:
            try:
                self.advise(_POPULATE_WRITE, start, stop)
            except OSError:
                _POPULATE_WRITE = 0

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
        os.close(self.fd)


class DiskOffloadAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, no amsgrad) whose moments live in memory-mapped files under
    ``directory``; bitwise equal to ``torch.optim.AdamW(..., fused=True)``. See the module docstring."""

    def __init__(
        self,
        params,
        directory: str | Path,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        chunk_mb: float = 16.0,
    ) -> None:
        if chunk_mb <= 0:
            raise ValueError(f"DiskOffloadAdamW: chunk_mb must be > 0, got {chunk_mb}")
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
        f = _MomentFile(self.directory / f"param{len(self._files):05d}.bin", local.numel())
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

    def _moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.state[p]
        return _local(state["exp_avg"]).view(-1), _local(state["exp_avg_sq"]).view(-1)

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
        """Unmap every moment page from the process and write them back in the background (after
        anything read the moments outside a step, e.g. a checkpoint save)."""
        self.wait()
        for f in self._files.values():
            f.advise(mmap.MADV_DONTNEED, 0, f.numel)
        self._start_flush()

    # -- step -------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                f = self._file_of(p)
                step_t = self.state[p]["step"]
                step_t += 1  # once per parameter and step, as torch's _fused_adam does
                param, grad = _local(p).view(-1), _local(p.grad).view(-1)
                exp_avg, exp_avg_sq = self._moments(p)
                n = param.numel()
                f.advise(mmap.MADV_WILLNEED, 0, min(n, self.chunk))
                for start in range(0, n, self.chunk):
                    stop = min(n, start + self.chunk)
                    if stop < n:
                        f.advise(mmap.MADV_WILLNEED, stop, min(n, stop + self.chunk))
                    f.populate(start, stop)
                    torch._fused_adamw_(
                        [param[start:stop]],
                        [grad[start:stop]],
                        [exp_avg[start:stop]],
                        [exp_avg_sq[start:stop]],
                        [],
                        [step_t],
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
                    f.advise(mmap.MADV_DONTNEED, start, stop)
        self._start_flush()
        return loss

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
        shutil.rmtree(self.directory, ignore_errors=True)
