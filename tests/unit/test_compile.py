"""``training.compile``: each decoder block through ``torch.compile`` gives eager's log-probs, entropies and
gradients to float rounding, on the plain model and under FSDP2; compiled blocks keep their names (state
dict, weight stream) and leave rlite's lean activations and in-place accumulation out.

Inductor (the backend a run uses) compiles C++ kernels with gcc on a CPU: it runs once here, on the plain
model, the GPU default at world size 1; the FSDP2 case uses ``aot_eager`` (the same graph capture and
autograd split, no code generation), which compiles in about a second.
"""

from __future__ import annotations

import pytest
import torch

import rlite.plugins.fsdp2.compile as compile_module
from rlite.testing import fixed_batch


@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlite.tokenizer import build_tiny_model_dir

    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def _build(model_dir, plain: bool, compile_blocks: bool):
    from rlite.config import ModelConfig, ParallelismConfig, TrainingConfig
    from rlite.plugins.fsdp2.backend import FSDP2Backend

    return FSDP2Backend.build(ModelConfig(path=model_dir), ParallelismConfig(shard_single_process=not plain),
                              TrainingConfig(compile=compile_blocks), torch.device("cpu"), total_optimizer_steps=1)


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _step(backend, batch, spec, weights):
    """Log-probs, entropy and the gradients of a weighted sum of the log-probs (micro-batches of 4: two shapes)."""
    backend.train_mode()
    logprobs, entropies = [], []
    for start in range(0, len(batch), spec.micro_batch_size):
        mb = batch.select(slice(start, start + spec.micro_batch_size))
        lp, ent = backend.logprobs(mb, spec, with_entropy=True)
        backend.backward((lp * weights[start : start + len(mb)]).sum())
        logprobs.append(lp.detach())
        entropies.append(ent.detach())
    grads = {name: _full(p.grad).clone() for name, p in backend.model.named_parameters()}
    backend.zero_grad()
    return torch.cat(logprobs), torch.cat(entropies), grads


@pytest.mark.parametrize("plain,backend_name", [(True, "inductor"), (False, "aot_eager")], ids=["plain", "fsdp2"])
def test_compiled_blocks_give_eager_logprobs_and_gradients(model_dir, world_of_one, monkeypatch, plain, backend_name):
    from rlite.training.backend import ForwardSpec

    monkeypatch.setattr(compile_module, "COMPILE_BACKEND", backend_name)
    # rows of different lengths in micro-batches of different widths: a recompile with symbolic sizes
    batch = fixed_batch(num_prompts=3, samples=4, prompt_len=6, max_len=7, vocab=250)
    batch = batch.select(list(range(8)) + [8, 9, 10])  # a last micro-batch of 3
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(0)) * batch.response_mask
    spec = ForwardSpec(micro_batch_size=4, temperature=0.8, chunk_size=8, exact_layout=False, share_prompts=False)
    eager = _build(model_dir, plain, compile_blocks=False)
    compiled = _build(model_dir, plain, compile_blocks=True)
    blocks = compiled.model.causal_lm.get_decoder().layers
    assert all(block._compiled_call_impl is not None for block in blocks), "every decoder block is compiled"
    assert eager.model.causal_lm.get_decoder().layers[0]._compiled_call_impl is None
    # inside compiled blocks rlite's own autograd functions stay out; the final norm keeps its lean forward
    assert "forward" not in vars(blocks[0].mlp) and "forward" not in vars(blocks[0].input_layernorm)
    assert "forward" in vars(compiled.model.causal_lm.get_decoder().norm)
    assert [n for n, _ in compiled.full_weights()] == [n for n, _ in eager.full_weights()], "names unchanged"

    lp_eager, ent_eager, grads_eager = _step(eager, batch, spec, weights)
    lp_compiled, ent_compiled, grads_compiled = _step(compiled, batch, spec, weights)
    mask = batch.response_mask.bool()
    assert lp_eager[mask].abs().min() > 0, "real log-probs"
    torch.testing.assert_close(lp_compiled, lp_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_compiled, ent_eager, rtol=1e-5, atol=1e-5)
    assert grads_compiled.keys() == grads_eager.keys()
    for name, grad in grads_eager.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        assert (grads_compiled[name] - grad).abs().max().item() <= 1e-4 * scale, name
    # pi_old scored without gradient repeats the training forward (the first ratio exactly 1)
    with torch.no_grad():
        scored = torch.cat([compiled.logprobs(batch.select(slice(s, s + 4)), spec)[0] for s in range(0, len(batch), 4)])
    assert torch.equal(scored, lp_compiled)


def test_compile_is_refused_with_the_shared_prompt_forward(tmp_path):
    from rlite.config import ConfigError
    from rlite.testing import tiny_config

    with pytest.raises(ConfigError, match=r"training.compile=true with training.share_prompt_prefix=true"):
        tiny_config(tmp_path, tmp_path / "run", "training.compile=true", pm=False)
    cfg = tiny_config(tmp_path, tmp_path / "run", "training.compile=true", "training.share_prompt_prefix=false", pm=False)
    assert cfg.training.compile
