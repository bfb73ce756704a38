"""The megatron backend behind rlite's contract, on CPU (gloo): its log-probs and gradients equal the
transformers model's, it trains through the real loop (dense and MoE), the engine holds exactly its
weights after every sync, resume is bitwise, and pi_old equals the first training forward bitwise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'rlite[megatron]'")

from safetensors.torch import load_file  # noqa: E402

import rlite.plugins.megatron as megatron_plugin  # noqa: E402
from rlite import hookimpl  # noqa: E402
from rlite.distributed import shutdown_distributed  # noqa: E402
from rlite.plugin_manager import build_plugin_manager  # noqa: E402
from rlite.run.build import build_run  # noqa: E402
from rlite.run.loop import run_training, train  # noqa: E402
from rlite.testing import EvenChars, fixed_batch, read_jsonl, tiny_config  # noqa: E402
from rlite.tokenizer import build_tiny_model_dir  # noqa: E402
from rlite.training.backend import ForwardSpec  # noqa: E402

MODELS = {"dense": {}, "moe": {"num_experts": 4, "experts_per_token": 2}}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp(request.param), hidden=32, layers=2, **MODELS[request.param])


def plugins():
    pm = build_plugin_manager(autoload=False)
    pm.register(megatron_plugin, name="rlite.plugins.megatron")  # as its entry point would
    pm.register(EvenChars(), name="even-chars")
    return pm


RUN = ("parallelism.backend=megatron", "rewards=[even_chars]", "rollout.samples_per_prompt=8", "rollout.max_new_tokens=6")


def test_logprobs_entropy_and_gradients_equal_the_transformers_model(tmp_path, model_dir, world_of_one):
    from rlite.hf_models import load_causal_lm
    from rlite.plugins.fsdp2.backend import policy_logprobs
    from rlite.training.logprobs import PolicyModel

    pm = plugins()
    cfg = tiny_config(model_dir, tmp_path, *RUN, pm=pm)
    backend = pm.registry("training_backend").get("megatron").implementation(
        cfg, cfg.parallelism.backend and megatron_plugin.MegatronConfig(), torch.device("cpu"), 1
    )
    try:
        hf = load_causal_lm(cfg.model)
        batch = fixed_batch(num_prompts=3, samples=2, prompt_len=6, max_len=7, vocab=250)
        spec = ForwardSpec(micro_batch_size=6, temperature=0.8, chunk_size=8, exact_layout=False)
        ours, our_entropy = backend.logprobs(batch, spec, with_entropy=True)
        theirs, their_entropy = policy_logprobs(PolicyModel(hf), batch, spec, with_entropy=True)
        assert torch.allclose(ours, theirs, atol=2e-5, rtol=0), (ours - theirs).abs().max()
        assert torch.allclose(our_entropy, their_entropy, atol=2e-5, rtol=0)
        (ours * torch.linspace(0.5, 1.5, ours.shape[1])).sum().backward()
        (theirs * torch.linspace(0.5, 1.5, theirs.shape[1])).sum().backward()
        grads = dict(backend.model.named_parameters())
        from rlite.plugins.megatron.convert import megatron_to_hf

        ours_hf = dict(megatron_to_hf(((n, grads[n].grad) for n in backend.full_names), backend.shape))
        for name, param in hf.named_parameters():
            if name in ours_hf:
                assert torch.allclose(ours_hf[name], param.grad, atol=1e-5, rtol=1e-4), name
    finally:
        backend.close()


def test_first_training_forward_repeats_the_scoring_forward_bitwise(tmp_path, model_dir, world_of_one):
    from rlite.stages.minibatches import micro_batches, score_logprobs, split_minibatches

    pm = plugins()
    cfg = tiny_config(model_dir, tmp_path, *RUN, pm=pm)
    backend = megatron_plugin.make_megatron(cfg, megatron_plugin.MegatronConfig(), torch.device("cpu"), 2)
    try:
        batch = fixed_batch(num_prompts=4, samples=4, prompt_len=6, max_len=7, vocab=250)
        spec = ForwardSpec(micro_batch_size=3, temperature=0.9, chunk_size=5, exact_layout=False)
        old = score_logprobs(backend, batch, spec, minibatches=2)
        backend.train_mode()
        offset = 0
        for mb in micro_batches(split_minibatches(batch, 2)[0], spec.micro_batch_size):
            logprobs, _ = backend.logprobs(mb, spec)
            assert torch.equal(logprobs.detach() * mb.response_mask, old[offset : offset + len(mb)])
            offset += len(mb)
    finally:
        backend.close()


class SyncAuditor:
    """After every sync: the engine holds exactly the backend's weights, and they changed."""

    def __init__(self):
        self.backend = None
        self.previous = None
        self.checked = []

    @hookimpl
    def after_weight_sync(self, step, weight_version, engine):
        trainer = {n: t.clone() for n, t in self.backend.full_weights()}
        if self.previous is not None:
            assert any(not torch.equal(trainer[n], self.previous[n]) for n in trainer), "the step changed nothing"
        self.previous = trainer
        engine_weights = dict(engine.named_weights())
        assert engine_weights.keys() <= trainer.keys()
        for name, tensor in engine_weights.items():
            assert torch.equal(tensor, trainer[name]), f"step {step}: engine weight {name} differs"
        self.checked.append(weight_version)


def test_trains_through_the_loop_with_bitwise_weight_sync(tmp_path, model_dir):
    pm = plugins()
    auditor = SyncAuditor()
    pm.register(auditor, name="sync-auditor")
    run = build_run(tiny_config(model_dir, tmp_path / "run", *RUN, "training.steps=3", "algorithm.kl.coef=0.01",
                                pm=pm), pm)
    auditor.backend = run.policy.backend
    try:
        train(run)
    finally:
        run.engine.shutdown()
        run.policy.backend.close()
        shutdown_distributed(run.ctx)
    assert auditor.checked == [1, 2, 3]
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["actor/grad_norm"] > 0 for r in rows)


class CrashAfterCheckpoint:
    @hookimpl
    def on_checkpoint_save(self, step):
        if step == 2:
            raise KeyboardInterrupt("crash after the step-2 checkpoint")


def test_resume_equals_uninterrupted_run_bitwise(tmp_path, model_dir):
    common = (*RUN, "checkpoint.every=2", "checkpoint.export_hf=true", "training.steps=4")
    run_training(tiny_config(model_dir, tmp_path / "straight", *common, pm=plugins()), plugins())
    crashing = plugins()
    crashing.register(CrashAfterCheckpoint(), name="crash")
    with pytest.raises(KeyboardInterrupt):
        run_training(tiny_config(model_dir, tmp_path / "resumed", *common, pm=crashing), crashing)
    run_training(tiny_config(model_dir, tmp_path / "resumed", *common, "checkpoint.resume=auto", pm=plugins()), plugins())
    a = load_file(tmp_path / "straight" / "hf_model" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "hf_model" / "model.safetensors")
    initial = load_file(model_dir / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert any(not torch.equal(a[n], initial[n]) for n in a), "the runs must have trained"

    def rows(path):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in read_jsonl(path)]

    assert rows(tmp_path / "straight" / "metrics.jsonl") == rows(tmp_path / "resumed" / "metrics.jsonl")


def test_missing_megatron_core_is_a_config_error_naming_the_extra(monkeypatch) -> None:
    monkeypatch.setattr(megatron_plugin, "megatron_installed", lambda: False)
    from rlite.config import ConfigError

    with pytest.raises(ConfigError, match=r"pip install 'rlite\[megatron\]'"):
        megatron_plugin.MegatronConfig()


def test_rlite_plugins_lists_megatron_from_its_entry_point(capsys, monkeypatch) -> None:
    import json

    from rlite.tools.cli import main

    monkeypatch.delenv("RLITE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("RLITE_PLUGINS", raising=False)
    assert main(["plugins", "--json"]) == 0
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert plugins["megatron"]["registers"] == {"training_backend": ["megatron"]}
    assert plugins["megatron"]["distribution"] == "rlite"


def test_train_without_the_extra_fails_in_one_line_naming_it(tmp_path, model_dir, capsys, monkeypatch) -> None:
    from rlite.tools.cli import main

    monkeypatch.delenv("RLITE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setattr(megatron_plugin, "megatron_installed", lambda: False)
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{path: {model_dir}}}\ndata: {{task: addition}}\nparallelism: {{backend: megatron}}\n")
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'rlite[megatron]'" in err and len(err.strip().splitlines()) == 1
