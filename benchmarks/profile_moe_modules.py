"""Where one MoE training step's model time goes, fsdp2 against megatron, module by module: the tiny
Qwen3-MoE of ``backends_moe.py --job moe`` built by both backends in one process (world of one, one
thread), a batch shaped like that job's (``--prompts`` x 8 samples, prompts up to ``--prompt`` tokens,
responses up to ``--response``, micro-batches of 32) and the loop's ``ForwardSpec`` (shared prompts on).

Two phases, as the loop runs them: ``logprobs`` (pi_old: every micro-batch without gradient) and
``train`` (every micro-batch forward with entropy, then backward). Printed per backend and phase: CPU
seconds per call (median of ``--repeats``, the backends alternating), then under ``torch.profiler`` the
self CPU time of each module's forward (megatron: router, token dispatch, permute/unpermute, experts,
attention, rotary; fsdp2: router, experts, attention), the backward's autograd nodes and the top
operators.

    python benchmarks/profile_moe_modules.py [--repeats 7] [--rows 30] [--prompts 8] [--prompt 12] [--response 16]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

# module classes and methods timed as named ranges (their own self CPU excludes the named ranges inside them)
MEGATRON_MODULES = {
    "TopKRouter": "router",
    "SequentialMLP": "experts",
    "GroupedExperts": "experts",
    "MLP": "expert/shared MLP",
    "SelfAttention": "attention (qkv, rotary, proj)",
    "DotProductAttention": "core attention",
    "SDPAttention": "core attention",
    "RMSNorm": "norm",
    "WrappedTorchNorm": "norm",
    "LanguageModelEmbedding": "embedding",
}
MEGATRON_METHODS = {
    "dispatch_preprocess": "dispatch",
    "token_dispatch": "dispatch",
    "dispatch_postprocess": "permute",
    "combine_preprocess": "unpermute",
    "token_combine": "combine",
    "combine_postprocess": "combine",
}
FSDP2_MODULES = {
    "Qwen3MoeTopKRouter": "router",
    "Qwen3MoeExperts": "experts",
    "Qwen3MoeSparseMoeBlock": "moe block (rest)",
    "Qwen3MoeAttention": "attention (qkv, rotary, proj)",
    "Qwen3MoeRMSNorm": "norm",
    "Qwen3MoeRotaryEmbedding": "rotary table",
    "Embedding": "embedding",
}


@contextlib.contextmanager
def named_ranges(model: torch.nn.Module, modules: dict[str, str], methods: dict[str, str]):
    """Each module of a listed class runs its forward inside ``record_function("module: <label>")``;
    listed methods of any submodule likewise."""
    handles, patched = [], []
    for module in model.modules():
        label = modules.get(type(module).__name__)
        if label is not None:
            ranges: list = []

            def pre(_module, _args, label=label, ranges=ranges):
                ranges.append(torch.autograd.profiler.record_function(f"module: {label}"))
                ranges[-1].__enter__()

            def post(_module, _args, _out, ranges=ranges):
                ranges.pop().__exit__(None, None, None)

            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        dispatcher = getattr(module, "token_dispatcher", None)
        if dispatcher is not None:
            for name, label in methods.items():
                original = getattr(dispatcher, name)

                def wrapped(*args, original=original, label=label, **kwargs):
                    with torch.autograd.profiler.record_function(f"module: {label}"):
                        return original(*args, **kwargs)

                setattr(dispatcher, name, wrapped)
                patched.append((dispatcher, name))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for owner, name in patched:
            delattr(owner, name)


def logprobs_phase(backend, micro_batches, spec) -> None:
    with torch.no_grad():
        for mb in micro_batches:
            backend.logprobs(mb, spec)


def train_phase(backend, micro_batches, spec) -> None:
    backend.train_mode()
    for mb in micro_batches:
        logprobs, entropy = backend.logprobs(mb, spec, with_entropy=True)
        (logprobs.sum() + entropy.sum()).backward()
    for param in backend.model.parameters():
        param.grad = None


def profile_table(events, rows: int) -> tuple[list[tuple[str, float, int]], list[tuple[str, float, int]],
                                               list[tuple[str, float, int]]]:
    """``(module ranges, backward nodes, operators)``: (name, self CPU ms, calls), largest first."""
    modules, backward, ops = collections.Counter(), collections.Counter(), collections.Counter()
    calls = collections.Counter()
    for event in events:
        name = event.key
        if name.startswith("module: "):
            modules[name[8:]] += event.self_cpu_time_total / 1000
        elif name.startswith("autograd::engine::evaluate_function: "):
            backward[name.split(": ", 1)[1]] += event.cpu_time_total / 1000
        elif name.startswith("aten::"):
            ops[name] += event.self_cpu_time_total / 1000
        calls[name] += event.count
    def top(counter, prefix=""):
        return [(name, ms, calls[prefix + name]) for name, ms in counter.most_common(rows)]
    return top(modules, "module: "), top(backward, "autograd::engine::evaluate_function: "), top(ops)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, default=30, help="rows of each profile table")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=12)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument("--backends", default="fsdp2,megatron")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rlite.plugin_manager import build_plugin_manager
    from rlite.testing import fixed_batch, tiny_config
    from rlite.tokenizer import build_tiny_model_dir
    from rlite.training.backend import ForwardSpec

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model_dir(Path(tmp) / "moe", hidden=128, layers=2, heads=4, kv_heads=2,
                                         intermediate=256, num_experts=8, experts_per_token=2)
        pm = build_plugin_manager()
        backends = {}
        for name in args.backends.split(","):
            cfg = tiny_config(model_dir, Path(tmp) / name, f"parallelism.backend={name}", pm=pm)
            make = pm.registry("training_backend").get(name)
            options = make.config_cls() if getattr(make, "config_cls", None) else None
            backends[name] = make.implementation(cfg, options, torch.device("cpu"), 1)
        batch = fixed_batch(num_prompts=args.prompts, samples=8, prompt_len=args.prompt, max_len=args.response,
                            vocab=250)
        micro_batches = [batch.select(list(range(start, min(start + 32, len(batch)))))
                         for start in range(0, len(batch), 32)]
        spec = ForwardSpec(micro_batch_size=32, temperature=1.0, chunk_size=1024, exact_layout=False,
                           entropy_grad=False, recompute_above_bytes=256 * 2**20, share_prompts=True)
        phases = {"logprobs": logprobs_phase, "train": train_phase}
        seconds = {(name, phase): [] for name in backends for phase in phases}
        for _ in range(args.repeats):
            for name, backend in backends.items():
                for phase, run in phases.items():
                    start = time.process_time()
                    run(backend, micro_batches, spec)
                    seconds[name, phase].append(time.process_time() - start)
        print(f"batch: {len(batch)} rows ({args.prompts} prompts x 8) in micro-batches of 32, prompts up to "
              f"{args.prompt} tokens, responses up to {args.response}; CPU ms per phase, median of {args.repeats}")
        for phase in phases:
            line = "  ".join(f"{name} {statistics.median(seconds[name, phase]) * 1000:7.1f}" for name in backends)
            print(f"  {phase:9s} {line}")
        for name, backend in backends.items():
            model = backend.model
            modules, methods = (MEGATRON_MODULES, MEGATRON_METHODS) if name == "megatron" else (FSDP2_MODULES, {})
            for phase, run in phases.items():
                run(backend, micro_batches, spec)  # warm
                with named_ranges(model, modules, methods), \
                        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    for _ in range(3):
                        run(backend, micro_batches, spec)
                events = prof.key_averages()
                total = sum(e.self_cpu_time_total for e in events) / 1000 / 3
                module_rows, backward_rows, op_rows = profile_table(events, args.rows)
                print(f"\n===== {name} {phase}: self CPU {total:.1f} ms per call (profiled, 3 calls)")
                print("  forward by module (self ms per call, calls per call):")
                for label, ms, count in module_rows:
                    print(f"    {label:32s} {ms / 3:8.2f} {count // 3:6d}")
                if backward_rows:
                    print("  backward nodes (total ms per call):")
                    for label, ms, count in backward_rows:
                        print(f"    {label:60s} {ms / 3:8.2f} {count // 3:6d}")
                print("  operators (self ms per call):")
                for label, ms, count in op_rows:
                    print(f"    {label:60s} {ms / 3:8.2f} {count // 3:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
