"""The megatron backend on CUDA (megatron-core without Transformer Engine or apex: its local layer
spec, torch norms): its log-probs, entropy and gradients equal the transformers model's on the same
GPU, and a short run through the real loop (dense and MoE) keeps the engine holding exactly the
backend's weights after every sync. Skipped without CUDA or without megatron-core (carry its wheel)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("megatron.core", reason="needs megatron-core (carry its wheel in .whl/)")

from rlite import hookimpl  # noqa: E402

MODELS = {"dense": {}, "moe": {"num_experts": 4, "experts_per_token": 2}}
RUN = ("parallelism.backend=megatron", "rewards=[even_chars]", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=6")


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory):
    from rlite.tokenizer import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp(request.param), hidden=32, layers=2, **MODELS[request.param])



def plugins():
    import rlite.plugins.megatron as megatron_plugin
    from rlite.plugin_manager import build_plugin_manager
    from rlite.testing import EvenChars

    pm = build_plugin_manager(autoload=False)
    pm.register(megatron_plugin, name="rlite.plugins.megatron")
    pm.register(EvenChars(), name="even-chars")
    return pm


def test_megatron_logprobs_and_gradients_on_cuda_equal_the_transformers_model(tmp_path, model_dir, monkeypatch, measure):
    import rlite.plugins.megatron as megatron_plugin
    from rlite.distributed import init_distributed, shutdown_distributed
    from rlite.hf_models import load_causal_lm
    from rlite.plugins.fsdp2.backend import policy_logprobs
    from rlite.plugins.megatron.convert import megatron_to_hf
    from rlite.testing import fixed_batch, tiny_config
    from rlite.training.backend import ForwardSpec
    from rlite.training.logprobs import PolicyModel

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    torch.backends.cuda.matmul.allow_tf32 = False
    ctx = init_distributed()
    pm = plugins()
    cfg = tiny_config(model_dir, tmp_path, *RUN, pm=pm)
    backend = megatron_plugin.make_megatron(cfg, megatron_plugin.MegatronConfig(), ctx.device, 1)
    try:
        assert next(backend.model.parameters()).device.type == "cuda"
        hf = load_causal_lm(cfg.model)  # fp32 on the CPU: the reference
        batch = fixed_batch(num_prompts=3, samples=2, prompt_len=6, max_len=7, vocab=250)
        spec = ForwardSpec(micro_batch_size=6, temperature=0.8, chunk_size=8, exact_layout=False)
        ours, our_entropy = backend.logprobs(batch, spec, with_entropy=True)
        theirs, their_entropy = policy_logprobs(PolicyModel(hf), batch, spec, with_entropy=True)
        assert ours.device.type == "cuda"  # where the model computes: the loss is computed there
        diff = (ours.detach().cpu() - theirs).abs().max().item()
        measure("megatron_vs_hf_logprob_max_abs_diff", diff, "nats")
        assert diff <= 1e-4
        assert torch.allclose(our_entropy.cpu(), their_entropy, atol=1e-4, rtol=0)
        weights = torch.linspace(0.5, 1.5, ours.shape[1])
        (ours * weights.to(ours.device)).sum().backward()
        (theirs * weights).sum().backward()
        grads = dict(backend.model.named_parameters())
        ours_hf = dict(megatron_to_hf(((n, grads[n].grad) for n in backend.full_names), backend.shape))
        worst = 0.0
        for name, param in hf.named_parameters():
            if name in ours_hf:
                a, b = ours_hf[name].cpu(), param.grad
                worst = max(worst, ((a - b).norm() / b.norm().clamp_min(1e-12)).item())
        measure("megatron_vs_hf_grad_worst_relative_error", worst)
        assert worst <= 1e-3
    finally:
        backend.close()
        shutdown_distributed(ctx, finished=True)


@pytest.mark.parametrize("precision", [(), ("parallelism.param_dtype=bfloat16",)], ids=["float32", "bf16-masters"])
def test_megatron_trains_on_cuda_with_bitwise_weight_sync(tmp_path, model_dir, monkeypatch, precision):
    """Float32, and bf16 compute with float32 master weights (which the engine gets, as from fsdp2)."""
    from rlite.distributed import shutdown_distributed
    from rlite.run.build import build_run
    from rlite.run.loop import train
    from rlite.testing import read_jsonl, tiny_config

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    pm = plugins()
    checked = []

    class SyncAuditor:
        backend = None

        @hookimpl
        def after_weight_sync(self, step, weight_version, engine):
            trainer = {n: t.detach().cpu() for n, t in self.backend.full_weights()}
            for name, tensor in dict(engine.named_weights()).items():
                assert torch.equal(tensor.detach().cpu(), trainer[name]), f"step {step}: engine weight {name} differs"
            checked.append(weight_version)

    auditor = SyncAuditor()
    pm.register(auditor, name="sync-auditor")
    run = build_run(tiny_config(model_dir, tmp_path / "run", *RUN, "training.steps=3", "algorithm.kl.coef=0.01", *precision,
                                pm=pm), pm)
    auditor.backend = run.policy.backend
    try:
        assert run.ctx.device.type == "cuda"
        train(run)
    finally:
        run.engine.shutdown()
        run.policy.backend.close()
        shutdown_distributed(run.ctx)
    assert checked == [1, 2, 3]
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["actor/grad_norm"] > 0 for r in rows)
