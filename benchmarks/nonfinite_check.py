"""What the finiteness check of every weight sync costs (``rlite.run.faults.refuse_nonfinite``).

Each sync streams every weight through ``refuse_nonfinite``, which sums each floating tensor (one
read of the weights) to stop a run whose update overflowed before the engine gets the weights. This
times that pass over a model-sized set of fp32 tensors against one copy of the same tensors (the
least a sync does: the copy into its buckets), alternating the two, one thread.

    python benchmarks/nonfinite_check.py --sizes-mb 50,200,540 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlite.stages.sync import refuse_nonfinite


def model_tensors(total_mb: int, tensor_mb: int = 4) -> list[tuple[str, torch.Tensor]]:
    n = max(1, total_mb // tensor_mb)
    return [(f"layer{i}.weight", torch.randn(tensor_mb * 2**20 // 4)) for i in range(n)]


def time_check(named) -> float:
    start = time.perf_counter()
    for _ in refuse_nonfinite(iter(named), 1):
        pass
    return time.perf_counter() - start


def time_copy(named, out) -> float:
    start = time.perf_counter()
    for o, (_, t) in zip(out, named):
        o.copy_(t)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="50,200,540")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| weights | check (median) | copy (median) | check / copy |")
    print("|---|---:|---:|---:|")
    for size in (int(x) for x in args.sizes_mb.split(",")):
        named = model_tensors(size)
        out = [torch.empty_like(t) for _, t in named]
        checks, copies = [], []
        for _ in range(args.repeats):  # alternating, so both see the same machine load
            checks.append(time_check(named))
            copies.append(time_copy(named, out))
        check, copy = statistics.median(checks), statistics.median(copies)
        print(f"| {size} MiB ({len(named)} tensors) | {check * 1e3:.1f} ms | {copy * 1e3:.1f} ms | {check / copy:.2f} |")


if __name__ == "__main__":
    main()
