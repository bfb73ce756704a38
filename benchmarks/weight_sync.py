"""Weight sync to an engine process: zero-copy shared-memory buckets vs serialized bytes through a pipe.

For each model size (fp32 tensors of 4 MB plus one bf16 tensor), on CPU, one engine process each:

* **shared memory** (``ProcessEngine`` + ``SharedBucketSender``): the first sync allocates the
  buckets in shared memory, packs them and sends their handles (one-time); every later sync is the
  trainer's ``copy_`` into the buckets and its checksum (both reported separately) plus the
  **handoff**: the messages, what is left of the engine's checksum verification (it sums each bucket
  while the trainer computes its own checksum, so on a machine with a core free for it nothing is
  left) and the acknowledgements. "handoff, no verify" is the same with the engine's checksum off.
* **bytes**: ``torch.save`` of the state dict, the bytes through the same kind of pipe, ``torch.load``
  and ``copy_`` into the engine's parameters, then an ack. The **handoff** is everything after
  ``torch.save``.

Run: ``python benchmarks/weight_sync.py [--sizes-mb 50,200,1024,2048] [--repeats 3] [--bucket-mb 512] [--append]``.
``--append`` adds the table to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import io
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from machine_info import cpu_model  # benchmarks/ is on sys.path when a script here runs

from rlite.plugins.transformers.process import ProcessEngine

TENSOR_NUMEL = 1 << 20  # 4 MB of fp32


def model_shapes(size_mb: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    n = max(1, round(size_mb / 4) - 1)
    shapes = [(f"layers.{i}.weight", (1024, 1024), torch.float32) for i in range(n)]
    shapes.append(("embed.weight", (2048, 1024), torch.bfloat16))  # 4 MB, a second dtype
    return shapes


def make_weights(shapes, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=g).to(dtype)) for name, shape, dtype in shapes]


class _Holder:
    """An engine with parameters of the given shapes and nothing else (the child of the shm path)."""

    def __init__(self, shapes) -> None:
        self.model = torch.nn.Module()
        for name, shape, dtype in shapes:
            self.model.register_parameter(
                name.replace(".", "_"),
                torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False),
            )
        self.weight_version = 0

    def release_memory(self) -> None:
        pass

    def resume_memory(self) -> None:
        pass


def make_holder(shapes) -> _Holder:
    return _Holder(shapes)


def flat_names(weights):
    return [(name.replace(".", "_"), t) for name, t in weights]


def bench_shared_memory(
    shapes, weights, repeats: int, verify: bool, compare: bool, bucket_mb: int
) -> dict[str, float]:
    engine = ProcessEngine(
        ".",
        pad_token_id=0,
        eos_token_ids=[],
        timeout_s=600.0,
        bucket_bytes=bucket_mb << 20,
        verify_checksums=verify,
        engine_factory=make_holder,
        factory_kwargs={"shapes": shapes},
    )
    try:
        t = time.perf_counter()
        first = engine.update_weights(flat_names(weights), 1)
        first_s = time.perf_counter() - t
        rows = []
        for version in range(2, 2 + repeats):
            for _, tensor in weights:  # new weights each step, as after an optimizer step
                tensor.add_(1)
            rows.append(engine.update_weights(flat_names(weights), version))
        if compare:  # the engine holds exactly the last weights sent
            held = dict(engine.named_weights())
            assert all(torch.equal(held[n], t) for n, t in flat_names(weights))
        return {
            "first_s": first_s,
            "buckets": first.buckets,
            "copy_s": statistics.median(r.copy_s for r in rows),
            "checksum_s": statistics.median(r.checksum_s for r in rows),
            "handoff_s": statistics.median(r.handoff_s for r in rows),
            "handoff_best_s": min(r.handoff_s for r in rows),
            "total_s": statistics.median(r.total_s for r in rows),
        }
    finally:
        engine.shutdown()


def _bytes_child(conn, shapes) -> None:
    torch.set_num_threads(1)
    params = {name: torch.zeros(shape, dtype=dtype) for name, shape, dtype in shapes}
    conn.send("ready")
    while True:
        data = conn.recv_bytes()
        if not data:
            return
        state = torch.load(io.BytesIO(data), weights_only=True)
        del data
        for name, tensor in state.items():
            params[name].copy_(tensor)
        del state
        conn.send("ack")


def bench_bytes(shapes, weights, repeats: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_bytes_child, args=(child, shapes), daemon=True)
    process.start()
    child.close()
    try:
        if not parent.poll(300) or parent.recv() != "ready":
            raise RuntimeError("bytes child did not start")
        serialize, handoff = [], []
        for _ in range(repeats):
            for _, tensor in weights:
                tensor.add_(1)
            t = time.perf_counter()
            buffer = io.BytesIO()
            torch.save(dict(weights), buffer)
            t1 = time.perf_counter()
            parent.send_bytes(buffer.getbuffer())
            if not parent.poll(600):
                raise RuntimeError("bytes child did not answer")
            assert parent.recv() == "ack"
            t2 = time.perf_counter()
            del buffer
            serialize.append(t1 - t)
            handoff.append(t2 - t1)
        parent.send_bytes(b"")
        process.join(30)
        return {
            "serialize_s": statistics.median(serialize),
            "handoff_s": statistics.median(handoff),
            "handoff_best_s": min(handoff),
        }
    finally:
        if process.is_alive():
            process.kill()
        process.join(5)


def machine() -> str:
    cpu = cpu_model()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, torch {torch.__version__}, {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", default="50,200,1024,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=512, help="shared-memory bucket size")
    parser.add_argument("--append", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)

    header = (
        "| model | shm first sync (alloc+pack+handles) | shm copy into buckets | trainer checksum "
        "| shm handoff | shm handoff, no verify | shm sync total | bytes: torch.save | bytes handoff "
        "| handoff ratio bytes/shm, verify / no verify | sync ratio (bytes save+handoff) / shm total |"
    )
    lines = [header, "|" + "---|" * 11]
    print(header, flush=True)
    for size_mb in [int(s) for s in args.sizes_mb.split(",")]:
        shapes = model_shapes(size_mb)
        weights = make_weights(shapes, seed=size_mb)
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        shm = bench_shared_memory(
            shapes, weights, args.repeats, verify=True, compare=size_mb <= 200, bucket_mb=args.bucket_mb
        )
        bare = bench_shared_memory(
            shapes, weights, args.repeats, verify=False, compare=False, bucket_mb=args.bucket_mb
        )
        raw = bench_bytes(shapes, weights, args.repeats)
        del weights

        def ms(stats: dict[str, float]) -> str:
            return f"{stats['handoff_s'] * 1e3:.1f} / {stats['handoff_best_s'] * 1e3:.1f} ms"

        ratio = raw["handoff_best_s"] / shm["handoff_best_s"]
        ratio_bare = raw["handoff_best_s"] / bare["handoff_best_s"]
        line = (
            f"| {nbytes / 2**20:.0f} MiB ({len(shapes)} tensors, {shm['buckets']} buckets) "
            f"| {shm['first_s']:.3f} s | {shm['copy_s']:.3f} s | {shm['checksum_s'] * 1e3:.1f} ms "
            f"| {ms(shm)} | {ms(bare)} | {shm['total_s']:.3f} s "
            f"| {raw['serialize_s']:.3f} s | {raw['handoff_s']:.3f} / {raw['handoff_best_s']:.3f} s "
            f"| {ratio:.0f}x / {ratio_bare:.0f}x "
            f"| {(raw['serialize_s'] + raw['handoff_s']) / shm['total_s']:.1f}x |"
        )
        lines.append(line)
        print(line, flush=True)

    if args.append:
        load = os.getloadavg()[0]
        section = [
            "",
            "## Weight sync to an engine process: shared memory vs bytes (`benchmarks/weight_sync.py`)",
            "",
            "Trainer and engine process on CPU, one thread each. Model: fp32 tensors of 4 MiB plus one bf16",
            "tensor. shm: `ProcessEngine` + `SharedBucketSender` (buckets in shared memory, the engine's",
            "parameters are views into them). First sync = allocate, pack, send handles (once). Later syncs =",
            "copy into the buckets + trainer checksum + handoff (messages, what the engine's checksum",
            "verification adds: it sums each bucket while the trainer computes its checksum; acks);",
            "'no verify' turns the engine's verification off. bytes: `torch.save` of the state dict,",
            "bytes through a pipe, `torch.load` and `copy_` in the engine process, ack; its handoff is",
            f"everything after `torch.save`. Median of {args.repeats} syncs after the first; handoffs as",
            "'median / best', and the handoff ratios from the best of each.",
            "",
            f"- Machine: {machine()}; shared, load average {load:.1f} while this ran.",
            f"- Date: {datetime.date.today().isoformat()}",
            f"- Command: `.venv/bin/python benchmarks/weight_sync.py --sizes-mb {args.sizes_mb} "
            f"--repeats {args.repeats} --bucket-mb {args.bucket_mb} --append`",
            "",
            *lines,
            "",
        ]
        path = Path(__file__).with_name("RESULTS.md")
        with path.open("a") as f:
            f.write("\n".join(section))
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
