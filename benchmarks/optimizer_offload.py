"""AdamW step time and memory: torch's fused in-memory AdamW against rlite's DiskOffloadAdamW.

Builds fp32 parameters of SmolLM2-135M's shapes (a 49152 x 576 embedding and 30 decoder blocks, no
model download), gives them gradients, and times optimizer steps of both, one after the other in this
process, one thread. Prints per-step wall and CPU seconds, the ratio, and the resident memory each
optimizer added. ``DiskOffloadAdamW``'s step reads and writes every moment (with direct I/O where the
file system takes it; otherwise its background write-back is waited for between steps), so its step
time is bound by the disk.

    python benchmarks/optimizer_offload.py [--steps 4] [--chunk-mb 16] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time

import torch
from machine_info import rss_mib  # benchmarks/ is on sys.path when a script here runs


def smollm2_shapes() -> list[tuple[int, ...]]:
    block = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536), (576,), (576,)]
    return [(49152, 576), (576,)] + block * 30


def time_steps(optimizer, steps: int) -> list[tuple[float, float]]:
    out = []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        optimizer.step()
        if hasattr(optimizer, "wait"):
            optimizer.wait()  # charge the write-back to the step, so nothing is hidden
        out.append((time.perf_counter() - wall, time.process_time() - cpu))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--chunk-mb", type=float, default=16.0)
    parser.add_argument("--dir", default=None, help="folder for the moment files (default: the temp folder)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from rlite.api import DiskOffloadAdamW

    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in smollm2_shapes()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    print(f"{n / 1e6:.1f}M fp32 parameters, {args.steps} steps each (the first is the warm-up)")
    rows = {}
    for name in ("torch AdamW(fused=True)", "rlite DiskOffloadAdamW"):
        gc.collect()
        before = rss_mib() / 1024
        if name.startswith("torch"):
            opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
        else:
            opt = DiskOffloadAdamW(params, tempfile.mkdtemp(dir=args.dir) + "/moments", lr=1e-5, chunk_mb=args.chunk_mb)
        times = time_steps(opt, args.steps)
        added = rss_mib() / 1024 - before
        steady = times[1:] or times
        rows[name] = (statistics.median(t[0] for t in steady), statistics.median(t[1] for t in steady), added)
        if hasattr(opt, "close"):
            opt.close()
        del opt
    print("| optimizer | step, wall s (median) | step, CPU s (median) | resident memory added, GiB |")
    print("|---|---:|---:|---:|")
    for name, (wall, cpu, added) in rows.items():
        print(f"| {name} | {wall:.3f} | {cpu:.3f} | {added:.2f} |")
    (fw, _, fm), (dw, _, dm) = rows.values()
    print(f"\ndisk / in-memory: step time {dw / fw:.1f}x, memory added {dm:.2f} vs {fm:.2f} GiB")


if __name__ == "__main__":
    main()
