"""Chunked-scan GAE (rlite.plugins.advantages.gae) against verl's per-token Python loop (gae_loop).

One CPU thread, batch 64, float32, gamma = 1.0, lambda = 0.95, T in {1k, 4k, 16k}. Two masks per T:
"right-padded" (random response lengths, the common single-turn batch: the scan takes its fast
path) and "tool spans" (full-length responses with masked interior spans in every other row: the
scan packs tokens with a scatter). Times are medians over repeats; the loop is always measured,
never extrapolated (it takes about a second per call at 16k).

Error columns are max over rows of max_t |a - b| / max_t |b| (relative to the row's scale; single
entries of GAE can be arbitrarily close to 0): scan vs loop (both float32), and scan vs the loop run
in float64.

    python benchmarks/gae_scan.py [--chunk 32] [--lengths 1024 4096 16384]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from rlite.plugins.advantages import SCAN_CHUNK, gae, gae_loop

BATCH = 64
GAMMA, LAM = 1.0, 0.95


def make_mask(kind: str, length: int, generator: torch.Generator) -> torch.Tensor:
    positions = torch.arange(length)[None, :]
    if kind == "right-padded":
        lengths = torch.randint(length // 2, length + 1, (BATCH,), generator=generator)
        lengths[0] = length
        return positions < lengths[:, None]
    mask = torch.ones(BATCH, length, dtype=torch.bool)
    for row in range(0, BATCH, 2):
        for _ in range(4):  # four tool spans of up to 5% of the length
            start = int(torch.randint(0, length, (), generator=generator))
            span = int(torch.randint(1, max(2, length // 20), (), generator=generator))
            mask[row, start : start + span] = False
    return mask


def timings(fn, repeats: int) -> tuple[float, float]:
    """(median, best) wall-clock seconds of ``fn()`` over ``repeats`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def row_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    return float(((got.double() - want.double()).abs() / scale).max())


def measure(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, chunk: int) -> str:
    """One table row: loop and scan times (median / best), speed-ups, errors."""
    short = rewards.shape[1] <= 4096
    loop = timings(lambda: gae_loop(rewards, values, mask, GAMMA, LAM), 3 if short else 2)
    scan = timings(lambda: gae(rewards, values, mask, GAMMA, LAM, chunk), 20 if short else 10)
    scan_adv, _ = gae(rewards, values, mask, GAMMA, LAM, chunk)
    loop_adv, _ = gae_loop(rewards, values, mask, GAMMA, LAM)
    exact_adv, _ = gae_loop(rewards.double(), values.double(), mask, GAMMA, LAM)
    return (
        f"{loop[0] * 1e3:.1f} / {loop[1] * 1e3:.1f} | {scan[0] * 1e3:.2f} / {scan[1] * 1e3:.2f} "
        f"| {loop[0] / scan[0]:.0f}x / {loop[1] / scan[1]:.0f}x "
        f"| {row_relative_error(scan_adv, loop_adv):.1e} | {row_relative_error(scan_adv, exact_adv):.1e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk", type=int, default=SCAN_CHUNK)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)

    print(f"torch {torch.__version__}, {platform.machine()}, threads=1, B={BATCH}, float32, ", end="")
    print(f"gamma={GAMMA}, lambda={LAM}, chunk={args.chunk}, load average {os.getloadavg()[0]:.1f}")
    print()
    print(
        "| T | mask | loop ms (median / best) | scan ms (median / best) | speed-up (median / best) "
        "| rel. err vs loop | rel. err vs fp64 |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for length in args.lengths:
        rewards = torch.randn(BATCH, length, generator=generator)
        values = torch.randn(BATCH, length, generator=generator)
        for kind in ["right-padded", "tool spans"]:
            mask = make_mask(kind, length, generator)
            print(f"| {length} | {kind} | {measure(rewards, values, mask, args.chunk)}")


if __name__ == "__main__":
    main()
