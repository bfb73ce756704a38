"""One training micro-batch of the tiny MoE job of ``backends_moe.py``, fsdp2 against megatron in one
process (world of one): the bytes autograd saves for backward (tensors counted once per storage; the
activation memory that a step's peak grows with), the seconds of forward + backward and of one pass
over ``full_weights`` as a weight sync makes it (medians of ``--repeats``, the two backends alternating).

    python benchmarks/backend_step_memory.py [--rows 32] [--prompt 12] [--response 16] [--repeats 5] [--vocab 32000]

Run it with another checkout's interpreter to measure that checkout's code (``/work/main/.venv/bin/python
benchmarks/backend_step_memory.py``): the script imports only ``rlite``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def saved_bytes_and_seconds(backend, batch, spec) -> tuple[int, float]:
    from rlite.testing import SavedActivations

    backend.train_mode()
    start = time.perf_counter()
    with SavedActivations() as saved:
        logprobs, _ = backend.logprobs(batch, spec, with_entropy=True)
    logprobs.sum().backward()
    seconds = time.perf_counter() - start
    return saved.bytes, seconds


def full_weights_seconds(backend) -> float:
    """One pass over ``full_weights`` as the weight sync asks for it of an engine sharing the trainer's weights."""
    start = time.perf_counter()
    for _ in backend.full_weights(views=backend.capabilities.weight_views):
        pass
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=12)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the tokenizer's 259)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rlite.plugin_manager import build_plugin_manager
    from rlite.testing import fixed_batch, tiny_config
    from rlite.tokenizer import build_tiny_model_dir
    from rlite.training.backend import ForwardSpec

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model_dir(Path(tmp) / "moe", hidden=128, layers=2, heads=4, kv_heads=2,
                                         intermediate=256, num_experts=8, experts_per_token=2,
                                         vocab_size=args.vocab)
        pm = build_plugin_manager()
        backends = {}
        for name in ("fsdp2", "megatron"):
            cfg = tiny_config(model_dir, Path(tmp) / name, f"parallelism.backend={name}", pm=pm)
            make = pm.registry("training_backend").get(name)
            options = make.config_cls() if getattr(make, "config_cls", None) else None
            backends[name] = make.implementation(cfg, options, torch.device("cpu"), 1)
        batch = fixed_batch(num_prompts=args.rows // 8, samples=8, prompt_len=args.prompt, max_len=args.response,
                            vocab=250)
        spec = ForwardSpec(micro_batch_size=args.rows, temperature=1.0, chunk_size=1024, exact_layout=False,
                           entropy_grad=False, recompute_above_bytes=64 * 2**20)
        results = {name: [] for name in backends}
        syncs = {name: [] for name in backends}
        for _ in range(args.repeats):
            for name, backend in backends.items():
                results[name].append(saved_bytes_and_seconds(backend, batch, spec))
                syncs[name].append(full_weights_seconds(backend))
    print(f"micro-batch: {args.rows} rows, prompts up to {args.prompt} tokens, responses up to {args.response}, "
          f"vocabulary {args.vocab or 'of the tokenizer (259)'}")
    for name, runs in results.items():
        print(f"{name:9s} saved for backward {runs[-1][0] / 2**20:7.2f} MiB   forward+backward "
              f"{statistics.median(s for _, s in runs) * 1000:7.1f} ms (median of {len(runs)})   full_weights "
              f"{statistics.median(syncs[name]) * 1000:6.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
