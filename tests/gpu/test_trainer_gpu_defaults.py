"""The trainer's defaults on one CUDA GPU (issue 41): which path they pick, that its log-probs keep to the
bf16 tolerance recorded in ``test_fsdp2_bf16.py``, that the plain model trains, that the micro-batch loop
does not wait for the device, and that compiled blocks match eager. Skipped without CUDA.

Written and checked on CPU only (``tests/unit/test_gpu_defaults.py``, ``test_device_loop.py``,
``test_compile.py`` run the same code there); these checks are what a GPU session runs to confirm it.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from test_fsdp2_bf16 import BF16_MAX_ABS_TOL, BF16_MEAN_ABS_TOL, WARMSTART, DigitReward, _sampled_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (model.dtype, parallelism.param_dtype) -> the default single-GPU path (shard_single_process=auto)
PRECISIONS = {
    "fp32": ("float32", "float32", "plain"),
    "bf16": ("bfloat16", "bfloat16", "plain"),
    "fp32-masters-bf16": ("float32", "bfloat16", "fsdp2"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlite.tokenizer import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def ctx():
    from rlite.distributed import init_distributed, shutdown_distributed

    context = init_distributed()
    yield context
    shutdown_distributed(context)


def _backend(precision: str, device, **training):
    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.plugins.fsdp2.backend import FSDP2Backend

    model_dtype, param_dtype, _ = PRECISIONS[precision]
    return FSDP2Backend.build(ModelConfig(path=WARMSTART, dtype=model_dtype), ParallelismConfig(param_dtype=param_dtype),
                              TrainingConfig(**training), device, total_optimizer_steps=1)


def _default_spec(tmp_path, micro_batch_size: int):
    """The ForwardSpec a default run builds on this GPU (liger when installed, shared prompts)."""
    from rlite.run.policy import forward_spec
    from rlite.testing import tiny_config
    from rlite.training.backend import BackendCapabilities

    cfg = tiny_config(WARMSTART, tmp_path / "run", f"training.micro_batch_size={micro_batch_size}",
                      "rollout.temperature=1.0", pm=False)
    return forward_spec(cfg, "cuda", BackendCapabilities(fused_logprobs=True))  # fsdp2's


def test_defaults_pick_their_path_and_keep_bf16_logprobs_within_the_recorded_tolerance(ctx, tmp_path, measure):
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoTokenizer

    from rlite.plugins.transformers.engine import TransformersEngine

    tokenizer = AutoTokenizer.from_pretrained(WARMSTART)
    engine = TransformersEngine.from_pretrained(WARMSTART, pad_token_id=tokenizer.pad_token_id,
                                                eos_token_ids=[tokenizer.eos_token_id])
    batch = _sampled_batch(tokenizer, engine, n_prompts=32, samples=8, max_new_tokens=8)
    spec = _default_spec(tmp_path, micro_batch_size=64)
    measure("GPU defaults: liger's fused log-probs", str(spec.use_liger), note="training.liger_fused_logprobs=auto")
    mask = batch.response_mask.bool()
    scores = {}
    for precision, (model_dtype, _, path) in PRECISIONS.items():
        backend = _backend(precision, ctx.device)
        assert isinstance(backend.model, FSDPModule) == (path == "fsdp2"), f"{precision}: the {path} path"
        assert all(p.dtype == getattr(torch, model_dtype) for p in backend.model.parameters())
        assert backend.optimizer.defaults["fused"] is True
        micro = [batch.select(slice(i, i + spec.micro_batch_size)) for i in range(0, len(batch), spec.micro_batch_size)]
        with torch.no_grad():
            scored = [backend.logprobs(mb, spec)[0] for mb in micro]
        assert scored[0].device.type == "cuda", "log-probs stay on the GPU, for the loss"
        # the first training forward repeats the scoring forward bit for bit (the first PPO ratio is exactly 1)
        backend.train_mode()
        trained, _ = backend.logprobs(micro[0], spec, with_entropy=True)
        assert torch.equal(trained.detach(), scored[0]), f"{precision}: training forward != pi_old"
        scores[precision] = torch.cat(scored).cpu()
        backend.close()
        del backend
        torch.cuda.empty_cache()
    for precision in ("bf16", "fp32-masters-bf16"):
        diff = (scores[precision] - scores["fp32"]).abs()[mask]
        measure(f"GPU defaults, {precision} vs fp32 log-probs: max / mean abs error",
                f"{diff.max().item():.4f} / {diff.mean().item():.5f}", "nats", f"{int(mask.sum())} sampled tokens")
        assert diff.max() > 0, f"{precision} must compute in bf16"
        assert diff.mean() <= BF16_MEAN_ABS_TOL and diff.max() <= BF16_MAX_ABS_TOL, precision
    assert (scores["fp32"] - batch.rollout_logprobs).abs()[mask].max() < 1e-3, "fp32 on the GPU scores the CPU engine"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_plain_single_gpu_model_learns(tmp_path, model_dir, precision, measure):
    """The default single-GPU path with fp32 weights and with pure bf16: a plain model (no FSDP2), gradients
    accumulated in place over micro-batches, and a GRPO run whose held-out reward rises."""
    from torch.distributed.fsdp import FSDPModule

    from rlite.distributed import shutdown_distributed
    from rlite.plugin_manager import build_plugin_manager, set_plugin_manager
    from rlite.run.build import build_run
    from rlite.run.loop import train
    from rlite.testing import read_jsonl, tiny_config

    pm = build_plugin_manager(autoload=False)
    pm.register(DigitReward(), name="digit-reward")
    set_plugin_manager(pm)
    model_dtype, param_dtype, _ = PRECISIONS[precision]
    try:
        cfg = tiny_config(
            model_dir, tmp_path / "run", f"model.dtype={model_dtype}", f"parallelism.param_dtype={param_dtype}",
            "rewards=[digit_fraction]", "training.steps=12", "training.lr=3e-3", "training.eval_every=12",
            "rollout.prompts_per_step=4", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=6",
            "training.micro_batch_size=8", "data.num_eval=32", pm=pm,
        )
        run = build_run(cfg, pm)
        try:
            assert not isinstance(run.policy.backend.model, FSDPModule), "one GPU, one precision: the plain model"
            params = dict(run.policy.backend.model.named_parameters())
            assert all(p.device.type == "cuda" and p.dtype == getattr(torch, model_dtype) for p in params.values())
            before = {n: p.detach().clone() for n, p in params.items()}
            train(run)
        finally:
            run.engine.shutdown()
            shutdown_distributed(run.ctx)
        assert sum(not torch.equal(before[n], p) for n, p in params.items()) > len(params) // 2
    finally:
        set_plugin_manager(None)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in rows if "eval/sampled_reward" in r]
    first, last = evals[0], evals[-1]
    measure(f"plain {precision} GRPO: held-out greedy reward", f"{first['eval/greedy_reward']:.3f} -> "
            f"{last['eval/greedy_reward']:.3f}", note="step 0 -> 12")
    assert last["eval/greedy_reward"] >= first["eval/greedy_reward"] + 0.5
    assert all(math.isfinite(r["actor/grad_norm"]) for r in rows if "actor/grad_norm" in r)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_plain_models_gradients_are_reproducible_bitwise(ctx, precision):
    """Twice the same forward and backward on the plain model give bitwise the same gradients: the in-place
    accumulation's embedding rows are summed by a sorting kernel on the GPU (atomics would not be)."""
    from rlite.testing import fixed_batch
    from rlite.training.backend import ForwardSpec

    backend = _backend(precision, ctx.device)
    batch = fixed_batch(num_prompts=4, samples=4, prompt_len=10, max_len=8, vocab=250)
    spec = ForwardSpec(micro_batch_size=16, temperature=1.0, chunk_size=64, exact_layout=False, share_prompts=True)
    backend.train_mode()
    grads = []
    for _ in range(2):
        logprobs, _ = backend.logprobs(batch, spec, with_entropy=True)
        backend.backward(logprobs.sum())
        grads.append({n: p.grad.clone() for n, p in backend.model.named_parameters()})
        backend.zero_grad()
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0]), [
        n for n in grads[0] if not torch.equal(grads[0][n], grads[1][n])][:4]
    backend.close()


@pytest.mark.parametrize("precision", ["fp32", "fp32-masters-bf16"])
def test_the_update_loop_does_not_wait_for_the_gpu(ctx, monkeypatch, precision, measure):
    """The micro-batch loop under rlite's host-sync recorder (which on a GPU also sees blocking host/device
    copies) and CUDA's own sync debug mode: only transformers' mask construction reads a device value."""
    import rlite.plugins.fsdp2.backend as fsdp2_backend
    import rlite.stages.update as update_stage
    from rlite.algorithms import AdvantageInput
    from rlite.plugin_manager import build_plugin_manager
    from rlite.rollout import TrainTargets
    from rlite.stages.update import LossSpec, update_policy
    from rlite.testing import HostSyncRecorder, fixed_batch
    from rlite.training.backend import ForwardSpec

    backend = _backend(precision, ctx.device)
    pm = build_plugin_manager(autoload=False)
    grpo, ppo = pm.registry("advantage_estimator").get("grpo"), pm.registry("policy_loss").get("ppo_clip")
    batch = fixed_batch(num_prompts=8, samples=4, prompt_len=10, max_len=8, vocab=250)
    advantages, returns = grpo.implementation(AdvantageInput(batch.scores, batch.group_ids, batch.response_mask),
                                              grpo.config_cls())
    targets = TrainTargets(advantages, returns, batch.response_mask.clone())
    recorder = HostSyncRecorder()
    planner = fsdp2_backend.forward_inputs

    def prepare(*args, **kwargs):
        with recorder.allowed():
            return planner(*args, **kwargs)

    def watch(fn):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with recorder:
                    return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return run

    monkeypatch.setattr(fsdp2_backend, "forward_inputs", prepare)
    monkeypatch.setattr(update_stage, "micro_batch_loss", watch(update_stage.micro_batch_loss))
    monkeypatch.setattr(update_stage, "loss_inputs", watch(update_stage.loss_inputs))
    monkeypatch.setattr(backend, "logprobs", watch(backend.logprobs))
    monkeypatch.setattr(backend, "backward", watch(backend.backward))
    spec = ForwardSpec(micro_batch_size=8, temperature=1.0, chunk_size=64, exact_layout=False, share_prompts=True)
    loss = LossSpec(ppo.implementation, ppo.config_cls(), "token-mean", 8.0, None, 0.0, 0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = update_policy(backend, batch, targets, spec, loss, minibatches=1, epochs=1, dp_size=1).metrics
    cuda_syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    ours = [found for found in recorder.found if "masking_utils" not in found[1]]
    micro_batches = int(metrics["batching/micro_batches"])
    measure(f"update loop, {precision}: host reads of device values per micro-batch",
            f"{len(recorder.found) / micro_batches:.1f} (CUDA sync warnings {len(cuda_syncs) / micro_batches:.1f})",
            note="all in transformers' mask construction" if not ours else f"rlite: {ours[:3]}")
    assert ours == [], ours
    assert len(cuda_syncs) <= 2 * micro_batches, [str(w.message) for w in cuda_syncs[:4]]
    backend.close()


def test_compiled_blocks_on_the_gpu_match_eager_and_keep_the_first_ratio_exactly_one(ctx, measure):
    """``training.compile`` with inductor's CUDA kernels: in fp32, eager's log-probs and gradients to float
    rounding; in bf16, within the recorded bf16 tolerance of fp32 (fused kernels round less often than eager
    bf16, so they differ from eager bf16 by about as much as bf16 differs from fp32); in both, pi_old scored
    without gradient equal to the compiled training forward bit for bit."""
    from rlite.testing import fixed_batch
    from rlite.training.backend import ForwardSpec

    batch = fixed_batch(num_prompts=4, samples=4, prompt_len=10, max_len=8, vocab=250)
    spec = ForwardSpec(micro_batch_size=8, temperature=1.0, chunk_size=64, exact_layout=False, share_prompts=False)
    weights = torch.linspace(-1, 1, batch.response_mask.shape[1], device=ctx.device)
    results = {}
    for precision, compile_blocks in (("fp32", False), ("fp32", True), ("bf16", True)):
        backend = _backend(precision, ctx.device, compile=compile_blocks)
        micro = [batch.select(slice(i, i + 8)) for i in range(0, len(batch), 8)]
        with torch.no_grad():
            scored = [backend.logprobs(mb, spec)[0] for mb in micro]
        backend.train_mode()
        trained = []
        for mb in micro:
            logprobs, _ = backend.logprobs(mb, spec, with_entropy=True)
            backend.backward((logprobs * weights).sum())
            trained.append(logprobs.detach())
        assert all(torch.equal(a, b) for a, b in zip(scored, trained)), f"{precision}, compile: ratio != 1"
        grads = {n: p.grad.float().cpu() for n, p in backend.model.named_parameters()}
        results[precision, compile_blocks] = (torch.cat(trained).cpu(), grads)
        backend.close()
    mask = batch.response_mask.bool()
    (lp_eager, g_eager), (lp_compiled, g_compiled) = results["fp32", False], results["fp32", True]
    value_error = (lp_compiled - lp_eager)[mask].abs().max().item()
    grad_error = max(((g_compiled[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in g_eager.items())
    bf16_error = (results["bf16", True][0] - lp_eager)[mask].abs()
    measure("compiled vs eager blocks, fp32: log-prob max abs error, worst gradient relative error",
            f"{value_error:.2e}, {grad_error:.2e}")
    measure("compiled bf16 vs eager fp32 log-probs: max / mean abs error",
            f"{bf16_error.max().item():.4f} / {bf16_error.mean().item():.5f}", "nats")
    assert value_error <= 1e-4 and grad_error <= 1e-3
    assert bf16_error.mean() <= BF16_MEAN_ABS_TOL and bf16_error.max() <= BF16_MAX_ABS_TOL
