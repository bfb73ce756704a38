"""The spawned-process engine on CUDA fed through CUDA-IPC flattened buckets. Skipped without CUDA.

The trainer (FSDP2 on the GPU) streams its weights into buckets allocated in GPU memory and hands the
engine process CUDA-IPC handles to them; the engine binds its parameters to views of the buckets.
After every sync, with the weights changed in between, the engine's weights must equal the trainer's
bit for bit, and what it samples (true on-policy mode) must carry exactly the trainer's log-probs.
The time per GB of each sync is measured for the report, not asserted.

``ProcessEngine(device=cuda)`` (what ``rollout.engine.args.process=true`` builds on a GPU rank) allocates its
buckets in the GPU's memory and hands the child CUDA-IPC handles: the CUDA-IPC path of ``rlite.sync``.
"""

from __future__ import annotations

import statistics

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SYNCS = 4
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A randomly initialised Qwen2 of about 0.22B parameters (0.9 GB in fp32), big enough to time."""
    from rlite.tokenizer import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("qwen2-220m"), hidden=1024, layers=12, heads=16,
                                    kv_heads=4, intermediate=2816, vocab_size=32000))


def _perturb(backend, seed: int) -> None:
    """Change every trainer weight in place (its local shard), as an optimizer step would."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in backend.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(torch.randn(local.shape, generator=g, device=local.device, dtype=local.dtype) * 1e-3)


def test_cuda_ipc_syncs_are_bitwise_and_the_engine_samples_exactly_them(model_dir, measure):
    import gpu_workers
    from transformers import AutoTokenizer

    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.distributed import init_distributed, shutdown_distributed
    from rlite.engines.base import SamplingParams
    from rlite.plugins.fsdp2.backend import FSDP2Backend
    from rlite.plugins.transformers.process import ProcessEngine
    from rlite.rollout import build_rollout_batch
    from rlite.training.backend import ForwardSpec

    ctx = init_distributed()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    backend = FSDP2Backend.build(ModelConfig(path=model_dir), ParallelismConfig(), TrainingConfig(), ctx.device, 1)
    engine = ProcessEngine(
        model_dir, pad_token_id=pad, eos_token_ids=[eos], timeout_s=300.0, start_timeout_s=300.0,
        engine_factory=gpu_workers.build_cuda_engine,
        factory_kwargs=dict(model_dir=model_dir, pad_token_id=pad, eos_token_ids=[eos], true_on_policy=True),
        device=ctx.device,
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist() for n in (5, 9, 7, 12)]
    spec = ForwardSpec(micro_batch_size=4 * len(prompts), temperature=1.0, chunk_size=1024, exact_layout=True)
    stats = []
    try:
        for version in range(1, SYNCS + 1):
            if version > 1:
                _perturb(backend, version)
            sync = engine.update_weights(backend.full_weights(), version)
            stats.append(sync)
            assert sync.first_sync == (version == 1)
            assert engine._sender.slots and all(slot.buffer.is_cuda for slot in engine._sender.slots)

            # what the engine samples carries exactly the trainer's log-probs of those tokens
            completions = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=MAX_NEW_TOKENS, seed=version))
            assert {c.weight_version for c in completions} == {version}
            batch = build_rollout_batch(prompts, completions, [{}] * len(prompts), 0, pad_token_id=pad,
                                        fixed_width=MAX_NEW_TOKENS)
            with torch.no_grad():
                trainer_logprobs = backend.logprobs(batch, spec)[0].cpu()
            mask = batch.response_mask.bool()
            assert torch.equal(trainer_logprobs[mask], batch.rollout_logprobs[mask]), (
                f"sync v{version}: max |diff| {(trainer_logprobs - batch.rollout_logprobs)[mask].abs().max():.3e}"
            )

            # the engine's weights are the trainer's, bit for bit
            engine_weights = dict(engine.named_weights())
            trainer_weights = dict(backend.full_weights())
            assert engine_weights.keys() == trainer_weights.keys()
            for name, weight in trainer_weights.items():
                assert torch.equal(engine_weights[name].to(weight.device), weight), f"sync v{version}: {name} differs"
            del engine_weights, trainer_weights
    finally:
        engine.shutdown()
        backend.close()
        shutdown_distributed(ctx)

    gb = stats[0].nbytes / 1e9
    steady = stats[1:]
    seconds = statistics.median(s.total_s for s in steady)
    measure("CUDA-IPC sync: bytes per sync", f"{gb:.3f}", "GB", f"{stats[0].buckets} buckets of <= 512 MB, fp32")
    measure("CUDA-IPC sync: first sync (allocate + handles)", f"{stats[0].total_s * 1e3:.1f}", "ms")
    measure("CUDA-IPC sync: later syncs, median", f"{seconds * 1e3:.1f}", "ms",
            f"copy {statistics.median(s.copy_s for s in steady) * 1e3:.1f} ms, "
            f"checksum {statistics.median(s.checksum_s for s in steady) * 1e3:.1f} ms, "
            f"handoff {statistics.median(s.handoff_s for s in steady) * 1e3:.1f} ms")
    measure("CUDA-IPC sync: time per GB (later syncs)", f"{seconds / gb * 1e3:.1f}", "ms/GB",
            f"{gb / seconds:.1f} GB/s")
