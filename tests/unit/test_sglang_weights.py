"""What reaches SGLang at a weight sync, on CPU: CUDA-IPC handles that name their GPU by UUID, weights in
the engine's dtype, FP8 weights with their scales for a quantized engine, and a check of what SGLang
holds afterwards.

A CPU has no CUDA-IPC handles, so the handle test replaces torch's reduction of a tensor with the one
torch makes for a CUDA tensor (the argument layout of ``rebuild_cuda_tensor``) and opens the payload as
SGLang's receivers do after ``monkey_patch_torch_reductions()``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from fake_sglang import (
    FakeSGLang,
    FakeSGLangEngine,
    RuleBroken,
    fake_sglang_modules,
    open_cuda_payload,
)

from rlite.engines.base import EngineError
from rlite.plugins.sglang.engine import SGLangEngine
from rlite.plugins.sglang.payloads import (
    CUDA_DEVICE_ARG,
    FlattenedTensorMetadataFields,
    check_engine_weights,
    flattened_bucket_payload,
    resolve_engine_dtype,
    serialize_payload,
)
from rlite.run.loop import run_training
from rlite.testing import tiny_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlite.tokenizer import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2)


@pytest.fixture
def fake_sglang(monkeypatch):
    for name, module in fake_sglang_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    return FakeSGLangEngine


# -- CUDA-IPC handles across processes that see different GPUs -----------------------------------------


@pytest.fixture
def cuda_reduction(monkeypatch):
    """torch's reduction of a tensor as it is for a tensor on ``cuda:3``; ``GPU-uuid-<i>`` is the UUID of
    the trainer's GPU ``i``."""
    from torch.multiprocessing import reductions

    def reduce_as_cuda(tensor):
        args = (type(tensor), tensor.size(), tensor.stride(), 0, torch.UntypedStorage, tensor.dtype, 3,
                b"ipc-handle", tensor.untyped_storage().nbytes(), 0, False, b"ref-counter", 0, b"event", True)  # fmt: skip
        return reductions.rebuild_cuda_tensor, args

    monkeypatch.setattr(reductions, "reduce_tensor", reduce_as_cuda)
    monkeypatch.setattr("rlite.plugins.sglang.payloads.cuda_device_uuid", lambda index: f"GPU-uuid-{index}")


def test_cuda_handles_name_the_gpu_by_uuid_so_a_process_with_other_visible_devices_opens_the_right_one(
    cuda_reduction,
):
    payload = flattened_bucket_payload([("w", torch.ones(4, dtype=torch.bfloat16))], metadata_cls=FlattenedTensorMetadataFields)
    data = serialize_payload(payload, output_str=False)
    # SGLang's scheduler of TP rank 0 runs with CUDA_VISIBLE_DEVICES=3: the trainer's cuda:3 is its cuda:0
    opened = open_cuda_payload(data, visible_gpus=("GPU-uuid-3",))
    kind, device, args = opened["flattened_tensor"]
    assert kind == "cuda" and args[CUDA_DEVICE_ARG] == "GPU-uuid-3" and device == 0
    # a receiver that sees the GPUs in another order finds the same GPU
    _, device, _ = open_cuda_payload(data, visible_gpus=("GPU-uuid-5", "GPU-uuid-3"))["flattened_tensor"]
    assert device == 1
    # the metadata is untouched, and torch's own reductions stay unpatched for everything else
    assert [m.name for m in opened["metadata"]] == ["w"]
    from torch.multiprocessing import reductions

    assert not hasattr(reductions, "_reduce_tensor_original")


def test_a_handle_for_a_gpu_the_receiver_does_not_see_is_refused_not_opened_elsewhere(cuda_reduction):
    data = serialize_payload({"t": torch.zeros(2)}, output_str=False)
    with pytest.raises(RuleBroken, match="Invalid device_uuid=GPU-uuid-3"):
        open_cuda_payload(data, visible_gpus=("GPU-uuid-0", "GPU-uuid-1"))


# -- the engine's dtype ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, config, expected",
    [
        ("auto", {"dtype": "bfloat16"}, torch.bfloat16),
        ("auto", {"torch_dtype": "float16"}, torch.float16),
        ("auto", {"dtype": "float32", "model_type": "qwen2"}, torch.float16),  # SGLang's rule for fp32 checkpoints
        ("auto", {"dtype": "float32", "model_type": "gemma2"}, torch.bfloat16),
        ("auto", {}, torch.float16),
        ("bfloat16", {"dtype": "float32"}, torch.bfloat16),
    ],
)
def test_engine_dtype_is_resolved_as_sglang_resolves_it(dtype, config, expected):
    assert resolve_engine_dtype(dtype, config) == expected


def test_a_run_sends_weights_in_the_engines_dtype_not_the_fp32_master_weights(tmp_path, model_dir, fake_sglang):
    run_training(tiny_config(model_dir, tmp_path / "run", "rollout.engine={name: sglang, args: {dtype: bfloat16}}",
                             "training.steps=1", "data.num_eval=0", "checkpoint.export_hf=true"))  # fmt: skip
    (engine,) = fake_sglang.instances
    assert engine.server_args["dtype"] == "bfloat16"  # SGLang is told the dtype the trainer sends
    assert engine.received and set(engine.received.values()) == {torch.bfloat16}
    # what it holds is the trainer's last weights (fp32) rounded once to bf16
    trained = _exported(tmp_path / "run")
    assert trained["model.norm.weight"].dtype == torch.float32
    for name, tensor in engine.weights.items():
        assert torch.equal(tensor, trained[name].to(torch.bfloat16)), name


def _exported(run_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf_model", dtype=torch.float32)
    return {name: p.detach() for name, p in model.named_parameters()}


# -- quantized rollouts ---------------------------------------------------------------------------


def test_fp8_rollouts_send_sglang_e4m3_weights_with_block_scales_and_start_it_quantized(tmp_path, model_dir, fake_sglang):
    import json

    from rlite.plugins.quantizers import Fp8BlockwiseConfig, fp8_blockwise

    overrides = ["rollout.engine={name: sglang, args: {dtype: bfloat16}}", "training.steps=1", "data.num_eval=0",
                 "rollout.quantization={name: fp8_blockwise, args: {block_size: 16}}", "checkpoint.export_hf=true"]  # fmt: skip
    run_training(tiny_config(model_dir, tmp_path / "run", *overrides))
    (engine,) = fake_sglang.instances
    assert json.loads(engine.server_args["json_model_override_args"])["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}  # fmt: skip
    projections = [n for n in engine.received if n.endswith("_proj.weight")]
    assert projections and all(engine.received[n] == torch.float8_e4m3fn for n in projections)
    assert all(engine.received[f"{n}_scale_inv"] == torch.float32 for n in projections)
    # SGLang computes with the weights a CPU engine samples with: the FP8 rounding of the bf16 weights
    served, trained = engine.served_weights(), _exported(tmp_path / "run")
    cfg = Fp8BlockwiseConfig(block_size=16)
    for name in projections:
        expected = fp8_blockwise(name, trained[name].to(torch.bfloat16), cfg)
        assert not torch.equal(expected, trained[name].to(torch.bfloat16)), name  # FP8 did round
        assert torch.equal(served[name].to(torch.bfloat16), expected), name
    assert torch.equal(served["model.norm.weight"], trained["model.norm.weight"].to(torch.bfloat16))  # not quantized


def test_a_quantizer_sglang_cannot_reload_is_a_config_error(tmp_path, model_dir, fake_sglang):
    from rlite.config import ConfigError

    overrides = ["rollout.engine=sglang", "rollout.quantization=int8_channel", "training.steps=1"]
    with pytest.raises(ConfigError, match="rollout.quantization: SGLang cannot load 'w8a8_int8' weights"):
        run_training(tiny_config(model_dir, tmp_path / "run", *overrides))


def test_the_fake_refuses_bf16_weights_for_fp8_parameters():
    from rlite.plugins.sglang.payloads import build_update_payloads

    fake = FakeSGLang(quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    payloads = build_update_payloads([("model.layers.0.mlp.up_proj.weight", torch.ones(16, 16, dtype=torch.bfloat16))],
                                     tp_size=1, metadata_cls=FlattenedTensorMetadataFields, output_str=False)  # fmt: skip
    fake.begin_weight_update()
    with pytest.raises(RuleBroken, match="arrived as torch.bfloat16 for an FP8 parameter"):
        fake.update_weights_from_tensor(payloads, load_format="flattened_bucket")


# -- the check after a sync -----------------------------------------------------------------------


def _named(step: int = 0):
    g = torch.Generator().manual_seed(step)
    return [
        ("model.embed_tokens.weight", torch.randn(20, 8, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(8, generator=g)),  # fused into qkv_proj by SGLang
        ("model.layers.0.input_layernorm.weight", torch.randn(8, generator=g)),
        ("model.norm.weight", torch.randn(8, generator=g)),
    ]


def test_every_sync_is_checked_against_sglangs_checksums():
    fake = FakeSGLang()
    engine = SGLangEngine("unused", backend=fake)
    engine.update_weights(iter(_named(1)), 1)
    assert fake.calls[-1] == ("check_weights", "checksum")
    fake.corrupt = {"model.norm.weight"}  # SGLang ends up with other bytes than were sent (a raced buffer)
    with pytest.raises(EngineError, match="weight check after sync v2: SGLang holds model.norm.weight with checksum"):
        engine.update_weights(iter(_named(2)), 2)


def test_the_check_compares_what_sglang_holds_under_the_sent_names_on_every_tp_rank():
    hashes = {"model.norm.weight": "aa", "model.layers.0.input_layernorm.weight": "bb", "model.layers.0.self_attn.q_proj.bias": "cc"}
    same = {"checksums": {"model.norm.weight": "aa", "model.layers.0.input_layernorm.weight": "bb", "x.qkv_proj.bias": "zz"}}
    assert check_engine_weights((True, "", [same, same], ""), hashes, 3) == 2  # q_proj.bias is fused: not compared
    sharded = [{"checksums": {**same["checksums"], "model.norm.weight": h}} for h in ("s0", "s1")]
    assert check_engine_weights({"success": True, "ranks": sharded}, hashes, 3) == 1  # differs by rank: sharded
    with pytest.raises(EngineError, match="reports none of the 3 1-D tensors"):
        check_engine_weights((True, "", [{"checksums": {}}], ""), hashes, 3)
    with pytest.raises(EngineError, match="check_weights failed: boom"):
        check_engine_weights({"success": False, "message": "boom"}, hashes, 3)


def test_a_run_checks_every_sync(tmp_path, model_dir, fake_sglang):
    run_training(tiny_config(model_dir, tmp_path / "run", "rollout.engine=sglang", "training.steps=2", "data.num_eval=0"))
    (engine,) = fake_sglang.instances
    versions = [c[1] for c in engine.calls if c[0] == "update_weight_version"]
    checks = [i for i, c in enumerate(engine.calls) if c[0] == "check_weights"]
    assert versions == ["0", "1", "2"] and len(checks) == 3
