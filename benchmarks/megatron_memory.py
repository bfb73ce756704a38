"""What the megatron backend's memory settings hold, counted on the tensors themselves (one process, a world
of one): after one training micro-batch and one optimizer step of a dense model, the bytes per parameter of
the model's parameters, of the gradients held between micro-batches (``.grad`` or the float32 main-gradient
buffers), of the master weights and of AdamW's moments in memory, and the bytes autograd saved for backward
(activations, counted once per storage, weights excluded).

    python benchmarks/megatron_memory.py [--hidden 256] [--layers 4] [--rows 16] [--prompt 32] [--response 32]

Variants: float32; ``parallelism.param_dtype=bfloat16`` (float32 masters and main gradients); the same with
``parallelism.reduce_dtype=bfloat16``; pure bf16 (``model.dtype=bfloat16`` too); float32 and bf16 with
``training.optimizer_offload=disk``. ZeRO-1 needs several ranks: ``tests/megatron/test_megatron_memory.py``
counts its per-rank bytes.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

VARIANTS = {
    "float32": (),
    "bf16 (fp32 masters, fp32 reduce)": ("parallelism.param_dtype=bfloat16",),
    "bf16, bf16 reduce": ("parallelism.param_dtype=bfloat16", "parallelism.reduce_dtype=bfloat16"),
    "pure bf16 (model.dtype=bf16)": ("model.dtype=bfloat16", "parallelism.param_dtype=bfloat16"),
    "float32, moments on disk": ("training.optimizer_offload=disk",),
    "bf16, moments on disk": ("parallelism.param_dtype=bfloat16", "training.optimizer_offload=disk"),
}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure(backend, batch, spec) -> dict[str, float]:
    from rlite.testing import SavedActivations

    backend.train_mode()
    with SavedActivations() as saved:
        logprobs, _ = backend.logprobs(batch, spec)
    logprobs.sum().backward()
    params = backend.main_params.params
    numel = sum(mp.param.numel() for mp in params)
    gradients = nbytes(mp.param.grad for mp in params) + nbytes(mp.main_grad for mp in params)
    row = {"parameters": nbytes(mp.param for mp in params) / numel, "gradients": gradients / numel}
    backend.step()
    masters = nbytes(mp.main for mp in params if mp.is_copy)
    row["masters"] = masters / numel
    row["moments"] = (backend.main_params.state_bytes(backend.optimizer) - masters) / numel
    row["total"] = row["parameters"] + row["gradients"] + row["masters"] + row["moments"]
    row["activations MiB"] = saved.bytes / 2**20
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import rlite.plugins.megatron as megatron_plugin
    from rlite.plugin_manager import build_plugin_manager
    from rlite.testing import fixed_batch, tiny_config
    from rlite.tokenizer import build_tiny_model_dir
    from rlite.training.backend import ForwardSpec

    pm = build_plugin_manager(autoload=False)
    pm.register(megatron_plugin, name="rlite.plugins.megatron")
    batch = fixed_batch(num_prompts=args.rows // 2, samples=2, prompt_len=args.prompt, max_len=args.response, vocab=250)
    spec = ForwardSpec(micro_batch_size=args.rows, temperature=1.0, chunk_size=1024, exact_layout=False)
    columns = ("parameters", "gradients", "masters", "moments", "total", "activations MiB")
    print(f"| variant | {' | '.join(columns)} |")
    print("|---|" + "---:|" * len(columns))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model_dir(Path(tmp) / "model", hidden=args.hidden, layers=args.layers)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            for name, overrides in VARIANTS.items():
                cfg = tiny_config(model_dir, Path(tmp) / "run", "parallelism.backend=megatron", *overrides, pm=pm)
                backend = megatron_plugin.make_megatron(cfg, megatron_plugin.MegatronConfig(), torch.device("cpu"), 1)
                try:
                    row = measure(backend, batch, spec)
                finally:
                    backend.close()
                print(f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + " |")
        finally:
            dist.destroy_process_group()
    print(f"(bytes per parameter; hidden {args.hidden}, {args.layers} layers, {args.rows} rows of "
          f"{args.prompt} + {args.response} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
