"""How many all-gathers the weight stream may keep in flight on a gloo group (issue #30).

Two spawned gloo ranks build the FSDP2 policy of a tiny model and stream its full weights
(:func:`rlite.plugins.fsdp2.weights.iter_full_tensors`, what every weight sync does) ``--streams``
times in a loop that does nothing else; a round passes when both ranks finish. ``--in-flight``:

* ``two``: the next tensor's all-gather starts before this one's is waited for (rlite's stream up to
  2026-11-26): two asynchronous functional all-gathers at once on the group;
* ``one``: the next starts once this one is complete (rlite's stream now), still while the consumer
  works on this tensor;
* ``none``: every all-gather waited for before the next tensor (no overlap at all).

    python benchmarks/gather_in_flight.py --in-flight two --streams 1000 --rounds 4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def gather_two_in_flight(plan):
    """The stream's gather ahead as it was: start the next, then wait for this one."""
    from rlite.plugins.fsdp2 import weights

    ahead = None
    for tensor, views, entry in plan:
        started = (entry, weights._start_full(tensor, views))
        if ahead is not None:
            yield ahead[0], weights._finish_full(ahead[1])
        ahead = started
    if ahead is not None:
        yield ahead[0], weights._finish_full(ahead[1])


def stream_weights(rank: int, init_file: str, model_dir: str, in_flight: str, streams: int) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.plugins.fsdp2 import weights
    from rlite.plugins.fsdp2.backend import FSDP2Backend

    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    if in_flight == "two":
        weights._gather_ahead = gather_two_in_flight
    elif in_flight == "none":
        weights._start_full = weights._full
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        backend = FSDP2Backend.build(ModelConfig(path=model_dir), ParallelismConfig(), TrainingConfig(),
                                     torch.device("cpu"), 1)  # fmt: skip
        start = time.perf_counter()
        for _ in range(streams):
            for _, full in backend.full_weights():
                full.sum()
        if rank == 0:
            print(f"  {streams} streams in {time.perf_counter() - start:.1f} s", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-flight", choices=("two", "one", "none"), default="one")
    parser.add_argument("--streams", type=int, default=1000, help="weight streams per round")
    parser.add_argument("--rounds", type=int, default=4, help="fresh pairs of ranks")
    args = parser.parse_args()

    from rlite.testing import spawn_ranks
    from rlite.tokenizer import build_tiny_model_dir

    root = Path(tempfile.mkdtemp())
    model_dir = str(build_tiny_model_dir(root / "model", hidden=32, layers=2))
    passed = 0
    for round_index in range(1, args.rounds + 1):
        try:
            spawn_ranks(stream_weights, (str(root / f"init{round_index}"), model_dir, args.in_flight, args.streams),
                        nprocs=2, timeout_s=900)  # fmt: skip
            passed += 1
            print(f"round {round_index}: passed", flush=True)
        except Exception as exc:  # noqa: BLE001  (a rank that died of a signal: counted, the next round runs)
            print(f"round {round_index}: {type(exc).__name__}: {exc}", flush=True)
    print(f"in flight {args.in_flight}: {passed} of {args.rounds} rounds of {args.streams} streams passed")


if __name__ == "__main__":
    main()
